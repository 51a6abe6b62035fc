"""Benchmark this project against HF transformers (and llama.cpp) on the same checkpoint, side by side in one run.

    python benchmarks/benchmark.py --work bench/ --llama_cpp   # makes a random Qwen2-0.5B-shaped checkpoint
    python benchmarks/benchmark.py --checkpoint <hf_dir> --work bench/

Exports the checkpoint as a new user would (`--device cpu --seq_length 2048`, nothing else: the
default prompt buckets) in each of --dtypes (float32 at every --batches size, the 16-bit-weight
folders at batch 1), then runs each engine in its own process: load time, load to first token,
prefill at several prompt lengths, greedy decode tok/s at batch 1 and 4, peak RSS, and checks that
greedy tokens agree with HF's (float32 folders; 16-bit ones compute on rounded weights, so HF's
tokens on the original weights are not theirs). --llama_cpp adds llama.cpp's llama-bench on the same
weights as f32 and f16 GGUF (benchmarks/llama_cpp.py builds and converts it once; without a compiler it
says why and leaves the column out). Prints a table and the goals' ratios, and writes JSON. Needs
the test extra (torch) for the HF side. Benchmarks are not tests: nothing here runs in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # llama_cpp.py

SHAPE_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def prompt_rows(n: int, batch: int, vocab: int = 380) -> List[List[int]]:
    import numpy as np

    rng = np.random.default_rng(n * 31 + batch)
    return [[int(t) for t in rng.integers(1, vocab, n)] for _ in range(batch)]


# --- workers: each runs in its own process and prints one JSON line --------------------------------

def worker_ours(args) -> Dict[str, Any]:
    start = time.perf_counter()
    from lite_runtime import pipeline

    pipe = pipeline("text_generation", model=args.folder, backend="ms", verify_checksums=False)
    load = time.perf_counter() - start
    first = pipe.generate(prompt_rows(args.first_prompt, 1), max_new_tokens=1)
    import cpu_kernels

    result: Dict[str, Any] = {"load_s": load, "load_to_first_token_s": time.perf_counter() - start,
                              "kernels_isa": cpu_kernels.isa(),
                              "first_prefill_s": first.prefill_seconds, "prefill_s": {}, "buckets": pipe.prefill_sizes,
                              "peak_rss_first_token_gib": peak_rss_gib()}
    for n in args.prompt_lengths:
        runs = [pipe.generate(prompt_rows(n, 1), max_new_tokens=1).prefill_seconds for _ in range(args.repeat)]
        result["prefill_s"][str(n)] = min(runs)
    # the steady decode rate, as for HF (which times new_tokens minus 1) and llama-bench (which warms up first):
    # the prompts above made one token each, so the incremental graph has not run (nor compiled) yet
    pipe.generate(prompt_rows(args.decode_prompt, pipe.batch_size), max_new_tokens=2, eos_token_id=[])
    out = pipe.generate(prompt_rows(args.decode_prompt, pipe.batch_size), max_new_tokens=args.new_tokens,
                        eos_token_id=[])  # no early stop: both engines make exactly new_tokens
    result.update(decode_tok_s=out.decode_tokens_per_second,  # all rows together
                  batch=pipe.batch_size, tokens=out.sequences, peak_rss_gib=peak_rss_gib())
    return result


def worker_hf(args) -> Dict[str, Any]:
    start = time.perf_counter()
    import torch
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(args.threads)
    model = Qwen2ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # no early stop: both engines make exactly new_tokens
    load = time.perf_counter() - start

    def gen(rows, new):
        ids = torch.tensor(rows)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        return time.perf_counter() - t, out.tolist()

    gen(prompt_rows(args.first_prompt, 1), 1)
    result: Dict[str, Any] = {"load_s": load, "load_to_first_token_s": time.perf_counter() - start, "prefill_s": {},
                              "peak_rss_first_token_gib": peak_rss_gib(),
                              "torch_isa": torch.backends.cpu.get_cpu_capability()}
    for n in args.prompt_lengths:
        result["prefill_s"][str(n)] = min(gen(prompt_rows(n, 1), 1)[0] for _ in range(args.repeat))
    decode = {}
    for batch in args.batches:
        rows = prompt_rows(args.decode_prompt, batch)
        t1, _ = gen(rows, 1)
        tn, tokens = gen(rows, args.new_tokens)
        decode[str(batch)] = {"tok_s": batch * (args.new_tokens - 1) / max(tn - t1, 1e-9), "tokens": tokens}
    result.update(decode=decode, peak_rss_gib=peak_rss_gib())
    return result


# --isa: how each engine is held to one x86 code path. Ours: the kernels' own switch. torch (the HF column): ATen's
# ATEN_CPU_CAPABILITY and MKL's MKL_ENABLE_INSTRUCTIONS. llama.cpp: a build with only those instructions
# (llama_cpp.ISA_FLAGS). oneDNN, under MindSpore's CPU MatMul (the float32 folders' prefill) and some of torch's
# ops: ONEDNN_MAX_CPU_ISA (without it MatMul ran brg_matmul:avx512_core on the "avx2" path, ONEDNN_VERBOSE=1).
ISA_ENV = {"native": {},
           "avx2": {"MSLITE_LLM_CPU_KERNELS_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
           "generic": {"MSLITE_LLM_CPU_KERNELS_ISA": "generic", "ATEN_CPU_CAPABILITY": "default",
                       "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}}


def warm_page_cache(path: str) -> None:
    """Read every file under `path` once, so a worker's load is timed with its files in the page cache, as a reload
    on the same machine is: otherwise whichever engine's files were evicted by the others' reads (GGUFs, checkpoint,
    folders) times the disk instead (a float32 folder's first token 3.05 s in one run, 1.47 s in the next)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        with open(name, "rb") as fh:
            while fh.read(16 << 20):
                pass


def warm_imports() -> None:
    """Import each engine once in a throwaway process: its libraries (MindSpore's ~800 MB, torch's) then come from the
    page cache for every timed worker, not only for those that follow another of the same engine (the float32 folder,
    measured first, loaded in 1.13 s against 0.70 s for the 16-bit ones right after it)."""
    for code in ("from lite_runtime.backends.ms import _mindspore; _mindspore(); import cpu_kernels",
                 "import torch, transformers; from transformers import Qwen2ForCausalLM"):
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=600)


def run_worker(kind: str, isa: str = "native", **kw) -> Dict[str, Any]:
    warm_page_cache(kw["folder"] if kind == "ours" else kw["checkpoint"])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind]
    for key, value in kw.items():
        if value is None:
            continue
        cmd += [f"--{key}", ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ISA_ENV[isa]})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the driver ------------------------------------------------------------------------------------

def ensure_checkpoint(args) -> str:
    if args.checkpoint:
        return args.checkpoint
    path = os.path.join(args.work, "qwen2-0.5b-shape")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from export.checkpoints.random_checkpoint import make_checkpoint

        print(f"making a random Qwen2-0.5B-shaped checkpoint in {path}", flush=True)
        make_checkpoint(path, **SHAPE_05B)
    return path


QUANTIZED = ("int8", "int4")  # --dtypes entries exported with --quantize (float32 compute, the CPU kernels' int8/int4)


def export(checkpoint: str, folder: str, args, batch: int, dtype: str) -> Dict[str, Any]:
    if os.path.isfile(os.path.join(folder, "manifest.json")) and not args.reexport:
        return {"reused": True}
    dtype_args = ["--quantize", dtype] if dtype in QUANTIZED else ["--dtype", dtype]
    cmd = [sys.executable, "-m", "export", "-q", "--checkpoint", checkpoint, "--output", folder, "--device", "cpu",
           *dtype_args, "--seq_length", str(args.seq_length), "--batch_size", str(batch), "--overwrite"]
    if args.buckets != "auto":
        cmd += ["--prefill_buckets", args.buckets]
    if args.cpu_kernels != "auto":
        cmd += ["--cpu_kernels", args.cpu_kernels]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"export failed:\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    return {"seconds": time.perf_counter() - start, "summary": line}


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def main(argv: Optional[List[str]] = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="HF Qwen2 checkpoint (default: make a random 0.5B-shaped one in --work)")
    p.add_argument("--work", default="bench", help="folder for the checkpoint, the exports and the JSON")
    p.add_argument("--seq_length", type=int, default=2048)
    p.add_argument("--buckets", default="auto", help="python -m export --prefill_buckets (default: auto, as a new "
                                                      "user gets)")
    p.add_argument("--dtypes", default="float32,bfloat16,float16,int8,int4",
                   help="folders to measure: float32, int8 and int4 (python -m export --quantize, the default group "
                        "sizes) at every --batches size, 16-bit weights at batch 1")
    p.add_argument("--prompt_lengths", type=ints, default=[16, 100, 512])
    p.add_argument("--first_prompt", type=int, default=100)
    p.add_argument("--decode_prompt", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--batches", type=ints, default=[1, 4])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--cpu_kernels", choices=("auto", "on", "off"), default="auto",
                   help="python -m export --cpu_kernels: off measures MindSpore's own MatMul in the decode step")
    p.add_argument("--llama_cpp", action="store_true", help="add llama.cpp as columns: f32 and f16 GGUFs, and Q8_0, "
                                                             "Q4_0 and Q4_K_M by llama-quantize from f16")
    p.add_argument("--isa", choices=tuple(ISA_ENV), default="native",
                   help="the x86 code path every engine runs: native (each picks the best this CPU has), avx2 (our "
                        "kernels' and torch's AVX2 path, llama.cpp built for AVX2: what an AVX2-only machine runs, "
                        "measured on an AVX-512 one), generic (our kernels' plain C++, as on a CPU without either)")
    p.add_argument("--reexport", action="store_true", help="export again even if the folders exist")
    p.add_argument("--json", default=None, help="where to write the results (default: benchmarks/results/"
                                             "benchmark-<path>.json, the x86 path every engine ran: avx512, avx2 "
                                             "or generic)")
    p.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_ours(args) if args.worker == "ours" else worker_hf(args)))
        return 0

    os.makedirs(args.work, exist_ok=True)
    checkpoint = ensure_checkpoint(args)
    common = dict(prompt_lengths=args.prompt_lengths, first_prompt=args.first_prompt,
                  decode_prompt=args.decode_prompt, new_tokens=args.new_tokens, repeat=args.repeat)
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "checkpoint": checkpoint,
                              "settings": vars(args), "exports": {}, "ours": {}, "hf": None}
    warm_imports()
    runs = [(d, b) for d in args.dtypes.split(",")
            for b in (args.batches if d in ("float32",) + QUANTIZED else args.batches[:1])]
    for dtype, batch in runs:
        key = f"{dtype}_b{batch}"
        folder = os.path.join(args.work, f"model_{key}" + ("_matmul" if args.cpu_kernels == "off" else ""))
        print(f"exporting {dtype} batch {batch} to {folder}", flush=True)
        report["exports"][key] = {**export(checkpoint, folder, args, batch, dtype), "folder_bytes": folder_bytes(folder)}
        print(f"measuring this project, {dtype} batch {batch}", flush=True)
        report["ours"][key] = run_worker("ours", args.isa, folder=folder, **common)
    print("measuring HF transformers", flush=True)
    report["hf"] = run_worker("hf", args.isa, checkpoint=checkpoint, batches=args.batches, threads=args.threads,
                              **common)
    if args.llama_cpp:
        import llama_cpp

        print("measuring llama.cpp (the first run builds it and converts the checkpoint: minutes)", flush=True)
        report["llama_cpp"] = llama_cpp.measure(checkpoint, os.path.join(args.work, "llama_cpp"), args.threads,
                                                prompt_tokens=args.prompt_lengths, dtypes=LLAMA_TYPES,
                                                isa="avx2" if args.isa == "avx2" else "native")
    report["paths"] = paths_line(report, args)
    report["weight_bytes"] = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                                 if f.endswith(".safetensors"))
    print_table(report)
    path = args.json or os.path.join(RESULTS, f"benchmark-{code_path(args.isa)}.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")
    return 0


def paths_line(report: Dict[str, Any], args) -> str:
    """Which code path each engine ran: our kernels' (as the worker's library reported it), torch's, llama.cpp's."""
    ours = sorted({r.get("kernels_isa") or "not built" for r in report["ours"].values()})
    if "avx512" in ours and any(k.split("_b")[0] in QUANTIZED for k in report["ours"]):
        ours = [i + " (int8/int4 folders: the AVX2 forms)" if i == "avx512" else i for i in ours]
    torch = report["hf"].get("torch_isa", "?")
    llama = (report.get("llama_cpp") or {}).get("isa")
    onednn = ISA_ENV[args.isa].get("ONEDNN_MAX_CPU_ISA")
    return (f"our kernels: {', '.join(ours)}; torch: {torch}; oneDNN (MindSpore's MatMul): "
            + (f"at most {onednn}" if onednn else "its own choice")
            + (f"; llama.cpp: {llama} build" if llama else ""))


def code_path(isa: str) -> str:
    """--isa as the result file names it: native is the best path this CPU has (avx512, avx2, or its machine name)."""
    if isa != "native":
        return isa
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"


def print_table(r: Dict[str, Any]) -> None:
    """One column per engine and dtype; rows are the measures; then the issue's goals as ratios."""
    hf, b0 = r["hf"], r["settings"]["batches"][0]
    cols: Dict[str, Dict[str, Any]] = {}
    for key, ours in r["ours"].items():
        dtype, batch = key.rsplit("_b", 1)
        col = cols.setdefault(f"ours {dtype}", {"size_gib": r["exports"][f"{dtype}_b{b0}"]["folder_bytes"] / 2**30})
        col[f"decode b{batch}"] = ours["decode_tok_s"]
        if int(batch) == b0:
            col.update(load=ours["load_s"], first=ours["load_to_first_token_s"], rss_first=ours["peak_rss_first_token_gib"],
                       rss=ours["peak_rss_gib"], **{f"prefill {n}": t for n, t in ours["prefill_s"].items()})
            if dtype == "float32":
                col["same tokens"] = ours["tokens"] == hf["decode"][str(batch)]["tokens"]
    llama = r.get("llama_cpp") or {}
    for dtype in LLAMA_TYPES:
        if dtype in llama:
            fig = llama[dtype]
            cols[f"llama.cpp {dtype}"] = {"decode b1": fig["decode_tok_s"], "size_gib": fig.get("gguf_bytes", 0) / 2**30,
                                          **({"rss": fig["peak_rss_gib"]} if "peak_rss_gib" in fig else {}),
                                          **{f"prefill {n}": t for n, t in fig["prefill_s"].items()}}
    cols["HF fp32"] = {"load": hf["load_s"], "first": hf["load_to_first_token_s"], "rss_first": hf["peak_rss_first_token_gib"],
                       "rss": hf["peak_rss_gib"], "size_gib": r["weight_bytes"] / 2**30,
                       **{f"prefill {n}": t for n, t in hf["prefill_s"].items()},
                       **{f"decode b{b}": d["tok_s"] for b, d in hf["decode"].items()}}
    rows = [("load (s)", "load"), ("load to first token (s)", "first")]
    rows += [(f"prefill {n} tokens (s)", f"prefill {n}") for n in r["settings"]["prompt_lengths"]]
    rows += [(f"decode batch {b} (tok/s)", f"decode b{b}") for b in r["settings"]["batches"]]
    rows += [("greedy tokens = HF's", "same tokens"), ("peak RSS to first token (GiB)", "rss_first"),
             ("peak RSS, whole run (GiB)", "rss"), ("folder / GGUF / checkpoint (GiB)", "size_gib")]
    print(f"\n{r['date']}, {r['machine']}, {r['settings']['threads']} threads")
    print(f"code paths: {r['paths']}")
    print("| | " + " | ".join(cols) + " |\n|" + " --- |" * (len(cols) + 1))
    for label, key in rows:
        cells = [c.get(key) for c in cols.values()]
        text = ["" if v is None else str(v) if isinstance(v, bool) else f"{v:.3g}" if v < 10 else f"{v:.1f}" for v in cells]
        print(f"| {label} | " + " | ".join(text) + " |")
    if "skipped" in llama:
        print(f"llama.cpp: skipped: {llama['skipped']}")
    print_goals(cols, r["settings"]["prompt_lengths"])


LLAMA_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_k_m")  # llama.cpp's columns (llama_cpp.measure)
SAME_BITS = {"int8": "q8_0", "int4": "q4_0"}  # our quantized folder -> llama.cpp's type of the same bits


def print_goals(cols: Dict[str, Dict[str, Any]], prompt_lengths: List[int]) -> None:
    """The issue's goals as ratios (> 1: this project is better), for the columns that were measured."""
    def ratio(label, num_col, num_key, den_col, den_key, goal):
        a, b = cols.get(num_col, {}).get(num_key), cols.get(den_col, {}).get(den_key)
        if a and b:
            print(f"  {label}: {a / b:.2f}x (goal {goal})")

    print("goals (ratios > 1 favour this project unless the goal says otherwise):")
    for n in prompt_lengths:
        ratio(f"prefill {n} tokens, HF / ours fp32", "HF fp32", f"prefill {n}", "ours float32", f"prefill {n}", ">= 1")
    ratio("load to first token, ours fp32 / HF", "ours float32", "first", "HF fp32", "first", "<= 0.5")
    ratio("decode b1, ours fp32 / llama.cpp f32", "ours float32", "decode b1", "llama.cpp f32", "decode b1", ">= 1")
    for dtype in ("bfloat16", "float16"):
        col = f"ours {dtype}"
        ratio(f"decode b1, ours {dtype} / llama.cpp f16", col, "decode b1", "llama.cpp f16", "decode b1", ">= 1")
        ratio(f"decode b1, ours {dtype} / ours fp32", col, "decode b1", "ours float32", "decode b1", ">= 1.8")
        ratio(f"prefill 100, llama.cpp f16 / ours {dtype}", "llama.cpp f16", "prefill 100", col, "prefill 100", ">= 1")
        ratio(f"folder, ours {dtype} / ours fp32", col, "size_gib", "ours float32", "size_gib", "about 0.5")
        ratio(f"folder, llama.cpp f16 GGUF / ours {dtype}", "llama.cpp f16", "size_gib", col, "size_gib", ">= 1")
        ratio(f"peak RSS, ours {dtype} / ours fp32", col, "rss", "ours float32", "rss", "about 0.5")
        ratio(f"peak RSS, llama.cpp f16 / ours {dtype}", "llama.cpp f16", "rss", col, "rss", ">= 1")
    for dtype, gguf in SAME_BITS.items():  # issue 32: at the same bits
        col, theirs = f"ours {dtype}", f"llama.cpp {gguf}"
        ratio(f"decode b1, ours {dtype} / llama.cpp {gguf.upper()}", col, "decode b1", theirs, "decode b1", ">= 1")
        if dtype == "int4":
            ratio(f"decode b1, ours {dtype} / llama.cpp Q4_K_M", col, "decode b1", "llama.cpp q4_k_m", "decode b1",
                  "reported")
        for n in prompt_lengths:
            ratio(f"prefill {n}, llama.cpp {gguf.upper()} / ours {dtype}", theirs, f"prefill {n}", col, f"prefill {n}",
                  ">= 0.9")
        ratio(f"decode, ours {dtype} batch 4 / batch 1 (total tok/s)", col, "decode b4", col, "decode b1", ">= 3")


if __name__ == "__main__":
    sys.exit(main())
