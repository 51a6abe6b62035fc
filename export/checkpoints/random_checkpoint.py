"""Random Hugging Face checkpoints (qwen2, qwen3, llama, qwen3_moe, qwen2_moe) for demos, tests and benchmarks; no
downloads.

The weights are random, so the text such a checkpoint generates is gibberish: it exists to exercise export and the
runtime end to end, and to be the reference the tests compare against. The tokenizer is a byte-level BPE trained here.

config.json, generation_config.json and the tokenizer files are written as JSON here, the keys and defaults as
transformers 5 writes them for the family, so the command line (scripts/make_demo_checkpoint.py) needs neither
transformers nor torch. A caller that passes a transformers tokenizer has it saved by its own save_pretrained.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Dict, Optional

import numpy as np

# A byte-level BPE like Qwen2's and Llama 3's, trained on this text; the special tokens are the family's.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
MindSpore Lite runs exported graphs on Ascend servers through the graph engine.
Large language models predict the next token from the tokens before it, one step at a time.
The prefill step reads the whole prompt and fills the key value cache; each decode step adds one token.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text too. def main(): return 0
Once upon a time there was a little model that wanted to run on every server in the data center.
""" * 4
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3's: a BOS token the tokenizer adds in front of every encoded text, and two eos ids (end of text, end of turn)
LLAMA_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
# a mixture of experts's defaults here: tiny, every layer sparse
MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=48)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|im_start|>", "<|begin_of_text|>").replace("<|im_end|>", "<|eot_id|>")
# the special tokens' roles and the length limit, as the tokenizer_config.json of each kind says them
_QWEN_TOKENS = dict(bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=32768)
_LLAMA_TOKENS = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>",
                     model_max_length=131072)


def train_tokenizer(vocab_size: int = 384, bos: bool = False):
    """A `tokenizers.Tokenizer` trained on _CORPUS (byte-level BPE) with Qwen2's special tokens, or with `bos`
    Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA_SPECIAL_TOKENS if bos else SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int = 384, bos: bool = False):
    """train_tokenizer's tokenizer as a transformers PreTrainedTokenizerFast with its special tokens and chat
    template (imports transformers: for tests and callers that edit the tokenizer before make_checkpoint)."""
    from transformers import PreTrainedTokenizerFast

    extra = dict(_LLAMA_TOKENS, add_bos_token=True) if bos else _QWEN_TOKENS  # Llama 3: BOS in front of each text
    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size, bos), unk_token=None, **extra)
    fast.chat_template = LLAMA_CHAT_TEMPLATE if bos else CHAT_TEMPLATE
    return fast


def _write_json(path: str, data: Dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tok, output: str, bos: bool) -> None:
    """The files transformers 5 writes for build_tokenizer(bos=bos): tokenizer.json (its post-processor adding
    <|begin_of_text|> in front with `bos`, as Llama 3's does), tokenizer_config.json and chat_template.jinja."""
    from tokenizers import processors

    if bos:
        first = LLAMA_SPECIAL_TOKENS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first}:0 $A:0", pair=f"{first}:0 $A:0 {first}:1 $B:1", special_tokens=[(first, tok.token_to_id(first))])
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    os.makedirs(output, exist_ok=True)
    tok.save(os.path.join(output, "tokenizer.json"))
    config = dict(_LLAMA_TOKENS if bos else _QWEN_TOKENS, backend="tokenizers", tokenizer_class="TokenizersBackend",
                  unk_token=None)
    with open(os.path.join(output, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    with open(os.path.join(output, "chat_template.jinja"), "w", encoding="utf-8") as fh:
        fh.write(LLAMA_CHAT_TEMPLATE if bos else CHAT_TEMPLATE)


def model_config(family: str, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, max_position_embeddings: int,
                 tie_word_embeddings: bool, rope_parameters: dict, bos_token_id: int, eos_token_id,
                 head_dim: Optional[int] = None, attention_bias: bool = False,
                 mlp_bias: bool = False, moe: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """config.json for `family` with the keys and defaults transformers 5's Qwen2Config / Qwen3Config / LlamaConfig
    write (Qwen3's head_dim defaults to 128, not hidden / heads); the MoE families' keys from `moe` (MOE_DEFAULTS
    where absent; qwen3_moe has no shared expert)."""
    cfg: Dict[str, Any] = dict(
        model_type=family, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6, rope_parameters=rope_parameters,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=None, hidden_act="silu",
        initializer_range=0.02, attention_dropout=0.0, use_cache=True)
    if family == "llama":
        cfg.update(head_dim=head_dim or hidden_size // num_attention_heads, attention_bias=attention_bias,
                   mlp_bias=mlp_bias, pretraining_tp=1)
        return cfg
    cfg.update(layer_types=["full_attention"] * num_hidden_layers, max_window_layers=28, sliding_window=None,
               use_sliding_window=False)
    if family in ("qwen3", "qwen3_moe"):
        cfg.update(head_dim=head_dim or 128, attention_bias=attention_bias)
    elif head_dim:
        cfg.update(head_dim=head_dim)
    if family.endswith("_moe"):
        cfg.update({k: v for k, v in dict(MOE_DEFAULTS, **(moe or {})).items()
                    if k != "shared_expert_intermediate_size" or family == "qwen2_moe"})
        cfg.update(router_aux_loss_coef=0.001, output_router_logits=False)
        if family == "qwen2_moe":
            cfg.update(qkv_bias=True)
    return cfg


def random_weights(cfg, seed: int, dtype) -> Dict[str, np.ndarray]:
    """The HF family's tensor names and layouts ([out, in] linear weights), random values: biases where the family
    has them (qwen2: q/k/v; qwen3 and llama: attention_bias, llama: mlp_bias too), qwen3's q_norm and k_norm.
    `cfg`: the config's fields as attributes (a transformers config or model_config's dict in a namespace)."""
    rng = np.random.default_rng(seed)
    e, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or e // cfg.num_attention_heads
    h, kh = cfg.num_attention_heads, cfg.num_key_value_heads
    family = cfg.model_type
    attention_bias = getattr(cfg, "attention_bias", False)
    qkv_bias = family in ("qwen2", "qwen2_moe") or attention_bias
    o_bias = family not in ("qwen2", "qwen2_moe") and attention_bias
    mlp_bias = getattr(cfg, "mlp_bias", False)

    def dense(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(dtype)

    def vec(n: int, mean: float = 0.0, std: float = 0.1) -> np.ndarray:
        return (mean + std * rng.standard_normal(n)).astype(dtype)

    # A small embedding keeps it from dominating the residual stream: with a tied head a large one
    # makes the model predict its own last token forever, which makes for weak greedy tests.
    w = {"model.embed_tokens.weight": (0.1 * rng.standard_normal((cfg.vocab_size, e))).astype(dtype)}
    def linear(name: str, out_f: int, in_f: int, bias: bool) -> None:
        w[name + ".weight"] = dense(out_f, in_f)
        if bias:
            w[name + ".bias"] = vec(out_f)

    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        # drawn in this order so that a qwen2 checkpoint of a seed is the same as before the families
        w[p + "input_layernorm.weight"] = vec(e, 1.0)
        linear(p + "self_attn.q_proj", h * d, e, qkv_bias)
        linear(p + "self_attn.k_proj", kh * d, e, qkv_bias)
        linear(p + "self_attn.v_proj", kh * d, e, qkv_bias)
        linear(p + "self_attn.o_proj", e, h * d, o_bias)
        w[p + "post_attention_layernorm.weight"] = vec(e, 1.0)
        if _sparse(cfg, n):  # the router, each expert's SwiGLU (HF's per-expert layout), Qwen2-MoE's shared expert
            w[p + "mlp.gate.weight"] = dense(cfg.num_experts, e)
            mi = cfg.moe_intermediate_size
            for x in range(cfg.num_experts):
                linear(f"{p}mlp.experts.{x}.gate_proj", mi, e, False)
                linear(f"{p}mlp.experts.{x}.up_proj", mi, e, False)
                linear(f"{p}mlp.experts.{x}.down_proj", e, mi, False)
            si = getattr(cfg, "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0
            if si:
                linear(p + "mlp.shared_expert.gate_proj", si, e, False)
                linear(p + "mlp.shared_expert.up_proj", si, e, False)
                linear(p + "mlp.shared_expert.down_proj", e, si, False)
                w[p + "mlp.shared_expert_gate.weight"] = dense(1, e)
        else:
            linear(p + "mlp.gate_proj", i, e, mlp_bias)
            linear(p + "mlp.up_proj", i, e, mlp_bias)
            linear(p + "mlp.down_proj", e, i, mlp_bias)
        if family in ("qwen3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = vec(d, 1.0), vec(d, 1.0)
    w["model.norm.weight"] = vec(e, 1.0)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = dense(cfg.vocab_size, e)
    return w


def _sparse(cfg, layer: int) -> bool:
    """HF's rule for a mixture-of-experts layer (export/config.py ModelConfig.sparse, written here again: this module
    imports nothing of export/)."""
    experts = getattr(cfg, "num_experts", 0) if cfg.model_type.endswith("_moe") else 0
    return bool(experts) and layer not in (getattr(cfg, "mlp_only_layers", None) or []) and \
        (layer + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0


def _special_ids(tokenizer) -> tuple:
    """(bos, eos, pad) token ids of a transformers tokenizer or of train_tokenizer's (Llama 3's when it has BOS)."""
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        ids, has_bos = tokenizer.convert_tokens_to_ids, tokenizer.bos_token is not None
    else:
        ids, has_bos = tokenizer.token_to_id, tokenizer.token_to_id(LLAMA_SPECIAL_TOKENS[0]) is not None
    if has_bos:  # Llama 3: generation stops at end of text or end of turn
        eos = [ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
        return ids(LLAMA_SPECIAL_TOKENS[0]), eos, eos[0]
    token = ids("<|endoftext|>")
    return token, token, token


def save_weights(weights: Dict[str, np.ndarray], output: str, max_shard_bytes: Optional[int] = None) -> None:
    """model.safetensors, or shards of at most `max_shard_bytes` with model.safetensors.index.json."""
    from safetensors.numpy import save_file

    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(weights, os.path.join(output, "model.safetensors"), metadata=meta)
        return
    shards, current, size = [], {}, 0
    for name, arr in weights.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = arr, size + arr.nbytes
    shards.append(current)
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(output, fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = int(sum(a.nbytes for a in weights.values()))
    with open(os.path.join(output, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)


def make_checkpoint(output: str, *, hidden_size: int = 64, intermediate_size: int = 128,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                    vocab_size: int = 512, max_position_embeddings: int = 1024, tie_word_embeddings: bool = True,
                    rope_theta: float = 10000.0, seed: int = 0, dtype: str = "float32",
                    max_shard_bytes: Optional[int] = None, tokenizer=None, family: str = "qwen2",
                    head_dim: Optional[int] = None, rope_scaling: Optional[dict] = None, attention_bias: bool = False,
                    mlp_bias: bool = False, moe: Optional[Dict[str, Any]] = None) -> str:
    """Write config.json, generation_config.json, *.safetensors and the tokenizer files to `output`.

    family: qwen2 (q/k/v bias), qwen3 (q_norm/k_norm; `head_dim` may differ from hidden / heads) or llama (a BOS
    token, two eos ids). rope_scaling: as transformers 5 writes it (`rope_type` and its keys), merged into
    rope_parameters. attention_bias, mlp_bias: the HF keys of qwen3 / llama. moe: qwen3_moe's / qwen2_moe's keys
    (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers,
    shared_expert_intermediate_size), over MOE_DEFAULTS. tokenizer: a transformers tokenizer
    (saved with its save_pretrained), or None for train_tokenizer's, with Llama 3's tokens for llama.
    """
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    bos_tokens = family == "llama"
    tok = tokenizer if tokenizer is not None else train_tokenizer(bos=bos_tokens)
    size = len(tok) if tokenizer is not None else tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {size} tokens")
    bos, eos, pad = _special_ids(tok)
    config = model_config(family, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                          num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                          tie_word_embeddings=tie_word_embeddings,
                          rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
                          bos_token_id=bos, eos_token_id=eos, head_dim=head_dim, attention_bias=attention_bias,
                          mlp_bias=mlp_bias, moe=moe)
    os.makedirs(output, exist_ok=True)
    _write_json(os.path.join(output, "config.json"), config)
    _write_json(os.path.join(output, "generation_config.json"),
                dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False))
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
    else:
        save_tokenizer(tok, output, bos=bos_tokens)
    save_weights(random_weights(SimpleNamespace(**config), seed, np.dtype(dtype)), output, max_shard_bytes)
    return output
