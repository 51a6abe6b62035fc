"""Benchmark this project against HF transformers on the same checkpoint, side by side in one run.

    python scripts/benchmark.py --work bench/            # makes a random Qwen2-0.5B-shaped checkpoint
    python scripts/benchmark.py --checkpoint <hf_dir> --work bench/

Exports the checkpoint (once per batch size), then runs each engine in its own process: load
time, load-to-first-token, prefill at several prompt lengths, greedy decode tok/s at batch 1 and
at batch 4, peak RSS, and checks that greedy tokens agree. Prints a table of ratios and writes
JSON. Needs the test extra (torch) for the HF side. Benchmarks are not tests: nothing here runs
in the test suite.
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
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

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
    result: Dict[str, Any] = {"load_s": load, "load_to_first_token_s": time.perf_counter() - start,
                              "first_prefill_s": first.prefill_seconds, "prefill_s": {}, "buckets": pipe.prefill_sizes,
                              "peak_rss_first_token_gib": peak_rss_gib()}
    for n in args.prompt_lengths:
        runs = [pipe.generate(prompt_rows(n, 1), max_new_tokens=1).prefill_seconds for _ in range(args.repeat)]
        result["prefill_s"][str(n)] = min(runs)
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
                              "peak_rss_first_token_gib": peak_rss_gib()}
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


def run_worker(kind: str, **kw) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind]
    for key, value in kw.items():
        if value is None:
            continue
        cmd += [f"--{key}", ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the driver ------------------------------------------------------------------------------------

def ensure_checkpoint(args) -> str:
    if args.checkpoint:
        return args.checkpoint
    path = os.path.join(args.work, "qwen2-0.5b-shape")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import make_demo_checkpoint

        print(f"making a random Qwen2-0.5B-shaped checkpoint in {path}", flush=True)
        make_demo_checkpoint.make_checkpoint(path, **SHAPE_05B)
    return path


def export(checkpoint: str, folder: str, args, batch: int) -> Dict[str, Any]:
    if os.path.isfile(os.path.join(folder, "manifest.json")) and not args.reexport:
        return {"reused": True}
    cmd = [sys.executable, "-m", "export", "-q", "--checkpoint", checkpoint, "--output", folder, "--device", "cpu",
           "--dtype", "float32", "--seq_length", str(args.seq_length), "--batch_size", str(batch), "--overwrite"]
    if args.buckets:
        cmd += ["--prefill_buckets", ",".join(map(str, args.buckets))]
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="HF Qwen2 checkpoint (default: make a random 0.5B-shaped one in --work)")
    p.add_argument("--work", default="bench", help="folder for the checkpoint, the exports and the JSON")
    p.add_argument("--seq_length", type=int, default=1024)
    p.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",") if x], default=[128, 512])
    p.add_argument("--prompt_lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 128, 512])
    p.add_argument("--first_prompt", type=int, default=128)
    p.add_argument("--decode_prompt", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 4])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--cpu_kernels", choices=("auto", "on", "off"), default="auto",
                   help="python -m export --cpu_kernels: off measures MindSpore's own MatMul in the decode step")
    p.add_argument("--reexport", action="store_true", help="export again even if the folders exist")
    p.add_argument("--json", default=None, help="where to write the results (default: <work>/benchmark.json)")
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
    report: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, "
                              f"{os.cpu_count()} cores", "checkpoint": checkpoint, "settings": vars(args),
                              "exports": {}, "ours": {}, "hf": None}
    for batch in args.batches:
        folder = os.path.join(args.work, f"model_b{batch}" + ("_matmul" if args.cpu_kernels == "off" else ""))
        print(f"exporting batch {batch} to {folder}", flush=True)
        report["exports"][str(batch)] = {**export(checkpoint, folder, args, batch), "folder_bytes": folder_bytes(folder)}
        print(f"measuring this project, batch {batch}", flush=True)
        report["ours"][str(batch)] = run_worker("ours", folder=folder, **common)
    print("measuring HF transformers", flush=True)
    report["hf"] = run_worker("hf", checkpoint=checkpoint, batches=args.batches, threads=args.threads, **common)
    report["weight_bytes"] = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                                 if f.endswith(".safetensors"))
    print_table(report)
    path = args.json or os.path.join(args.work, "benchmark.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")
    return 0


def print_table(r: Dict[str, Any]) -> None:
    hf, ours1 = r["hf"], r["ours"][str(r["settings"]["batches"][0])]
    rows = [("load (s)", ours1["load_s"], hf["load_s"], False),
            ("load to first token (s)", ours1["load_to_first_token_s"], hf["load_to_first_token_s"], False)]
    for n, t in ours1["prefill_s"].items():
        rows.append((f"prefill {n} tokens (ms)", t * 1000, hf["prefill_s"][n] * 1000, False))
    for batch, ours in r["ours"].items():
        rows.append((f"decode batch {batch} (tok/s)", ours["decode_tok_s"], hf["decode"][batch]["tok_s"], True))
        same = ours["tokens"] == hf["decode"][batch]["tokens"]
        rows.append((f"  greedy tokens identical, batch {batch}", same, True, None))
    rows.append(("peak RSS to first token (GiB)", ours1["peak_rss_first_token_gib"], hf["peak_rss_first_token_gib"],
                 False))
    rows.append(("peak RSS, whole run (GiB)", ours1["peak_rss_gib"], hf["peak_rss_gib"], False))
    print(f"\n{'':34}{'mslite-llm (ms)':>16}{'HF transformers':>17}{'ratio':>9}")
    for name, ours_v, hf_v, higher_better in rows:
        if higher_better is None:
            print(f"{name:34}{str(ours_v):>16}{'':>17}")
            continue
        ratio = (ours_v / hf_v) if higher_better else (hf_v / ours_v if ours_v else float("inf"))
        print(f"{name:34}{ours_v:16.2f}{hf_v:17.2f}{ratio:8.2f}x")
    w = r["weight_bytes"]
    for batch, e in r["exports"].items():
        print(f"folder batch {batch}: {e['folder_bytes'] / 2**30:.2f} GiB = {e['folder_bytes'] / w:.2f} x weights; "
              f"{e.get('summary', 'reused')}")
    print("ratio > 1 means this project is better (faster, or less memory)")


if __name__ == "__main__":
    sys.exit(main())
