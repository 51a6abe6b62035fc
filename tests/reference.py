"""The Hugging Face reference (transformers' *ForCausalLM of the checkpoint's family, fp32, CPU) and comparison helpers."""
from __future__ import annotations

import contextlib
import json
import os
from functools import lru_cache
from typing import List

import numpy as np

TOL = 1e-4  # float32's limit against HF


@contextlib.contextmanager
def exact_activations():
    """The CPU kernels' matmuls with x exact (float32's form, as check's replays run them: quantized weights without
    int16 activations, bfloat16 weights without the AVX512-BF16 form), the default after."""
    import cpu_kernels

    cpu_kernels.set_quant_activations("exact")
    try:
        yield
    finally:
        cpu_kernels.set_quant_activations(None)


def served_limit(folder: str) -> float:
    """How far a bfloat16 CPU folder's logits may be from the float32 reference as it serves: the bfloat16-activation
    limit derived for it at export (golden.json `limits`) where this CPU runs the AVX512-BF16 form, else float32's."""
    import cpu_kernels

    with open(os.path.join(folder, "golden.json"), encoding="utf-8") as fh:
        limits = json.load(fh).get("limits")
    if cpu_kernels.bf16_form() == "avx512_bf16" and limits and "bf16" in limits:
        return float(limits["bf16"]["rel"])
    return TOL


@lru_cache(maxsize=8)
def hf_model(checkpoint: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_last_logits(checkpoint: str, tokens: List[int]) -> np.ndarray:
    """float32 logits [V] of the last token of one unpadded prompt."""
    import torch

    with torch.no_grad():
        return hf_model(checkpoint)(torch.tensor([tokens])).logits[0, -1].float().numpy()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def prompts(batch: int, lengths: List[int], seed: int = 0, vocab: int = 380) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths[:batch]]


def right_pad(rows: List[List[int]], width: int, pad: int = 0) -> np.ndarray:
    out = np.full((len(rows), width), pad, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def hf_generate(checkpoint: str, row: List[int], **kwargs) -> List[int]:
    """HF generate on one unpadded row: the prompt ids followed by the generated ids."""
    import torch

    with torch.no_grad():
        out = hf_model(checkpoint).generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                            **kwargs)
    return [int(t) for t in out[0]]


def load_into(net, checkpoint: str) -> None:
    """Set every weight Parameter of an export/network/model.py network from the checkpoint, in the Parameter's dtype, for
    tests that run the network itself (export never does: it compiles the graphs without weights and writes the
    weights file straight from the checkpoint)."""
    import mindspore as ms
    from mindspore import Tensor

    from export.checkpoints import open_checkpoint
    from export.checkpoints.safetensors import stored_as

    where = open_checkpoint(checkpoint)
    dtypes = {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}
    for param in net.get_parameters():
        if param.name.endswith(("key_cache", "value_cache")):
            continue
        arr = np.ascontiguousarray(stored_as(where[param.name].stored(param.name), dtypes[param.dtype]))
        tensor = Tensor.from_numpy(arr)
        param.set_data(tensor.view(ms.bfloat16) if param.dtype == ms.bfloat16 else tensor)


def paged_inputs(ids, lengths, seq_length: int, block_size: int, order=None):
    """The block tables and slots of a prefill (ids [B, n], n > 1: positions 0..len-1) or a decode step (ids [B, 1]:
    position len-1) of a network or graph whose caches are its nominal pool (1 + B*M blocks, M = ceil(seq_length /
    block_size)): row r's sequence in the blocks `order` lists for it (default: blocks 1 + r*M .. (r + 1)*M, reversed
    so a table runs backwards), padding written nowhere (slot -1). Returns (tables [B, M], slots [B*n]) int32."""
    ids = np.asarray(ids)
    b, n = ids.shape
    m = -(-seq_length // block_size)
    tables = np.array(order if order is not None else [[1 + r * m + j for j in range(m)][::-1] for r in range(b)],
                      np.int32)
    slots = np.full((b, n), -1, np.int32)
    for r, length in enumerate(lengths):
        for i, pos in enumerate(range(length) if n > 1 else [length - 1]):
            slots[r, i] = tables[r, pos // block_size] * block_size + pos % block_size
    return tables, slots.reshape(-1)
