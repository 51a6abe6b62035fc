"""The paged KV cache's block size on the CPU: the decode step and a prompt piece at several block sizes, the same
model and lengths, paired alternating runs (the CPU default, export/devices.py, comes from this).

    python benchmarks/bench_block_size.py --checkpoint demo/smollm2 [--sizes 16,32,64,128] [--lengths 512,4096]

For each block size the checkpoint is exported once (`--device cpu --dtype bfloat16 --batch_size 16 --seq_length
8192 --block_size N --prefill_buckets 16`: the prefill graphs are not timed here, and with the default buckets the
golden references of ten buckets of 16 rows take most of an hour). Then, per length L, in rounds alternating the folders: 16 sequences of L positions in blocks
handed out shuffled (BlockPool.scatter: tables that skip and run backwards, as a loaded server's do), timed over 20
decode steps of all 16 (the inc graph), and one 128-token piece at position L through the chunk graph beside them.
The attention reads what the blocks hold: its cost does not depend on the values, so nothing is prefilled. Median
per block size; JSON with the machine, date and the kernels' code path. Not a test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def export(checkpoint: str, out: str, block: int) -> str:
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        print(f"exporting block size {block}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "export", "--checkpoint", os.path.abspath(checkpoint), "--output", out,
                        "--device", "cpu", "--dtype", "bfloat16", "--seq_length", "8192", "--batch_size", "16",
                        "--block_size", str(block), "--prefill_buckets", "16", "--overwrite", "-q"], cwd=ROOT, check=True)
    return out


def timings(pipe, length: int, steps: int) -> Dict[str, float]:
    """ms per decode step of 16 sequences at `length`, and ms of a 128-token piece at `length` beside them."""
    from lite_runtime.engine.runner import SequenceBlocks, StepRow

    runner = pipe.runner
    runner.pool.scatter()
    seqs = [SequenceBlocks(runner.pool) for _ in range(runner.batch_size + 1)]
    try:
        for seq in seqs:
            seq.reserve(length + 128 + steps)
        rows = [StepRow(1, length + 1, seq.blocks) for seq in seqs[:-1]]
        runner.step(rows)  # warm
        start = time.perf_counter()
        for i in range(steps):
            runner.step([StepRow(1, length + 1 + i, r.table) for r in rows])
        step_ms = (time.perf_counter() - start) / steps * 1000
        piece = [1] * 128
        runner.chunk(piece, length, seqs[-1].blocks, rows)  # warm
        start = time.perf_counter()
        runner.chunk(piece, length, seqs[-1].blocks, rows)
        piece_ms = (time.perf_counter() - start) * 1000
    finally:
        for seq in seqs:
            seq.release(commit=False)
    return {"step_ms": step_ms, "piece_ms": piece_ms}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "demo", "smollm2"))
    p.add_argument("--work", default="/tmp/bench-block")
    p.add_argument("--sizes", default="16,32,64,128")
    p.add_argument("--lengths", default="512,4096")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "bench-block-size.json"))
    args = p.parse_args(argv)
    import cpu_kernels
    from lite_runtime import pipeline

    sizes = [int(s) for s in args.sizes.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    pipes = {}
    for size in sizes:
        folder = export(args.checkpoint, os.path.join(args.work, f"b{size}"), size)
        need = -(-(max(lengths) + 128 + args.steps + 2) // size)  # blocks per sequence at the longest length
        pipes[size] = pipeline("text_generation", model=folder, backend="ms", chunk_graphs=True, warm_up="smallest",
                               verify_checksums=False, num_blocks=17 * need + 1)
    runs: Dict[str, Dict[int, List[Dict[str, float]]]] = {str(n): {s: [] for s in sizes} for n in lengths}
    for r in range(args.rounds):
        for length in lengths:
            for size in (sizes if r % 2 == 0 else sizes[::-1]):  # alternating order
                runs[str(length)][size].append(timings(pipes[size], length, args.steps))
    report: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "kernels_isa": cpu_kernels.isa()},
        "model": os.path.basename(os.path.abspath(args.checkpoint)), "dtype": "bfloat16", "batch": 16, "results": {}}
    print(f"{report['model']} bfloat16, 16 sequences, {report['machine']}")
    print("| length | block size | decode step ms (16 rows) | 128-token piece ms |")
    print("| --- | --- | --- | --- |")
    for length in lengths:
        for size in sizes:
            got = runs[str(length)][size]
            med = {k: statistics.median(g[k] for g in got) for k in ("step_ms", "piece_ms")}
            report["results"].setdefault(str(length), {})[str(size)] = med
            print(f"| {length} | {size} | {med['step_ms']:.1f} | {med['piece_ms']:.1f} |")
    with open(args.output, "w") as fh:
        json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
