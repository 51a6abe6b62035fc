"""Qwen3-MoE (`model_type: qwen3_moe`, Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q_norm and k_norm, no
bias unless `attention_bias`), and in each sparse layer a router over `num_experts` SwiGLU experts, of which each token
takes `num_experts_per_tok` (export/families/moe.py; the rule for sparse layers: export/config.py ModelConfig.sparse).

HF: transformers.models.qwen3_moe (Qwen3MoeTopKRouter: softmax of the router logits in float32, top-k, divided by
their sum when `norm_topk_prob`; Qwen3MoeExperts: each chosen expert's SwiGLU, weighted, summed). Checkpoints hold
`mlp.gate.weight` [E, H] and each expert's `mlp.experts.N.{gate,up,down}_proj.weight`.
"""
from __future__ import annotations

from typing import Any, Dict

from export.families import qwen3
from export.families.moe import moe_keys

MODEL_TYPE = "qwen3_moe"
SLIDING_WINDOW_KEYS = True


def structure(raw: Dict[str, Any], source: str) -> Dict[str, bool]:
    return qwen3.structure(raw, source)


def moe(raw: Dict[str, Any], source: str) -> Dict[str, Any]:
    # transformers 5 saves Qwen3MoeConfig's num_experts as num_local_experts (its attribute_map); Qwen's releases
    # write num_experts
    return moe_keys(raw, source, shared_expert=False, experts_alias="num_local_experts")
