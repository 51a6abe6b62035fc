"""Qwen2 and Qwen2.5 (`model_type: qwen2`): Llama's decoder with a bias on q, k and v (not on o_proj).

HF: transformers.models.qwen2 (Qwen2Attention: q/k/v_proj bias=True, o_proj bias=False; MLP without
bias). Qwen2.5 checkpoints carry the same model_type, often with YaRN `rope_scaling` for 128K
contexts (export/config.py reads it, export/network/rope.py computes it).
"""
from __future__ import annotations

from typing import Any, Dict

MODEL_TYPE = "qwen2"
SLIDING_WINDOW_KEYS = True


def structure(raw: Dict[str, Any], source: str) -> Dict[str, bool]:
    return {"qkv_bias": True, "o_proj_bias": False, "mlp_bias": False, "qk_norm": False}
