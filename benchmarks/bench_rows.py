"""Sequences in a decode step, against llama.cpp's `llama-batched-bench`: aggregate decode tok/s at 1, 4, 8, 16.

    python benchmarks/bench_rows.py --folder bf16=/path/to/folder --gguf bf16=/path/to/model.gguf \
        [--folder int8=... --gguf int8=...] [--counts 1,4,8,16] [--prompt 32] [--new 128] [--rounds 2] \
        [--modes fit,full] [--activations int8,int16] [--out results.json]

Each label pairs one of our folders (exported with --batch_size at least the largest count) with a GGUF of the same
weights at the same bits (bf16 / Q8_0 / Q4_0). For each count n, n sequences of --prompt random tokens are prefilled,
then --new decode steps of all n are timed: n * new / seconds, as llama-batched-bench's S_TG (-npp prompt -ntg new
-npl counts, its prompts decoded apart: not shared). Rounds alternate: ours (each mode), then llama.cpp, for each
label, --rounds times; the medians and their ratios are printed and written to --out.

Our modes (ModelRunner.step, lite_runtime/engine/runner.py):
- `fit`: as shipped: the inc graph of the fewest rows that holds the n sequences (export --step_rows);
- `full`: every step through the batch_size inc graph (the design before step graphs of fewer rows).
`--activations` runs each mode of a quantized folder once per mode of the quantized matmuls' x
(MSLITE_LLM_QUANT_ACTIVATIONS: int8, the default, or int16), an A/B of the two in the same rounds.
Each mode of a folder runs in a process of its own, which loads the folder and compiles the graphs it needs before
timing. The CPU kernels' path (ISA and the quantized decode form) is recorded with each figure. Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def ours(folder: str, counts: List[int], prompt: int, new: int, mode: str) -> Dict[str, object]:
    """Aggregate decode tok/s of each count through our runner (in this process)."""
    import numpy as np

    import cpu_kernels
    from lite_runtime import pipeline
    from lite_runtime.engine.blocks import SequenceBlocks
    from lite_runtime.engine.runner import StepRow

    gen = pipeline("text_generation", model=folder, backend="ms", warm_up="none")
    runner = gen.runner
    if mode == "full":
        runner.step_sizes = [runner.batch_size]
    b = runner.batch_size
    if max(counts) > b:
        raise SystemExit(f"{folder}: batch_size {b} is fewer than {max(counts)} sequences; re-export with --batch_size")
    for key in runner.step_graphs.values():
        runner.warm(key)
    rng = np.random.default_rng(0)
    vocab = int(gen.config.vocab_size)
    out: Dict[str, object] = {}
    for n in counts:
        seqs = [SequenceBlocks(runner.pool) for _ in range(n)]
        prompts = [rng.integers(100, vocab - 100, prompt).tolist() for _ in range(n)]
        try:
            for s, p in zip(seqs, prompts):
                s.reserve(len(p))
            logits = runner.prefill(prompts, [s.blocks for s in seqs])
            toks = [list(p) + [int(np.argmax(l))] for p, l in zip(prompts, logits)]

            def step():
                rows = [None] * b
                for i in range(n):
                    seqs[i].reserve(len(toks[i]))
                    rows[i] = StepRow(toks[i][-1], len(toks[i]), seqs[i].blocks)
                logits = runner.step(rows)
                for i in range(n):
                    toks[i].append(int(np.argmax(logits[i])))

            step()  # the graph this count runs is warm; its first call's allocations are not timed
            start = time.perf_counter()
            for _ in range(new):
                step()
            seconds = time.perf_counter() - start
        finally:
            for s in seqs:
                s.release(commit=False)
        out[str(n)] = {"tok_s": n * new / seconds, "step_ms": 1000 * seconds / new,
                       "graphs": dict(runner.step_counts)}
        runner.step_counts = {}
    plans = sorted(getattr(gen.backend, "plans", {}))  # the graphs run without MindSpore's executor (direct steps)
    return {"counts": out, "kernels": f"{cpu_kernels.paths()}, activations {cpu_kernels.quant_activations()}",
            "executor": f"direct steps ({', '.join(plans)})" if plans else "MindSpore's graph executor"}


class Crashed(RuntimeError):
    """llama.cpp's tool died by SIGSEGV."""


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return " amx_int8" in fh.read()
    except OSError:
        return False


def llama(binary: str, gguf: str, counts: List[int], prompt: int, new: int, threads: int) -> Dict[str, object]:
    ctx = max(counts) * (prompt + new) + 64
    cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new),
           "-npl", ",".join(map(str, counts)), "-t", str(threads), "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode == -signal.SIGSEGV:
        raise Crashed(f"{binary} crashed (SIGSEGV)")
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    out = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            rec = json.loads(line)
            out[str(rec["pl"])] = {"tok_s": rec["speed_tg"], "step_ms": 1000 * rec["t_tg"] / new}
    return {"counts": out}


def _child(args) -> int:
    print(json.dumps(ours(args.child, [int(c) for c in args.counts.split(",")], args.prompt, args.new, args.mode)))
    return 0


def _ours_process(folder: str, args, mode: str, isa: str, activations: str = "") -> Dict[str, object]:
    env = dict(os.environ)
    if isa != "native":
        env["MSLITE_LLM_CPU_KERNELS_ISA"] = isa
    if activations:
        env["MSLITE_LLM_QUANT_ACTIVATIONS"] = activations
    cmd = [sys.executable, os.path.abspath(__file__), "--child", folder, "--mode", mode, "--counts", args.counts,
           "--prompt", str(args.prompt), "--new", str(args.new)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _kernel_path(isa: str) -> str:
    env = dict(os.environ)
    if isa != "native":
        env["MSLITE_LLM_CPU_KERNELS_ISA"] = isa
    code = "import cpu_kernels; print(cpu_kernels.paths())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    return proc.stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--folder", action="append", default=[], help="label=path of one of our folders")
    p.add_argument("--gguf", action="append", default=[], help="label=path of llama.cpp's GGUF of the same weights")
    p.add_argument("--counts", default="1,4,8,16")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="fit,full", help="our runner's modes: fit (as shipped), full (batch_size rows)")
    p.add_argument("--isa", default="native", help="our kernels' path: native, avx512 (without VNNI and BF16), avx2 or "
                   "generic (forced); with avx2, llama.cpp is built for AVX2 too (GGML_NATIVE off, no AVX-512)")
    p.add_argument("--activations", default="", help="the quantized matmuls' x, one run of ours each: e.g. int8,int16 "
                   "(MSLITE_LLM_QUANT_ACTIVATIONS; default: the kernels' default, once)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama_isa", default="", help="llama.cpp's build (benchmarks/llama_cpp.py ISA_FLAGS): default "
                   "native (avx2 with --isa avx2); native-noamx where its AMX path crashes, which a native run that "
                   "dies by SIGSEGV on an AMX machine falls back to by itself")
    p.add_argument("--llama_dir", default="/tmp/ppl/llama_cpp_python-0.3.36/vendor/llama.cpp",
                   help="llama.cpp's source (benchmarks/llama_cpp.py source_dir finds or unpacks it)")
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fit", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    import llama_cpp

    folders = dict(x.split("=", 1) for x in args.folder)
    ggufs = dict(x.split("=", 1) for x in args.gguf)
    # llama.cpp built for the same ISA where ours is held to AVX2 (its build-bench-avx2), else for this machine
    src = llama_cpp.source_dir(args.llama_dir) if not os.path.isdir(args.llama_dir) else args.llama_dir
    llama_isa = args.llama_isa or ("avx2" if args.isa == "avx2" else "native")
    binary = llama_cpp.build_tool(src, "llama-batched-bench", isa=llama_isa)
    llama_note = ""

    def llama_run(gguf: str) -> Dict[str, object]:
        nonlocal binary, llama_isa, llama_note
        try:
            return llama(binary, gguf, counts, args.prompt, args.new, args.threads)
        except Crashed as exc:
            if llama_isa != "native" or not has_amx():
                raise SystemExit(str(exc)) from None
            # its AMX path dies on some machines (performance-log 48): the same source without AMX, said so
            llama_note = "the native build crashed here (SIGSEGV, AMX path); figures from the build without AMX"
            print(f"llama.cpp: {llama_note}", flush=True)
            llama_isa = "native-noamx"
            binary = llama_cpp.build_tool(src, "llama-batched-bench", isa=llama_isa)
            return llama(binary, gguf, counts, args.prompt, args.new, args.threads)
    counts = [int(c) for c in args.counts.split(",")]
    # our runs per folder: (mode, the activations' name in the label, MSLITE_LLM_QUANT_ACTIVATIONS)
    ours_runs = [(mode, f" x{act}" if act else "", act) for mode in args.modes.split(",")
                 for act in (args.activations.split(",") if args.activations else [""])]
    runs: Dict[str, List[Dict[str, object]]] = {}
    for r in range(args.rounds):
        for label in folders:
            for mode, suffix, act in ours_runs:
                res = _ours_process(folders[label], args, mode, args.isa, act)
                runs.setdefault(f"ours {label} {mode}{suffix}", []).append(res)
                print(f"round {r + 1}: ours {label} {mode}{suffix}: " + ", ".join(
                    f"{n}: {res['counts'][str(n)]['tok_s']:.1f}" for n in counts)
                    + (f" [{res['executor']}]" if r == 0 and "executor" in res else ""), flush=True)
            if label in ggufs:
                res = llama_run(ggufs[label])
                runs.setdefault(f"llama.cpp {label}", []).append(res)
                print(f"round {r + 1}: llama.cpp {label}: " + ", ".join(
                    f"{n}: {res['counts'][str(n)]['tok_s']:.1f}" for n in counts), flush=True)
    medians = {name: {str(n): statistics.median(x["counts"][str(n)]["tok_s"] for x in xs) for n in counts}
               for name, xs in runs.items()}
    print(f"\naggregate decode tok/s, median of {args.rounds} alternating rounds "
          f"({args.prompt}-token prompts, {args.new} new tokens each)")
    print("| sequences | " + " | ".join(medians) + " |")
    for n in counts:
        print(f"| {n} | " + " | ".join(f"{m[str(n)]:.1f}" for m in medians.values()) + " |")
    ratios = {}
    for label in folders:
        ref = medians.get(f"llama.cpp {label}")
        for mode, suffix, _ in ours_runs:
            name = f"{label} {mode}{suffix}"
            if ref:
                # the median of the per-round ratios (each round's ours against that round's llama.cpp)
                per_round = [[o["counts"][str(n)]["tok_s"] / l["counts"][str(n)]["tok_s"] for n in counts]
                             for o, l in zip(runs[f"ours {name}"], runs[f"llama.cpp {label}"])]
                ratios[name] = {str(n): statistics.median(r[i] for r in per_round) for i, n in enumerate(counts)}
                print(f"ours {name} / llama.cpp (median of per-round ratios): " + ", ".join(
                    f"{n}: {ratios[name][str(n)]:.2f}x" for n in counts))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "kernel_path": _kernel_path(args.isa), "isa_forced": args.isa,
                       "prompt": args.prompt, "new": args.new, "rounds": args.rounds, "folders": folders,
                       "ggufs": ggufs, "llama_cpp": binary,
                       "llama_cpp_isa": llama_isa, "llama_cpp_note": llama_note, "runs": runs, "medians": medians, "ratios": ratios},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
