"""python -m export.compare --checkpoint <hf_dir> --model_dir <folder>: a folder on this CPU against HF transformers.

HF transformers (PyTorch, float32, the checkpoint's own weights) produces greedy tokens and top-k
logits for the folder's golden prompts (or, for a folder without them, the same plan
export/writers/golden.py uses). The folder replays them teacher-forced on the `ms` backend and the report
is the one `python -m lite_runtime.check` prints, with the limits of the folder's dtype. It also
replays the folder's stored golden references through HF, which checks the export's own float32
reference (export/writers/reference.py).

Float16 folders for Atlas run here too: they are the artifact that ships. MindSpore's CPU float16
kernels are slow (README, "Checking a folder"). Bfloat16 folders cannot run on MindSpore's CPU
(no kernels) and are refused with what to do instead. Needs torch (the test extra).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import logging
import os
import sys
import time
from typing import List, Optional, Sequence

import numpy as np

from export.errors import ExportError
from lite_runtime.golden import TOLERANCES, Reference, ReferenceBatch, ReferenceRow, replay

log = logging.getLogger(__name__)
TORCH_HINT = "pip install torch==2.13.0 (a CPU build: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"


def hf_model(checkpoint: str, dtype: str = "float32", matrices_in: str = "float32", kv_in: str = "float32"):
    """HF's model; `matrices_in` rounds its matrices (2-D weights) through that dtype, as a CPU folder with 16-bit
    weights stores them (the same round-to-nearest-even as export/checkpoints/safetensors.py), computing in `dtype`;
    `kv_in` rounds the keys and values its attention reads through that dtype, as a CPU folder's bfloat16 KV cache
    holds them (kv_rounding_attention)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ExportError(f"export.compare runs HF transformers as the reference and needs PyTorch: {TORCH_HINT}") from None
    from export.checkpoints.gguf import is_gguf

    if is_gguf(checkpoint):  # transformers dequantizes the file itself (its own reader, not ours)
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(checkpoint)),
                                                     gguf_file=os.path.basename(checkpoint), dtype=getattr(torch, dtype))
    elif _packed(checkpoint):
        model = _dequantized_model(checkpoint, getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    if matrices_in != dtype:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.copy_(param.to(getattr(torch, matrices_in)).to(param.dtype))
    if kv_in != "float32":
        model.set_attn_implementation(kv_rounding_attention(kv_in))
    return model.eval()


def kv_rounding_attention(kv_in: str) -> str:
    """The name of an HF attention implementation (registered once) that is sdpa's on keys and values rounded through
    `kv_in` (torch's round to nearest even, as cpu_kernels/paged.h writes a bfloat16 cache): every key and value a
    query reads, its own included, is as the folder's cache holds it. Rounding is idempotent, so rounding the whole
    cache at each call equals rounding each entry once when it is stored."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"mslite_kv_{kv_in}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        sdpa, store = ALL_ATTENTION_FUNCTIONS["sdpa"], getattr(torch, kv_in)

        def attention(module, query, key, value, *args, **kwargs):
            return sdpa(module, query, key.to(store).to(key.dtype), value.to(store).to(value.dtype), *args, **kwargs)

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def _packed(checkpoint: str) -> bool:
    import json

    try:
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as fh:
            return "quantization_config" in json.load(fh)
    except (OSError, ValueError):
        return False


def _dequantized_model(checkpoint: str, dtype):
    """HF's class for a GPTQ/AWQ checkpoint without the GPTQ/AWQ libraries transformers would need: built from the
    config, every tensor from export's reader (its packed layers dequantized: held to hand-packed twins by
    tests/test_packed.py)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from export.checkpoints import open_checkpoint
    from export.checkpoints.safetensors import widen

    raw = json.load(open(os.path.join(checkpoint, "config.json"), encoding="utf-8"))
    raw.pop("quantization_config", None)
    config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    where = open_checkpoint(checkpoint)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name in where:
                param.copy_(torch.from_numpy(np.array(widen(where[name].stored(name)), np.float32)))
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in params:
            model.tie_weights()
    return model


class HFSteps:
    """HF model with the two calls `replay` makes (`infer(rows).logits`, `prefill_size`), one row at a time
    with its own KV cache: a row that extends the previous call's by one token feeds only that token."""

    class Output:
        def __init__(self, logits: np.ndarray) -> None:
            self.logits = logits

    def __init__(self, model) -> None:
        self.model = model
        self._rows: List[List[int]] = []
        self._past: list = []
        # the KV cache's keyword in and attribute out: `cache` since transformers 5.x renamed it (the old
        # `past_key_values` is deprecated, gone in 5.40: a FutureWarning), `past_key_values` before. The model makes
        # its own DynamicCache at a row's first call (use_cache) and extends it at the next.
        params = inspect.signature(model.forward).parameters
        self._cache_name = "cache" if "cache" in params else "past_key_values"

    def prefill_size(self, longest: int) -> int:
        return longest

    def _last_logits(self, ids, past):
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True, **{self._cache_name: past})
        return out.logits[0, -1].float().numpy(), getattr(out, self._cache_name)

    def infer(self, rows: Sequence[Sequence[int]]) -> "HFSteps.Output":
        logits, past = [], []
        extend = len(rows) == len(self._rows) and all(
            len(r) == len(c) + 1 and list(r[:-1]) == c for r, c in zip(rows, self._rows))
        for i, row in enumerate(rows):
            lg, p = self._last_logits(list(row[-1:]), self._past[i]) if extend else self._last_logits(list(row), None)
            logits.append(lg)
            past.append(p)
        self._rows, self._past = [list(r) for r in rows], past
        return HFSteps.Output(np.stack(logits))


def hf_reference(model, batches: Sequence[Sequence[Sequence[int]]], steps: Sequence[int], top_k: int) -> Reference:
    """HF float32 greedy continuation and top-k logits of each prompt (rows run one by one)."""
    stepper = HFSteps(model)
    out = []
    for prompts, n in zip(batches, steps):
        rows = []
        for prompt in prompts:
            record, seq = ReferenceRow(prompt=list(prompt)), list(prompt)
            for _ in range(n):
                seq.append(record.record(stepper.infer([seq]).logits[0], top_k))
            rows.append(record)
        out.append(ReferenceBatch("", rows))
    return Reference(source="HF transformers, float32, the checkpoint's weights", batches=out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m export.compare",
        description="Run a model folder on this CPU (backend ms) and HF transformers on the same prompts, and report "
                    "greedy token agreement and top-k logit error with the limits of the folder's dtype (the report "
                    "of python -m lite_runtime.check). Exit code 0: pass, 1: fail, 2: cannot compare.")
    p.add_argument("--checkpoint", required=True, help="the HF checkpoint folder the model folder was exported from")
    p.add_argument("--model_dir", required=True, help="model folder written by python -m export")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def compare(checkpoint: str, model_dir: str, quiet: bool = True):
    """(report of the folder against HF, rows of the stored golden against HF or None)."""
    from export.writers.golden import TOP_K, plan_batches, prompts_for
    from lite_runtime import InferConfig
    from lite_runtime.check import check_config
    from lite_runtime.golden import load_golden

    config = InferConfig.from_folder(model_dir, backend="ms")  # checksums verified once, here
    _refuse_what_cannot_fit(checkpoint, config)
    if config.compute_dtype == "bfloat16":
        raise ExportError(f"{config.folder.yaml_path}: a bfloat16 folder cannot run on this CPU (MindSpore has no "
                          "bfloat16 CPU kernels); run python -m lite_runtime.check on the Atlas A2 server it is for, or "
                          "export a float16 or float32 folder from the same checkpoint and compare that")
    if config.compute_dtype == "float16" and not quiet:
        print("float16 graphs run on MindSpore's CPU float16 kernels, several times slower than float32 "
              "(README, 'Checking a folder')", file=sys.stderr)
    golden = load_golden(config.folder)
    if golden is not None:
        prompts = [[r.prompt for r in b.rows] for b in golden.batches]
        steps = [len(b.rows[0].tokens) for b in golden.batches]
        top_k = len(golden.batches[0].rows[0].top_ids[0])
    else:
        plan = plan_batches(sorted(config.folder.infer["prefill_buckets"]), config.infer_seq_length, config.batch_size)
        prompts = prompts_for(plan, config.folder.path, int(config.vocab_size))[0]
        steps, top_k = [n for _, _, n in plan], TOP_K
    start = time.perf_counter()
    if quiet or not sys.stderr.isatty():  # HF's "Loading weights" bar: piped, it leaves \r-joined lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    # a CPU folder with 16-bit weights computes in float32 on rounded matrices: so does its reference
    # (a folder whose KV cache is bfloat16 replays with float32 caches against it: lite_runtime/check.py)
    model = hf_model(checkpoint, matrices_in=config.dtype if config.compute_dtype != config.dtype else "float32")
    if config.folder.quantization:  # HF on the weights the folder holds, dequantized (what the folder means)
        load_folder_linears(model, config.folder)
    reference = hf_reference(model, prompts, steps, top_k)
    log.info("HF reference: %d prompts in %.1f s", sum(map(len, prompts)), time.perf_counter() - start)
    golden_rows = replay(HFSteps(model), golden, TOLERANCES["float32"]) if golden is not None else None
    del model  # HF's float32 copy is gone before the folder loads: the two never need memory together
    gc.collect()
    report = check_config(config, reference)
    return report, golden_rows


def folder_linears(folder):
    """{HF name: float32 [O, I]} of a quantized folder's linear layers, dequantized from its weights file (rank 0's
    inc graph names them): W = (q + offset) * scale, per group (model_dirs/README.md, "Quantized folders")."""
    from export.network.quantize import dequantize, unpack_int4
    from lite_runtime.backends.ms import _parameter_arrays, _read_mindir

    path = folder.graph_paths()["inc"]
    arrays = _parameter_arrays(_read_mindir(path), path)
    out = {}
    for name, q in arrays.items():
        if name + "_scale" not in arrays:
            continue
        scale = np.asarray(arrays[name + "_scale"])
        if scale.dtype == np.uint16:  # bfloat16 bits
            scale = (scale.astype(np.uint32) << 16).view(np.float32)
        offset = arrays.get(name + "_offset")
        if offset is not None and offset.dtype == np.uint16:
            offset = (offset.astype(np.uint32) << 16).view(np.float32)
        values = unpack_int4(np.asarray(q)) if q.dtype == np.uint8 else np.asarray(q)
        out[name] = dequantize(values, scale.astype(np.float32).T,
                               None if offset is None else offset.astype(np.float32).T)
    return out


def load_folder_linears(model, folder) -> int:
    """Put a quantized folder's dequantized linear weights into HF's model; returns how many."""
    import torch

    params = dict(model.named_parameters())
    weights = folder_linears(folder)
    with torch.no_grad():
        for name, values in weights.items():
            if name not in params or tuple(params[name].shape) != values.shape:
                raise ExportError(f"{folder.path}: {name} {list(values.shape)} is not a weight of the checkpoint's "
                                  "model; compare the folder with the checkpoint it was exported from")
            params[name].copy_(torch.from_numpy(values).to(params[name].dtype))
    return len(weights)


def _refuse_what_cannot_fit(checkpoint: str, config) -> None:
    """HF transformers holds the checkpoint in float32 (4 bytes per parameter), then the folder runs on the `ms`
    backend: refuse up front, with the numbers, what this machine cannot hold (lite_runtime/memory.py)."""
    from export.checkpoints import open_checkpoint
    from lite_runtime.memory import GIB, available_bytes, gib, refuse_if_too_big

    refuse_if_too_big(config.folder)  # the folder itself cannot run here: checking it on the device is the answer
    where = open_checkpoint(checkpoint)
    hf = 4 * sum(int(np.prod(f.shape(n), dtype=np.int64)) for n, f in where.items()) + GIB // 2
    have = available_bytes()
    if have is not None and hf > have:
        raise ExportError(f"{checkpoint}: HF transformers needs about {gib(hf)} to run it in float32 (4 bytes per "
                          f"parameter), and {gib(have)} is available; run python -m lite_runtime.check "
                          f"{config.folder.path} instead: its golden references come from the export's float32 "
                          "reference, which export.compare holds to HF on models that fit")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from lite_runtime.check import print_report
    from lite_runtime.errors import InferError

    try:
        from export.checkpoints.gguf import is_gguf

        if not os.path.isdir(args.checkpoint) and not is_gguf(args.checkpoint):
            raise ExportError(f"--checkpoint {args.checkpoint}: not a folder or a GGUF file; pass the checkpoint the "
                              "folder was exported from")
        report, golden_rows = compare(args.checkpoint, args.model_dir, quiet=args.quiet)
    except (ExportError, InferError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    if golden_rows is not None:
        worst = max(r.max_rel for r in golden_rows)
        same = all(r.first_divergence is None for r in golden_rows)
        print(f"stored golden references against HF: {'greedy tokens identical' if same else 'greedy tokens DIFFER'}, "
              f"top-k logits within {worst:.1e} relative")
    if args.json_path:
        import json

        doc = report.to_dict()
        if golden_rows is not None:
            doc["golden_against_hf"] = [{"prompt": r.prompt, "max_rel": r.max_rel,
                                         "first_divergence": r.first_divergence} for r in golden_rows]
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
