"""The building blocks of the shared decoder (export/network/model.py) as MindSpore cells: linear layers, RMSNorm, the MLP,
attention with its KV cache, the decoder layer and the embedding, each running plain MindSpore ops or, in
`--device cpu` folders, our CPU kernels (cpu_kernels). The Atlas fused form of the attention and norms is in
export/network/atlas_layers.py. Module and parameter names equal the Hugging Face checkpoint names, so the weight map is
the identity.

Only plain ops with CPU kernels in MindSpore 2.10 (fp32/fp16) are used here, so the same graph runs on the CPU and
under GE on Ascend: mean/rsqrt RMSNorm, rotate-half RoPE, BatchMatMul attention with grouped-query attention done
by reshaping q.

BROADCASTS. Elementwise ops never broadcast implicitly here; operands are brought to the output's
shape with ops.broadcast_to first. MindSpore 2.10's CPU Add/Sub/Mul/Div kernel, whenever it
really broadcasts (different shapes, neither a scalar), builds two index arrays of the output's
size (16 bytes per element) outside its memory pool and keeps them as long as the graph lives,
one set per op. For the attention mask at 1024 tokens that was 235 MB per layer; the 0.5B shape's
prefill grew by ~0.35 GiB per layer. With equal shapes the kernel takes its fast path; results
are bit-identical (docs/performance-log.md, "The prefill's memory: implicit broadcasts", 2026-11-21).

Shapes: B batch (sequences a step serves), L tokens in this call, S the longest sequence (= exported seq_length),
NB blocks of BS positions in the paged KV cache, M = ceil(S / BS) blocks per sequence, T = M * BS,
H query heads, KH key/value heads, G = H // KH, D head_dim, E hidden_size, V vocab.
"""
from __future__ import annotations

from typing import Any  # noqa: F401

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from export.config import ModelConfig
from export.network.matmul import (KERNEL_PREFILL_MAX_ROWS, Form, MatmulMethod, PlainMatmul, QuantMatmul,  # noqa: F401
                           ew_add, is_quantized, kernel_matmul, lazy_parameter as _weight)

MS_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}

# FLOAT16. MindSpore 2.10's CPU Add/Sub/Mul/Div (and SiLU) take their fast path only for float32; for
# any other dtype they always build the broadcast index arrays of BROADCASTS (16 bytes per output
# element, kept while the graph lives), even for equal shapes or a scalar operand. The float16
# prefill grew by ~0.27 GiB per layer per 1024 tokens per row: a 0.5B-shaped Atlas folder at
# seq_length 1024, batch 2, reached 20 GB on the CPU. For float16 tensors the elementwise ops here
# are AddN (bit-identical to Add) and MulNoNan (bit-identical to Mul except that x * 0 is +0, never
# -0 or NaN); SiLU is x * sigmoid(x). All three are CANN AI Core ops, so the graph stays plain on
# Ascend (not yet run there; `check` on the device proves the numerics). float32 (fast path) and
# bfloat16 (Ascend only; MulNoNan has no CPU bfloat16 kernel) keep Add/Mul/SiLU. Measured in
# docs/performance-log.md, "Float16 graphs on the CPU: MindSpore's elementwise kernels", 2026-11-22.
_mul_no_nan = ops.MulNoNan()


def ew_mul(a, b):
    return _mul_no_nan(a, b) if a.dtype == ms.float16 else a * b


def ew_silu(x):
    return _mul_no_nan(x, ops.sigmoid(x)) if x.dtype == ms.float16 else ops.silu(x)


def kernel_op(function: str, out_shape, out_dtype):
    """One of cpu_kernels' fused decode-step ops as an aot Custom op (float32 activations)."""
    import cpu_kernels

    return ops.Custom(cpu_kernels.local_func(function), out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


def kernel_embed():
    """Our CPU embedding kernel as an aot Custom op: ids [N] int32, table [V, E] (float32/16, bfloat16) ->
    [N, E] float32. MindSpore 2.10's CPU Gather has no bfloat16 kernel."""
    import cpu_kernels

    return ops.Custom(cpu_kernels.local_func(cpu_kernels.EMBED), out_shape=lambda ids, table: (ids[0], table[1]),
                      out_dtype=lambda ids, table: ms.float32, func_type="aot")


def kernel_embed_quant(packed: bool):
    """Our CPU kernel for a quantized table's lookup as an aot Custom op: ids [N] int32, q [V, E] int8 (or [V, E / 2]
    uint8, two int4 a byte: `packed`), scale [G, V] float32 (, offset [G, V]) -> [N, E] float32, the plain ops'
    (q + offset) * scale in one call (a step's lookup ran as eight or more small MindSpore kernels)."""
    import cpu_kernels

    return ops.Custom(cpu_kernels.local_func(cpu_kernels.EMBED_QUANT),
                      out_shape=lambda ids, q, *scales: (ids[0], q[1] * (2 if packed else 1)),
                      out_dtype=lambda ids, *rest: ms.float32, func_type="aot")


class Linear(nn.Cell):
    """y = x @ W^T (+ b), W [out, in] as HF stores it, stored and multiplied by the layer's `method` (export/network/matmul.py:
    plain MatMul, our CPU kernel, or a quantized matmul), chosen once for the network. `few_rows` is the decode
    step's call (a method may run another op for a few rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype,
                 method: "MatmulMethod" = None, row_parallel: bool = False) -> None:
        super().__init__()
        self.method = method if method is not None else PlainMatmul()
        self.weight, self.weight_scale, self.weight_offset = self.method.storage(out_features, in_features, dtype)
        self.bias = _weight((out_features,), dtype, "bias") if bias else None
        # tensor parallel, row-parallel (o_proj, down_proj): this rank's columns of W give a partial product; the
        # ranks' partial products are summed by AllReduce and the (replicated) bias is added once, after it
        self.reduce = ops.AllReduce() if row_parallel else None
        self.kernel_bias = bias and not row_parallel  # the method adds the bias

    def weights(self) -> tuple:
        """W as the CPU kernels' fused decode ops take it: (weight,), or (q, scale[, offset]) when quantized
        (cpu_kernels/decode_ops.cc tells them apart by dtype and by the number of tensors)."""
        if self.weight_scale is None:
            return (self.weight,)
        return (self.weight, self.weight_scale) if self.weight_offset is None else (
            self.weight, self.weight_scale, self.weight_offset)

    def arity(self) -> int:
        """How many tensors `weights()` gives (the fused ops' out_shape functions need the positions)."""
        return len(self.weights())

    def _add_bias(self, y):
        # explicit broadcasts everywhere: see BROADCASTS in the module docstring. The depend keeps
        # MindSpore from running every layer's broadcast at graph start.
        return ew_add(y, ops.broadcast_to(ops.depend(self.bias, y), y.shape))

    def _reduced(self, y):
        if self.reduce is None:
            return y
        y = self.reduce(y)
        return y if self.bias is None else self._add_bias(y)

    def construct(self, x, valid_length=None):  # [N, in] -> [N, out]; valid_length [B]: the full graph's prompts
        bias = self.bias if self.kernel_bias else None
        return self._reduced(self.method(x, self.weight, self.weight_scale, self.weight_offset, bias, valid_length))

    def few_rows(self, x):  # [B, in] -> [B, out], B the batch size
        bias = self.bias if self.kernel_bias else None
        return self._reduced(self.method(x, self.weight, self.weight_scale, self.weight_offset, bias, None, True))


class RMSNorm(nn.Cell):
    def __init__(self, size: int, eps: float, dtype, fused: bool = False) -> None:
        super().__init__()
        self.weight = _weight((size,), dtype, "weight")
        self.eps = eps
        if fused:  # the decode step: one kernel instead of eight
            import cpu_kernels

            self.kernel = kernel_op(cpu_kernels.RMS_NORM, lambda x, *_: x, lambda x, *_: x)
            self.eps_tensor = Tensor(np.array([eps], np.float32))
        else:
            self.kernel = None

    def few_rows(self, x):  # [B, E], the decode step
        return self.construct(x) if self.kernel is None else self.kernel(x, self.weight, self.eps_tensor)

    def construct(self, x):
        dtype = x.dtype
        x32 = ops.cast(x, ms.float32)
        var = ops.mean(ops.square(x32), -1, keep_dims=True)
        x32 = x32 * ops.broadcast_to(ops.rsqrt(var + self.eps), x32.shape)
        return ew_mul(ops.cast(x32, dtype), ops.broadcast_to(ops.depend(self.weight, x32), x32.shape))


class MLP(nn.Cell):
    def __init__(self, cfg: ModelConfig, dtype, k: "Form", tp: bool = False) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, dtype, k.linear(bias))
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, dtype, k.linear(bias))
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias, dtype, k.linear(bias and not tp),
                                row_parallel=tp)
        if k.decode_ops and not bias:  # the decode step: gate, up, SiLU and the product in one kernel
            import cpu_kernels

            self.swiglu = kernel_op(cpu_kernels.SWIGLU, lambda x, wg, *_: (x[0], wg[0]), lambda x, *_: x)
        else:
            self.swiglu = None

    def construct(self, x, valid_length=None):  # [N, E]
        v = valid_length
        return self.down_proj(ew_mul(ew_silu(self.gate_proj(x, v)), self.up_proj(x, v)), v)

    def few_rows(self, x):  # [B, E], the decode step
        return self.down_proj.few_rows(ew_mul(ew_silu(self.gate_proj.few_rows(x)), self.up_proj.few_rows(x)))


def rotate_half(x):  # [..., D]
    x1, x2 = ops.split(x, x.shape[-1] // 2, axis=-1)
    return ops.cat((-x2, x1), axis=-1)


class KVCache:
    """The paged KV cache's shape (docs/architecture.md, "The KV cache: a pool of blocks"): `blocks` blocks of
    `block_size` positions per layer, a sequence's positions in the blocks its block table lists (M = max_blocks per
    sequence). `kernel_layout`: [NB, KH, BS, D], a kv head's positions of a block contiguous, as the CPU kernels read
    them (cpu_kernels/paged.h); else [NB, BS, KH, D], ReshapeAndCache's and PagedAttention's (Atlas), which the plain
    form's gathers and scatters read too. `blocks` is nominal: the runtime sets the pool's size when it loads the
    folder (the graphs index the caches only through block tables and slots). `dtype`: the caches' MindSpore dtype
    where it is not the compute dtype (bfloat16 under the CPU kernels, cpu_kernels/paged.h: k and v rounded to nearest
    even as they are written, widened exactly as they are read; export/config.py kv_cache_dtype); None: the compute
    dtype."""

    def __init__(self, blocks: int, block_size: int, max_blocks: int, kernel_layout: bool, dtype=None) -> None:
        self.blocks, self.block_size, self.max_blocks, self.kernel_layout = blocks, block_size, max_blocks, kernel_layout
        self.dtype = dtype
        if dtype is not None and not kernel_layout:
            raise ValueError("a KV cache dtype of its own needs the CPU kernels (their layout and ops)")

    @property
    def kv16(self) -> bool:
        """bfloat16 caches: the graph calls the cache's ops by cpu_kernels.KV16_OPS' names."""
        return self.dtype is not None and self.dtype == ms.bfloat16

    def shape(self, kv_heads: int, head_dim: int):
        if self.kernel_layout:
            return (self.blocks, kv_heads, self.block_size, head_dim)
        return (self.blocks, self.block_size, kv_heads, head_dim)


class Attention(nn.Cell):
    """Self-attention that owns its layer's paged KV cache Parameters (KVCache: [NB, BS, KH, D], or [NB, KH, BS, D]
    for the CPU kernels); with cfg.qk_norm, q_norm and k_norm (RMSNorm over each head's D, as Qwen3) before RoPE.

    Every write goes through slots (slot = block * BS + position in the block; a negative slot is not written: a
    graph row without a sequence, a piece's padding) and every read through block tables: the plain form gathers a
    sequence's blocks and masks past its length, the CPU kernels read the blocks in place."""

    def __init__(self, cfg: ModelConfig, cache: KVCache, dtype, k: "Form", tp: bool = False) -> None:
        super().__init__()
        self.h, self.kh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.g = self.h // self.kh
        self.scale = 1.0 / float(np.sqrt(self.d))
        self.block_size = cache.block_size
        bias = cfg.qkv_bias
        self.q_proj = Linear(cfg.hidden_size, self.h * self.d, bias, dtype, k.linear(bias))
        self.k_proj = Linear(cfg.hidden_size, self.kh * self.d, bias, dtype, k.linear(bias))
        self.v_proj = Linear(cfg.hidden_size, self.kh * self.d, bias, dtype, k.linear(bias))
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, cfg.o_proj_bias, dtype,
                             k.linear(cfg.o_proj_bias and not tp), row_parallel=tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        if k.decode_ops:  # q/k/v with RoPE in one kernel, the cache writes and the attention over the blocks in others
            import cpu_kernels

            f32 = ms.float32
            per = self.q_proj.arity()  # tensors per weight: x, Wq.., bq, Wk.., bk, Wv.., bv, ...
            quant = is_quantized(self.q_proj.method)  # the fused ops by their quantized names (cpu_kernels)
            # (the chunk graph's: its rows that hold a token first, so its piece's padding is not computed)
            kv16 = cache.kv16  # the cache's ops by their bfloat16 caches' names
            self.qkv_rope = kernel_op(cpu_kernels.fused_op(cpu_kernels.QKV_ROPE_VALID, quant), lambda valid, *s: (
                [s[0][0], s[1][0]], [s[0][0], s[2 + per][0]], [s[0][0], s[3 + 2 * per][0]]),
                lambda *_: (f32, f32, f32))
            # without a qkv bias the kernel adds zeros (graph constants, not parameters: the names stay HF's)
            self.zero_bias = None if bias else (Tensor(np.zeros(self.h * self.d, np.float32)),
                                                Tensor(np.zeros(self.kh * self.d, np.float32)))
            self.norm_eps = Tensor(np.array([cfg.rms_norm_eps], np.float32)) if cfg.qk_norm else None
            # queries over the paged cache: each its own length and block table (the decode step, a prompt, a piece)
            self.attention = kernel_op(cpu_kernels.fused_op(cpu_kernels.DECODE_ATTENTION, False, kv16),
                                       lambda q, *_: q, lambda q, *_: q)
            # the input norm, q/k/v, RoPE and the cache writes in one op, which writes the cache Parameters it is
            # given in place (marked so: MindSpore orders it before the attention's reads)
            self.decode_qkv = kernel_op(cpu_kernels.fused_op(cpu_kernels.DECODE_QKV, quant, kv16),
                                        lambda x, ln, eps, wq, *_: [x[0], wq[0]], lambda x, *_: x)
            self.decode_qkv.add_prim_attr("side_effect_mem", True)
            self.write_cache = kernel_op(cpu_kernels.fused_op(cpu_kernels.WRITE_CACHE, False, kv16), lambda *_: [1],
                                         lambda *_: f32)
            self.write_cache.add_prim_attr("side_effect_mem", True)
        else:
            self.qkv_rope = self.attention = self.decode_qkv = self.write_cache = None
        cache_shape = cache.shape(self.kh, self.d)
        cache_dtype = cache.dtype or dtype
        self.key_cache = _weight(cache_shape, cache_dtype, "key_cache")  # not in the weights file: the runtime's pool
        self.value_cache = _weight(cache_shape, cache_dtype, "value_cache")
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm_pv = ops.BatchMatMul()

    def _project(self, x, cos, sin, b, n, valid_length=None):
        """x [B*n, E] -> q [B, KH, G*n, D], k, v [B, KH, n, D] with RoPE applied."""
        if n == 1:  # the decode step
            q, k, v = self.q_proj.few_rows(x), self.k_proj.few_rows(x), self.v_proj.few_rows(x)
        else:
            q, k, v = self.q_proj(x, valid_length), self.k_proj(x, valid_length), self.v_proj(x, valid_length)
        q = q.reshape(b, n, self.h, self.d)
        k = k.reshape(b, n, self.kh, self.d)
        v = v.reshape(b, n, self.kh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.reshape(b, n, 1, self.d), sin.reshape(b, n, 1, self.d)
        q = ew_add(ew_mul(q, ops.broadcast_to(cos, q.shape)), ew_mul(rotate_half(q), ops.broadcast_to(sin, q.shape)))
        k = ew_add(ew_mul(k, ops.broadcast_to(cos, k.shape)), ew_mul(rotate_half(k), ops.broadcast_to(sin, k.shape)))
        # query head h uses key head h // G (HF repeat_kv), so [B, n, KH, G, D] -> [B, KH, G*n, D]
        q = q.reshape(b, n, self.kh, self.g, self.d).transpose(0, 2, 3, 1, 4).reshape(b, self.kh, self.g * n, self.d)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def _attend(self, q, k, v, mask, b, n):
        """q [B, KH, G*n, D], k/v [B, KH, T, D], mask [B, 1, n, T] additive -> [B*n, H*D]."""
        scores = self.bmm_qk(q, k).reshape(b, self.kh, self.g, n, -1)
        # the biggest of the explicit broadcasts (module docstring): 235 MB per layer at 1024 tokens without it
        mask = ops.broadcast_to(mask.reshape(b, 1, 1, n, -1), scores.shape)
        scores = ops.cast(scores, ms.float32) * self.scale + mask
        probs = ops.cast(ops.softmax(scores, -1), v.dtype).reshape(b, self.kh, self.g * n, -1)
        out = self.bmm_pv(probs, v).reshape(b, self.kh, self.g, n, self.d)
        return out.transpose(0, 3, 1, 2, 4).reshape(b * n, self.h * self.d)

    def write(self, k, v, slots):
        """The plain form's cache writes: k, v [N, KH, D] at slots [N] ([NB, BS, KH, D] caches, ScatterNdUpdate on
        (block, position)). A negative slot writes block 0 (the null block, which no sequence is given: its
        contents are never read as a sequence's). Returns the caches as read after the writes."""
        bs = self.block_size
        safe = ops.maximum(slots, ops.zeros_like(slots))  # negative -> slot 0 of the null block
        index = ops.stack((ops.floor_div(safe, bs), safe - ops.floor_div(safe, bs) * bs), -1)  # [N, 2]
        k_done = ops.scatter_nd_update(self.key_cache, index, k)
        v_done = ops.scatter_nd_update(self.value_cache, index, v)
        return ops.depend(self.key_cache, k_done), ops.depend(self.value_cache, v_done)

    def gather(self, cache, tables):
        """The plain form's reads: a [NB, BS, KH, D] cache's blocks of each sequence, tables [R, M] ->
        [R, KH, M*BS, D] (a copy of each context: only the CPU kernels read the blocks in place)."""
        r, m = tables.shape
        blocks = ops.gather(cache, tables, 0)  # [R, M, BS, KH, D]
        return blocks.reshape(r, m * self.block_size, self.kh, self.d).transpose(0, 2, 1, 3)

    def prefill(self, x, cos, sin, mask, b, n, valid_length, slots):
        """The prompt attends to itself (it starts at position 0): k and v written at slots [B*n], read fresh."""
        q, k, v = self._project(x, cos, sin, b, n, valid_length)
        rows = (b * n, self.kh, self.d)
        k_done, v_done = self.write(k.transpose(0, 2, 1, 3).reshape(rows), v.transpose(0, 2, 1, 3).reshape(rows),
                                    slots)
        out = self._attend(q, k, v, mask, b, n)
        return self.o_proj(ops.depend(ops.depend(out, k_done), v_done), valid_length)

    def _rows_qkv(self, x, cos, sin, valid):
        """x [N, E], a row per token at its own position (cos, sin [N, D]) -> q [N, H, D], k, v [N, KH, D], RoPE applied
        (after Qwen3's per-head norms); valid [1] int32: the first rows that hold a token (the kernels compute those)."""
        n = x.shape[0]
        if self.qkv_rope is not None:
            q, k, v = self._kernel_qkv(x, cos, sin, valid)
            return q.reshape(n, self.h, self.d), k.reshape(n, self.kh, self.d), v.reshape(n, self.kh, self.d)
        q = self.q_proj(x).reshape(n, self.h, self.d)
        k = self.k_proj(x).reshape(n, self.kh, self.d)
        v = self.v_proj(x).reshape(n, self.kh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.reshape(n, 1, self.d), sin.reshape(n, 1, self.d)
        q = ew_add(ew_mul(q, ops.broadcast_to(cos, q.shape)), ew_mul(rotate_half(q), ops.broadcast_to(sin, q.shape)))
        k = ew_add(ew_mul(k, ops.broadcast_to(cos, k.shape)), ew_mul(rotate_half(k), ops.broadcast_to(sin, k.shape)))
        return q, k, v

    def chunk(self, x, cos, sin, ctx, b, n):
        """The chunk graph's attention: rows 0..b-1 of x [b + n, E] are the decode step's (a token per sequence),
        rows b.. a piece of one sequence. ctx, by name (CausalLM.chunk): slots [b + n] (every token's write), with
        cpu_kernels query_lengths [b + n], query_rows [b + n] and tables [b + 1, M] (each query's length and block
        table), else block_tables [B, M], piece_table [1, M], step_mask [B, T] and piece_mask [1, n, T]. Returns
        [b + n, H*D]."""
        q, k, v = self._rows_qkv(x, cos, sin, ctx["valid"] if self.qkv_rope is not None else None)
        if self.write_cache is not None:  # cpu_kernels: written in place, then every query over its blocks
            flat = (b + n, self.kh * self.d)
            done = self.write_cache(k.reshape(flat), v.reshape(flat), self.key_cache, self.value_cache, ctx["slots"])
            return self.attention(ops.depend(q.reshape(b + n, self.h * self.d), done), self.key_cache,
                                  self.value_cache, ctx["query_lengths"], ctx["query_rows"], ctx["tables"])
        keys, values = self.write(k, v, ctx["slots"])
        out = self._attend(q[:b].reshape(b, self.kh, self.g, self.d), self.gather(keys, ctx["block_tables"]),
                           self.gather(values, ctx["block_tables"]), ctx["step_mask"], b, 1)
        # query head h uses key head h // G: [n, KH, G, D] -> [1, KH, G*n, D]
        qc = q[b:].reshape(n, self.kh, self.g, self.d).transpose(1, 2, 0, 3).reshape(1, self.kh, self.g * n, self.d)
        piece = self._attend(qc, self.gather(keys, ctx["piece_table"]), self.gather(values, ctx["piece_table"]),
                             ctx["piece_mask"], 1, n)
        return ops.cat((out, piece), 0)

    def decode(self, x, cos, sin, mask, b, slots, tables):
        """One token per sequence, written at slots [B]; each reads its blocks (tables [B, M]) under `mask`."""
        q, k, v = self._project(x, cos, sin, b, 1)
        keys, values = self.write(k.reshape(b, self.kh, self.d), v.reshape(b, self.kh, self.d), slots)
        return self.o_proj.few_rows(self._attend(q, self.gather(keys, tables), self.gather(values, tables), mask, b, 1))

    def _biases(self):
        p = (self.q_proj, self.k_proj, self.v_proj)
        return (p[0].bias, p[1].bias, p[2].bias) if self.zero_bias is None else (
            self.zero_bias[0], self.zero_bias[1], self.zero_bias[1])

    def _qkv_weights(self) -> tuple:
        """Wq.., bq, Wk.., bk, Wv.., bv as the fused ops take them (Linear.weights: one tensor, or a quantized
        weight's two or three)."""
        bq, bk, bv = self._biases()
        return (self.q_proj.weights() + (bq,) + self.k_proj.weights() + (bk,) + self.v_proj.weights() + (bv,))

    def decode_step(self, x, norm, cos, sin, slots, lengths, rows, tables):
        """A layer's first half through cpu_kernels, up to o_proj: `norm` (the layer's input RMSNorm), q/k/v, RoPE and
        the cache writes at slots [N] in one op (MsliteLlmPagedDecodeQkv, in place), then the attention: query i over
        the first lengths[i] positions of the blocks tables[rows[i]] (the decode step: a token per sequence; the
        CPU prefill graph: every prompt token, causal by its position + 1)."""
        q = self.decode_qkv(*self.decode_qkv_args(x, norm, cos, sin, slots))
        return self.attention(q, self.key_cache, self.value_cache, lengths, rows, tables)

    def decode_qkv_args(self, x, norm, cos, sin, slots) -> tuple:
        """MsliteLlmPagedDecodeQkv's tensors, in its order (the decode step's layer kernel takes them too)."""
        args = (x, norm.weight, norm.eps_tensor) + self._qkv_weights() + (
            cos, sin, self.key_cache, self.value_cache, slots)
        return args if self.q_norm is None else args + (self.q_norm.weight, self.k_norm.weight)

    def _kernel_qkv(self, x, cos, sin, valid):
        """q, k, v [N, H*D], [N, KH*D] through cpu_kernels' one op (projections, bias, Qwen3's norms, RoPE) for the
        first `valid` rows (the rest zero)."""
        args = (valid, x) + self._qkv_weights() + (cos, sin)
        if self.q_norm is None:
            return self.qkv_rope(*args)
        return self.qkv_rope(*(args + (self.q_norm.weight, self.k_norm.weight, self.norm_eps)))


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, cache: KVCache, dtype, k: "Form", tp: bool = False,
                 sparse: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, k.decode_ops)
        self.self_attn = Attention(cfg, cache, dtype, k, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, k.decode_ops)
        self.sparse = sparse
        if sparse:  # a mixture of experts (export/network/moe.py): its own cell, none of the fused MLP kernels
            from export.network.moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(cfg, dtype, k, tp, fused)  # fused: Ascend's MoE ops (FusedDecoderLayer)
        else:
            self.mlp = MLP(cfg, dtype, k, tp)
        if k.decode_ops:  # the decode step: o_proj (and down_proj) each with the residual add, one kernel
            import cpu_kernels

            quant = is_quantized(self.self_attn.o_proj.method)  # one method for every linear layer of the network
            self.project_add = kernel_op(cpu_kernels.fused_op(cpu_kernels.GEMV_ADD, quant), lambda *s: s[-1],
                                         lambda x, *_: x)  # x, W.., r
        if k.decode_ops and sparse:  # a mixture of experts: no fused MLP kernel; the decode step's layer in one
            # kernel (cpu_kernels.DECODE_MOE_LAYER: q/k/v, the attention, o_proj + x, the MoE op's residual form)
            # where o_proj has no bias or AllReduce and the MLP no shared expert
            self.norm_swiglu = self.tail = self.layer_valid_op = None
            o = self.self_attn.o_proj
            plain = o.bias is None and o.reduce is None and self.mlp.shared_expert is None
            self.layer_op = kernel_op(cpu_kernels.fused_op(cpu_kernels.DECODE_MOE_LAYER, False, cache.kv16),
                                      lambda layout, x, *_: x,
                                      lambda layout, x, *_: x) if plain else None
            if self.layer_op is not None:
                self.layer_op.add_prim_attr("side_effect_mem", True)
                qkv = self.self_attn.decode_qkv_args(None, self.input_layernorm, None, None, None)
                kc = next(i for i, t in enumerate(qkv) if t is self.self_attn.key_cache)
                moe = self.mlp.residual_args(self.post_attention_layernorm)
                self.layer_layout = Tensor(np.array([len(qkv), o.arity(), kc, len(moe)], np.int32))
        elif k.decode_ops:
            # post_attention_layernorm, gate, up, SiLU and the product in one kernel (no MLP bias)
            self.norm_swiglu = None if self.mlp.swiglu is None else kernel_op(
                cpu_kernels.fused_op(cpu_kernels.NORM_SWIGLU, quant), lambda h, w, e, wg, *_: (h[0], wg[0]),
                lambda h, *_: h)
            # and all of it in one kernel where neither o_proj nor the MLP has a bias or an AllReduce
            o, mlp = self.self_attn.o_proj, self.mlp
            plain = all(lin.bias is None and lin.reduce is None for lin in (o, mlp.down_proj))
            wo = o.arity()  # tensors of Wo: attn, Wo.., x, ...
            self.tail = kernel_op(cpu_kernels.fused_op(cpu_kernels.DECODE_TAIL, quant), lambda *s: s[1 + wo],
                                  lambda attn, *_: attn) if (
                plain and self.norm_swiglu is not None) else None
            # the decode step's whole layer in one kernel where the tail is one (MindSpore's runtime spends ~25 us
            # between two kernels: docs/performance-log.md 35); it writes the caches in place, as decode_qkv does
            self.layer_op = None if self.tail is None else kernel_op(
                cpu_kernels.fused_op(cpu_kernels.DECODE_LAYER, quant, cache.kv16), lambda layout, x, *_: x,
                lambda layout, x, *_: x)
            # and the chunk graph's layer in one call too, computing its rows that hold a token (its step rows and
            # its piece's valid tokens: the piece's padding is not computed); ~40 us of MindSpore's runtime between
            # two of our kernels, 3 gaps a layer fewer (docs/performance-log.md 51)
            self.layer_valid_op = None if self.tail is None else kernel_op(
                cpu_kernels.fused_op(cpu_kernels.DECODE_LAYER_VALID, quant, cache.kv16), lambda valid, layout, x, *_: x,
                lambda valid, layout, x, *_: x)
            if self.layer_op is not None:
                self.layer_op.add_prim_attr("side_effect_mem", True)
                self.layer_valid_op.add_prim_attr("side_effect_mem", True)
                # its layout, counted on the very tuples _kernel_layer passes (placeholders for the activations)
                qkv = self.self_attn.decode_qkv_args(None, self.input_layernorm, None, None, None)
                kc = next(i for i, t in enumerate(qkv) if t is self.self_attn.key_cache)
                tail = self._tail_args(None, self.post_attention_layernorm)
                self.layer_layout = Tensor(np.array([len(qkv), len(tail), kc], np.int32))
        else:
            self.project_add = self.norm_swiglu = self.tail = self.layer_op = self.layer_valid_op = None

    def prefill(self, x, cos, sin, ctx, b, n, valid_length):  # x [B*n, E]
        """ctx, by name (CausalLM.prefill): slots [B*n] (each token's write), with cpu_kernels lengths, rows [B*n] and
        tables [B, M] (each token's position + 1, its sequence and their block tables), else mask [B, n, n]."""
        if self.project_add is not None:
            attn = self.self_attn.decode_step(x, self.input_layernorm, cos, sin, ctx["slots"], ctx["lengths"],
                                              ctx["rows"], ctx["tables"])
            # the rest as the full graph's (MatMul in float32 folders: MsliteLlmDecodeTail's tiles are 1.5x slower at
            # 128 rows; GEMM_VALID, skipping the padding rows, in 16-bit ones)
            h = ew_add(x, self.self_attn.o_proj(attn, valid_length))
            if self.sparse:  # the MoE op takes the norm and the residual, and each prompt's rows only
                return self.mlp.residual(h, self.post_attention_layernorm, valid_length)
            return ew_add(h, self.mlp(self.post_attention_layernorm.few_rows(h), valid_length))
        h = ew_add(x, self.self_attn.prefill(self.input_layernorm(x), cos, sin, ctx["mask"], b, n, valid_length,
                                             ctx["slots"]))
        return ew_add(h, self.mlp(self.post_attention_layernorm(h), valid_length))

    def chunk(self, x, cos, sin, ctx, b, n):  # x [b + n, E]: the decode step's rows, then a piece of one row
        if self.layer_valid_op is not None:  # cpu_kernels: the layer in one call, as the decode step's
            return self._kernel_layer(x, cos, sin, ctx["slots"], ctx["query_lengths"], ctx["query_rows"],
                                      ctx["tables"], ctx["valid"])
        if self.project_add is not None:  # cpu_kernels, as the decode step
            return self._kernel_tail(x, self.self_attn.chunk(self.input_layernorm.few_rows(x), cos, sin, ctx, b, n))
        h = ew_add(x, self.self_attn.o_proj(self.self_attn.chunk(self.input_layernorm(x), cos, sin, ctx, b, n)))
        return ew_add(h, self.mlp(self.post_attention_layernorm(h)))

    def _kernel_tail(self, x, attn):
        """After the attention, through cpu_kernels: o_proj + residual, the norm and the MLP, down_proj + residual (one
        kernel where neither o_proj nor the MLP has a bias or a tensor-parallel AllReduce)."""
        norm = self.post_attention_layernorm
        if self.tail is not None:
            return self.tail(*((attn,) + self._tail_args(x, norm)))
        h = self._project_add(self.self_attn.o_proj, attn, x)
        if self.sparse:  # the MoE op takes the norm and the residual (export/network/moe.py)
            return self.mlp.residual(h, norm)
        if self.norm_swiglu is not None:
            mlp = self.norm_swiglu(*((h, norm.weight, norm.eps_tensor) + self.mlp.gate_proj.weights()
                                     + self.mlp.up_proj.weights()))
        else:
            normed = norm.few_rows(h)
            mlp = ew_mul(ew_silu(self.mlp.gate_proj.few_rows(normed)), self.mlp.up_proj.few_rows(normed))
        return self._project_add(self.mlp.down_proj, mlp, h)

    def _tail_args(self, x, norm) -> tuple:
        """MsliteLlmDecodeTail's tensors after attn, in its order (the decode step's layer kernel takes them too)."""
        mlp = self.mlp
        return (self.self_attn.o_proj.weights() + (x, norm.weight, norm.eps_tensor) + mlp.gate_proj.weights()
                + mlp.up_proj.weights() + mlp.down_proj.weights())

    def _kernel_layer(self, x, cos, sin, slots, lengths, rows, tables, valid=None):
        """The decode step's layer through MsliteLlmPagedDecodeLayer: decode_qkv_args and _tail_args, after a layout
        [3] (their counts, key_cache's index among the first); a sparse layer's through MsliteLlmPagedDecodeMoeLayer:
        decode_qkv_args, Wo and the MoE op's residual_args, after a layout [4]. With `valid` ([1] int32: the chunk
        graph's rows that hold a token) through MsliteLlmPagedDecodeLayerValid, which computes those rows only."""
        qkv = self.self_attn.decode_qkv_args(x, self.input_layernorm, cos, sin, slots)
        if self.sparse:
            return self.layer_op(*((self.layer_layout,) + qkv + (lengths, rows, tables)
                                   + self.self_attn.o_proj.weights()
                                   + self.mlp.residual_args(self.post_attention_layernorm)))
        args = (self.layer_layout,) + qkv + (lengths, rows, tables) + self._tail_args(x, self.post_attention_layernorm)
        if valid is not None:
            return self.layer_valid_op(*((valid,) + args))
        return self.layer_op(*args)

    def _project_add(self, linear, x, residual):
        """residual + linear(x) in the decode step: one kernel, unless the projection has a bias (Llama's
        attention_bias / mlp_bias), which that kernel does not add, or is row-parallel (its AllReduce comes first)."""
        if linear.bias is None and linear.reduce is None:
            return self.project_add(*((x,) + linear.weights() + (residual,)))
        return ew_add(residual, linear.few_rows(x))

    def decode(self, x, cos, sin, ctx, b):  # x [B, E]
        """ctx, by name (CausalLM.decode): slots [B], tables [B, M], with cpu_kernels lengths [B] and rows [B], else
        mask [B, T]."""
        if self.layer_op is not None:  # cpu_kernels: the layer in one call
            return self._kernel_layer(x, cos, sin, ctx["slots"], ctx["lengths"], ctx["rows"], ctx["tables"])
        if self.project_add is not None:  # cpu_kernels: 3 calls per layer (more where a family has o/MLP biases)
            attn = self.self_attn.decode_step(x, self.input_layernorm, cos, sin, ctx["slots"], ctx["lengths"],
                                              ctx["rows"], ctx["tables"])
            return self._kernel_tail(x, attn)
        h = ew_add(x, self.self_attn.decode(self.input_layernorm.few_rows(x), cos, sin, ctx["mask"], b, ctx["slots"],
                                            ctx["tables"]))
        return ew_add(h, self.mlp.few_rows(self.post_attention_layernorm.few_rows(h)))


class Embedding(nn.Cell):
    """The token embedding. `shards` > 1 (tensor parallel, vocab-parallel): this rank holds rows
    [vocab_start, vocab_start + V/shards) of the table; ids outside them give zeros, and AllReduce sums the ranks'
    rows into every rank's embedding. `vocab_start` is a Parameter (each rank's weights file holds its own value), so
    every rank runs the same graph."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype, k: "Form", shards: int = 1) -> None:
        """The table is stored as the form says (export/network/matmul.py), and the head uses it when it is this table (a tied
        model; the form's `table` method is then the one that reads this storage). A quantized embedding
        (k.embedding, export/network/quantize.py TablePlan) is q [V, E] int8, or int4 two per byte as uint8 [V, E / 2] (input
        2j in the low nibble, two's complement) in every form, with a scale (and offset) per group of its row,
        [G, V] (G = 1: per row); a lookup gathers the rows, their scales and offsets, and computes (q + offset) *
        scale by plain ops. A float one is [V, E] in the compute dtype, or in 16 bits read by our kernel."""
        super().__init__()
        self.rows = vocab_size // shards
        self.dtype = dtype
        self.head_method = k.table(False)
        self.weight_offset = self.weight_scale = self.kernel = None
        self.packed = False
        e = k.embedding
        self.quantized = e is not None
        if e is not None:
            groups = 1 if e.group_size == 0 else hidden_size // e.group_size
            self.packed = e.bits == 4
            self.weight = (_weight((self.rows, hidden_size // 2), ms.uint8, "weight") if self.packed else
                           _weight((self.rows, hidden_size), ms.int8, "weight"))
            self.weight_scale = _weight((groups, self.rows), dtype, "weight_scale")
            if not e.symmetric:
                self.weight_offset = _weight((groups, self.rows), dtype, "weight_offset")
            self.kernel = kernel_embed_quant(self.packed) if k.decode_ops and dtype == ms.float32 else None
        else:
            self.weight = _weight((self.rows, hidden_size), k.table_dtype or dtype, "weight")
            self.kernel = kernel_embed() if k.table_dtype is not None else None
        if shards > 1:
            self.vocab_start = Parameter(initializer("zeros", (1,), ms.int32), name="vocab_start", requires_grad=False)
            self.reduce = ops.AllReduce()
        else:
            self.vocab_start = self.reduce = None

    def _lookup(self, ids):
        if not self.quantized:
            return self.kernel(ids, self.weight) if self.kernel is not None else ops.gather(self.weight, ids, 0)
        if self.kernel is not None:
            return (self.kernel(ids, self.weight, self.weight_scale) if self.weight_offset is None else
                    self.kernel(ids, self.weight, self.weight_scale, self.weight_offset))
        if self.packed:  # rows of nibbles (input 2j low, 2j + 1 high, two's complement) -> -8..7
            v = ops.cast(ops.gather(self.weight, ids, 0), ms.int32)  # [N, E/2], 0..255
            high = ops.floor_div(v, 16)
            nibbles = ops.stack((v - high * 16, high), -1).reshape(v.shape[0], -1)  # [N, E], 0..15
            q = ops.cast(nibbles - ops.floor_div(nibbles, 8) * 16, self.dtype)
        else:
            q = ops.cast(ops.gather(self.weight, ids, 0), self.dtype)  # [N, E]
        n, groups = q.shape[0], self.weight_scale.shape[0]
        q = q.reshape(n, groups, -1)
        scale = ops.gather(self.weight_scale, ids, 1).transpose(1, 0).reshape(n, groups, 1)
        if self.weight_offset is not None:
            offset = ops.gather(self.weight_offset, ids, 1).transpose(1, 0).reshape(n, groups, 1)
            q = ew_add(q, ops.broadcast_to(offset, q.shape))
        return ew_mul(q, ops.broadcast_to(scale, q.shape)).reshape(n, -1)

    def construct(self, ids):  # [N] -> [N, E]
        if self.vocab_start is None:
            return self._lookup(ids)
        local = ids - ops.broadcast_to(self.vocab_start, ids.shape)  # explicit broadcasts: BROADCASTS above
        inside = ops.logical_and(local >= 0, local < self.rows)
        x = self._lookup(ops.select(inside, local, ops.zeros_like(local)))
        mask = ops.broadcast_to(ops.cast(inside, x.dtype).reshape(-1, 1), x.shape)
        return self.reduce(ew_mul(x, mask))
