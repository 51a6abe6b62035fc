"""Rotary position tables in numpy: shared by the MindSpore network (graph constants) and the float32 reference.

One place for the math, so the golden references of export/writers/golden.py and the exported graphs
cannot drift apart on RoPE. The scaling types are the static ones of transformers'
modeling_rope_utils, computed the same way in float32: `linear` (positions / factor), `yarn`
(per-frequency blend of interpolation and extrapolation, and an attention factor on cos and sin)
and `llama3` (Llama 3.1's smoothed per-wavelength factor). They only change the tables, so the
graphs and the CPU kernels are the same for every type.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np

from export.config import ModelConfig


def _default_inv_freq(base: float, d: int) -> np.ndarray:
    return (1.0 / (base ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)


def _yarn(cfg: ModelConfig, s: dict) -> Tuple[np.ndarray, float]:
    d, base, factor = cfg.head_dim, cfg.rope_theta, s["factor"]
    original = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = (base ** (np.arange(0, d, 2).astype(np.float32) / d)).astype(np.float32)
    inv_extrapolation = (1.0 / pos_freqs).astype(np.float32)
    inv_interpolation = (1.0 / (factor * pos_freqs)).astype(np.float32)
    inv = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv.astype(np.float32), float(attention_factor)


def _llama3(cfg: ModelConfig, s: dict) -> np.ndarray:
    inv = _default_inv_freq(cfg.rope_theta, cfg.head_dim)
    factor, low_f, high_f = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low_f, old / high_f
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((old / wavelen - low_f) / (high_f - low_f)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def inv_freq(cfg: ModelConfig) -> Tuple[np.ndarray, float]:
    """The inverse frequencies [D/2] (float32) and the factor cos and sin are multiplied by."""
    kind, s = cfg.rope_type, cfg.rope_scaling or {}
    if kind == "default":
        return _default_inv_freq(cfg.rope_theta, cfg.head_dim), 1.0
    if kind == "linear":
        return (_default_inv_freq(cfg.rope_theta, cfg.head_dim) / np.float32(s["factor"])).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(cfg, s)
    if kind == "llama3":
        return _llama3(cfg, s), 1.0
    raise ValueError(f"rope type {kind!r} has no tables")  # ModelConfig refuses it first


def rope_tables(cfg: ModelConfig, seq_length: int) -> Tuple[np.ndarray, np.ndarray]:
    """cos, sin [S, D] in float32, neox layout (the two halves repeat), as HF computes them."""
    inv, factor = inv_freq(cfg)
    freqs = np.outer(np.arange(seq_length, dtype=np.float32), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    if factor != 1.0:
        cos, sin = (cos * np.float32(factor)).astype(np.float32), (sin * np.float32(factor)).astype(np.float32)
    return cos, sin
