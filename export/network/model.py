"""The decoder of every family (export/families) in MindSpore with a KV cache (use_past): a full (prefill) and an
incremental step. The families differ only in the structural flags of ModelConfig: biases on q/k/v, o_proj and the
MLP, and Qwen3's per-head RMSNorm of q and k before RoPE; rope scaling only changes the tables (export/network/rope.py).

Two graph forms (--graph): `plain`, only ops with CPU kernels in MindSpore 2.10, so the same graph runs on the CPU
and under GE on Ascend; `fused` (Atlas profiles), Ascend's fused attention, norm and rotary operators, which the
`ms` backend replaces by CPU stand-ins when it loads the graph (lite_runtime/backends/standins.py).
Building blocks: export/network/layers.py (plain ops and CPU kernels), export/network/atlas_layers.py (Ascend fused ops).

Shapes: B batch, L tokens in this call, S cache length (= exported seq_length),
H query heads, KH key/value heads, G = H // KH, D head_dim, E hidden_size, V vocab.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from export.network.atlas_layers import AtlasRMSNorm, FusedDecoderLayer, FusedSteps, lengths_int64
from export.config import ModelConfig
from export.network.layers import MS_DTYPES, DecoderLayer, Embedding, KVCache, Linear, RMSNorm
from export.network.matmul import Form, choose_form  # noqa: F401 (Form: annotations)
from export.network.rope import rope_tables


class DecoderModel(nn.Cell):
    """The layers, of one form: DecoderLayer (plain ops or CPU kernels, `k`) or FusedDecoderLayer (`fused`)."""

    def __init__(self, cfg: ModelConfig, cache: KVCache, dtype, k: "Form",
                 tp: bool = False, vocab_shards: int = 1, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, k, vocab_shards)
        if not fused:
            layers = [DecoderLayer(cfg, cache, dtype, k, tp, cfg.sparse(i)) for i in range(cfg.num_hidden_layers)]
        else:
            layers = [FusedDecoderLayer(cfg, cache, dtype, tp, k, cfg.sparse(i)) for i in range(cfg.num_hidden_layers)]
        self.layers = nn.CellList(layers)
        if fused:
            self.norm = AtlasRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        else:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, k.decode_ops)


class CausalLM(nn.Cell):
    """The network with both steps. Inputs are the graph inputs the manifest records (model_dirs/README.md, "Graph
    inputs and outputs"); every graph writes the paged KV cache through slots and reads it through block tables
    (docs/architecture.md, "The KV cache: a pool of blocks"), M = ceil(seq_length / block_size) blocks a sequence:

    prefill(input_ids [B, L] int32 right-padded, valid_length [B] int32 = prompt lengths, block_tables [B, M] int32,
            slot_mapping [B*L] int32: each token's slot, -1 for padding)
    decode(input_ids [B, 1] int32, valid_length [B] int32 = tokens of each sequence after this step, block_tables
           [B, M], slot_mapping [B]: where each new token goes, -1 for a row without a sequence)
    chunk(the decode step, as decode; chunk_ids [1, C] int32 right-padded, chunk_length [1] = its valid tokens,
          start [1] = the position of its first token, chunk_block_table [1, M] = its sequence's blocks,
          chunk_slot_mapping [C] = where its tokens go, -1 for padding): the step of every sequence and a piece of
          one more sequence's prompt, each piece token attending over its sequence up to its own position
          (continuous batching, chunked prefill, prefix caching: lite_runtime/engine/scheduler.py).
    prefill and decode return float32 logits [B, V] of each row's last valid token, chunk [B + 1, V]: the step's rows
    and the piece's last token. Positions come from the lengths inside the graph.

    `dtype` is the compute dtype (activations, KV cache, norms and biases; `kv_dtype`: the KV cache's where it differs,
    bfloat16 under the CPU kernels, export/config.py kv_dtype). CPU folders may use our
    kernels (cpu_kernels): gemv=True for every matmul of the decode step, gemm=True for those of the
    full graph, and weight_dtype float16/bfloat16 to store the matrices (linear layers, embedding,
    head) in 16 bits while computing in float32, which needs both (export/network/matmul.py KernelMatmul).

    `tensor_parallel`: one rank of a Megatron split. `cfg` is then the rank's share (tensor_parallel_config: its
    heads, kv heads and intermediate columns); o_proj and down_proj are row-parallel, each followed by AllReduce
    (group hccl_world_group, as Lite's HCCL expects; the ms backend renames it at load). The norms are replicated.
    `vocab_shards` > 1 (vocab-parallel): the embedding and lm_head are split by vocabulary rows too (Embedding), and
    each rank's logits of its rows are gathered (AllGather) into the whole vocabulary's; 1: they are replicated.
    Either way every rank computes the same logits.

    `fused` (Atlas A2 profiles only): the fused form of the layers (export/network/atlas_layers.py); else plain.
    `quant`: the linear layers' export/checkpoints/methods.py QuantMethod, or None: float weights; `tables`: a quantized folder's
    export/network/quantize.py TablePlan (each table quantized or float); `atlas`: the folder is for an Atlas device (its
    quantized matmul is WeightQuantBatchMatmul). The form and every linear layer's method are
    chosen here, once (export/network/matmul.py choose_form).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, seq_length: int, dtype: str = "float32",
                 gemv: bool = False, gemm: bool = False, weight_dtype: Optional[str] = None,
                 tensor_parallel: bool = False, vocab_shards: int = 1, fused: bool = False, quant=None,
                 atlas: bool = False, tables=None, block_size: int = 16, num_blocks: Optional[int] = None,
                 kv_dtype: Optional[str] = None) -> None:
        super().__init__()
        ms_dtype = MS_DTYPES[dtype]
        if weight_dtype == dtype:
            weight_dtype = None
        if weight_dtype is not None and not (gemv and gemm and dtype == "float32"):
            raise ValueError(f"{weight_dtype} weights with {dtype} compute need the CPU kernels (gemv and gemm)")
        if fused and (gemv or gemm or dtype == "float32"):
            raise ValueError("the fused form runs Ascend's float16/bfloat16 operators, without the CPU kernels")
        k = choose_form(gemv, gemm, MS_DTYPES[weight_dtype] if weight_dtype else None, quant, atlas, tables)
        self.config, self.batch_size, self.seq_length, self.dtype = cfg, batch_size, seq_length, ms_dtype
        self.block_size = block_size
        self.max_blocks = -(-seq_length // block_size)
        # the pool's nominal size (the runtime sets its own when it loads the folder): the null block and each row one
        # longest sequence
        self.num_blocks = num_blocks or 1 + batch_size * self.max_blocks
        # the caches' dtype where it is not the compute dtype (bfloat16 under the CPU kernels: KVCache)
        cache = KVCache(self.num_blocks, block_size, self.max_blocks, k.decode_ops,
                        MS_DTYPES[kv_dtype] if kv_dtype is not None and kv_dtype != dtype else None)
        self.model = DecoderModel(cfg, cache, ms_dtype, k, tensor_parallel, vocab_shards, fused)
        # whether the layers run the CPU kernels' decode ops (the prefill and chunk contexts take their form)
        self.layer_kernels = k.decode_ops
        self.tied = bool(cfg.tie_word_embeddings)
        self.lm_head = None if self.tied else Linear(cfg.hidden_size, cfg.vocab_size // vocab_shards, False, ms_dtype,
                                                     k.table(False))
        self.vocab_shards = vocab_shards
        self.gather_logits = None
        if vocab_shards > 1:
            # export never joins a communication group, where AllGather would read the group's size: say it
            self.gather_logits = ops.AllGather()
            self.gather_logits.rank_size = vocab_shards
            self.gather_logits.add_prim_attr("rank_size", vocab_shards)
        cos, sin = rope_tables(cfg, seq_length)
        self.cos, self.sin = Tensor(cos, ms_dtype), Tensor(sin, ms_dtype)  # [S, D] graph constants
        self.fused = FusedSteps(self.cos, self.sin) if fused else None
        self.rows = Tensor(np.arange(batch_size, dtype=np.int32))
        self.positions = Tensor(np.arange(seq_length, dtype=np.int32))
        # every position a block table covers (the plain form's reads gather M blocks of BS: T >= seq_length)
        self.table_positions = Tensor(np.arange(self.max_blocks * block_size, dtype=np.int32))

    def _logits(self, hidden, decode: bool = False):  # [B, E] -> [B, V] float32
        hidden = self.model.norm.few_rows(hidden) if decode else self.model.norm(hidden)
        if self.tied:  # the embedding's table, by its method
            embed = self.model.embed_tokens
            logits = embed.head_method(hidden, embed.weight, embed.weight_scale, embed.weight_offset, None, None,
                                       decode)
        else:
            logits = self.lm_head.few_rows(hidden) if decode else self.lm_head(hidden)
        logits = ops.cast(logits, ms.float32)
        if self.gather_logits is None:
            return logits
        b = hidden.shape[0]  # [B, V/shards] of each rank -> [shards*B, V/shards] -> [B, V], rank r's rows r-th
        gathered = self.gather_logits(logits).reshape(self.vocab_shards, b, -1)
        return gathered.transpose(1, 0, 2).reshape(b, -1)

    def prefill(self, input_ids, valid_length, block_tables, slot_mapping):
        b, n = input_ids.shape
        x = self.model.embed_tokens(input_ids.reshape(-1))  # [B*n, E]
        if self.fused is not None:
            cos, sin = self.fused.prompt(n)
            ctx = {"lengths": lengths_int64(valid_length), "mask": self.fused.mask, "slots": slot_mapping}
            for layer in self.model.layers:
                x = layer.prefill(x, cos, sin, ctx, b, n)
            return self._logits(ops.gather(x, self.rows[:b] * n + valid_length - 1, 0))
        pos = self.positions[:n]
        if self.layer_kernels:
            # cpu_kernels: a layer's first half as the decode step's, over every token (norm, q/k/v, RoPE and the
            # cache write in one kernel; the kernels' attention, causal by each token's position + 1, reading its
            # sequence's blocks): ~20 graph nodes a layer instead of ~100 with the mask, BatchMatMul and softmax, so
            # MindSpore compiles the graph in a quarter of the time or less (0.5B shape: 0.14 s against 0.48 s at
            # 128 tokens, 2.0-2.3 s at 2048), and the prompt runs faster from 512 tokens on (docs/performance-log.md,
            # "Load to first token: the full graph in the decode step's kernels, and their attention", 2026-11-25)
            rows = ops.broadcast_to(self.rows[:b].reshape(b, 1), (b, n)).reshape(-1)
            cos, sin = ops.tile(self.cos[:n], (b, 1)), ops.tile(self.sin[:n], (b, 1))  # [B*n, D]
            # each token reads up to itself; a padding token (past its prompt's valid_length) reads nothing: its
            # attention is skipped, not computed over the whole context (its output is never read)
            valid = ops.cast(pos.reshape(1, n) < valid_length.reshape(b, 1), ms.int32)  # [B, n]
            lengths = (ops.broadcast_to((pos + 1).reshape(1, n), (b, n)) * valid).reshape(-1)
            ctx = {"slots": slot_mapping, "lengths": lengths, "rows": rows, "tables": block_tables}
        else:
            cos = ops.tile(self.cos[:n].reshape(1, n, -1), (b, 1, 1))  # [B, n, D]
            sin = ops.tile(self.sin[:n].reshape(1, n, -1), (b, 1, 1))
            causal = pos.reshape(1, n, 1) >= pos.reshape(1, 1, n)  # [1, n(query), n(key)]
            valid = pos.reshape(1, 1, n) < valid_length.reshape(b, 1, 1)  # [B, 1, n]
            ctx = {"slots": slot_mapping, "mask": _additive(ops.logical_and(causal, valid))}  # [B, n, n]
        for layer in self.model.layers:
            x = layer.prefill(x, cos, sin, ctx, b, n, valid_length)
        last = ops.gather(x, self.rows[:b] * n + valid_length - 1, 0)  # [B, E]
        return self._logits(last)

    def chunk(self, input_ids, valid_length, block_tables, slot_mapping, chunk_ids, chunk_length, start,
              chunk_block_table, chunk_slot_mapping, every: bool = False):
        """The decode step of every row and a piece of one more sequence's prompt in one call: the weights are read
        once for both (on a device where a step is bound by reading them, a separate piece would cost the running
        rows a whole second step). Rows 0..B-1 of the activations are the step's, then the piece's tokens."""
        b, n = input_ids.shape[0], chunk_ids.shape[1]
        x = self.model.embed_tokens(ops.cat((input_ids.reshape(-1), chunk_ids.reshape(-1))))  # [B + n, E]
        step_pos = valid_length - 1  # [B]
        # the piece's positions; its padding tokens take the last valid one's (their writes are skipped: slot -1)
        piece_pos = ops.minimum(self.positions[:n], ops.broadcast_to(chunk_length - 1, (n,))) + ops.broadcast_to(
            start, (n,))  # [n]
        pos = ops.cat((step_pos, piece_pos))  # [B + n]
        slots = ops.cat((slot_mapping, chunk_slot_mapping))  # [B + n]
        last = ops.cat((self.rows[:b], chunk_length + (b - 1)))  # [B + 1]: each row's token, the piece's last
        query_lengths = ops.cat((valid_length, piece_pos + 1))  # [B + n]: each query reads up to its own position
        if self.fused is not None:
            cos, sin = self.fused.rows(pos, b + n)
            # PagedAttention: one query per token, each with its own block table and context length
            tables = ops.cat((block_tables, ops.broadcast_to(chunk_block_table, (n, self.max_blocks))))
            ctx = {"slots": slots, "tables": tables, "lengths": query_lengths}
        else:
            cos, sin = ops.gather(self.cos, pos, 0), ops.gather(self.sin, pos, 0)  # [B + n, D]
            if self.layer_kernels:  # cpu_kernels' attention: each query's length and row of `tables`
                # the piece's padding tokens read nothing: the kernels' attention skips them, so a piece's attention
                # costs its valid tokens, not the graph's C (their outputs are never read)
                piece_valid = ops.cast(self.positions[:n] < ops.broadcast_to(chunk_length, (n,)), ms.int32)
                query_lengths = ops.cat((valid_length, (piece_pos + 1) * piece_valid))
                ctx = {"slots": slots, "query_lengths": query_lengths, "valid": chunk_length + b,
                       "query_rows": ops.cat((self.rows[:b], ops.broadcast_to(self.rows[b - 1:b] + 1, (n,)))),
                       "tables": ops.cat((block_tables, chunk_block_table))}
            else:
                t = self.table_positions.shape[0]
                step_mask = _additive(self.table_positions.reshape(1, -1) < valid_length.reshape(b, 1))  # [B, T]
                keep = ops.broadcast_to(self.table_positions.reshape(1, t), (n, t)) <= ops.broadcast_to(
                    piece_pos.reshape(n, 1), (n, t))
                piece_mask = _additive(keep).reshape(1, n, t)  # [1, n, T]: token i sees its sequence up to itself
                ctx = {"slots": slots, "block_tables": block_tables, "piece_table": chunk_block_table,
                       "step_mask": step_mask, "piece_mask": piece_mask}
        # ctx, by name (export/network/layers.py Attention.chunk): every form's slots [B + n] (the cache writes); the form's
        # own keys beside them
        for layer in self.model.layers:
            x = layer.chunk(x, cos, sin, ctx, b, n)
        if every:  # the score graph: every row's and every piece position's, [B + n, V] (padding positions too)
            return self._logits(x, decode=True)
        return self._logits(ops.gather(x, last, 0), decode=True)  # [B + 1, V]

    def decode(self, input_ids, valid_length, block_tables, slot_mapping):
        b = input_ids.shape[0]
        x = self.model.embed_tokens(input_ids.reshape(-1))  # [B, E]
        pos = valid_length - 1  # [B]
        if self.fused is not None:
            cos, sin = self.fused.step(pos, b)
            ctx = {"slots": slot_mapping, "tables": block_tables, "lengths": valid_length}
            for layer in self.model.layers:
                x = layer.decode(x, cos, sin, ctx, b)
            return self._logits(x, decode=True)
        cos, sin = ops.gather(self.cos, pos, 0), ops.gather(self.sin, pos, 0)  # [B, D]
        if self.layer_kernels:
            ctx = {"slots": slot_mapping, "tables": block_tables, "lengths": valid_length, "rows": self.rows[:b]}
        else:
            valid = self.table_positions.reshape(1, -1) < valid_length.reshape(b, 1)  # [B, T]
            ctx = {"slots": slot_mapping, "tables": block_tables, "mask": _additive(valid)}
        for layer in self.model.layers:
            x = layer.decode(x, cos, sin, ctx, b)
        return self._logits(x, decode=True)


def _additive(keep):
    """A boolean mask as the additive float32 one attention adds: 0 where kept, -1e9 elsewhere. Computed with
    scalar operands: ops.select between zeros and full tensors of the mask's shape was folded into two graph
    constants of B x n x n float32, 32 MB per prefill graph at 2048 tokens, 8 GiB at 32768 (past protobuf's 2 GB)."""
    return (ops.cast(keep, ms.float32) - 1.0) * 1e9


class PrefillGraph(nn.Cell):
    """The full graph. auto_prefix=False keeps the parameter names of the network."""

    def __init__(self, net: CausalLM) -> None:
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, input_ids, valid_length, block_tables, slot_mapping):
        return self.net.prefill(input_ids, valid_length, block_tables, slot_mapping)


class ChunkGraph(nn.Cell):
    """The chunk graph: the decode step of every row (input_ids [B, 1], valid_length [B], block_tables [B, M],
    slot_mapping [B], as the inc graph) and C tokens of one more sequence's prompt (chunk_ids [1, C], chunk_length [1]
    of them valid, at positions from start [1], in the blocks chunk_block_table [1, M], written at chunk_slot_mapping
    [C]), so a server prefills a prompt piece by piece inside the decode steps of the others, and from the end of a
    prefix its blocks already hold. Same parameters; logits [B + 1, V].

    `every` (the score graph): the same call returning the logits of every piece position, [B + C, V] (B: the step
    rows it is compiled with, one for export's score graphs, export/writers/graphs.py SCORE_STEP_ROWS; row B + i: after the
    piece's token i; those past chunk_length are padding's), for speculative decoding's verify, prompt
    logprobs and perplexity (docs/architecture.md, "score graphs")."""

    def __init__(self, net: CausalLM, every: bool = False) -> None:
        super().__init__(auto_prefix=False)
        self.net, self.every = net, every

    def construct(self, input_ids, valid_length, block_tables, slot_mapping, chunk_ids, chunk_length, start,
                  chunk_block_table, chunk_slot_mapping):
        return self.net.chunk(input_ids, valid_length, block_tables, slot_mapping, chunk_ids, chunk_length, start,
                              chunk_block_table, chunk_slot_mapping, self.every)


class DecodeGraph(nn.Cell):
    """The incremental graph: one token per row, same parameters (weights and KV cache)."""

    def __init__(self, net: CausalLM) -> None:
        super().__init__(auto_prefix=False)
        self.net = net

    def construct(self, input_ids, valid_length, block_tables, slot_mapping):
        return self.net.decode(input_ids, valid_length, block_tables, slot_mapping)
