"""Configuration read once at the edge: Qwen2Config from a HF config.json, ExportConfig from the CLI."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from export.errors import ExportError

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2",)
# dtype of the exported graph -> devices that have kernels for it (see DESIGN.md)
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Qwen2Config:
    """The fields of a HF Qwen2 `config.json` that change the math, under their HF names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    head_dim: Optional[int] = None
    model_type: str = "qwen2"
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None  # int or list of ints, as HF writes it

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], source: str = "config.json") -> "Qwen2Config":
        """Build from HF keys; unknown keys are ignored, features we cannot honour are refused."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ExportError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ExportError(
                f"{source}: use_sliding_window=true is not supported; export a checkpoint "
                "with use_sliding_window=false"
            )
        rope = _rope_settings(raw, source)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ExportError(f"{source}: hidden_act {act!r} is not supported; only 'silu'")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name != "num_key_value_heads"]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ExportError(f"{source}: missing field(s) {', '.join(missing)}")
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs.setdefault("num_key_value_heads", raw["num_attention_heads"])
        kwargs["rope_theta"] = rope
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        config = cls(**kwargs)
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str) -> "Qwen2Config":
        if not os.path.isfile(path):
            raise ExportError(f"{path}: not found; pass --checkpoint a Hugging Face model folder with config.json")
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ExportError(f"{path}: not valid JSON ({exc}); fix or re-download the file") from None
        if not isinstance(raw, dict):
            raise ExportError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, source=path)

    def validate(self, source: str = "config.json") -> None:
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim")
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ExportError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ExportError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ExportError(f"{source}: head_dim ({self.head_dim}) must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ExportError(f"{source}: {name} must be a positive number, got {value!r}")


def _rope_settings(raw: Dict[str, Any], source: str) -> float:
    """rope_theta from either layout HF has used: top-level keys, or `rope_parameters`."""
    scaling = raw.get("rope_scaling")
    if scaling:
        raise ExportError(
            f"{source}: rope_scaling {scaling!r} is not supported; only default rotary embeddings"
        )
    params = raw.get("rope_parameters")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ExportError(
                f"{source}: rope_parameters.rope_type {rope_type!r} is not supported; only 'default'"
            )
        theta = params.get("rope_theta", theta)
    return 10000.0 if theta is None else theta


@dataclass(frozen=True)
class ExportConfig:
    """What the CLI asked for; argparse names equal these field names."""

    checkpoint: str
    output: str
    name: str
    seq_length: int = 1024
    batch_size: int = 1
    dtype: str = "float32"  # the CLI resolves "no --dtype" to the device profile's default
    device: str = "atlas_800i_a2"
    overwrite: bool = False
    # extra, shorter full graphs; the seq_length one is always there. None: the device's rule (devices.default_buckets)
    prefill_buckets: Optional[Tuple[int, ...]] = None
    # our CPU kernels (cpu_kernels) in the graphs' matmuls: auto (cpu folders, when the library is built), on, off
    cpu_kernels: str = "auto"

    @property
    def compute_dtype(self) -> str:
        """Activations, KV cache, norms and biases. CPU folders always compute in float32: --dtype float16 or
        bfloat16 there stores the matrices in 16 bits (half the memory to read per token), which only our
        kernels read, widening them in registers."""
        return "float32" if self.device == "cpu" else self.dtype

    @property
    def half_weights_on_cpu(self) -> bool:
        return self.device == "cpu" and self.dtype != "float32"

    def use_cpu_kernels(self) -> bool:
        """Whether the graphs use cpu_kernels' matmuls. `on` without the built library is an error, and so is a
        CPU folder with 16-bit weights (nothing else reads them)."""
        import cpu_kernels

        if self.device != "cpu" or (self.cpu_kernels == "off" and not self.half_weights_on_cpu):
            return False
        if cpu_kernels.library_path() is None:
            if self.half_weights_on_cpu:
                raise ExportError(f"--device cpu --dtype {self.dtype} needs the CPU kernel library, which is not "
                                  f"built; {cpu_kernels.BUILD_HINT}, or export --dtype float32")
            if self.cpu_kernels == "on":
                raise ExportError(f"--cpu_kernels on: the CPU kernel library is not built; {cpu_kernels.BUILD_HINT}")
            log.warning("the CPU kernel library is not built, so the decode graph uses MindSpore's MatMul "
                        "(about 0.8x the decode speed on 2 cores); %s", cpu_kernels.BUILD_HINT)
            return False
        return True

    def validate(self, model: Qwen2Config, allowed: Tuple[str, ...]) -> None:
        """`allowed`: the dtypes the device profile has kernels for."""
        if self.batch_size < 1:
            raise ExportError(f"--batch_size must be at least 1, got {self.batch_size}")
        if self.seq_length < 2:
            raise ExportError(f"--seq_length must be at least 2, got {self.seq_length}")
        if self.seq_length > model.max_position_embeddings:
            raise ExportError(
                f"--seq_length {self.seq_length} exceeds max_position_embeddings "
                f"{model.max_position_embeddings} in config.json; pass a smaller --seq_length"
            )
        for bucket in self.prefill_buckets or ():
            if not 1 <= bucket < self.seq_length:
                raise ExportError(f"--prefill_buckets: {bucket} must be between 1 and --seq_length - 1 "
                                  f"({self.seq_length - 1}); the full seq_length graph is always exported")
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.dtype not in allowed:
            raise ExportError(
                f"--dtype {self.dtype} has no kernels on device profile {self.device!r}; "
                f"use one of {', '.join(allowed)}"
            )
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ExportError(f"--cpu_kernels {self.cpu_kernels!r} is not one of auto, on, off")
        if self.cpu_kernels == "on" and self.device != "cpu":
            raise ExportError(f"--cpu_kernels on needs --device cpu (got --device {self.device}); graphs for Atlas "
                              "use MindSpore's own ops")
        if self.cpu_kernels == "off" and self.half_weights_on_cpu:
            raise ExportError(f"--cpu_kernels off: --device cpu --dtype {self.dtype} stores 16-bit weights that only "
                              "the CPU kernels read; drop --cpu_kernels off or export --dtype float32")
        if not self.name or any(c in self.name for c in "/\\ ") or self.name.startswith("."):
            raise ExportError(f"--name {self.name!r} must be a plain file name (no slashes or spaces)")
