"""Measure how far half-precision runs land from the float32 golden references: the data behind the check's limits.

    python benchmarks/measure_check_limits.py --work bench/limits [--with_05b]

For random Qwen2 checkpoints of several shapes (and, with --with_05b, the Qwen2-0.5B shape), it
exports a float16 folder (its golden.json is float32, from the checkpoint), replays the golden
prompts teacher-forced on (a) the folder through MindSpore's CPU float16 kernels and (b) HF
transformers in float16 and in bfloat16 on the CPU (stand-ins for a half-precision device, which
this project does not have), and prints the worst top-k logit error relative to each step's
largest |logit|, greedy divergences, and the smallest reference top-2 margins. The limits in
lite_runtime/golden.py (TOLERANCES) are chosen from these figures; model_dirs/README.md says how.
With --quantized: quantized CPU folders of fourteen shapes (QUANTIZED_SPECS: hidden 64 to 1024, tied and untied,
int8 and int4, groups and per channel, the export's rounding and GPTQ/AWQ imports), each checked as it is and after
tampers: the margins of check's derived limits and whether every tamper fails (docs/checking.md, "Limits derived for
a quantized CPU folder"; results/check-limits-quantized.json).
Not a test: nothing here runs in the test suite. Needs the test extra (torch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # benchmark.py

SHAPES = {  # name -> make_checkpoint settings
    "tiny-gqa": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, seed=0),
    "small-gqa": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, seed=1),
    "small-mha-untied": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False, seed=2),
    "mid-gqa": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=16, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=8192, seed=3),
}
SHAPE_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)


def summarize(rows):
    """Figures of one replay, judged with the check's limits for the dtype that ran (lite_runtime/golden.py)."""
    return {"max_rel": max(r.max_rel for r in rows), "diverged_prompts": sum(r.first_divergence is not None for r in rows),
            "near_tie_steps": sum(len(r.near_ties) for r in rows), "steps": sum(r.steps for r in rows),
            "failed_prompts": sum(not r.passed for r in rows)}


def measure(name: str, kwargs: dict, work: str, seq_length: int, buckets) -> dict:
    from export.compare import HFSteps, hf_model
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline
    from lite_runtime.folder import load_folder
    from export.checkpoints.random_checkpoint import make_checkpoint
    from lite_runtime.golden import TOLERANCES, load_golden, replay

    ckpt = os.path.join(work, "ckpt-" + name)
    if not os.path.isdir(ckpt):
        make_checkpoint(ckpt, **kwargs)
    folder = os.path.join(work, "fp16-" + name)
    if not os.path.isdir(folder):
        run_export(ExportConfig(checkpoint=ckpt, output=folder, name=name, seq_length=seq_length, batch_size=2,
                                dtype="float16", device="cpu", prefill_buckets=tuple(buckets)))
    golden = load_golden(load_folder(folder))
    margins = sorted((r.top_logits[t][0] - r.top_logits[t][1]) / r.scale[t]
                     for b in golden.batches for r in b.rows for t in range(len(r.tokens)))
    out = {"checkpoint": kwargs, "smallest_relative_margins": margins[:3]}
    start = time.perf_counter()
    out["ms_float16"] = summarize(replay(pipeline("text_generation", model=folder, backend="ms"), golden,
                                         TOLERANCES["float16"]))
    out["ms_float16"]["seconds"] = round(time.perf_counter() - start, 1)
    for dtype in ("float32", "float16", "bfloat16"):
        out["hf_" + dtype] = summarize(replay(HFSteps(hf_model(ckpt, dtype)), golden, TOLERANCES[dtype]))
    return out


# the sweep behind docs/checking.md's table of derived limits (tests/test_check_limits.py draws a few of these shapes)
QUANTIZED_SPECS = (  # hidden, layers, tied, bits, group, symmetric, source, seed
    (64, 2, True, 8, 0, True, "rtn", 1), (64, 2, False, 4, 32, False, "rtn", 2),
    (128, 2, False, 4, 64, True, "gptq", 3), (128, 3, True, 4, 64, False, "awq", 4),
    (256, 2, True, 8, 128, True, "gptq", 5), (256, 4, False, 4, 128, False, "rtn", 6),
    (512, 2, False, 4, 32, False, "awq", 7), (512, 3, True, 8, 0, True, "rtn", 8),
    (768, 2, True, 4, 128, True, "gptq", 9), (1024, 2, False, 4, 128, False, "awq", 10),
    (1024, 3, True, 4, 32, False, "rtn", 11), (1024, 2, False, 8, 64, True, "gptq", 12),
    (1024, 4, False, 4, 64, True, "gptq", 13), (896, 4, True, 4, 128, False, "rtn", 14),
)


def measure_quantized(spec, work: str, tampers: int) -> dict:
    """One quantized CPU folder (tests/limits_harness.py): check's worst errors against its derived limits, with x
    exact and with int16 activations, the lanes' distances the limits came from (golden.json `limits`), and, for
    `tampers` tampers of each kind (one group's scale 1 % off, one nibble inverted, in a linear layer drawn at random),
    whether check failed them and by how much the tampered folder's logits moved."""
    import shutil

    import numpy as np

    from tests.limits_harness import check, make_folder, tamper

    start = time.perf_counter()
    folder = make_folder(work, spec)
    good = check(folder)
    limits = json.load(open(os.path.join(folder, "golden.json")))["limits"]
    out = {"spec": spec.name(), **{k: good[k] for k in ("passed", "exact", "exact_limit", "int16", "int16_limit")},
           "exact_lane": limits["exact"]["measured"], "int16_lane": limits["int16"]["measured"],
           "exact_margin": good["exact_limit"] / good["exact"], "int16_margin": good["int16_limit"] / good["int16"],
           "tampers": []}
    rng = np.random.default_rng(spec.seed)
    for kind in ("scale", "nibble"):
        for i in range(tampers):
            copy = f"{folder}-{kind}{i}"
            where = tamper(folder, copy, kind, rng)
            bad = check(copy)
            out["tampers"].append({"kind": kind, **where, "failed": not bad["passed"], "moved": bad["exact"]})
            shutil.rmtree(copy)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="folder for the checkpoints and exported folders")
    p.add_argument("--with_05b", action="store_true", help="also the random Qwen2-0.5B shape (slow: fp16 on the CPU)")
    p.add_argument("--quantized", action="store_true",
                   help="quantized CPU folders of many shapes instead: check's derived limits, two-sided (margins of "
                        "correct folders, tampered folders)")
    p.add_argument("--tampers", type=int, default=2, help="--quantized: tampers of each kind per folder")
    p.add_argument("--output", default=None,
                   help="JSON file for the figures (default: benchmarks/results/check-limits.json, with --quantized "
                        "check-limits-quantized.json)")
    args = p.parse_args(argv)
    args.output = args.output or os.path.join(RESULTS, "check-limits-quantized.json" if args.quantized
                                              else "check-limits.json")
    os.makedirs(args.work, exist_ok=True)
    if args.quantized:
        return main_quantized(args)
    shapes = dict(SHAPES)
    if args.with_05b:
        shapes["qwen2-0.5b-shape"] = SHAPE_05B
    results = {}
    for name, kwargs in shapes.items():
        seq, buckets = (1024, (32, 128)) if name == "qwen2-0.5b-shape" else (128, (16, 64))
        results[name] = measure(name, kwargs, args.work, seq, buckets)
        r = results[name]
        print(f"{name:18s} max rel: ms fp16 {r['ms_float16']['max_rel']:.2e}  hf fp16 {r['hf_float16']['max_rel']:.2e}  "
              f"hf bf16 {r['hf_bfloat16']['max_rel']:.2e}  hf fp32 {r['hf_float32']['max_rel']:.2e} | diverged prompts "
              f"ms fp16 {r['ms_float16']['diverged_prompts']}, hf fp16 {r['hf_float16']['diverged_prompts']}, hf bf16 "
              f"{r['hf_bfloat16']['diverged_prompts']} | smallest margin/scale {r['smallest_relative_margins'][0]:.1e} "
              f"| failed prompts under the limits: ms fp16 {r['ms_float16']['failed_prompts']}, hf fp16 "
              f"{r['hf_float16']['failed_prompts']}, hf bf16 {r['hf_bfloat16']['failed_prompts']}, hf fp32 "
              f"{r['hf_float32']['failed_prompts']} | ms fp16 replay {r['ms_float16']['seconds']} s", flush=True)
    if args.output:
        from benchmark import machine

        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "shapes": results}, fh, indent=2)
    return 0


def main_quantized(args) -> int:
    from benchmark import machine
    from tests.limits_harness import Spec

    rows = []
    print("| folder | x exact: worst | limit (10 x lane) | margin | int16: worst | limit | margin | tampers failed | "
          "smallest tamper move |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for values in QUANTIZED_SPECS:
        r = measure_quantized(Spec(*values), args.work, args.tampers)
        rows.append(r)
        moved = min((t["moved"] for t in r["tampers"]), default=float("nan"))
        print(f"| {r['spec']} | {r['exact']:.2e} | {r['exact_limit']:.2e} | {r['exact_margin']:.1f}x | "
              f"{r['int16']:.2e} | {r['int16_limit']:.2e} | {r['int16_margin']:.1f}x | "
              f"{sum(t['failed'] for t in r['tampers'])}/{len(r['tampers'])} | {moved:.1e} |", flush=True)
    with open(args.output, "w", encoding="utf-8") as fh:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "folders": rows}, fh, indent=2)
    return 0 if all(r["passed"] and r["exact_margin"] >= 3 and r["int16_margin"] >= 3
                    and all(t["failed"] for t in r["tampers"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
