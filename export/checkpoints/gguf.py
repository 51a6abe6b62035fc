"""A GGUF file (llama.cpp's format) as a Hugging Face checkpoint folder: config.json, model.safetensors in float32,
the tokenizer with its chat template, generation_config.json. Read through export/checkpoints/gguf_file.py (every count and
offset checked against the file), dequantized with the `gguf` package's own dequantizers; the tokenizer built from
its metadata with the tokenizers library (no torch, no transformers).

This is the way in for a model that is at hand only as a GGUF (the README's demo model, SmolLM2-135M-Instruct, ships
so): the folder it writes goes through `python -m export` like any checkpoint. It writes float32, so a quantized
GGUF's values are kept exactly (a Q4_1 weight is d * q + m in float16 parts; its float32 value is exact) and the
folder's golden references and HF's own GGUF loading see the same numbers. Tensors are dequantized and written
one at a time: memory holds one tensor, whatever the model. The disk holds the float32 copy (4 bytes a parameter):
meant for small models; quantized folders straight from a GGUF are issue 31's import.

Architectures: `llama`, `qwen2`, `qwen3` (the families export/ has) and the mixtures of experts `qwen3moe` and
`qwen2moe` (each layer's stacked `ffn_{gate,up,down}_exps` [E, rows, inputs] read one expert at a time under Qwen's
per-expert names, the router `ffn_gate_inp`, Qwen2-MoE's `*_shexp`; norm_topk_prob as llama.cpp hard-codes it, true
for qwen3moe and false for qwen2moe; sigmoid or grouped gating, scaled expert weights and MLA refused by their keys);
anything else is refused by name. llama.cpp's
converter permutes a Llama's q and k rows (its RoPE pairs neighbours, HF's pairs halves); they are put back here as
transformers puts them back when it loads a GGUF.

    python -m export.checkpoints.gguf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --output demo/smollm2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from export.errors import ExportError
from export.checkpoints.gguf_file import GGUFFile, open_gguf_file

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                 "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe")}
# llama.cpp hard-codes the renormalisation of the chosen experts' weights per architecture (HF's norm_topk_prob; its
# src/models/qwen3moe.cpp and qwen2moe.cpp pass norm_w true and false to build_moe_ffn whatever the file says): a
# file means what llama.cpp computes from it
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False}

# GGUF tensor name -> HF name ({} is the layer index); gguf-py's tensor_mapping.py names these for the three families
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
          "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
          # a mixture of experts: the router, Qwen2-MoE's shared expert and its gate (1-D in the file, [1, H] in HF's)
          "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
# the experts, stacked in the file ([E, rows, inputs], llama.cpp's converter): each expert its own HF tensor
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
            "ffn_down_exps.weight": "down_proj.weight"}
SOURCE_FILE = "gguf_source.json"
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _reader(path: str) -> GGUFFile:
    if not os.path.isfile(path):
        raise ExportError(f"{path}: no such GGUF file")
    return open_gguf_file(path)


def hf_name(gguf_name: str) -> Optional[str]:
    """The HF checkpoint name of a GGUF tensor, or None for one this converter does not know (stacked experts: the
    name with `{}` where the expert's index goes)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    if match and match.group(2) in _EXPERTS:
        return f"model.layers.{match.group(1)}.mlp.experts.{{}}.{_EXPERTS[match.group(2)]}"
    return None


def gguf_config(reader: GGUFFile, path: str) -> Dict[str, Any]:
    """config.json for the file, from its metadata (HF's names, as mlx-lm and transformers read them)."""
    arch = reader.field("general.architecture")
    if arch not in ARCHITECTURES:
        raise ExportError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{', '.join(sorted(ARCHITECTURES))}")

    def need(key: str) -> Any:
        value = reader.field(f"{arch}.{key}")
        if value is None:
            raise ExportError(f"{path}: GGUF metadata {arch}.{key} is missing; the file cannot be converted")
        return value

    scaling = reader.field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ExportError(f"{path}: GGUF rope scaling {scaling!r} is not converted; supported: none")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = reader.field("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    matrices = {t.type_name for t in reader.tensors if len(t.shape) == 2}
    head_dim = reader.field(f"{arch}.attention.key_length") or reader.field(f"{arch}.rope.dimension_count")
    config: Dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": ARCHITECTURES[arch][1],
        "hidden_size": hidden,
        "intermediate_size": int(reader.field(f"{arch}.feed_forward_length") or 0) or (
            int(need("expert_feed_forward_length")) if arch in _NORM_TOPK else int(need("feed_forward_length"))),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(reader.field(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(reader.field(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": len(tokens) if tokens is not None else int(need("vocab_size")),
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        # the matrices' type when they are all 16-bit floats (what a --device cpu export keeps by default), else float32
        "torch_dtype": {"F16": "float16", "BF16": "bfloat16"}.get(matrices.pop() if len(matrices) == 1 else "", "float32"),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if arch in _NORM_TOPK:
        config.update(_moe_config(reader, path, arch, names, need, config["num_hidden_layers"]))
    for key in ("bos_token_id", "eos_token_id"):
        value = reader.field(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _moe_config(reader: GGUFFile, path: str, arch: str, names, need, layers: int) -> Dict[str, Any]:
    """A qwen3moe / qwen2moe file's experts as HF's config keys. Routing other than Qwen's (a softmax over every
    expert, then top-k) is refused by the metadata key that says so: sigmoid gating, expert groups, MLA attention
    (DeepSeek's)."""
    gating = reader.field(f"{arch}.expert_gating_func")
    if gating not in (None, 1):
        raise ExportError(f"{path}: GGUF metadata {arch}.expert_gating_func is {gating} (1 is softmax, 2 sigmoid): "
                          "only softmax routing is supported")
    groups = reader.field(f"{arch}.expert_group_count")
    if groups not in (None, 0, 1):
        raise ExportError(f"{path}: GGUF metadata {arch}.expert_group_count is {groups}: grouped expert routing "
                          "(DeepSeek's) is not supported")
    if reader.field(f"{arch}.attention.kv_lora_rank") is not None:
        raise ExportError(f"{path}: GGUF metadata {arch}.attention.kv_lora_rank is set: MLA attention (DeepSeek's) "
                          "is not supported")
    scale = reader.field(f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 1):
        raise ExportError(f"{path}: GGUF metadata {arch}.expert_weights_scale is {scale}: scaled expert weights "
                          "(DeepSeek's) are not supported")
    config = {"num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
              "moe_intermediate_size": int(need("expert_feed_forward_length")),
              "norm_topk_prob": _NORM_TOPK[arch], "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(need("expert_shared_feed_forward_length"))
        config["qkv_bias"] = "blk.0.attn_q.bias" in names
    return config


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (per head, rows [0, 2, 4, ..., 1, 3, ...] of HF's order become neighbours)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _tensors(reader: GGUFFile, path: str,
             config: Dict[str, Any]) -> List[Tuple[str, Tuple[int, ...], Callable[[], np.ndarray], Any, Optional[int]]]:
    """(HF name, shape, load, the GGUF tensor, the expert's index in it or None) for every tensor: names and shapes are
    known before any data is read. A stacked experts' tensor gives one entry per expert, each dequantizing its rows
    only."""
    permute = config["model_type"] == "llama"
    out, unknown = [], []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            unknown.append(tensor.name)
            continue
        if "{}" in name:
            if len(tensor.shape) != 3:
                raise ExportError(f"{path}: GGUF tensor {tensor.name} has shape {list(tensor.shape)}; stacked experts "
                                  "are [experts, rows, inputs]")
            experts, rows = tensor.shape[0], tensor.shape[1]
            for n in range(experts):
                out.append((name.format(n), tuple(tensor.shape[1:]),
                            lambda tensor=tensor, n=n, rows=rows: reader.dequantized_rows(tensor, n * rows, rows),
                            tensor, n))
            continue
        shape = tensor.shape
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # [H] in the file, HF's Linear(H, 1)
            out.append((name, (1,) + tuple(shape), lambda tensor=tensor: reader.dequantized(tensor).reshape(1, -1),
                        tensor, None))
            continue

        def load(tensor=tensor, name=name) -> np.ndarray:
            values = reader.dequantized(tensor)
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                values = _unpermute(values, config["num_attention_heads"])
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                values = _unpermute(values, config["num_key_value_heads"])
            return values

        out.append((name, shape, load, tensor, None))
    if unknown:
        raise ExportError(f"{path}: tensors this converter does not know: {', '.join(unknown[:5])}"
                          f"{' …' if len(unknown) > 5 else ''}; supported: the {config['model_type']} decoder's")
    return out


# GGUF types a folder keeps as they are: (bits, symmetric)
_NATIVE = {"Q8_0": (8, True), "Q4_0": (4, True), "Q4_1": (4, False)}


def is_gguf(path: str) -> bool:
    """A file (not a folder) that begins with GGUF's magic."""
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFTensors:
    """A GGUF file as a checkpoint source for export (the interface of export/checkpoints/safetensors.py's SafetensorsFile, under the
    HF names): `stored(name)` is the tensor dequantized to float32 by the gguf package, llama.cpp's q/k permutation
    undone. Nothing is read before a tensor is asked for; each ask dequantizes it again (the golden references ask
    once per forward pass), and memory holds that one tensor in float32."""

    def __init__(self, reader: GGUFFile, path: str, config: Dict[str, Any]) -> None:
        self.path = path
        self._reader, self._config = reader, config
        entries = _tensors(reader, path, config)
        self._gguf = {name: tensor for name, _, _, tensor, _ in entries}
        self._expert = {name: index for name, _, _, _, index in entries if index is not None}
        self._entries = {name: (shape, load) for name, shape, load, _, _ in entries}
        self._offsets = {name: tensor.offset + (index or 0) * (tensor.nbytes // tensor.shape[0])
                         for name, _, _, tensor, index in entries}
        self.header = {name: {"shape": list(shape)} for name, (shape, _) in self._entries.items()}

    def names(self) -> List[str]:
        return list(self._entries)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._entries[name][0]

    def offset(self, name: str) -> int:
        return self._offsets[name]

    def stored(self, name: str) -> np.ndarray:
        return self._entries[name][1]()

    def read(self, name: str) -> np.ndarray:
        return self.stored(name)

    def will_need(self, name: str) -> None:
        """A hint the safetensors source acts on; the GGUF's pages are read as it is dequantized."""

    def native_method(self):
        """The folder method the file's linear layers are stored in as they are: Q8_0 -> int8, Q4_0 -> int4
        symmetric, Q4_1 -> int4 with offsets, each in groups of 32 (export/network/quantize.py); None for any other type or
        a mix (those are dequantized)."""
        from export.checkpoints.methods import is_linear

        methods = {self.native_method_of(n) for n in self._entries if is_linear(n)}
        return next(iter(methods)) if len(methods) == 1 else None

    def native_method_of(self, name: str):
        """The folder method one tensor is stored in as it is (Q8_0, Q4_0, Q4_1 in groups of 32), or None."""
        from export.checkpoints.methods import QuantMethod

        kind = self._gguf[name].type_name
        if kind not in _NATIVE:
            return None
        bits, symmetric = _NATIVE[kind]
        return QuantMethod(bits, 32, symmetric, f"gguf:{kind}")

    def stored_type(self, name: str) -> str:
        return f"gguf:{self._gguf[name].type_name}"

    def below_8_bits(self, name: str) -> Optional[str]:
        """`<GGUF tensor> is <type>, fewer than 8 bits a weight` for a tensor the file holds so, else None."""
        from export.checkpoints.methods import FULL_GGUF_TYPES

        tensor = self._gguf[name]
        if tensor.type_name in FULL_GGUF_TYPES:
            return None
        return f"{tensor.name} is {tensor.type_name} (fewer than 8 bits a weight)"

    def quantized(self, name: str):
        """(q int8 [O, I], scale [O, I / 32], offset or None) float32 of a Q8_0/Q4_0/Q4_1 layer, bit for bit: the
        blocks' integers as they are (ggml's layouts: Q8_0 = f16 d, 32 x int8; Q4_0 = f16 d, 16 bytes whose low
        nibbles are elements 0-15 and high nibbles 16-31, w = d (u - 8); Q4_1 = f16 d, f16 m, the same nibbles,
        w = d u + m = (u - 8 + (8 + m / d)) d)."""
        tensor = self._gguf[name]
        raw = self._reader.raw(tensor)  # [O, blocks * bytes] (stacked experts: [E * O, ...], this expert's O rows)
        rows, inputs = tensor.shape[-2:]
        if name in self._expert:
            raw = raw[self._expert[name] * rows:(self._expert[name] + 1) * rows]
        blocks = inputs // 32
        if tensor.type_name == "Q8_0":
            b = raw.reshape(rows, blocks, 34)
            d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
            q = b[:, :, 2:].copy().view(np.int8).reshape(rows, inputs)
            offset = None
        else:
            size = 18 if tensor.type_name == "Q4_0" else 20
            b = raw.reshape(rows, blocks, size)
            d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
            nibbles = b[:, :, size - 16:]
            u = np.concatenate((nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)), axis=2)  # [O, blocks, 32]
            q = (u.astype(np.int8) - np.int8(8)).reshape(rows, inputs)
            if tensor.type_name == "Q4_0":
                offset = None
            else:
                m = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
                flat = d == 0  # a block of equal weights m: stored as q = 0, offset 1, scale m
                offset = (8 + m / np.where(flat, np.float32(1), d)).astype(np.float32)
                if flat.any():
                    q.reshape(rows, blocks, 32)[flat] = 0
                    offset[flat], d[flat] = 1.0, m[flat]
        heads = self._heads(name)
        if heads:
            q, d = _unpermute(q, heads), _unpermute(d, heads)
            offset = None if offset is None else _unpermute(offset, heads)
        return q, d, offset

    def _heads(self, name: str) -> int:
        if self._config["model_type"] != "llama":
            return 0
        if name.endswith("q_proj.weight"):
            return self._config["num_attention_heads"]
        if name.endswith("k_proj.weight"):
            return self._config["num_key_value_heads"]
        return 0


def open_gguf(path: str) -> Tuple[Dict[str, Any], Dict[str, GGUFTensors]]:
    """(config.json's dict, every HF tensor name -> the source that holds it) of a GGUF checkpoint."""
    reader = _reader(path)
    config = gguf_config(reader, path)
    source = GGUFTensors(reader, path, config)
    return config, {name: source for name in source.names()}


def write_tokenizer_files(path: str, folder: str) -> List[str]:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja (if the file has one) and generation_config.json
    of a GGUF checkpoint, written into `folder`; returns their names."""
    reader = _reader(path)
    _write_tokenizer(reader, path, folder)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as fh:
        json.dump(generation_config(reader), fh, indent=2)
    return sorted(f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                              "generation_config.json") if os.path.isfile(os.path.join(folder, f)))


def generation_config(reader: GGUFFile) -> Dict[str, Any]:
    """bos, eos and pad ids as generation_config.json writes them, from the file's tokenizer metadata; an end-of-turn
    id (`tokenizer.ggml.eot_token_id`, Llama 3's <|eot_id|>) stops generation too, as llama.cpp stops on it."""
    out: Dict[str, Any] = {}
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = reader.field(f"tokenizer.ggml.{meta}")
        if value is not None:
            out[key] = int(value)
    eot = reader.field("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) != out.get("eos_token_id"):
        out["eos_token_id"] = [out["eos_token_id"], int(eot)] if "eos_token_id" in out else int(eot)
    return out


def write_safetensors(file: str, tensors: List[Tuple[str, Tuple[int, ...], Callable[[], np.ndarray]]]) -> None:
    """A float32 safetensors file written one tensor at a time (the header first: every shape is known)."""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape, load in tensors:
            values = load()
            if values.shape != shape:
                raise ExportError(f"{file}: tensor {name} came out {values.shape}, expected {shape}")
            fh.write(np.ascontiguousarray(values, dtype="<f4").tobytes())


# The split regexes of the byte-level BPE pre-tokenizers GGUF files name in tokenizer.ggml.pre (llama.cpp's
# llama-vocab.cpp lists them). Any other value splits as GPT-2 does (ByteLevel's own regex), as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (gguf-py's TokenType)


def _byte_alphabet() -> Dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which a byte-level vocabulary is spelled."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer(reader: GGUFFile, path: str):
    """The file's tokenizer from its tokenizer.* metadata, built with the tokenizers library alone (transformers'
    GGUF reader needs torch): a byte-level BPE of the file's tokens and merges, its control tokens special, its
    user-defined tokens added whole, split by the regex its `tokenizer.ggml.pre` names. tests/test_gguf.py and
    tests/test_readme.py hold it to transformers' own GGUF tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = reader.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ExportError(f"{path}: tokenizer.ggml.model {kind!r} is not converted; supported: gpt2 (the byte-level "
                          "BPE of Qwen2, Qwen3, Llama 3 and SmolLM2)")
    tokens = reader.field("tokenizer.ggml.tokens")
    merges = reader.field("tokenizer.ggml.merges")
    types = reader.field("tokenizer.ggml.token_type") or []
    if not tokens or merges is None:
        raise ExportError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ExportError(f"{path}: tokenizer.ggml.merges holds {merge!r}, not two tokens")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _SPLITS.get(reader.field("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= spelled]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
    return tok


def _write_tokenizer(reader: GGUFFile, path: str, output: str) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja from the file's metadata."""
    build_tokenizer(reader, path).save(os.path.join(output, "tokenizer.json"))
    tokens = reader.field("tokenizer.ggml.tokens")
    config: Dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": int(reader.field(f"{reader.field('general.architecture')}."
                                                                     "context_length", 0)) or None}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = reader.field(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= int(index) < len(tokens):
            config[name] = tokens[int(index)]
    with open(os.path.join(output, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    template = reader.field("tokenizer.chat_template")
    if isinstance(template, str):
        with open(os.path.join(output, "chat_template.jinja"), "w", encoding="utf-8") as fh:
            fh.write(template)


def convert(path: str, output: str, overwrite: bool = False, source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write the HF checkpoint folder; returns its config. Nothing is left at `output` if it fails. `source`, if
    given, is written into it as gguf_source.json (what it was made from)."""
    if os.path.exists(output) and not overwrite:
        raise ExportError(f"{output} already exists; delete it or pass --overwrite")
    reader = _reader(path)
    config = dict(gguf_config(reader, path), torch_dtype="float32")  # written in float32 below
    tensors = [entry[:3] for entry in _tensors(reader, path, config)]
    partial = f"{output.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        write_safetensors(os.path.join(partial, "model.safetensors"), tensors)
        with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2)
        with open(os.path.join(partial, "generation_config.json"), "w", encoding="utf-8") as fh:
            json.dump(generation_config(reader), fh, indent=2)
        _write_tokenizer(reader, path, partial)
        if source is not None:
            with open(os.path.join(partial, SOURCE_FILE), "w", encoding="utf-8") as fh:
                json.dump(source, fh, indent=2)
        if os.path.exists(output):
            shutil.rmtree(output)
        os.replace(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m export.checkpoints.gguf",
                                     description="Write a GGUF file (llama, qwen2, qwen3, qwen3moe, qwen2moe) as a "
                                                 "float32 HF checkpoint folder that `python -m export` takes.")
    parser.add_argument("--gguf", required=True, help="the .gguf file")
    parser.add_argument("--output", required=True, help="the checkpoint folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = convert(args.gguf, args.output, overwrite=args.overwrite)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.output}: {config['architectures'][0]}, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']} (float32 from {os.path.basename(args.gguf)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
