"""Decode speed at batch 1, this project against llama.cpp at equal bits, alternating in fresh processes.

    python benchmarks/bench_decode_ab.py --folder <batch-1 --device cpu folder> --gguf <llama.cpp GGUF> \
        --llama_bench <path> [--isa avx2] [--rounds 5] [--tokens 64]

Why alternating: this machine's memory bandwidth moves by up to +-40 % between minutes and between processes (a
plain read measured 33-57 GB/s; docs/performance-log.md, "The CPU decode step on the AVX2 path", 2026-11-24), so
one run of each engine, minutes apart, says little. Each round runs both (the order flips every round); the figure
that counts is the median of the per-round ratios.
Ours: the folder's decode step through the `ms` backend after a 128-token prompt, tokens/s: by default the runner's
inc graph, tokens fed back greedily; --api generate or infer: through pipe.generate, or pipe.infer([sequence]) once
per token (the step API). llama.cpp: `llama-bench -p 0 -n <tokens> -r 1` (generation from an empty context).
Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ours(folder: str, tokens: int, api: str = "runner") -> float:
    """Decode tok/s at batch 1 after a 128-token prompt, through `api`: "runner" (the inc graph, tokens fed back by
    argmax), "generate" (pipe.generate's decode loop) or "infer" (pipe.infer([sequence]) once per token, the step API
    a caller driving its own loop uses)."""
    import numpy as np

    from lite_runtime import pipeline

    pipe = pipeline("text_generation", model=folder, backend="ms", verify_checksums=False, warm_up="all")
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 300, 128)]
    if api == "generate":
        pipe.generate([prompt], max_new_tokens=4, eos_token_id=[])  # warm
        out = pipe.generate([prompt], max_new_tokens=tokens + 1, eos_token_id=[])
        return out.decode_steps / out.decode_seconds
    if api == "infer":
        seq = list(prompt)
        for _ in range(2):  # the prefill, then a warm step
            seq.append(pipe.infer([seq]).next_tokens[0])
        start = time.perf_counter()
        for _ in range(tokens):
            seq.append(pipe.infer([seq]).next_tokens[0])
        return tokens / (time.perf_counter() - start)
    from lite_runtime.engine.runner import SequenceBlocks, StepRow

    runner = pipe.runner
    seq = SequenceBlocks(runner.pool)  # one sequence's blocks in the KV pool, for the prompt and every step
    seq.reserve(len(prompt) + tokens + 2)
    idle = [None] * (runner.batch_size - 1)

    def step(token: int, length: int) -> int:
        return int(np.argmax(runner.step([StepRow(token, length, seq.blocks)] + idle)[0]))

    token = int(np.argmax(runner.prefill([prompt], [seq.blocks])[0]))
    token = step(token, len(prompt) + 1)  # warm
    start = time.perf_counter()
    for i in range(tokens):
        token = step(token, len(prompt) + 2 + i)
    return tokens / (time.perf_counter() - start)


def llama(binary: str, gguf: str, tokens: int, threads: int) -> float:
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o",
                          "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True)
    p.add_argument("--gguf", required=True)
    p.add_argument("--llama_bench", required=True)
    p.add_argument("--isa", choices=("native", "avx2", "generic"), default="native",
                   help="our kernels' path (MSLITE_LLM_CPU_KERNELS_ISA); build llama.cpp to match (llama_cpp.py --isa)")
    p.add_argument("--api", choices=("runner", "generate", "infer"), default="runner",
                   help="our decode loop: the runner's inc graph (default), pipe.generate, or pipe.infer per token")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--baseline_root", help="also: another checkout (e.g. a git worktree of an earlier commit, its kernels "
                                           "built in place), with its own export of the model in --baseline_folder")
    p.add_argument("--baseline_folder", help="the model exported by --baseline_root's code")
    p.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # the checkout to measure: its lite_runtime and its kernels, ahead of this one's and the installed
        sys.path.insert(0, os.path.abspath(args.child))
        import cpu_kernels

        tok_s = ours(args.folder, args.tokens, args.api)
        form = getattr(cpu_kernels, "quant_form", lambda: None)()  # the quantized decode form (older builds: none)
        print(json.dumps({"tok_s": tok_s, "isa": cpu_kernels.isa() + (f"/{form}" if form else ""),
                          "kernels": cpu_kernels.library_path()}))
        return 0
    env = {k: v for k, v in os.environ.items() if k != "MSLITE_LLM_CPU_KERNELS_ISA"}
    if args.isa != "native":
        env["MSLITE_LLM_CPU_KERNELS_ISA"] = args.isa
    def ours_in(root: str, folder: str) -> dict:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", root,
                              "--folder", folder, "--gguf", args.gguf, "--llama_bench", args.llama_bench, "--tokens",
                              str(args.tokens), "--api", args.api], capture_output=True, text=True, env=env, check=True, cwd=root)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if not result["kernels"].startswith(os.path.abspath(root)):  # the baseline ran its own kernels, or says so
            raise SystemExit(f"{root}: the child loaded kernels from {result['kernels']}")
        return result

    engines = ["ours", "llama"] + (["baseline"] if args.baseline_root else [])
    rows = []
    for r in range(args.rounds):
        result = {}
        for who in (engines if r % 2 == 0 else engines[::-1]):
            if who == "ours":
                result.update(ours_in(ROOT, args.folder))
            elif who == "baseline":
                result["baseline_tok_s"] = ours_in(os.path.abspath(args.baseline_root), args.baseline_folder)["tok_s"]
            else:
                result["llama_tok_s"] = llama(args.llama_bench, args.gguf, args.tokens, args.threads)
        result["ratio"] = result["tok_s"] / result["llama_tok_s"]
        if args.baseline_root:
            result["baseline_ratio"] = result["baseline_tok_s"] / result["llama_tok_s"]
        rows.append(result)
        base = (f", baseline {result['baseline_tok_s']:.1f} tok/s (ratio {result['baseline_ratio']:.2f})"
                if args.baseline_root else "")
        print(f"round {r + 1}: ours ({result['isa']}) {result['tok_s']:.1f} tok/s, llama.cpp "
              f"{result['llama_tok_s']:.1f} tok/s, ratio {result['ratio']:.2f}{base}", flush=True)
    print(f"median: ours {statistics.median(r['tok_s'] for r in rows):.1f} tok/s, llama.cpp "
          f"{statistics.median(r['llama_tok_s'] for r in rows):.1f} tok/s; median of the per-round ratios "
          f"{statistics.median(r['ratio'] for r in rows):.2f} ({os.path.basename(args.folder)} against "
          f"{os.path.basename(args.gguf)})")
    if args.baseline_root:
        print(f"baseline ({args.baseline_root}): median {statistics.median(r['baseline_tok_s'] for r in rows):.1f} "
              f"tok/s, median of its per-round ratios to llama.cpp "
              f"{statistics.median(r['baseline_ratio'] for r in rows):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
