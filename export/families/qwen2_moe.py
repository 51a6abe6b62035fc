"""Qwen2-MoE (`model_type: qwen2_moe`, Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias by
`qkv_bias`, default true), routed experts as Qwen3-MoE's (export/families/qwen3_moe.py), plus a shared expert every
token takes: a SwiGLU of `shared_expert_intermediate_size` times sigmoid(`mlp.shared_expert_gate`(x)), a Linear to
one output without bias.

HF: transformers.models.qwen2_moe (Qwen2MoeSparseMoeBlock). Checkpoints add `mlp.shared_expert.{gate,up,down}_proj`
and `mlp.shared_expert_gate.weight` [1, H].
"""
from __future__ import annotations

from typing import Any, Dict

from export.families.keys import flag
from export.families.moe import moe_keys

MODEL_TYPE = "qwen2_moe"
SLIDING_WINDOW_KEYS = True


def structure(raw: Dict[str, Any], source: str) -> Dict[str, bool]:
    return {"qkv_bias": flag(raw, "qkv_bias", True, source), "o_proj_bias": False, "mlp_bias": False,
            "qk_norm": False}


def moe(raw: Dict[str, Any], source: str) -> Dict[str, Any]:
    return moe_keys(raw, source, shared_expert=True)
