"""Write a small random Hugging Face checkpoint (qwen2, qwen3 or llama) with a locally trained tokenizer (no downloads).

The weights are random, so the text it generates is gibberish: the checkpoint exists to exercise
export and runtime end to end, and to be the reference the tests compare against.

    python scripts/make_demo_checkpoint.py --output demo/qwen2-tiny
    python scripts/make_demo_checkpoint.py --output demo/llama-tiny --family llama
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Optional

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
FAMILIES = ("qwen2", "qwen3", "llama")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = 384, bos: bool = False):
    """A transformers fast tokenizer trained here on _CORPUS (byte-level BPE): Qwen2's special tokens, or with
    `bos` Llama 3's (its template adds <|begin_of_text|> in front, as Llama 3's tokenizer.json does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA_SPECIAL_TOKENS if bos else SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if bos:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                       pad_token="<|end_of_text|>", unk_token=None, add_bos_token=True,
                                       model_max_length=131072)
        fast.chat_template = CHAT_TEMPLATE.replace("<|im_start|>", "<|begin_of_text|>").replace("<|im_end|>", "<|eot_id|>")
        return fast
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None, model_max_length=32768)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_weights(cfg, seed: int, dtype) -> Dict[str, np.ndarray]:
    """The HF family's tensor names and layouts ([out, in] linear weights), random values: biases where the family
    has them (qwen2: q/k/v; qwen3 and llama: attention_bias, llama: mlp_bias too), qwen3's q_norm and k_norm."""
    rng = np.random.default_rng(seed)
    e, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or e // cfg.num_attention_heads
    h, kh = cfg.num_attention_heads, cfg.num_key_value_heads
    family = cfg.model_type
    attention_bias = getattr(cfg, "attention_bias", False)
    qkv_bias = family == "qwen2" or attention_bias
    o_bias = family != "qwen2" and attention_bias
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
        linear(p + "mlp.gate_proj", i, e, mlp_bias)
        linear(p + "mlp.up_proj", i, e, mlp_bias)
        linear(p + "mlp.down_proj", e, i, mlp_bias)
        if family == "qwen3":
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = vec(d, 1.0), vec(d, 1.0)
    w["model.norm.weight"] = vec(e, 1.0)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = dense(cfg.vocab_size, e)
    return w


def make_checkpoint(output: str, *, hidden_size: int = 64, intermediate_size: int = 128,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                    vocab_size: int = 512, max_position_embeddings: int = 1024, tie_word_embeddings: bool = True,
                    rope_theta: float = 10000.0, seed: int = 0, dtype: str = "float32",
                    max_shard_bytes: Optional[int] = None, tokenizer=None, family: str = "qwen2",
                    head_dim: Optional[int] = None, rope_scaling: Optional[dict] = None, attention_bias: bool = False,
                    mlp_bias: bool = False) -> str:
    """Write config.json, generation_config.json, *.safetensors and the tokenizer files to `output`.

    family: qwen2 (q/k/v bias), qwen3 (q_norm/k_norm; `head_dim` may differ from hidden / heads) or llama (a BOS
    token, two eos ids). rope_scaling: as transformers 5 writes it (`rope_type` and its keys), merged into
    rope_parameters. attention_bias, mlp_bias: the HF keys of qwen3 / llama.
    """
    from safetensors.numpy import save_file
    from transformers import AutoConfig, GenerationConfig

    if family not in FAMILIES:
        raise SystemExit(f"--family {family!r} is not one of {', '.join(FAMILIES)}")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(bos=family == "llama")
    if vocab_size < len(tokenizer):
        raise SystemExit(f"--vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    if tokenizer.bos_token is not None:  # Llama 3: generation stops at end of text or end of turn
        bos = tokenizer.bos_token_id
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
        pad = eos[0]
    else:
        bos = pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        eos = pad
    extra = {"head_dim": head_dim} if head_dim else {}
    if family != "qwen2":
        extra.update(attention_bias=attention_bias)
    if family == "llama":
        extra.update(mlp_bias=mlp_bias)
    else:
        extra.update(use_sliding_window=False)
    cfg = AutoConfig.for_model(family, vocab_size=vocab_size, hidden_size=hidden_size,
                               intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
                               num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                               max_position_embeddings=max_position_embeddings,
                               tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
                               bos_token_id=bos, eos_token_id=eos, **extra)
    os.makedirs(output, exist_ok=True)
    cfg.save_pretrained(output)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(output)
    tokenizer.save_pretrained(output)
    weights = random_weights(cfg, seed, np.dtype(dtype))
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(weights, os.path.join(output, "model.safetensors"), metadata=meta)
        return output
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
    return output


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="folder to write the checkpoint into")
    p.add_argument("--family", choices=FAMILIES, default="qwen2", help="the HF model_type to write (default: qwen2)")
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--intermediate_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--max_position_embeddings", type=int, default=1024)
    p.add_argument("--untied", action="store_true", help="write a separate lm_head (default: tied to the embedding)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_shard_bytes", type=int, default=None, help="shard the weights (writes an index file)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = make_checkpoint(args.output, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                          num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                          num_key_value_heads=args.num_key_value_heads, vocab_size=args.vocab_size,
                          max_position_embeddings=args.max_position_embeddings,
                          tie_word_embeddings=not args.untied, dtype=args.dtype, seed=args.seed,
                          max_shard_bytes=args.max_shard_bytes, family=args.family)
    print(f"wrote a random {args.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
