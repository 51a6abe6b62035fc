"""Measure how far half-precision runs land from the float32 golden references: the data behind the check's limits.

    python benchmarks/measure_check_limits.py --work bench/limits [--with_05b]

For random Qwen2 checkpoints of several shapes (and, with --with_05b, the Qwen2-0.5B shape), it
exports a float16 folder (its golden.json is float32, from the checkpoint), replays the golden
prompts teacher-forced on (a) the folder through MindSpore's CPU float16 kernels and (b) HF
transformers in float16 and in bfloat16 on the CPU (stand-ins for a half-precision device, which
this project does not have), and prints the worst top-k logit error relative to each step's
largest |logit|, greedy divergences, and the smallest reference top-2 margins. The limits in
lite_runtime/golden.py (TOLERANCES) are chosen from these figures; model_dirs/README.md says how.
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
    from export.random_checkpoint import make_checkpoint
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


def measure_quantized(name: str, kwargs: dict, work: str, seq_length: int, buckets) -> dict:
    """The int8 and int4 CPU folders of one random checkpoint (their golden.json: float32 on the folder's own
    integers), replayed through the ms backend and our kernels, whose quantized matmuls round x to int16 (the limit
    lite_runtime.golden.INT16_ACTIVATIONS): each replay through the prefill graphs and through the chunk graphs, as
    `check` runs them."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from export.random_checkpoint import make_checkpoint
    from lite_runtime import pipeline
    from lite_runtime.folder import load_folder
    from lite_runtime.golden import INT16_ACTIVATIONS, load_golden, replay, replay_chunks

    ckpt = os.path.join(work, "ckpt-" + name)
    if not os.path.isdir(ckpt):
        make_checkpoint(ckpt, **kwargs)
    out = {"checkpoint": kwargs}
    for bits in ("int8", "int4"):
        folder = os.path.join(work, f"{bits}-{name}")
        if not os.path.isdir(folder):
            run_export(ExportConfig(checkpoint=ckpt, output=folder, name=name, seq_length=seq_length, batch_size=2,
                                    device="cpu", quantize=bits, prefill_buckets=tuple(buckets)))
        golden = load_golden(load_folder(folder))
        start = time.perf_counter()
        gen = pipeline("text_generation", model=folder, backend="ms", chunk_graphs=True)
        rows = replay(gen, golden, INT16_ACTIVATIONS) + replay_chunks(gen.runner, golden, INT16_ACTIVATIONS)
        out["ms_" + bits] = {**summarize(rows), "seconds": round(time.perf_counter() - start, 1)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="folder for the checkpoints and exported folders")
    p.add_argument("--with_05b", action="store_true", help="also the random Qwen2-0.5B shape (slow: fp16 on the CPU)")
    p.add_argument("--quantized", action="store_true",
                   help="measure int8/int4 CPU folders through our kernels instead (the int16-activation limit)")
    p.add_argument("--output", default=None,
                   help="JSON file for the figures (default: benchmarks/results/check-limits.json, with --quantized "
                        "check-limits-quantized.json)")
    args = p.parse_args(argv)
    args.output = args.output or os.path.join(RESULTS, "check-limits-quantized.json" if args.quantized
                                              else "check-limits.json")
    os.makedirs(args.work, exist_ok=True)
    shapes = dict(SHAPES)
    if args.with_05b:
        shapes["qwen2-0.5b-shape"] = SHAPE_05B
    results = {}
    for name, kwargs in shapes.items():
        seq, buckets = (1024, (32, 128)) if name == "qwen2-0.5b-shape" else (128, (16, 64))
        if args.quantized:
            results[name] = r = measure_quantized(name, kwargs, args.work, seq, buckets)
            print(f"{name:18s} " + "  ".join(f"{k[3:]}: max rel {v['max_rel']:.2e}, diverged prompts "
                                             f"{v['diverged_prompts']}, near-tie steps {v['near_tie_steps']}, failed "
                                             f"{v['failed_prompts']}" for k, v in r.items() if k.startswith("ms_")),
                  flush=True)
            continue
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


if __name__ == "__main__":
    sys.exit(main())
