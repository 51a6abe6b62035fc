"""The Atlas fused form of the decoder layer (`--graph fused`): Ascend's fused operators where the plain form chains
small ops, with the valid lengths as tensors so that no length ever recompiles and GE can sink the whole graph
(tiling sink, `ge.tiling_schedule_optimize=1` in the profile's ini).

- the KV cache is paged (docs/architecture.md, "The KV cache: a pool of blocks"): [NB, BS, KH, D] per layer, written
  by ReshapeAndCache (key, value [T, KH*D], slot_mapping [T] int32: block * BS + position; a negative slot is skipped)
  and read by PagedAttention (query [T, H, D], block_tables [T, M] int32, context_lens [T] int32: one query per token,
  each over its own sequence's blocks up to its own position: the decode step's rows and a chunk's piece alike).
  Both as MindSpore 2.10's ops.auto_generate defines them ("no backend implementation in MindSpore, only use to
  export MindIR and run in MindSpore Lite"); PagedAttention takes float16 or bfloat16, as the fused form computes.
- prompt attention: PromptFlashAttention, layout BNSD (q [B, H, n, D], k/v [B, KH, n, D], GQA through
  num_key_value_heads), sparse_mode 3 (rightDownCausal) with the documented 2048 x 2048 compressed causal mask,
  actual_seq_lengths = actual_seq_lengths_kv = the prompt lengths (int64 [B]): rows past a prompt are not read. A
  prompt starts at position 0, so it attends to its own fresh keys and values; they go into the blocks beside.
- norms: RmsNorm, and AddRmsNorm for the residual add before post_attention_layernorm (one op for add + norm).
- rotary embedding: RotaryPositionEmbedding mode 0 (rotate-half, as HF) on BNSD with cos/sin [B|1, 1, n, D].
Which profile gets the fused form: export/devices.py (DeviceProfile.fused) and ge_configs/README.md. The
projections, the MLP and the cache writes are the plain form's (export/network/layers.py); parameter names are the same, so
the weights file does not change with the graph form.

On the CPU the `ms` backend replaces these ops by stand-ins (lite_runtime/backends/standins.py,
cpu_kernels/atlas_ops.cc) when it loads a graph: `check` there proves the wiring, `check` on the device the kernels.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.ops.auto_generate import (AddRmsNorm, PagedAttention, PromptFlashAttention, ReshapeAndCache, RmsNorm,
                                         RotaryPositionEmbedding)

from export.config import ModelConfig
from export.network.layers import DecoderLayer, KVCache, RMSNorm, ew_add
from export.network.matmul import Form

# the side of the compressed causal mask of PromptFlashAttention's sparse_mode 2 and 3 (MindSpore 2.10 op docs)
COMPRESSED_MASK = 2048
SPARSE_RIGHT_DOWN_CAUSAL = 3


def attention_scale(head_dim: int) -> float:
    """scale_value of the fused attention: it multiplies q.k^T before the softmax, and its default is 1.0."""
    return 1.0 / float(np.sqrt(head_dim))


def compressed_causal_mask() -> Tensor:
    """[2048, 2048] bool, True (discard) strictly above the diagonal: sparse_mode 2/3's mask, a 4 MB graph constant."""
    return Tensor(np.triu(np.ones((COMPRESSED_MASK, COMPRESSED_MASK), np.bool_), 1))


class AtlasRMSNorm(RMSNorm):
    """RMSNorm through the fused RmsNorm op (same parameter); `add_norm(x, r)` is AddRmsNorm: (norm(x + r), x + r)."""

    def __init__(self, size: int, eps: float, dtype) -> None:
        super().__init__(size, eps, dtype)
        self.rms_norm = RmsNorm(eps)
        self.add_rms_norm = AddRmsNorm()

    def construct(self, x):
        return self.rms_norm(x, self.weight)[0]

    def few_rows(self, x):
        return self.construct(x)

    def add_norm(self, x, residual):
        y, _, total = self.add_rms_norm(x, residual, self.weight, self.eps)
        return y, total


class FusedDecoderLayer(DecoderLayer):
    """A decoder layer of the fused form. Same cells and parameters as DecoderLayer (no CPU kernels); the attention
    core, the cache writes, the norms and RoPE through the fused ops."""

    def __init__(self, cfg: ModelConfig, cache: KVCache, dtype, tp: bool = False, k: "Form" = Form(),
                 sparse: bool = False) -> None:
        super().__init__(cfg, cache, dtype, k._replace(decode_ops=False), tp, sparse, fused=sparse)
        a = self.self_attn
        self.input_layernorm = AtlasRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = AtlasRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.qk_norm:
            a.q_norm = AtlasRMSNorm(a.d, cfg.rms_norm_eps, dtype)
            a.k_norm = AtlasRMSNorm(a.d, cfg.rms_norm_eps, dtype)
        self.rope = RotaryPositionEmbedding()
        scale = attention_scale(a.d)
        self.prompt_attention = PromptFlashAttention(
            num_heads=a.h, scale_value=scale, pre_tokens=2147483647, next_tokens=0, input_layout="BNSD",
            num_key_value_heads=a.kh, sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL)
        self.write_cache = ReshapeAndCache()
        self.paged_attention = PagedAttention(a.h, scale, a.kh)

    def _qkv(self, x, cos, sin, b, n):
        """x [B*n, E] -> q [B, H, n, D], k, v [B, KH, n, D], RoPE applied (after Qwen3's per-head norms)."""
        a = self.self_attn
        q = a.q_proj(x).reshape(b, n, a.h, a.d)
        k = a.k_proj(x).reshape(b, n, a.kh, a.d)
        v = a.v_proj(x).reshape(b, n, a.kh, a.d)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        # x [B, N, n, D], cos/sin [B|1, 1, n, D]; mode 0: rotate-half, as HF
        return self.rope(q, cos, sin, 0), self.rope(k, cos, sin, 0), v

    def _out(self, out, b, n):  # [B, H, n, D] -> o_proj over [B*n, H*D]
        a = self.self_attn
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b * n, a.h * a.d))

    def _write(self, k, v, slots):
        """k, v [B, KH, n, D] (BNSD) -> ReshapeAndCache of their B*n tokens [B*n, KH*D] at slots [B*n]."""
        a = self.self_attn
        tokens = (-1, a.kh * a.d)
        return self.write_cache(k.transpose(0, 2, 1, 3).reshape(tokens), v.transpose(0, 2, 1, 3).reshape(tokens),
                                a.key_cache, a.value_cache, slots)

    def _paged(self, q, tables, lengths, written):
        """q [T, H, D] after `written` (the step's ReshapeAndCache), each query over its blocks -> [T, H*D]."""
        a = self.self_attn
        out = self.paged_attention(ops.depend(q, written), a.key_cache, a.value_cache, tables, lengths, None, None,
                                   None, None, None)
        return out.reshape(-1, a.h * a.d)

    def prefill(self, x, cos, sin, ctx, b, n, valid_length=None):
        """x [B*n, E]; ctx: lengths int64 [B] the prompt lengths, mask the compressed causal mask, slots [B*n]."""
        q, k, v = self._qkv(self.input_layernorm(x), cos, sin, b, n)
        written = self._write(k, v, ctx["slots"])
        out = self.prompt_attention(q, k, v, ctx["mask"], ctx["lengths"], ctx["lengths"], None, None, None, None, None,
                                    None)
        attn = self._out(ops.depend(out, written), b, n)
        normed, h = self.post_attention_layernorm.add_norm(x, attn)
        return ew_add(h, self.mlp(normed))

    def chunk(self, x, cos, sin, ctx, b, n):
        """The chunk graph: x [b + n, E], the decode step's rows (a token per sequence) then a piece of one more
        sequence, each at its own position (cos/sin [1, 1, b + n, D]). ctx, by name (CausalLM.chunk): slots [b + n],
        tables [b + n, M] (each token's sequence's blocks: the piece's repeated), lengths [b + n] (each token's
        position + 1). Every token written, then each attends over its blocks up to itself (PagedAttention)."""
        a = self.self_attn
        q, k, v = self._qkv(self.input_layernorm(x), cos, sin, 1, b + n)  # [1, H|KH, b + n, D]
        written = self._write(k, v, ctx["slots"])
        attn = a.o_proj(self._paged(q.reshape(a.h, b + n, a.d).transpose(1, 0, 2), ctx["tables"], ctx["lengths"],
                                    written))
        normed, h = self.post_attention_layernorm.add_norm(x, attn)
        return ew_add(h, self.mlp(normed))

    def decode(self, x, cos, sin, ctx, b):
        """x [B, E]; ctx: slots [B], tables [B, M], lengths int32 [B] = tokens of each sequence after this step."""
        a = self.self_attn
        q, k, v = self._qkv(self.input_layernorm(x), cos, sin, b, 1)  # q [B, H, 1, D]
        written = self._write(k, v, ctx["slots"])
        attn = a.o_proj.few_rows(self._paged(q.reshape(b, a.h, a.d), ctx["tables"], ctx["lengths"], written))
        normed, h = self.post_attention_layernorm.add_norm(x, attn)
        return ew_add(h, self.mlp(normed))


def lengths_int64(valid_length):
    """The fused attention ops' actual_seq_lengths: int64 [B] (int32 graph inputs, as every form has)."""
    return ops.cast(valid_length, ms.int64)


class FusedSteps(nn.Cell):
    """The fused form's per-call inputs of the layers: RoPE tables in BNSD, and the compressed causal mask."""

    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        super().__init__()
        self.cos, self.sin = cos, sin  # [S, D]
        self.mask = compressed_causal_mask()

    def prompt(self, n):  # cos/sin [1, 1, n, D]: every row's positions are 0..n-1
        d = self.cos.shape[-1]
        return self.cos[:n].reshape(1, 1, n, d), self.sin[:n].reshape(1, 1, n, d)

    def rows(self, pos, n):  # pos [n] -> cos/sin [1, 1, n, D]: a row per token, each at its own position
        d = self.cos.shape[-1]
        return ops.gather(self.cos, pos, 0).reshape(1, 1, n, d), ops.gather(self.sin, pos, 0).reshape(1, 1, n, d)

    def step(self, pos, b):  # pos [B] -> cos/sin [B, 1, 1, D]
        d = self.cos.shape[-1]
        return ops.gather(self.cos, pos, 0).reshape(b, 1, 1, d), ops.gather(self.sin, pos, 0).reshape(b, 1, 1, d)
