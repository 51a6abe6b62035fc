"""llama.cpp on the same Hugging Face checkpoint, for benchmarks/benchmark.py's side-by-side column.

Why: llama.cpp is the usual reference for LLM speed on a CPU, so the benchmark reports what it does
with the very checkpoint we run, on the same cores. There is no llama.cpp binary for this machine on
PyPI or Debian, but the llama-cpp-python sdist on PyPI vendors llama.cpp's full source, including
its HF->GGUF converter; that is all we need, and pip can fetch it from the local mirror.

How (each step is cached in `work_dir`, so only the first run takes minutes):

1. `pip download --no-binary :all: llama-cpp-python`, unpack it, and build only the `llama-bench`
   tool with cmake (Release, GGML_NATIVE: what a user building llama.cpp on this machine gets); other tools on
   demand (step 4).
2. Convert the checkpoint to f32 / f16 GGUF with the vendored `convert_hf_to_gguf.py`. The weights
   are converted untouched; two things synthetic checkpoints (export/checkpoints/random_checkpoint.py) lack
   are filled in by wrapping two converter functions, only when the converter would otherwise stop:
   - config.json without "architectures": the class is taken from transformers' causal-LM mapping
     for its model_type (qwen2 -> Qwen2ForCausalLM);
   - a tokenizer the converter does not recognise (it identifies the pre-tokenizer by hashing how
     the tokenizer splits a fixed text; ours are trained on the spot): its pre-tokenizer is labelled
     "qwen2". The checkpoint's own tokens are kept and padded with unused entries to the
     embedding's row count, as the converter always does. llama-bench feeds synthetic token ids,
     so only the vocabulary's size matters for timing, and that is the checkpoint's.
   Missing pure-Python converter dependencies (sentencepiece, pyyaml, ...) are pip-installed into
   the running interpreter's environment; torch and numpy must already be there.
3. `llama-bench -t <threads> -p <n,...> -n 32 -r <repetitions> -o json`: prefill seconds per prompt
   length and decode tokens per second (generation from an empty context).

4. For benchmarks/perplexity.py: `build_tool()` builds `llama-perplexity`, `llama-quantize` and `llama-tokenize`
   into the same build folder as llama-bench (each once, the libraries shared); `quantize()` runs llama-quantize
   on a converted GGUF (Q8_0, Q4_0, Q4_1, ... with its defaults), `tokenize()` gives llama.cpp's token ids of a
   text, `perplexity()` runs llama-perplexity on a text file and reads its final estimate.

`measure()` never raises: a step that cannot be done (no compiler, pip fails, conversion fails...)
gives {"skipped": "<one-line reason>"}; the step-4 helpers raise Skip for their caller to report. Progress goes to
stderr.

    python benchmarks/llama_cpp.py --checkpoint DIR [--work_dir /tmp/llama_work] [--threads 2]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Dict, List, Sequence

DEFAULT_WORK = "/tmp/llama_work"
DECODE_TOKENS = 32  # llama-bench's tg test: tokens generated per repetition
# Converter imports -> pip names; None: too big or too version-sensitive to install behind the user's back.
_CONVERTER_MODULES = {"torch": None, "numpy": None, "transformers": "transformers",
                      "sentencepiece": "sentencepiece", "safetensors": "safetensors", "yaml": "pyyaml",
                      "tqdm": "tqdm"}


class Skip(Exception):
    """A step that cannot be done on this machine; the message is the reason benchmark.py shows."""


def _say(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _run(cmd: Sequence[str], what: str, timeout: float, **kw: Any) -> str:
    """stdout of `cmd`; Skip with the last line of its output when it cannot run or fails."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"{what}: {exc}") from None
    if proc.returncode != 0:
        raise Skip(f"{what} failed (exit {proc.returncode}): {_last_line(proc.stderr or proc.stdout)}")
    return proc.stdout


# ---------------------------------------------------------------- 1. source and llama-bench

def source_dir(work_dir: str) -> str:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded and unpacked once into work_dir."""
    pattern = os.path.join(work_dir, "llama_cpp_python-*", "vendor", "llama.cpp")
    if glob.glob(pattern):
        return sorted(glob.glob(pattern))[-1]
    sdist = os.path.join(work_dir, "sdist")
    os.makedirs(sdist, exist_ok=True)
    if not glob.glob(os.path.join(sdist, "llama_cpp_python-*.tar.gz")):
        _say("downloading the llama-cpp-python sdist (it vendors llama.cpp's source)")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "llama-cpp-python",
              "-d", sdist], "pip download llama-cpp-python", 900)
    archives = sorted(glob.glob(os.path.join(sdist, "llama_cpp_python-*.tar.gz")))
    if not archives:
        raise Skip(f"pip download left no llama_cpp_python-*.tar.gz in {sdist}")
    _say(f"unpacking {os.path.basename(archives[-1])}")
    # Unpack beside work_dir's final folder and rename, so an interrupted run leaves nothing half-done.
    staging = tempfile.mkdtemp(prefix="unpack-", dir=work_dir)
    try:
        with tarfile.open(archives[-1]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, filter="data")
            else:  # Python without extraction filters
                tar.extractall(staging)
        for top in os.listdir(staging):
            if os.path.isdir(os.path.join(staging, top, "vendor", "llama.cpp")):
                os.replace(os.path.join(staging, top), os.path.join(work_dir, top))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not glob.glob(pattern):
        raise Skip(f"{archives[-1]} has no vendor/llama.cpp")
    return sorted(glob.glob(pattern))[-1]


def _build_with_progress(cmd: List[str], timeout: float, what: str = "llama-bench") -> None:
    """Run the build, echoing ninja/make progress every 10 %; Skip with the first error on failure."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise Skip(f"cmake build: {exc}") from None
    deadline, shown, tail, first_error = time.monotonic() + timeout, -10, [], ""
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if not first_error and "error" in line.lower():
            first_error = line.strip()[:300]
        ninja = re.match(r"\[(\d+)/(\d+)\]", line)
        make = re.match(r"\[\s*(\d+)%\]", line)
        percent = 100 * int(ninja[1]) // int(ninja[2]) if ninja else int(make[1]) if make else None
        if percent is not None and percent >= shown + 10:
            shown = percent - percent % 10
            _say(f"build {percent}%")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise Skip(f"building {what} took more than {timeout:.0f} s")
    if proc.wait() != 0:
        raise Skip(f"building {what} failed: {first_error or _last_line(chr(10).join(tail))}")


# llama.cpp's x86 code paths by cmake options: "native" is what a user building on this machine gets; "avx2" the
# AVX2 + FMA + F16C build (no AVX-512), to measure beside this project's AVX2 path on an AVX-512 machine
ISA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    # this machine's ISA less AMX: the native build's AMX path crashed on the Intel Xeon VM of performance-log 48
    # (SIGSEGV in ggml_backend_amx_mul_mat whenever a batch holds more than one token); GGML_AMX_* do not apply
    # under GGML_NATIVE (-march=native turns AMX on), so the compiler's flags turn it off
    "native-noamx": ["-DGGML_NATIVE=ON", "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                     "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
             "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"],
}


# the tools build_tool() builds: llama-bench for the speed columns, llama-perplexity / llama-quantize / llama-tokenize
# for benchmarks/perplexity.py, llama-server for benchmarks/bench_paged_serve.py, llama-batched-bench for
# benchmarks/bench_rows.py
TOOLS = ("llama-bench", "llama-perplexity", "llama-quantize", "llama-tokenize", "llama-server", "llama-batched-bench")


def build_tool(src: str, target: str = "llama-bench", isa: str = "native") -> str:
    """Path of llama.cpp's tool `target` (TOOLS), built once into <src>/build-bench[-<isa>] (Release, static;
    ISA_FLAGS[isa]); every tool of one ISA shares that build folder, so the second one links the same libraries."""
    if isa not in ISA_FLAGS:
        raise Skip(f"no llama.cpp build for ISA {isa!r} (known: {', '.join(ISA_FLAGS)})")
    if target not in TOOLS:
        raise Skip(f"no llama.cpp tool {target!r} here (known: {', '.join(TOOLS)})")
    build = os.path.join(src, "build-bench" if isa == "native" else f"build-bench-{isa}")
    binary = os.path.join(build, "bin", target)
    if os.access(binary, os.X_OK):
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise Skip(f"building llama.cpp needs {tool} (apt-get install cmake g++)")
    if not os.path.isfile(os.path.join(build, "CMakeCache.txt")):
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _say("configuring llama.cpp with cmake")
        _run(["cmake", "-S", src, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa],
              "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], "cmake configure", 600)
    if target == "llama-server":  # the server's target exists only with LLAMA_BUILD_SERVER (a reconfigure, once)
        _run(["cmake", "-S", src, "-B", build, "-DLLAMA_BUILD_SERVER=ON"], "cmake configure (server)", 600)
    _say(f"building {target} on {os.cpu_count() or 2} cores (minutes the first time)")
    start = time.perf_counter()
    _build_with_progress(["cmake", "--build", build, "--target", target, "-j", str(os.cpu_count() or 2)],
                         timeout=3600, what=target)
    if not os.access(binary, os.X_OK):
        raise Skip(f"the build did not produce {binary}")
    _say(f"built {target} in {time.perf_counter() - start:.0f} s")
    return binary


def build_bench(src: str, isa: str = "native") -> str:
    """Path of llama-bench, built once into <src>/build-bench[-<isa>] (build_tool)."""
    return build_tool(src, "llama-bench", isa)


def version(binary: str, src: str) -> str:
    """llama.cpp's version and commit as llama-bench reports them, and the sdist it came from."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
        found = re.search(r"version: (.*)", proc.stdout + proc.stderr)
        own = found[1].strip() if found else "unknown version"
    except (OSError, subprocess.TimeoutExpired):
        own = "unknown version"
    sdist = os.path.basename(os.path.dirname(os.path.dirname(src)))
    return f"llama.cpp {own}, vendored in {sdist.replace('_', '-', 2)}"


# ---------------------------------------------------------------- 2. conversion to GGUF

def converter_dependencies() -> List[str]:
    """pip-install the converter's missing pure-Python dependencies; returns what was installed."""
    missing = [m for m in _CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    unavailable = [m for m in missing if _CONVERTER_MODULES[m] is None]
    if unavailable:
        raise Skip(f"convert_hf_to_gguf.py needs {', '.join(unavailable)} in this Python environment")
    packages = [_CONVERTER_MODULES[m] for m in missing]
    if packages:
        _say(f"pip-installing the converter's dependencies into {sys.prefix}: {' '.join(packages)}")
        _run([sys.executable, "-m", "pip", "install", *packages], "pip install " + " ".join(packages), 900)
    return packages


# Runs the vendored converter (argv[1]: its folder) with the two fallbacks the module docstring
# describes. Each fallback prints a "NOTE:" line, which convert() records beside the GGUF.
_CONVERTER = r"""
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
from conversion.base import ModelBase, TextModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

def note(text):
    print("NOTE: " + text, file=sys.stderr, flush=True)

_load_hparams = ModelBase.load_hparams
def load_hparams(dir_model, is_mistral_format):
    hparams = _load_hparams(dir_model, is_mistral_format)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hparams.get("model_type"))
    if not hparams.get("architectures") and arch:
        hparams["architectures"] = [arch]
        note(f"config.json has no architectures; used {arch} (from model_type {hparams['model_type']})")
    return hparams
ModelBase.load_hparams = staticmethod(load_hparams)

_vocab_pre = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return _vocab_pre(self, tokenizer)
    except NotImplementedError:
        note(f"pre-tokenizer not recognised; labelled qwen2 (own {len(tokenizer)} tokens, "
             f"padded to vocab_size {self.hparams['vocab_size']})")
        return "qwen2"
TextModel.get_vocab_base_pre = get_vocab_base_pre

sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def converter_command(src: str, checkpoint: str, dtype: str, outfile: str):
    """(argv, environment) that run the vendored convert_hf_to_gguf.py on `checkpoint` into `outfile`, with the
    fallbacks of the module docstring (benchmarks/bench_export.py times it beside our export)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(src, "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")])))
    return [sys.executable, "-c", _CONVERTER, src, checkpoint, "--outtype", dtype, "--outfile", outfile], env


def _checkpoint_key(checkpoint: str, src: str) -> str:
    """Hash of the checkpoint's files (path, size, mtime) and of the converter's sdist."""
    stamp = hashlib.sha256(os.path.dirname(os.path.dirname(src)).encode())
    for path in sorted(glob.glob(os.path.join(os.path.abspath(checkpoint), "*"))):
        stamp.update(f"{path}:{os.path.getsize(path)}:{os.path.getmtime(path)}".encode())
    return stamp.hexdigest()[:12]


def convert(src: str, checkpoint: str, dtype: str, work_dir: str) -> Dict[str, Any]:
    """{"gguf": path, "notes": [...], "seconds": s} for `checkpoint` in `dtype` (f32/f16), converted once."""
    out = os.path.join(work_dir, f"{os.path.basename(os.path.abspath(checkpoint))}-"
                                 f"{_checkpoint_key(checkpoint, src)}-{dtype}.gguf")
    info_path = out + ".json"
    if os.path.isfile(out) and os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as fh:
            return json.load(fh)
    partial = out + ".partial"
    cmd, env = converter_command(src, checkpoint, dtype, partial)
    _say(f"converting {checkpoint} to {dtype} GGUF")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"convert_hf_to_gguf.py: {exc}") from None
    with open(out + ".log", "w", encoding="utf-8") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not os.path.isfile(partial):
        raise Skip(f"convert_hf_to_gguf.py failed (exit {proc.returncode}, log {out}.log): "
                   f"{_last_line(proc.stderr)}")
    os.replace(partial, out)
    info = {"gguf": out, "seconds": round(time.perf_counter() - start, 1),
            "notes": list(dict.fromkeys(line[len("NOTE: "):] for line in proc.stderr.splitlines()
                                        if line.startswith("NOTE: ")))}
    with open(info_path, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    _say(f"converted in {info['seconds']} s: {out}")
    return info


# ---------------------------------------------------------------- 3. llama-bench

_PEAK_RSS = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)
sys.stdout.write(proc.stdout.decode() + "\\npeak_rss_kib=%d" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(proc.returncode)
"""


def bench(binary: str, gguf: str, threads: int, prompt_tokens: Sequence[int], repetitions: int) -> Dict[str, Any]:
    """Prefill seconds per prompt length (mean over repetitions) and decode tokens per second. Where llama-bench
    fails on the prompts but decodes (seen: a SIGSEGV on any prompt, an Intel Xeon with AMX, docs/performance-log.md
    45), the decode figure alone, with "prefill_skipped" saying why."""
    def run(prompts: str) -> str:
        # through a fresh interpreter whose only child is llama-bench, so its peak RSS is llama-bench's alone
        return _run([sys.executable, "-c", _PEAK_RSS, binary, "-m", gguf, "-t", str(threads), "-p", prompts,
                     "-n", str(DECODE_TOKENS), "-r", str(repetitions), "-o", "json"], "llama-bench", 3600)

    skipped = None
    try:
        out = run(",".join(str(n) for n in prompt_tokens))
    except Skip as exc:
        out, skipped = run("0"), f"{exc} (with prompts {list(prompt_tokens)}; it decodes without)"
        _say(f"llama-bench: prefill skipped: {skipped}")
    out, _, peak_kib = out.rpartition("\npeak_rss_kib=")
    try:
        rows = json.loads(out)
    except ValueError:
        raise Skip(f"llama-bench printed no JSON: {_last_line(out)}") from None
    result: Dict[str, Any] = {"prefill_s": {}, "peak_rss_gib": round(int(peak_kib) / 2**20, 3),
                              "gguf_bytes": os.path.getsize(gguf)}
    for row in rows:
        n_prompt, n_gen = int(row.get("n_prompt", 0)), int(row.get("n_gen", 0))
        if n_prompt > 0 and n_gen == 0:
            seconds = row["avg_ns"] / 1e9 if row.get("avg_ns") else n_prompt / row["avg_ts"]
            result["prefill_s"][n_prompt] = round(seconds, 4)
        elif n_gen > 0 and n_prompt == 0:
            result["decode_tok_s"] = round(row["avg_ts"], 2)
            result["decode_tok_s_stdev"] = round(row.get("stddev_ts", 0.0), 2)
    if skipped is not None:
        result["prefill_skipped"] = skipped
    elif len(result["prefill_s"]) != len(set(prompt_tokens)):
        raise Skip("llama-bench's JSON lacks some of the requested tests")
    if "decode_tok_s" not in result:
        raise Skip("llama-bench's JSON lacks the decode test")
    return result


# ---------------------------------------------------------------- 4. quantize, tokenize, perplexity

def quantize(binary: str, gguf: str, qtype: str, threads: int = 2) -> Dict[str, Any]:
    """{"gguf": path, "seconds": s, "type": qtype}: `gguf` (an f16/f32 one) through `llama-quantize <in> <out> <qtype>`
    with its defaults (no --pure: what a user gets, so a tied embedding or output matrix may get another type, as
    llama-quantize chooses), once; the result sits beside `gguf`, named by the type."""
    out = f"{gguf[:-len('.gguf')] if gguf.endswith('.gguf') else gguf}-{qtype.lower()}.gguf"
    info_path = out + ".json"
    if os.path.isfile(out) and os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as fh:
            return json.load(fh)
    partial = out + ".partial"
    _say(f"quantizing {os.path.basename(gguf)} to {qtype}")
    start = time.perf_counter()
    try:
        proc = subprocess.run([binary, gguf, partial, qtype, str(threads)], capture_output=True, text=True,
                              timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"llama-quantize: {exc}") from None
    with open(out + ".log", "w", encoding="utf-8") as fh:
        fh.write(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not os.path.isfile(partial):
        raise Skip(f"llama-quantize {qtype} failed (exit {proc.returncode}, log {out}.log): "
                   f"{_last_line(proc.stderr or proc.stdout)}")
    os.replace(partial, out)
    info = {"gguf": out, "type": qtype, "seconds": round(time.perf_counter() - start, 1)}
    with open(info_path, "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    return info


def tokenize(binary: str, gguf: str, text: str) -> List[int]:
    """The token ids llama.cpp makes of `text` with `gguf`'s vocabulary (llama-tokenize --stdin --ids): a BOS first
    exactly when the GGUF asks for one (tokenizer.ggml.add_bos_token), special-token text not parsed, escapes
    processed, as llama-perplexity tokenizes its -f file (after that drops one trailing newline)."""
    try:
        proc = subprocess.run([binary, "-m", gguf, "--stdin", "--ids", "--log-disable"], input=text,
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"llama-tokenize: {exc}") from None
    found = re.search(r"\[[\d,\s]*\]", proc.stdout)
    if proc.returncode != 0 or not found:
        raise Skip(f"llama-tokenize failed (exit {proc.returncode}): {_last_line(proc.stderr or proc.stdout)}")
    return json.loads(found[0])


def perplexity(binary: str, gguf: str, text_file: str, ctx: int = 512, threads: int = 2,
               chunks: int = -1) -> Dict[str, Any]:
    """llama-perplexity's own figure on `text_file` at context `ctx`, its defaults otherwise:

    {"ppl": float, "ppl_stderr": float, "chunks": n, "ctx": ctx, "tokens_scored": n * (ctx - ctx//2 - 1),
     "cumulative": [ppl after chunk 1, 2, ...] (4 decimals, as it prints them), "seconds": wall time of the process
     (load included), "seconds_per_pass": its own timing of the first pass}

    What it computes (tools/perplexity/perplexity.cpp, perplexity()): the whole file tokenized once (BOS first when
    the GGUF's add_bos_token says so), cut into floor(tokens / ctx) chunks of ctx tokens (the tail dropped); each
    chunk evaluated from an empty cache with its first token replaced by BOS when add_bos_token is set; only
    the second half scored: the logits at positions ctx//2 .. ctx-2 predict the tokens at ctx//2+1 .. ctx-1, so
    ctx - ctx//2 - 1 tokens per chunk; PPL = exp(mean negative log-likelihood over all of them), the standard error
    from their spread."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "-t", str(threads),
                               "--chunks", str(chunks)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Skip(f"llama-perplexity: {exc}") from None
    seconds, out = time.perf_counter() - start, proc.stdout
    if proc.returncode != 0:
        raise Skip(f"llama-perplexity failed (exit {proc.returncode}): {_last_line(out)}")
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
    over = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", out)
    if not final or not over:
        raise Skip(f"llama-perplexity printed no final estimate: {_last_line(out)}")
    n_chunks, n_ctx = int(over[1]), int(over[2])
    if n_ctx != ctx:
        raise Skip(f"llama-perplexity ran at n_ctx={n_ctx}, not the {ctx} asked for")
    per_pass = re.search(r"([\d.]+) seconds per pass", out)
    return {"ppl": float(final[1]), "ppl_stderr": float(final[2]), "chunks": n_chunks, "ctx": ctx,
            "tokens_scored": n_chunks * (ctx - ctx // 2 - 1),
            "cumulative": [float(v) for v in re.findall(r"\[\d+\]([\d.]+)", out)],
            "seconds": round(seconds, 2), "seconds_per_pass": float(per_pass[1]) if per_pass else None}


# quantized GGUF types measure() makes with llama-quantize from the f16 conversion (its argument -> llama-quantize's)
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k_m": "Q4_K_M"}


def measure(checkpoint: str, work_dir: str = DEFAULT_WORK, threads: int = 2, prompt_tokens=(16, 100),
            dtypes=("f32", "f16"), repetitions: int = 3, isa: str = "native") -> Dict[str, Any]:
    """llama.cpp's figures on `checkpoint` for each GGUF dtype, or {"skipped": reason}; never raises.

    {"version": str, "isa": str, "threads": int, "repetitions": int, "decode_tokens": 32,
     "<dtype>": {"decode_tok_s": float, "decode_tok_s_stdev": float, "prefill_s": {n: seconds},
                 "peak_rss_gib": llama-bench's peak RSS, "gguf_bytes": int, "gguf": path,
                 "conversion_notes": [...]}, ...}
    """
    try:
        if not os.path.isfile(os.path.join(checkpoint, "config.json")):
            raise Skip(f"{checkpoint} is not a Hugging Face checkpoint (no config.json)")
        os.makedirs(work_dir, exist_ok=True)
        src = source_dir(work_dir)
        binary = build_bench(src, isa)
        installed = converter_dependencies()
        result: Dict[str, Any] = {"version": version(binary, src), "isa": isa, "threads": threads,
                                  "repetitions": repetitions, "decode_tokens": DECODE_TOKENS}
        if installed:
            result["pip_installed"] = installed
        for dtype in dtypes:
            if dtype in QUANT_TYPES:  # llama-quantize on the f16 GGUF, its defaults (what a user gets)
                f16 = convert(src, checkpoint, "f16", work_dir)
                done = quantize(build_tool(src, "llama-quantize", isa), f16["gguf"], QUANT_TYPES[dtype], threads)
                gguf = {"gguf": done["gguf"], "notes": f16["notes"] + [f"llama-quantize {QUANT_TYPES[dtype]} of the "
                                                                        "f16 GGUF, its defaults"]}
            else:
                gguf = convert(src, checkpoint, dtype, work_dir)
            _say(f"llama-bench {dtype}: {threads} threads, prompts {list(prompt_tokens)}, "
                 f"{DECODE_TOKENS} decode tokens, {repetitions} repetitions")
            figures = bench(binary, gguf["gguf"], threads, prompt_tokens, repetitions)
            result[dtype] = {**figures, "gguf": gguf["gguf"], "conversion_notes": gguf["notes"]}
        return result
    except Skip as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the benchmark must go on without this column
        return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--work_dir", default=DEFAULT_WORK, help="cache for the source, build and GGUF files")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt_tokens", default="16,100", help="comma-separated prompt lengths")
    p.add_argument("--dtypes", default="f32,f16", help="comma-separated GGUF types (f32, f16, bf16; q8_0, q4_0, q4_1, q4_k_m by "
                                                 "llama-quantize from f16)")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--isa", choices=tuple(ISA_FLAGS), default="native", help="the build's x86 code path")
    args = p.parse_args(argv)
    doc = measure(args.checkpoint, args.work_dir, args.threads,
                  tuple(int(n) for n in args.prompt_tokens.split(",")), tuple(args.dtypes.split(",")),
                  args.repetitions, args.isa)
    print(json.dumps(doc, indent=2))
    return 1 if "skipped" in doc else 0


if __name__ == "__main__":
    sys.exit(main())
