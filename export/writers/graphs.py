"""The graphs of a folder, compiled without weights: each a MindIR proto whose parameters hold no data.

mindspore.export compiles a cell, takes its graph proto, and only then writes every parameter's bytes
(mindspore/train/serialization.py: _save_mindir -> _cell_info, then _save_mindir_together or
_split_save). Compiling needs each Parameter's shape and dtype, not its bytes, so the network is built
with lazily initialised Parameters (nothing allocated), each graph is compiled and its proto taken the
way mindspore.export takes it (`_cell_info`, in MindSpore 2.7 to 2.10), and the bytes are written once
per rank by export/writers/weights_file.py. `write_graph` then points every parameter at its place in that file
(MindIR's external_data: location, offset, length) and writes the graph.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from export.config import ExportConfig, ModelConfig, tensor_parallel_config, vocab_shards
from export.errors import ExportError
from lite_runtime.folder import MINDIR_DTYPES, graph_file, is_kv_cache, mindir_specs, rank_name
from lite_runtime.manifest import GraphEntry

Params = Dict[str, Tuple[Tuple[int, ...], str]]  # parameter name -> (shape, dtype)


@dataclass
class CompiledGraph:
    role: str
    tokens: int
    proto: Any  # mind_ir_pb2.ModelProto, parameters without data
    rows: Optional[int] = None  # step rows, of an inc or score graph of fewer than batch_size; None: batch_size


def graph_plan(cfg: ExportConfig) -> List[Tuple[str, int, Optional[int]]]:
    """(role, tokens, rows) of every graph of one rank: a prefill graph per bucket and seq_length, the inc graph, an
    inc graph per --step_rows (rows; None: batch_size), a chunk graph per chunk size (a decode step and one row's
    prompt piece at an offset, for lite_runtime.serve), and a score graph per score size (the chunk graph returning
    every position of its piece) of SCORE_STEP_ROWS step rows."""
    buckets = sorted(set(cfg.prefill_buckets or ()) | {cfg.seq_length})
    score_rows = SCORE_STEP_ROWS if cfg.batch_size > SCORE_STEP_ROWS else None
    return [("prefill", n, None) for n in buckets] + [("inc", 1, None)] + \
        [("inc", 1, r) for r in cfg.step_rows or ()] + [("chunk", n, None) for n in cfg.chunk_sizes or ()] + \
        [("score", n, score_rows) for n in cfg.score_sizes or ()]


# A score graph's step rows. Every use of a score graph is a piece alone (a verify of draft tokens, perplexity,
# check's replay); one that comes while other sequences decode (a prompt's logprobs, echo) is a step and a piece in
# two calls (lite_runtime/engine/runner.py ModelRunner.chunk). With batch_size step rows beside the piece, a verify
# of 8 tokens on a batch-16 folder computed 24 rows (docs/architecture.md, "Score graphs of one step row"). One row,
# not none: a graph of zero rows would carry empty tensors through every op.
SCORE_STEP_ROWS = 1


class Network:
    """The network of one rank, built without weights: its parameters (shapes and dtypes) and its graphs. Every
    rank of a tensor-parallel folder has the same network (equal shares of the heads and MLP columns, the same
    parameter names), so one is built and compiled for all of them."""

    def __init__(self, cfg: ExportConfig, model_cfg: ModelConfig, quant=None, tables=None) -> None:
        """`quant`: the linear layers' export/checkpoints/methods.py QuantMethod, or None; `tables`: a quantized folder's
        export/network/quantize.py TablePlan."""
        import mindspore as ms

        from export.network.model import CausalLM

        ms.set_context(mode=ms.GRAPH_MODE)
        self.cfg = cfg
        self.kernels = cfg.use_cpu_kernels()
        # every full-graph matmul through our kernel: 16-bit matrices need it; float32 ones only for few rows
        # (export/network/matmul.py KERNEL_PREFILL_MAX_ROWS)
        gemm = self.kernels and cfg.half_weights_on_cpu
        tp = cfg.tp_size
        self.vocab_shards = vocab_shards(model_cfg, tp)
        self.net = CausalLM(tensor_parallel_config(model_cfg, tp) if tp > 1 else model_cfg, cfg.batch_size,
                            cfg.seq_length, cfg.compute_dtype, gemv=self.kernels, gemm=gemm, weight_dtype=cfg.dtype,
                            tensor_parallel=tp > 1, vocab_shards=self.vocab_shards,
                            fused=cfg.graph == "fused", quant=quant, tables=tables, atlas=cfg.device != "cpu",
                            block_size=cfg.block_size or 16, kv_dtype=cfg.kv_dtype(self.kernels))

    def parameters(self) -> Params:
        names = {"Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16", "Int32": "int32",
                 "Int8": "int8", "UInt8": "uint8", "Int4": "qint4x2"}
        return {p.name: (tuple(p.shape), names[str(p.dtype)]) for p in self.net.get_parameters()}

    def compile(self, role: str, tokens: int, rows: Optional[int] = None) -> CompiledGraph:
        """Compile one graph and take its proto, as mindspore.export does before it writes any data."""
        import numpy as np

        import mindspore as ms
        from export.network.model import ChunkGraph, DecodeGraph, PrefillGraph

        try:
            from mindspore.train.serialization import _cell_info
        except ImportError:
            raise ExportError(f"MindSpore {ms.__version__} has no mindspore.train.serialization._cell_info, which "
                              "export uses to compile graphs without their weights; install 2.7 to 2.10: "
                              "pip install 'mindspore>=2.7,<2.11'") from None
        from mindspore.train import mind_ir_pb2

        cell = ChunkGraph(self.net, every=role == "score") if role in ("chunk", "score") else \
            {"prefill": PrefillGraph, "inc": DecodeGraph}[role](self.net)
        # Compiling ends with Cell.init_parameters_data(), which gives every lazy Parameter its data: calloc'd zeros
        # no page of which is touched for most dtypes, but qint4x2 zeros are written (a 7B int4 network: 3.3 GiB,
        # measured 2026-11-26). The proto holds no data either way, so the graph cell initializes none.
        cell.init_parameters_data = lambda *args, **kwargs: {}
        step_rows, blocks = rows, self.net.max_blocks
        rows = self.cfg.batch_size if rows is None else rows  # the graph's rows: every shape follows its inputs
        piece = role in ("chunk", "score")
        n = 1 if piece else tokens
        args = [ms.Tensor(np.zeros((rows, n), np.int32)),
                ms.Tensor(np.full((rows,), 1 if role == "prefill" else 2, np.int32)),
                ms.Tensor(np.zeros((rows, blocks), np.int32)), ms.Tensor(np.full((rows * n,), -1, np.int32))]
        if piece:  # the piece: chunk_ids, chunk_length, start, chunk_block_table, chunk_slot_mapping
            args += [ms.Tensor(np.zeros((1, tokens), np.int32)), ms.Tensor(np.ones((1,), np.int32)),
                     ms.Tensor(np.zeros((1,), np.int32)), ms.Tensor(np.zeros((1, blocks), np.int32)),
                     ms.Tensor(np.full((tokens,), -1, np.int32))]
        level = ms.get_context("jit_syntax_level")
        ms.set_context(jit_syntax_level=ms.STRICT)  # as mindspore.export compiles
        try:
            stream, _ = _cell_info(cell, False, *args)
        finally:
            ms.set_context(jit_syntax_level=level)
        proto = mind_ir_pb2.ModelProto()
        proto.ParseFromString(stream)
        for param in proto.graph.parameter:
            if param.raw_data or param.external_data.location:
                raise ExportError(f"MindSpore {ms.__version__} put parameter data into the {role} graph's proto; "
                                  "export needs 2.7 to 2.10: pip install 'mindspore>=2.7,<2.11'")
        return CompiledGraph(role, tokens, proto, step_rows)


def compile_graphs(cfg: ExportConfig, network: Network,
                   progress: Optional[Callable[[int], None]] = None) -> List[CompiledGraph]:
    """Every graph of graph_plan, once for all ranks; holds MindSpore's process-wide lock."""
    from lite_runtime.mindspore_lock import MINDSPORE_LOCK

    graphs = []
    with MINDSPORE_LOCK:
        for role, tokens, rows in graph_plan(cfg):
            graphs.append(network.compile(role, tokens, rows))
            if progress is not None:
                progress(1)
    return graphs


def write_graph(folder: str, cfg: ExportConfig, graph: CompiledGraph, rank: int, layout,
                portable_kernels: bool) -> GraphEntry:
    """Rank `rank`'s copy of the graph: its parameters pointed at that rank's weights file (`layout`:
    export/writers/weights_file.py Layout), written, and its manifest entry returned. The specs are read from the very proto
    written."""
    tp = cfg.tp_size
    file = graph_file(rank_name(cfg.name, rank, tp), graph.role, graph.tokens, cfg.seq_length, graph.rows)
    for param in graph.proto.graph.parameter:
        name = param.name.rsplit(":", 1)[-1]
        if is_kv_cache(name):  # the pool: no data in the folder, sized and allocated by the runtime at load
            continue
        entry = layout.entries.get(name)
        declared = (tuple(int(d) for d in param.dims), MINDIR_DTYPES[_type_name(param.data_type)])
        if entry is None or declared != (entry.shape, entry.dtype):
            raise ExportError(f"{file}: parameter {name} {list(param.dims)} is not in {layout.location} as the "
                              "graph declares it; this is a bug in export/writers/graphs.py, please report it")
        param.external_data.location = layout.location
        param.external_data.offset = entry.offset
        param.external_data.length = entry.nbytes
    if portable_kernels:
        _portable_kernel_paths(graph.proto)
    with open(os.path.join(folder, file), "wb") as fh:
        fh.write(graph.proto.SerializeToString())
    inputs, outputs = mindir_specs(graph.proto)
    return GraphEntry(graph.role, file, layout.location, graph.tokens, inputs, outputs, rank=rank if tp > 1 else None,
                      rows=graph.rows)


def _type_name(data_type: int) -> str:
    from mindspore.train import mind_ir_pb2

    return mind_ir_pb2.TensorProto.DataType.Name(data_type)


def _portable_kernel_paths(model) -> int:
    """Store our CPU kernels' Custom ops by library name, not by this machine's path; returns how many.

    mindspore.export records the absolute path of the library the op was built with; the `ms`
    backend points the name at the loading machine's library (cpu_kernels.local_func).
    """
    import cpu_kernels

    return cpu_kernels.retarget(model, lambda func: cpu_kernels.graph_func(func.rpartition(":")[2]))
