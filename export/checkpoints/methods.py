"""How a checkpoint's or a folder's linear layers are quantized (QuantMethod), and which tensors are those linear
layers: the vocabulary the checkpoint readers (gguf.py, packed.py) and the network's quantization
(export/network/quantize.py) share."""
from __future__ import annotations

import re

from dataclasses import asdict, dataclass
from typing import Any, Dict

from lite_runtime.folder import quantization_label

LINEAR_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


# a mixture of experts' experts and Qwen2-MoE's shared expert, each its own linear layers in the checkpoint (Qwen's
# layout): quantized as the dense layers are; the router (`mlp.gate`) and the shared expert's gate stay float
# (export/network/moe.py)
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_expert)\.(gate|up|down)_proj\.weight$")


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and (name.endswith(LINEAR_SUFFIXES) or _EXPERT.match(name) is not None)


@dataclass(frozen=True)
class QuantMethod:
    """How a folder's linear layers are stored: `bits` 8 or 4, `group_size` inputs per scale (0: per channel),
    `symmetric` (no offsets), `source`: rtn, gptq, awq, or gguf:<type>."""

    bits: int
    group_size: int
    symmetric: bool
    source: str

    def groups(self, inputs: int) -> int:
        return 1 if self.group_size == 0 else inputs // self.group_size

    def label(self) -> str:
        return quantization_label(self.to_dict())

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def record(self, tables: Any) -> Dict[str, Any]:
        """What the manifest, the yaml and golden.json say: this method, and how the tables are held (`tables`: the
        network's TablePlan, export/network/quantize.py; its record())."""
        return {**self.to_dict(), "tables": tables.record()}

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "QuantMethod":
        return cls(int(raw["bits"]), int(raw["group_size"]), bool(raw["symmetric"]), str(raw["source"]))


# GGUF tensor types that hold 8 bits or more per weight; any other quantized type is below (4, 5 or 6 bits)
FULL_GGUF_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q8_1", "Q8_K")
