"""Model families: one module per Hugging Face `model_type`, and the registry that picks it.

A family module says how its checkpoints differ from the shared decoder (export/network/model.py for the
MindSpore graphs, export/writers/reference.py for the float32 reference): which projections carry a bias,
whether q and k are normalised per head, which HF config keys it reads for that. Everything the
families share (RMSNorm, RoPE tables and their scaling types, the KV-cache attention, the graph
wrappers, the CPU kernels) lives once, in those shared modules; parameter names are always the
checkpoint's own. A new family is one module here and one entry in FAMILIES (plus its entry in
lite_runtime's InputOfInfer.MAPPING when it needs other graph inputs).

Module contract: MODEL_TYPE (the config.json value), SLIDING_WINDOW_KEYS (whether the family has
Qwen's use_sliding_window / max_window_layers keys), structure(raw, source) -> the structural flags
of ModelConfig (qkv_bias, o_proj_bias, mlp_bias, qk_norm); a mixture-of-experts family also has moe(raw, source) ->
the experts' fields (moe.py). Family modules read their keys with keys.flag and
import nothing else of export/, so export/config.py imports this registry at the top (no cycle).
"""
from __future__ import annotations

from types import ModuleType
from typing import Dict

from export.errors import ExportError
from export.families import llama, qwen2, qwen2_moe, qwen3, qwen3_moe

# the dense families, then the mixtures of experts (export/network/moe.py; export/pipeline.py _moe_supported says
# which of their folders export)
FAMILIES: Dict[str, ModuleType] = {m.MODEL_TYPE: m for m in (qwen2, qwen3, llama, qwen3_moe, qwen2_moe)}

# model_types people try that are mixtures of experts of other designs (routing, attention): refused by name
MIXTURE_OF_EXPERTS = ("mixtral", "deepseek_v2", "deepseek_v3", "llama4", "qwen3_next")


def get(model_type, source: str = "config.json") -> ModuleType:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    known = ", ".join(FAMILIES)
    if model_type in MIXTURE_OF_EXPERTS:
        raise ExportError(f"{source}: model_type {model_type!r} is a mixture-of-experts model of another design, "
                          f"which is not supported; supported: {known}")
    raise ExportError(f"{source}: model_type {model_type!r} is not supported; supported: {known}")
