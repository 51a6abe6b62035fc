"""Llama 2 / 3.x (`model_type: llama`): the plain decoder, biases only where the config asks.

HF: transformers.models.llama (LlamaAttention: q/k/v/o_proj bias = `attention_bias`; LlamaMLP:
gate/up/down_proj bias = `mlp_bias`; both false by default). Llama 3.1/3.2 use `rope_scaling` type
`llama3` (export/network/rope.py). Their tokenizers add a BOS token (lite_runtime/tokenizer.py honours
`add_bos_token`) and their generation configs list several eos ids.
"""
from __future__ import annotations

from typing import Any, Dict

from export.families.keys import flag

MODEL_TYPE = "llama"
SLIDING_WINDOW_KEYS = False


def structure(raw: Dict[str, Any], source: str) -> Dict[str, bool]:
    bias = flag(raw, "attention_bias", False, source)
    return {"qkv_bias": bias, "o_proj_bias": bias, "mlp_bias": flag(raw, "mlp_bias", False, source),
            "qk_norm": False}
