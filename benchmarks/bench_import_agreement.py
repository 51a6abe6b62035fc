"""SmolLM2-135M-Instruct packed as GPTQ and AWQ, imported, and run greedy beside HF transformers on the checkpoint's
dequantized weights (issue 43, goal 1): how many of the golden prompts' tokens the folder gives as HF does.

    python benchmarks/bench_import_agreement.py --work /tmp/agree [--checkpoint demo/smollm2]

The checkpoint is scripts/get_smollm2.py's float32 SmolLM2 (written into --work unless given). tests/packers.py packs
its linear layers as GPTQ (4-bit, symmetric, groups of 64) and as AWQ (GEMM layout, zero points, groups of 64), the
embedding and head left in float16 as Qwen's GPTQ/AWQ releases leave them; each packed checkpoint is exported for the
CPU as the README's commands would (`--device cpu`, its float16 kept, `--seq_length 512 --batch_size 4`), and the
packers' float twin (every packed layer dequantized) is what HF runs. Per folder:
- the export's own report (golden.json `agreement`: the folder's float32 reference against the checkpoint's);
- free-running greedy decoding of each golden prompt (NEW tokens), the folder through pipeline().generate as it
  serves (x rounded to int16 in its quantized matmuls, the default) and with x exact (cpu_kernels
  set_quant_activations("exact"), as check runs it), against HF's greedy on the twin: greedy agreement counts each
  prompt's tokens before its first difference, over all of them (the export's definition);
- the largest |logit| difference between the two runs of the folder at the same tokens (teacher-forced on HF's): what
  int16 activations alone move.
Writes benchmarks/results/import-agreement.json and prints a markdown table. Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

NEW = 16
OUTPUT = os.path.join(HERE, "results", "import-agreement.json")


def hf_greedy(model, prompt, steps):
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def folder_greedy(pipe, prompts, steps, mode):
    import cpu_kernels

    cpu_kernels.set_quant_activations(mode)
    rows = pipe.runner.batch_size
    new = []
    try:
        for i in range(0, len(prompts), rows):  # the folder's rows at a time
            part = prompts[i:i + rows]
            out = pipe.generate(part, max_new_tokens=steps, eos_token_id=[])
            new += [list(seq[len(p):]) for seq, p in zip(out.sequences, part)]
    finally:
        cpu_kernels.set_quant_activations(None)
    return new


def agreement(ours, theirs):
    before = total = 0
    for a, b in zip(ours, theirs):
        total += len(b)
        for x, y in zip(a, b):
            if x != y:
                break
            before += 1
    return before, total


def logits_gap(pipe, prompts, continuations):
    """Largest |logit| difference between x exact and x in int16, teacher-forced on the same tokens."""
    import numpy as np

    import cpu_kernels

    worst = 0.0
    for prompt, cont in zip(prompts, continuations):
        seq = list(prompt)
        for token in cont:
            runs = []
            for mode in ("exact", "int16"):
                cpu_kernels.set_quant_activations(mode)
                runs.append(pipe.infer([seq]).logits[0])
            worst = max(worst, float(np.abs(runs[0] - runs[1]).max()))
            seq.append(token)
    cpu_kernels.set_quant_activations(None)
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/agree")
    p.add_argument("--checkpoint", default=None, help="SmolLM2's float32 HF folder (default: written into --work)")
    p.add_argument("--output", default=OUTPUT)
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    ckpt = args.checkpoint or os.path.join(args.work, "smollm2")
    if not os.path.isdir(ckpt):
        from get_smollm2 import main as get_smollm2

        get_smollm2(["--output", ckpt])
    from export.compare import hf_model
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline
    from lite_runtime.folder import load_folder
    from lite_runtime.golden import load_golden
    from tests.packers import pack

    rows = []
    for method in ("gptq", "awq"):
        packed, twin = pack(ckpt, os.path.join(args.work, method), method, bits=4, group=64)
        folder = os.path.join(args.work, f"{method}-folder")
        start = time.time()
        summary = run_export(ExportConfig(checkpoint=packed, output=folder, name="smollm2", seq_length=512,
                                          batch_size=4, dtype="float16", device="cpu", overwrite=True))
        seconds = time.time() - start
        golden = load_golden(load_folder(folder))
        prompts = [list(r.prompt) for b in golden.batches for r in b.rows]
        hf = hf_model(twin)
        theirs = [hf_greedy(hf, pr, NEW) for pr in prompts]
        del hf
        pipe = pipeline("text_generation", model=folder, backend="ms")
        runs = {mode: folder_greedy(pipe, prompts, NEW, mode) for mode in ("int16", "exact")}
        gap = logits_gap(pipe, prompts, theirs)
        row = {"method": method, "export_seconds": round(seconds, 1), "tables": summary.tables,
               "export_agreement": summary.agreement, "limits": summary.limits, "prompts": len(prompts),
               "int16_logit_gap": gap}
        for mode, ours in runs.items():
            before, total = agreement(ours, theirs)
            row[mode] = {"greedy_agreement": before / total, "tokens": total,
                         "prompts_identical": sum(a == b for a, b in zip(ours, theirs))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    from benchmark import machine

    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "checkpoint": ckpt, "new_tokens": NEW,
           "rows": rows}
    with open(args.output, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print("| import | tables | export's agreement (reference) | greedy agreement with HF, int16 x (serving) | "
          "with x exact (check) | largest logit gap int16 vs exact |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['tables']} | {r['export_agreement']['greedy_agreement']:.1%} | "
              f"{r['int16']['greedy_agreement']:.1%} of {r['int16']['tokens']} | "
              f"{r['exact']['greedy_agreement']:.1%} | {r['int16_logit_gap']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
