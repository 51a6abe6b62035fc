"""The decode step's matrices alone: our GEMV over every weight of a step, against the time to read those bytes.

    python benchmarks/bench_decode_step.py [--isa native,avx2,generic] [--dtypes float32,bfloat16,float16] [--rows 1]

A step of the Qwen2-0.5B shape at batch 1 is a GEMV with each of its matrices (per layer q/k/v, o_proj, gate, up,
down; then the lm_head): 1.98 GB in float32, read once. This times, for each code path of our kernels (each in its
own process: the path is chosen when the library loads, MSLITE_LLM_CPU_KERNELS_ISA) and each weight dtype:
- `kernels`: MsliteLlmGemv called on every matrix in turn, as the graph calls it (one call per matrix; the norms,
  RoPE, attention and cache writes of the graph are not here), best of --repeat steps;
- `read`: the same bytes summed by numpy on as many threads (each thread a share of each matrix): what reading
  them costs on this machine, the floor a memory-bound GEMV can reach.
Prints ms per step and GB/s for both, and the kernels' share of the read's pace. With --llama_cpp_json (the output
of benchmarks/llama_cpp.py) it adds llama.cpp's whole token at equal bits beside it. With --in_graph FOLDER, the same
step through MindSpore (a batch-1 `--device cpu` folder), our kernels timing themselves inside it
(MSLITE_LLM_CPU_KERNELS_PROFILE): what they take of the step, and what the rest of the graph takes. Not a test.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (outputs, inputs) of one layer's matrices, then the head: the 0.5B shape
LAYER = [(1152, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)]
HEAD = (151936, 896)
LAYERS = 24


def to_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(np.float16)
    u = a.view(np.uint32).astype(np.uint64)  # bfloat16: round to nearest even, kept as uint16
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def matrices(dtype: str, seed: int = 0) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = LAYER * LAYERS + [HEAD]
    return [to_bits(rng.standard_normal(s, dtype=np.float32) * 0.02, dtype) for s in shapes]


def measure(dtype: str, rows: int, threads: int, repeat: int) -> Dict[str, float]:
    import cpu_kernels

    cpu_kernels.set_threads(threads)
    lib = ctypes.CDLL(cpu_kernels.library_path())
    ws = matrices(dtype)
    x = np.random.default_rng(1).standard_normal((rows, 4864), dtype=np.float32)
    calls = []
    for w in ws:
        xi = np.ascontiguousarray(x[:, :w.shape[1]])
        y = np.zeros((rows, w.shape[0]), np.float32)
        arrays = (xi, w, y)
        params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
        dims = [(ctypes.c_int64 * 2)(*a.shape) for a in arrays]
        shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
        names = (ctypes.c_char_p * 3)(b"float32", dtype.encode(), b"float32")
        calls.append((params, (ctypes.c_int * 3)(2, 2, 2), shapes, names, arrays, dims))
    fn = lib.MsliteLlmGemv

    def step():
        for params, ndims, shapes, names, _, _ in calls:
            if fn(3, params, ndims, shapes, names, None, None) != 0:
                raise RuntimeError("MsliteLlmGemv failed")

    def read():  # each thread sums its share of every matrix (numpy releases the GIL)
        def part(t):
            for w in ws:
                flat = w.reshape(-1)
                n = flat.size // threads
                flat[t * n:(t + 1) * n].sum(dtype=np.float64 if w.dtype == np.float32 else np.int64)
        pool = [threading.Thread(target=part, args=(t,)) for t in range(threads)]
        for p in pool:
            p.start()
        for p in pool:
            p.join()

    nbytes = sum(w.nbytes for w in ws)
    out = {"bytes": nbytes, "isa": cpu_kernels.isa()}
    for name, f in (("kernels", step), ("read", read)):
        f()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_ms"] = best * 1000
        out[f"{name}_gbs"] = nbytes / best / 1e9
    return out


OPS = ("GEMV", "GEMV+bias", "GEMM over prompt rows", "embed", "RMSNorm", "q/k/v+RoPE", "GEMV+residual", "SwiGLU",
       "attention", "norm+q/k/v+RoPE+cache", "norm+SwiGLU", "o_proj+norm+MLP", "int8/int4 matmul",
       "whole layer", "MoE (router + experts)", "between our ops (MindSpore)")


def in_graph(folder: str, steps: int) -> Dict[str, object]:
    """The folder's decode step through MindSpore (the `ms` backend, batch 1), with our kernels timing themselves
    (MSLITE_LLM_CPU_KERNELS_PROFILE, set by the parent): ms per step, and how much of it each kernel took."""
    import cpu_kernels
    from lite_runtime import pipeline

    pipe = pipeline("text_generation", model=folder, backend="ms", verify_checksums=False, warm_up="all")
    runner = pipe.runner
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 300, 128)]
    lib = ctypes.CDLL(cpu_kernels.library_path())
    calls, ns = (ctypes.c_int64 * len(OPS))(), (ctypes.c_int64 * len(OPS))()
    from lite_runtime.engine.runner import SequenceBlocks, StepRow

    seq = SequenceBlocks(runner.pool)  # one sequence's blocks in the KV pool
    seq.reserve(len(prompt) + steps + 1)
    idle = [None] * (runner.batch_size - 1)
    best = None
    for _ in range(3):
        token = int(np.argmax(runner.prefill([prompt], [seq.blocks])[0]))
        lib.MsliteLlmProfile(calls, ns, 1)  # the decode steps only
        start = time.perf_counter()
        for i in range(steps):
            token = int(np.argmax(runner.step([StepRow(token, len(prompt) + 1 + i, seq.blocks)] + idle)[0]))
        step_ms = (time.perf_counter() - start) / steps * 1000
        lib.MsliteLlmProfile(calls, ns, 1)
        per_op = {OPS[i]: {"calls": calls[i] / steps, "ms": ns[i] / 1e6 / steps} for i in range(len(OPS)) if calls[i]}
        run = {"step_ms": step_ms, "kernels_ms": sum(v["ms"] for k, v in per_op.items() if k != OPS[-1]),
               "ops": per_op}
        if best is None or step_ms < best["step_ms"]:
            best = run
    return {**best, "isa": cpu_kernels.isa(), "dtype": pipe.config.dtype}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--isa", default="native,avx2", help="our kernels' code paths, comma-separated: native (the "
                                                        "library's own choice), avx2, generic")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--rows", type=int, default=1, help="rows of x (the batch)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--llama_cpp_json", help="benchmarks/llama_cpp.py's output, for llama.cpp's token at equal bits")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--in_graph", nargs="*", metavar="FOLDER",
                   help="also time these folders' decode step through MindSpore (batch-1 --device cpu folders), "
                        "with how much of it our kernels take")
    p.add_argument("--steps", type=int, default=32, help="decode steps per --in_graph run (best of 3 runs)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child_graph", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.threads, args.repeat)))
        return 0
    if args.child_graph:
        print(json.dumps(in_graph(args.child_graph, args.steps)))
        return 0
    llama = {}
    if args.llama_cpp_json:
        with open(args.llama_cpp_json) as fh:
            llama = json.load(fh)
    env_isa = {"native": None, "avx2": "avx2", "generic": "generic"}
    results = []
    print(f"decode step matrices of the 0.5B shape, rows {args.rows}, {args.threads} threads; best of {args.repeat}")
    print("| path | weights | kernels ms | GB/s | read ms | GB/s | kernels / read pace | llama.cpp token ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for isa in args.isa.split(","):
        for dtype in filter(None, args.dtypes.split(",")):  # --dtypes "": only --in_graph
            env = dict(os.environ)
            env.pop("MSLITE_LLM_CPU_KERNELS_ISA", None)
            if env_isa[isa]:
                env["MSLITE_LLM_CPU_KERNELS_ISA"] = env_isa[isa]
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", dtype, "--rows",
                                   str(args.rows), "--threads", str(args.threads), "--repeat", str(args.repeat)],
                                  capture_output=True, text=True, env=env, check=True)
            r = {**json.loads(proc.stdout.strip().splitlines()[-1]), "dtype": dtype, "asked": isa}
            gguf = {"float32": "f32", "float16": "f16", "bfloat16": "f16"}[dtype]
            tok = llama.get(gguf, {}).get("decode_tok_s")
            r["llama_cpp_token_ms"] = 1000 / tok if tok else None
            results.append(r)
            theirs = f"{1000 / tok:.1f} ({gguf}, {llama.get('isa', '?')} build)" if tok else ""
            print(f"| {r['isa']} | {dtype} | {r['kernels_ms']:.1f} | {r['kernels_gbs']:.1f} | {r['read_ms']:.1f} | "
                  f"{r['read_gbs']:.1f} | {r['read_ms'] / r['kernels_ms']:.2f} | {theirs} |", flush=True)
    graphs = []
    if args.in_graph:
        print("\n| path | folder | step ms | our kernels ms | the rest ms | by kernel (ms per step) |")
        print("| --- | --- | --- | --- | --- | --- |")
    for folder in args.in_graph or ():
        for isa in args.isa.split(","):
            env = {k: v for k, v in os.environ.items() if k != "MSLITE_LLM_CPU_KERNELS_ISA"}
            env["MSLITE_LLM_CPU_KERNELS_PROFILE"] = "1"
            if env_isa[isa]:
                env["MSLITE_LLM_CPU_KERNELS_ISA"] = env_isa[isa]
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child_graph", folder, "--steps",
                                   str(args.steps)], capture_output=True, text=True, env=env, check=True)
            g = {**json.loads(proc.stdout.strip().splitlines()[-1]), "folder": folder}
            graphs.append(g)
            ops = ", ".join(f"{k} {v['ms']:.1f}" for k, v in sorted(g["ops"].items(), key=lambda kv: -kv[1]["ms"]))
            print(f"| {g['isa']} | {os.path.basename(folder)} ({g['dtype']}) | {g['step_ms']:.1f} | "
                  f"{g['kernels_ms']:.1f} | {g['step_ms'] - g['kernels_ms']:.1f} | {ops} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": args.rows, "threads": args.threads,
                       "results": results, "llama_cpp": llama, "in_graph": graphs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
