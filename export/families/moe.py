"""Reading a mixture-of-experts family's config.json keys (qwen3_moe, qwen2_moe): shared by those family modules,
which import nothing else of export/ but keys.py. The keys and their defaults are transformers' Qwen3MoeConfig and
Qwen2MoeConfig's (`norm_topk_prob` false, `decoder_sparse_step` 1, `mlp_only_layers` none)."""
from __future__ import annotations

from typing import Any, Dict

from export.errors import ExportError
from export.families.keys import flag


def _count(raw: Dict[str, Any], name: str, source: str, default=None, least: int = 1) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ExportError(f"{source}: missing field {name} (a mixture-of-experts config needs it)")
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ExportError(f"{source}: {name} must be an integer of at least {least}, got {value!r}")
    return value


def _experts(raw: Dict[str, Any], source: str, alias: str = "") -> int:
    """num_experts, or its `alias` where the family's config maps it (transformers 5's Qwen3MoeConfig saves
    num_experts as num_local_experts: attribute_map); both present must agree."""
    if alias and alias in raw:
        if "num_experts" in raw and raw["num_experts"] != raw[alias]:
            raise ExportError(f"{source}: num_experts ({raw['num_experts']!r}) and {alias} ({raw[alias]!r}) disagree; "
                              "they name one field: keep one")
        return _count(raw, alias, source)
    return _count(raw, "num_experts", source)


def moe_keys(raw: Dict[str, Any], source: str, shared_expert: bool, experts_alias: str = "") -> Dict[str, Any]:
    """The ModelConfig fields of the experts (export/config.py); `shared_expert`: the family has Qwen2-MoE's;
    `experts_alias`: another key the family's config writes num_experts under."""
    layers = raw.get("mlp_only_layers") or []
    if not isinstance(layers, list):
        raise ExportError(f"{source}: mlp_only_layers must be a list of layer indices, got {layers!r}")
    fields = {
        "num_experts": _experts(raw, source, experts_alias),
        "num_experts_per_tok": _count(raw, "num_experts_per_tok", source),
        "moe_intermediate_size": _count(raw, "moe_intermediate_size", source),
        "norm_topk_prob": flag(raw, "norm_topk_prob", False, source),
        "decoder_sparse_step": _count(raw, "decoder_sparse_step", source, default=1),
        "mlp_only_layers": tuple(layers),
        "shared_expert_intermediate_size": 0,
    }
    if shared_expert:
        fields["shared_expert_intermediate_size"] = _count(raw, "shared_expert_intermediate_size", source)
    return fields
