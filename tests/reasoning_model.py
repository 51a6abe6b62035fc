"""A tiny Qwen3 checkpoint that thinks on cue, with Qwen3's real tokenizer and template (tests/qwen_tokenizer.py).

Random weights never write `<think>`, so this one is built to: one layer whose MLP and attention write almost
nothing, so the next token is a function of the current one (a bigram table in the embeddings and lm_head),
except for one bit of context the attention carries: whether a `<think>` token is anywhere before (its query is
zero, so it attends to every position alike, and its value reads only `<think>`'s embedding direction). That bit
is what tells Qwen3's generation prompt (`<|im_start|>assistant\\n`: no block, so the model opens one) from an
R1-style one (`<think>\\n`: the block is open, so the model reasons at once). The answers:

    Qwen3, thinking:          "\\n" -> <think> Let me think. </think> "\\n\\n" Hello ! <|im_end|>
    R1 (opened by the prompt): "\\n" ->         Let me think. </think> "\\n\\n" Hello ! <|im_end|>
    Qwen3, enable_thinking false (the prompt ends "</think>\\n\\n"): "\\n\\n" -> Hello ! <|im_end|>

Every other token's logit is exactly 0 (its lm_head row and the hidden state share no direction), so under a
grammar the model picks the lowest allowed id, the same in transformers and in the folder. It is a real Qwen3
checkpoint: transformers runs it, and the tests hold the server to transformers' greedy tokens.
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np

THINK, END, NL, NL2, IM_END = 151667, 151668, 198, 271, 151645
LET, ME, THINK_WORD, DOT, HELLO, BANG = 10061, 752, 1744, 13, 9707, 0
# current token -> next token (the "\n" row only when no <think> came before: after one, "\n" -> Let)
CHAIN = {THINK: LET, LET: ME, ME: THINK_WORD, THINK_WORD: DOT, DOT: END, END: NL2, NL2: HELLO, HELLO: BANG,
         BANG: IM_END}
DIMS = {t: i for i, t in enumerate([NL, THINK, LET, ME, THINK_WORD, DOT, END, NL2, HELLO, BANG])}
OPENED = 10  # the hidden direction "a <think> came before"
HIDDEN, RESERVED = 64, 16  # the bigram's directions: 0-15; every other token's embedding lives in 16-63


def make(root: str) -> str:
    """The checkpoint's folder (config, weights, Qwen3's tokenizer files), under `root`."""
    import torch
    from safetensors.torch import load_file, save_file

    import qwen_tokenizer
    from export.checkpoints import random_checkpoint
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer.qwen3_tokenizer_dir(os.path.join(root, "tokenizer")))
    assert [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")] == [THINK, END]
    ckpt = random_checkpoint.make_checkpoint(os.path.join(root, "ckpt"), tokenizer=tok, family="qwen3",
                                             vocab_size=151936, hidden_size=HIDDEN, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False, seed=5)
    with open(os.path.join(ckpt, "generation_config.json")) as fh:
        generation = json.load(fh)
    generation["eos_token_id"] = [IM_END, 151643]  # as Qwen3's
    with open(os.path.join(ckpt, "generation_config.json"), "w") as fh:
        json.dump(generation, fh)
    files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    weights = {}
    for f in files:
        weights.update(load_file(f))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, :RESERVED] = 0
    head[:, :RESERVED] = 0
    for token, dim in DIMS.items():
        embed[token] = 0
        embed[token, dim] = 1
    for current, nxt in CHAIN.items():
        head[nxt, DIMS[current]] = 10
    head[THINK, DIMS[NL]], head[THINK, OPENED] = 10, -40  # "\n" opens a block when none came before ...
    head[LET, DIMS[NL]] = 8  # ... and otherwise starts the reasoning
    prefix = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.down_proj.weight"):
        weights[prefix + name].zero_()
    weights[prefix + "self_attn.v_proj.weight"][0, DIMS[THINK]] = 1  # kv head 0, its first dim: "<think> here"
    weights[prefix + "self_attn.o_proj.weight"][OPENED, 0] = 20  # query head 0 (kv head 0) -> "opened"
    for f in files:
        os.remove(f)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(ckpt, "model.safetensors"),
              metadata={"format": "pt"})
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    assert np.isfinite(embed.numpy()).all() and torch.count_nonzero(head[:, :RESERVED]) > 0
    return ckpt


def r1_template() -> str:
    """DeepSeek-R1-Distill-Qwen's chat template (tests/data, llama.cpp's copy without the `enable_thinking` switch
    llama.cpp added to it): its generation prompt is `<｜Assistant｜><think>\\n`."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepseek-r1-distill-qwen.jinja"),
              encoding="utf-8") as fh:
        return fh.read()
