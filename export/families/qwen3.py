"""Qwen3 (`model_type: qwen3`): RMSNorm over each head of q and k before RoPE, no qkv bias.

HF: transformers.models.qwen3 (Qwen3Attention: q_norm and k_norm are RMSNorm(head_dim) applied to
[.., heads, head_dim] before the rotary embedding; every projection has a bias only when
`attention_bias` is true; `head_dim` is explicit and may differ from hidden_size / heads, e.g.
Qwen3-0.6B: 1024 / 16 heads but head_dim 128).
"""
from __future__ import annotations

from typing import Any, Dict

from export.families.keys import flag

MODEL_TYPE = "qwen3"
SLIDING_WINDOW_KEYS = True


def structure(raw: Dict[str, Any], source: str) -> Dict[str, bool]:
    bias = flag(raw, "attention_bias", False, source)
    return {"qkv_bias": bias, "o_proj_bias": bias, "mlp_bias": False, "qk_norm": True}
