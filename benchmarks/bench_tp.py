"""The cost of tensor parallelism on this machine: one folder per --tp_size of the same checkpoint, run side by side.

    python benchmarks/bench_tp.py --checkpoint <hf_dir> --work bench_tp/ [--tp_sizes 1,2] [--output FILE]

Each folder is exported with `--device cpu --seq_length 512 --tp_size N` (nothing else). tp 1 runs in one process;
tp N under `msrun --worker_num N` (loopback). Each rank loads the folder, times a 100-token prefill (median of 3)
and greedy decode of 64 tokens (tok/s), and every rank writes its figures; all ranks' tokens must agree with tp 1's.
Also reports each rank's weights file against the whole model's. On a 2-core CPU, two ranks share the two cores
and add an AllReduce per layer twice per token: tensor parallelism is slower here, as expected; on Atlas it is
what makes a large model fit. Benchmarks are not tests: nothing here runs in the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # benchmark.py

WORKER = """
import json, statistics, sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from lite_runtime import pipeline
pipe = pipeline("text_generation", model={folder!r}, backend="ms", warm_up="all")
load = time.perf_counter() - start
prompt = [[100 + i for i in range(100)]]
times = []
for _ in range(3):
    t = time.perf_counter()
    pipe.infer(prompt)
    times.append(time.perf_counter() - t)
out = pipe.generate(prompt, max_new_tokens=64, eos_token_id=[])
json.dump({{"rank": pipe.config.rank_id, "load_s": load, "prefill_100_s": statistics.median(times),
           "decode_tok_s": out.decode_tokens_per_second, "tokens": out[0]}},
          open({out!r} + f"/rank{{pipe.config.rank_id}}.json", "w"))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(folder: str, tp: int, work: str) -> List[Dict[str, Any]]:
    out = os.path.join(work, f"result_tp{tp}")
    os.makedirs(out, exist_ok=True)
    script = os.path.join(out, "worker.py")
    with open(script, "w") as fh:
        fh.write(WORKER.format(root=ROOT, folder=folder, out=out))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if tp == 1:
        subprocess.run([sys.executable, script], cwd=ROOT, env=env, check=True)
    else:
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "msrun"), "--worker_num", str(tp),
                        "--local_worker_num", str(tp), "--master_port", str(free_port()), "--log_dir",
                        os.path.join(out, "logs"), "--join", "True", script], cwd=ROOT, env=env, check=True)
    results = []
    for r in range(tp):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            results.append(json.load(fh))
    return results


def weights_bytes(folder: str) -> List[int]:
    with open(os.path.join(folder, "manifest.json")) as fh:
        manifest = json.load(fh)
    files = sorted({g["variables"] for g in manifest["graphs"]})
    return [manifest["files"][f]["size"] for f in files]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="HF checkpoint (default: a random Qwen2-0.5B-shaped one in --work)")
    p.add_argument("--work", required=True)
    p.add_argument("--tp_sizes", default="1,2")
    p.add_argument("--seq_length", type=int, default=512)
    p.add_argument("--output", default=os.path.join(RESULTS, "bench-tp.json"),
                   help="write the figures as JSON here (default: benchmarks/results/bench-tp.json)")
    args = p.parse_args(argv)
    import benchmark

    os.makedirs(args.work, exist_ok=True)
    checkpoint = args.checkpoint
    if not checkpoint:
        checkpoint = benchmark.ensure_checkpoint(argparse.Namespace(checkpoint=None, work=args.work))
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": benchmark.machine(),
                              "cores": os.cpu_count(),
                              "checkpoint": checkpoint, "seq_length": args.seq_length, "folders": {}}
    for tp in [int(t) for t in args.tp_sizes.split(",")]:
        folder = os.path.join(args.work, f"tp{tp}_s{args.seq_length}")
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            subprocess.run([sys.executable, "-m", "export", "--checkpoint", checkpoint, "--output", folder, "--device",
                            "cpu", "--seq_length", str(args.seq_length), "--tp_size", str(tp), "-q"], cwd=ROOT,
                           check=True)
        ranks = run(folder, tp, args.work)
        report["folders"][tp] = {"ranks": ranks, "weights_bytes_per_rank": weights_bytes(folder)}
        print(f"tp {tp}: load {ranks[0]['load_s']:.1f} s, prefill 100 tokens {ranks[0]['prefill_100_s']:.3f} s, "
              f"decode {ranks[0]['decode_tok_s']:.1f} tok/s, weights per rank "
              f"{[round(b / 2 ** 30, 2) for b in weights_bytes(folder)]} GiB", flush=True)
    base = report["folders"].get(1)
    print("\n| tp_size | load (s) | prefill 100 tokens (s) | decode (tok/s) | weights per rank (GiB) | tokens = tp 1's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tp, result in report["folders"].items():
        r0 = result["ranks"][0]
        same = all(r["tokens"] == (base or result)["ranks"][0]["tokens"] for r in result["ranks"])
        per_rank = ", ".join(f"{b / 2 ** 30:.2f}" for b in result["weights_bytes_per_rank"])
        print(f"| {tp} | {r0['load_s']:.1f} | {r0['prefill_100_s']:.3f} | {r0['decode_tok_s']:.1f} | {per_rank} | "
              f"{'yes' if same else 'NO'} |")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
