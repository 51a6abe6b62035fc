"""GPTQ and AWQ checkpoints packed from a float checkpoint, for the tests and the quantization benchmarks: written from
the formats' documentation (AutoGPTQ / GPTQModel's `qweight`/`qzeros`/`scales`/`g_idx`, AutoAWQ's GEMM layout), not
from export/checkpoints/packed.py, which reads them: the two meet only at the files.

Round-to-nearest per group, as the packers' own fallbacks do (GPTQ's Hessian updates change which integers are
chosen, not how they are stored). Like Qwen's GPTQ-Int4/Int8 and AWQ releases, only the decoder layers' linear
layers are packed; `embed_tokens`, `lm_head` and the norms stay in float16 (the checkpoint's `torch_dtype`).

`pack(float_dir, out_dir, method, bits, group)` writes the packed checkpoint and returns `(packed_dir, twin_dir)`:
the twin is the same model in float32, every packed layer dequantized, W = (u - z) * s, and every other tensor the
float16 value widened. HF transformers on the twin is "HF on the checkpoint's dequantized weights".
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Tuple

import numpy as np

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# a mixture of experts' projections, packed per expert as Qwen's GPTQ releases pack them (the router mlp.gate and
# Qwen2-MoE's shared_expert_gate stay in 16 bits)
EXPERT = re.compile(r"\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble k of a word holds column 8c + AWQ_ORDER[k]


def pack_inputs(u: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ's qweight: u [in, out] unsigned, 32 / bits consecutive inputs per int32 word, the first lowest."""
    per = 32 // bits
    words = np.zeros((u.shape[0] // per, u.shape[1]), np.uint32)
    for j in range(per):
        words |= u[j::per].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def pack_outputs(u: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Packed along the outputs (GPTQ's qzeros in order; AWQ's qweight and qzeros in AWQ_ORDER): u [rows, out]."""
    per = 32 // bits
    order = order or tuple(range(per))
    words = np.zeros((u.shape[0], u.shape[1] // per), np.uint32)
    for k in range(per):
        words |= u[:, order[k]::per].astype(np.uint32) << np.uint32(bits * k)
    return words.view(np.int32)


def quantize_layer(w: np.ndarray, method: str, bits: int, group: int, sym: bool = True):
    """w [out, in] float -> (u [in, out] unsigned ints, z [groups, out], scales float16 [groups, out]).

    GPTQ with sym: scale = 2 max|w| / maxq over the group, zero (maxq + 1) / 2; AWQ (zero point) and GPTQ without sym:
    scale = (max - min) / maxq with min <= 0 <= max, zero = round(-min / scale). u = clamp(round(w / s) + z)."""
    out_f, in_f = w.shape
    g = in_f if group == -1 else group
    maxq = (1 << bits) - 1
    x = w.astype(np.float32).T.reshape(in_f // g, g, out_f)  # [groups, g, out]
    if method == "gptq" and sym:
        top = np.abs(x).max(axis=1)
        scale = (2 * top / maxq).astype(np.float16)
        zero = np.full_like(top, (maxq + 1) // 2)
    else:
        lo, hi = np.minimum(x.min(axis=1), 0), np.maximum(x.max(axis=1), 0)
        scale = ((hi - lo) / maxq).astype(np.float16)
        zero = np.clip(np.rint(-lo / np.maximum(scale.astype(np.float32), 1e-10)), 0, maxq)
    scale[scale == 0] = np.float16(1e-4)
    s32 = scale.astype(np.float32)
    u = np.clip(np.rint(x / s32[:, None, :]) + zero[:, None, :], 0, maxq).astype(np.int64)
    return u.reshape(in_f, out_f), zero.astype(np.int64), scale


def dequantized(u: np.ndarray, z: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """(u - z) * s -> float32 [out, in]."""
    in_f = u.shape[0]
    g = in_f if group == -1 else group
    groups = np.arange(in_f) // g
    return np.ascontiguousarray(((u - z[groups]).astype(np.float32) * scale.astype(np.float32)[groups]).T)


def pack(float_dir: str, out_dir: str, method: str = "gptq", bits: int = 4, group: int = 128,
         sym: bool = True, fmt: str = "gptq", pack_head: bool = False) -> Tuple[str, str]:
    """Write `out_dir/packed` and `out_dir/twin` from a float checkpoint folder; returns both paths.

    method gptq (bits 4 or 8, fmt "gptq": zeros stored minus one; "gptq_v2": as they are) or awq (bits 4, zero
    point). pack_head: lm_head packed too (some exporters do; the model must be untied)."""
    from safetensors.numpy import load_file, save_file

    config = json.load(open(os.path.join(float_dir, "config.json"), encoding="utf-8"))
    tensors: Dict[str, np.ndarray] = {}
    for f in sorted(os.listdir(float_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(float_dir, f)))
    if pack_head and "lm_head.weight" not in tensors:
        raise ValueError("pack_head needs an untied lm_head.weight")
    maxq = (1 << bits) - 1
    packed, twin = {}, {}
    for name, value in tensors.items():
        layer = name[:-len(".weight")]
        linear = (name.endswith(".weight") and (any(layer.endswith(l) for l in LINEARS) or EXPERT.search(layer))) or (
            pack_head and name == "lm_head.weight")
        if not linear:
            half = np.asarray(value, np.float32).astype(np.float16)
            packed[name], twin[name] = half, half.astype(np.float32)
            continue
        u, z, scale = quantize_layer(np.asarray(value, np.float32), method, bits, group, sym)
        twin[name] = dequantized(u, z, scale, group)
        packed[layer + ".scales"] = scale
        if method == "gptq":
            packed[layer + ".qweight"] = pack_inputs(u, bits)
            stored = (z - 1) & maxq if fmt == "gptq" else z
            packed[layer + ".qzeros"] = pack_outputs(stored, bits)
            g = u.shape[0] if group == -1 else group
            packed[layer + ".g_idx"] = (np.arange(u.shape[0]) // g).astype(np.int32)
        else:
            packed[layer + ".qweight"] = pack_outputs(u, bits, AWQ_ORDER)
            packed[layer + ".qzeros"] = pack_outputs(z, bits, AWQ_ORDER)
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": False,
           "checkpoint_format": fmt} if method == "gptq" else
          {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    paths = []
    for sub, tensors_out, extra in (("packed", packed, {"quantization_config": qc, "torch_dtype": "float16"}),
                                    ("twin", twin, {"torch_dtype": "float32"})):
        d = os.path.join(out_dir, sub)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(float_dir):
            if not f.endswith(".safetensors") and f not in ("config.json", "model.safetensors.index.json"):
                src = os.path.join(float_dir, f)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(d, f))
        cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "dtype", "torch_dtype")}
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as fh:
            json.dump({**cfg, **extra}, fh, indent=2)
        # C order: safetensors writes an array's memory as it lies (a Fortran-ordered scale would be transposed)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors_out.items()}, os.path.join(d, "model.safetensors"))
        paths.append(d)
    return paths[0], paths[1]
