"""Configuration read once at the edge: ModelConfig from a HF config.json (any family), ExportConfig from the CLI."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from export import families
from export.errors import ExportError

log = logging.getLogger(__name__)

# dtypes of the exported graph; which of them a device has kernels for is its profile's `dtypes` (export/devices.py;
# docs/architecture.md, "Configuration")
DTYPES = ("float32", "float16", "bfloat16")

# rope_scaling types computed as transformers computes them (export/network/rope.py): all static, one table per export
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
# what each scaling type needs besides its rope_type, and what it may carry
_ROPE_KEYS = {
    "linear": (("factor",), ()),
    "yarn": (("factor",), ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling changes the rotary frequencies with each sequence's length at run time, which "
               "graphs of static shapes cannot; drop rope_scaling or use 'yarn'",
    "longrope": "LongRoPE switches between two frequency tables by sequence length at run time, which graphs of "
                "static shapes cannot; drop rope_scaling",
}


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a HF `config.json` that change the math, under their HF names, for every family
    (export/families): the shared decoder reads the structural flags, never the model_type."""

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
    # the family's structure (export/families/<model_type>.py)
    qkv_bias: bool = True
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # rotary scaling as transformers 5 writes `rope_parameters` (rope_type plus its keys), None for plain RoPE
    rope_scaling: Optional[Dict[str, Any]] = None
    # the window of the layers that slide (use_sliding_window), None when none does; export needs seq_length <= it
    sliding_window: Optional[int] = None
    # a mixture of experts (qwen3_moe, qwen2_moe: the family's moe()); 0 experts: every layer a dense MLP. A layer is
    # sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (`sparse`); its router picks
    # num_experts_per_tok experts (softmax in float32, top-k, divided by their sum with norm_topk_prob), each a SwiGLU
    # of moe_intermediate_size; qwen2_moe adds a shared expert of shared_expert_intermediate_size, times
    # sigmoid(shared_expert_gate(x)).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))

    @property
    def kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts (HF's Qwen3Moe/Qwen2MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def to_dict(self) -> Dict[str, Any]:
        """The fields (the manifest's `model.config`); a dense model's without the experts' (all zero)."""
        fields = dataclasses.asdict(self)
        return fields if self.num_experts else {k: v for k, v in fields.items() if k not in _MOE_FIELDS}

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from HF keys; unknown keys are ignored, features we cannot honour are refused."""
        family = families.get(raw.get("model_type"), source)
        from export.checkpoints.packed import quantization

        quantization(raw, source)  # an unsupported quantization_config is refused here, before anything is read
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ExportError(f"{source}: hidden_act {act!r} is not supported; only 'silu'")
        own = {"rope_theta", "rope_scaling", "sliding_window", "qkv_bias", "o_proj_bias", "mlp_bias", "qk_norm",
               *_MOE_FIELDS}
        fields = {f.name for f in dataclasses.fields(cls)} - own
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name != "num_key_value_heads"]
        missing = [name for name in required if name not in raw]
        if missing:
            raise ExportError(f"{source}: missing field(s) {', '.join(missing)}")
        kwargs = {k: v for k, v in raw.items() if k in fields}
        kwargs.setdefault("num_key_value_heads", raw["num_attention_heads"])
        kwargs["rope_theta"], kwargs["rope_scaling"] = _rope_settings(raw, source)
        kwargs["sliding_window"] = _sliding_window(raw, family, source)
        kwargs.update(family.structure(raw, source))
        kwargs.update(family.moe(raw, source) if hasattr(family, "moe") else {})
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        config = cls(**kwargs)
        config.validate(source)
        return config

    @classmethod
    def from_checkpoint(cls, checkpoint: str) -> "ModelConfig":
        """A HF folder's config.json, or the config a GGUF file's metadata gives (export/checkpoints/gguf.py)."""
        from export.checkpoints.gguf import gguf_config, is_gguf
        from export.checkpoints.gguf_file import open_gguf_file

        if is_gguf(checkpoint):
            return cls.from_dict(gguf_config(open_gguf_file(checkpoint), checkpoint), source=checkpoint)
        return cls.from_file(os.path.join(checkpoint, "config.json"))

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        if not os.path.isfile(path):
            raise ExportError(f"{path}: not found; pass --checkpoint a Hugging Face model folder with config.json, "
                              "or a .gguf file")
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
        if self.num_experts:
            self._validate_moe(source)

    def _validate_moe(self, source: str) -> None:
        sizes = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
        for name in sizes + ("shared_expert_intermediate_size",):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name in sizes else 0):
                raise ExportError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ExportError(f"{source}: num_experts_per_tok ({self.num_experts_per_tok}) is greater than "
                              f"num_experts ({self.num_experts}); a token cannot pick more experts than there are")
        bad = [i for i in self.mlp_only_layers
               if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ExportError(f"{source}: mlp_only_layers holds {bad[0]!r}, not a layer index below "
                              f"num_hidden_layers ({self.num_hidden_layers})")


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "shared_expert_intermediate_size")


def tensor_parallel_config(model: ModelConfig, tp_size: int) -> ModelConfig:
    """One rank's share of the model: its query heads, kv heads and MLP columns, and every expert's columns of a
    mixture of experts (ExportConfig.validate checked that tp_size divides them); head_dim stays the model's. The
    router and Qwen2-MoE's shared expert are every rank's, whole."""
    return dataclasses.replace(model, num_attention_heads=model.num_attention_heads // tp_size,
                               num_key_value_heads=model.num_key_value_heads // tp_size,
                               intermediate_size=model.intermediate_size // tp_size, head_dim=model.head_dim,
                               moe_intermediate_size=model.moe_intermediate_size // tp_size)


def vocab_shards(model: ModelConfig, tp_size: int) -> int:
    """How many ranks split the embedding and lm_head by vocabulary rows: all of them (vocab-parallel, as Megatron
    and vLLM do) when tp_size divides the vocabulary, as it does for every Qwen2/2.5/3 and Llama 3 vocabulary up to
    TP 16; else 1, and each rank holds the whole tables."""
    return tp_size if tp_size > 1 and model.vocab_size % tp_size == 0 else 1


def _rope_settings(raw: Dict[str, Any], source: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, scaling) from either layout found in the wild: `rope_theta` + `rope_scaling` (hub checkpoints
    written by transformers 4) or `rope_parameters` (transformers 5). Scaling comes back in the second form."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    merged: Dict[str, Any] = {}
    for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ExportError(f"{source}: {name} must be an object, got {value!r}")
        if any(isinstance(v, dict) for v in value.values()):
            raise ExportError(f"{source}: {name} per layer type is not supported; one rotary setting for all layers")
        merged.update(value)
    theta = merged.pop("rope_theta", None)
    theta = raw.get("rope_theta", 10000.0) if theta is None else theta
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    partial = merged.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ExportError(f"{source}: partial_rotary_factor {partial!r} is not supported; only rotary embeddings "
                          "over the whole head_dim")
    if rope_type in _ROPE_REFUSED:
        raise ExportError(f"{source}: {key} type {rope_type!r} is not supported: {_ROPE_REFUSED[rope_type]}")
    if rope_type not in ROPE_TYPES:
        raise ExportError(f"{source}: {key} type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    needed, optional = _ROPE_KEYS[rope_type]
    scaling_out: Dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "yarn":
        merged.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings")
                          or raw.get("max_position_embeddings"))
    for name in needed + optional:
        value = merged.get(name)
        if value is None:
            if name in needed:
                raise ExportError(f"{source}: {key} type {rope_type!r} needs {name}")
            continue
        if name == "truncate":
            if not isinstance(value, bool):
                raise ExportError(f"{source}: {key}.truncate must be true or false, got {value!r}")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ExportError(f"{source}: {key}.{name} must be a positive number, got {value!r}")
        scaling_out[name] = value
    return theta, scaling_out


def _sliding_window(raw: Dict[str, Any], family, source: str) -> Optional[int]:
    """The window of the layers HF runs with sliding-window attention, or None when no layer does.

    Sliding changes nothing while every position is inside the window (seq_length <= window), so such
    checkpoints export with --seq_length up to the window (ExportConfig.validate says so); beyond it
    they are refused.
    """
    layer_types = raw.get("layer_types")
    layers = raw.get("num_hidden_layers")
    if isinstance(layer_types, list):
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if unknown:
            raise ExportError(f"{source}: layer_types {', '.join(map(repr, unknown))} are not supported; only "
                              "full_attention and sliding_attention")
    elif family.SLIDING_WINDOW_KEYS and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", 0)
        sliding = [i for i in range(layers or 0) if i >= first]
    else:
        sliding = []
    if not sliding:
        return None
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ExportError(f"{source}: sliding-window attention on {len(sliding)} layer(s) with sliding_window "
                          f"{window!r} is not supported; export a checkpoint without use_sliding_window")
    return window


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
    # tensor parallel ranks (Megatron split, export/network/model.py CausalLM tensor_parallel); 1: one device's folder
    tp_size: int = 1
    # the graph form (export/devices.py graph_form): fused (Ascend's fused operators), plain, or None: the profile's
    graph: Optional[str] = None
    # tokens of the chunk graphs (a decode step and one row's prompt piece at an offset: the server's chunked prefill
    # and prefix reuse); None: the profile's (export/devices.py default_chunks); (): none. Tensor-parallel folders
    # have none
    chunk_sizes: Optional[Tuple[int, ...]] = None
    # tokens of the score graphs: the chunk graph returning the logits of every position of its piece (speculative
    # decoding's verify, prompt logprobs, perplexity); None: the profile's (export/devices.py default_scores); ():
    # none. Tensor-parallel folders have none
    score_sizes: Optional[Tuple[int, ...]] = None
    # weight-only quantization of the linear layers (export/network/quantize.py): None (a quantized checkpoint keeps its
    # method, a float one stays float), none, int8 or int4; group_size None: the default for the bits
    quantize: Optional[str] = None
    group_size: Optional[int] = None
    # a quantized folder's embedding and head (export/network/quantize.py resolve_tables): auto (as an imported checkpoint holds
    # them; int8 per row with --quantize), none (float), int8
    quantize_tables: str = "auto"
    # rows of the extra inc graphs (fewer than batch_size: a decode step of few sequences computes only theirs); None:
    # the profile's (export/devices.py default_step_rows); (): none
    step_rows: Optional[Tuple[int, ...]] = None
    # positions per block of the paged KV cache (every graph reads and writes it through block tables); None: the
    # device profile's (export/devices.py block_size)
    block_size: Optional[int] = None
    # the KV cache's dtype on CPU folders (kv_dtype): auto, float32 or bfloat16
    kv_cache_dtype: str = "auto"

    @property
    def compute_dtype(self) -> str:
        """Activations, KV cache, norms and biases. CPU folders always compute in float32: --dtype float16 or
        bfloat16 there stores the matrices in 16 bits (half the memory to read per token), which only our
        kernels read, widening them in registers."""
        return "float32" if self.device == "cpu" else self.dtype

    @property
    def half_weights_on_cpu(self) -> bool:
        return self.device == "cpu" and self.dtype != "float32"

    def kv_dtype(self, kernels: bool) -> str:
        """The paged KV cache's dtype. On Atlas the compute dtype (ReshapeAndCache and PagedAttention's). On a CPU
        folder whose graphs run the CPU kernels, bfloat16 by default where its dtype is bfloat16 (a bfloat16
        checkpoint's default CPU folder, its int8/int4 ones too): what HF computes a bfloat16 model's attention on,
        half the bytes a decode step reads and twice the tokens a pool holds (cpu_kernels/paged.h: rounded to nearest
        even as written, widened exactly as read); float32 otherwise. `--kv_cache_dtype float32` keeps float32 caches
        on any CPU folder; `bfloat16` asks for them on any folder the CPU kernels run (`kernels`; every form of their
        ops takes either cache, under names of its own for bfloat16 ones: cpu_kernels.KV16_OPS)."""
        want = self.kv_cache_dtype
        if self.device != "cpu":
            return self.compute_dtype
        if want == "auto":
            return "bfloat16" if kernels and self.dtype == "bfloat16" else "float32"
        if want == "bfloat16" and not kernels:
            raise ExportError("--kv_cache_dtype bfloat16: bfloat16 caches are read by the CPU kernels only; drop "
                              "--cpu_kernels off or the option")
        return want

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

    def validate(self, model: ModelConfig, allowed: Tuple[str, ...]) -> None:
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
        if model.sliding_window is not None and self.seq_length > model.sliding_window:
            raise ExportError(
                f"--seq_length {self.seq_length}: config.json has sliding-window attention (use_sliding_window, "
                f"sliding_window {model.sliding_window}), which is not supported beyond the window; pass "
                f"--seq_length {model.sliding_window} or less, where sliding changes nothing"
            )
        for size in self.chunk_sizes or ():
            if not 1 <= size <= self.seq_length:
                raise ExportError(f"--chunk_sizes: {size} must be between 1 and --seq_length {self.seq_length} (or "
                                  "none: no chunk graph, a folder that cannot be served)")
        for size in self.score_sizes or ():
            if not 1 <= size <= self.seq_length:
                raise ExportError(f"--score_sizes: {size} must be between 1 and --seq_length {self.seq_length} (or "
                                  "none: no score graph, a folder without speculative decoding and prompt logprobs)")
        for rows in self.step_rows or ():
            if not 1 <= rows < self.batch_size:
                raise ExportError(f"--step_rows: {rows} must be between 1 and --batch_size - 1 ({self.batch_size - 1}); "
                                  "the inc graph of batch_size rows is always exported")
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
        if self.block_size is not None:
            atlas = self.device != "cpu"
            if self.block_size < 1 or (atlas and (self.block_size % 16 or self.block_size > 512)):
                raise ExportError(f"--block_size {self.block_size}: " + (
                    "on Atlas a multiple of 16 up to 512 (ReshapeAndCache and PagedAttention's blocks; 128 is what "
                    "vllm-ascend and MindIE use)" if atlas else "must be at least 1"))
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ExportError(f"--kv_cache_dtype {self.kv_cache_dtype!r} is not one of auto, float32, bfloat16")
        if self.kv_cache_dtype != "auto" and self.device != "cpu":
            raise ExportError(f"--kv_cache_dtype {self.kv_cache_dtype}: on Atlas the KV cache is the compute dtype "
                              f"(--dtype {self.dtype}, as ReshapeAndCache and PagedAttention take it); drop the option")
        if self.quantize not in (None, "none", "int8", "int4"):
            raise ExportError(f"--quantize {self.quantize!r} is not one of none, int8, int4")
        if self.tp_size < 1:
            raise ExportError(f"--tp_size must be at least 1, got {self.tp_size}")
        if self.tp_size > 1:
            split = {"num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_key_value_heads,
                     "intermediate_size": model.intermediate_size,
                     **({"moe_intermediate_size": model.moe_intermediate_size} if model.num_experts else {})}
            bad = [f"{k} {v}" for k, v in split.items() if v % self.tp_size]
            if bad:
                raise ExportError(f"--tp_size {self.tp_size} does not divide config.json's {', '.join(bad)}; each "
                                  "rank takes an equal share of the heads, kv heads and MLP columns: pick a divisor")
        if not self.name or any(c in self.name for c in "/\\ ") or self.name.startswith("."):
            raise ExportError(f"--name {self.name!r} must be a plain file name (no slashes or spaces)")
