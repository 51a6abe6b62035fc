"""Rotary position tables in numpy: shared by the MindSpore network (graph constants) and the float32 reference.

One place for the math, so the golden references of export/golden.py and the exported graphs
cannot drift apart on RoPE.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from export.config import Qwen2Config


def rope_tables(cfg: Qwen2Config, seq_length: int) -> Tuple[np.ndarray, np.ndarray]:
    """cos, sin [S, D] in float32, neox layout (the two halves repeat), as HF computes them."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    freqs = np.outer(np.arange(seq_length, dtype=np.float32), inv_freq.astype(np.float32))
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
