"""The `ms` backend: MindSpore's MindIR executor (mindspore.load + nn.GraphCell). CPU default; tests run it.

Graphs are read, loaded and compiled on first use (MsBackend). Weights and KV cache are held once:
- every graph is loaded without parameter data (a copy of its proto with the data references
  cleared), so mindspore.load reads no weights; its KV caches' first dimension is set to the pool's
  blocks (the runner's choice at load: lite_runtime/engine/kv_pool.py);
- the first graph loaded has its Parameters set from the weights file itself, memory-mapped
  copy-on-write and asked for huge pages (`_ask_huge_pages`); the KV caches are zero pages, memory only once a block
  is written;
- the weights our CPU kernels read (`_kernel_weights`), which a decode step streams whole, are copied at load into a
  private arena of 2 MiB pages (`_into_huge_pages`, `_huge_arena`: from 4 KiB pages the step pays a TLB miss per
  page), the mapping's pages under them let go, where that memory is there (lite_runtime/memory.py
  weights_copy_bytes); everything else stays the page cache's pages, never copied (MSLITE_LLM_HUGE_PAGES=0: all of
  it, as before);
- every later graph's Parameters are pointed at the first one's with `set_data`, which shares
  the storage: all graphs read and write the same cache, and nothing is handed over.
- where the CPU kernels' banded int4 form runs (AVX-512 VNNI, AVX2), the int4 matrices only our quantized ops read are
  repacked at the first load into bands of 16 rows (`_repacked_weights`, cpu_kernels.repack_int4_r16), written once
  into the arena, and the ops reading them renamed to their R16 twins (docs/architecture.md, "int4 in bands of 16
  rows"); where the banded int8 form runs (AVX-512 VNNI) and the weights are copied, the int8 ones likewise, biased
  (cpu_kernels.repack_int8_r16; "int8 in bands of 16 rows"); the folder on disk is unchanged.
(`mindspore.load` with the data and `GraphCell(params_init=...)` would each hold another copy.)

Graphs of `--device cpu` folders may call our CPU kernels (cpu_kernels) as aot Custom ops by
library name; loading points that name at this machine's built library. Graphs of `--graph fused` Atlas
folders call Ascend's fused operators, which MindSpore's CPU lacks: loading replaces each by its CPU
stand-in (backends/standins.py), which proves the graph's wiring, not Ascend's kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Tuple

import numpy as np

from lite_runtime.backends import bind_inputs, unavailable
from lite_runtime.folder import TensorSpec, mindir_specs
from lite_runtime.mindspore_lock import MINDSPORE_LOCK


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the duration, as it was after. Importing MindSpore and compiling a
    graph create hundreds of thousands of Python objects that live on, and each collection they trigger walks all
    of them: 0.11 s of the 0.76 s import on a 2-core VM (docs/performance-log.md, "Load to first token: the full
    graph in the decode step's kernels, and their attention", 2026-11-25), more in a compile."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        # and what they left is moved out of the collector's reach (gc.freeze): a decode step makes a few hundred
        # short-lived objects, and the collections they trigger walked MindSpore's objects again, ~5 % of an int4
        # decode step of the 0.5B shape (docs/performance-log.md, "Quantized decode: int16 activations",
        # 2026-11-26). Frozen objects are never collected; the ones frozen here live as long as the process.
        gc.freeze()


def _mindspore():
    # Import protobuf before MindSpore: `import mindspore` sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
    # when it is unset (for its checkpoint files above 2 GB, which we never read), and protobuf's pure-Python
    # implementation parses and writes our graph protos 17x slower: 9 of the 14 s of loading a 7-graph
    # 0.5B folder. Imported first, protobuf keeps its default (upb) or whatever the user's environment says.
    from google.protobuf.internal import api_implementation  # noqa: F401  (this import makes the choice)

    try:
        with _collector_paused():
            import mindspore
            from mindspore import nn
    except ImportError:
        raise unavailable("ms", "MindSpore", "pip install mindspore==2.10.0 'numpy<2' "
                          "(or use backend 'mslite' on Atlas)") from None
    return mindspore, nn


def _launcher(cell):
    """A compiled GraphCell's run without the Python GraphCell.__call__ spends on every call before it (the arguments'
    key, the compile cache's lookup, the cell's attributes and jit config: 0.3-0.5 ms of a SmolLM2 decode step's ~8;
    docs/performance-log.md 48): the graph executor called with the phase the compile recorded, as MindSpore's own
    run does after those checks. The same graph, arguments and outputs. None where this MindSpore lacks the pieces
    (its internals, 2.7-2.10), or with MSLITE_LLM_CELL_CALL=1: the cell is then called as before."""
    if os.environ.get("MSLITE_LLM_CELL_CALL") == "1":
        return None
    try:
        try:
            from mindspore.graph.api import _cell_graph_executor, _convert_python_data
        except ImportError:
            from mindspore.common.api import _cell_graph_executor, _convert_python_data
        executor = _cell_graph_executor._graph_executor
        phase = cell.compile_phase
        if not executor.has_compiled(phase):
            return None
    except (ImportError, AttributeError):
        return None

    def launch(args):
        return _convert_python_data(executor(tuple(args), phase)).asnumpy()

    return launch


def _read_mindir(path: str):
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    return model


# BFLOAT16: numpy has none; its bits are read as uint16 and viewed as mindspore.common.np_dtype.bfloat16 (MsBackend._cell)
_NUMPY = {"FLOAT": np.float32, "FLOAT16": np.float16, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_,
          "DOUBLE": np.float64, "INT8": np.int8, "UINT8": np.uint8, "BFLOAT16": np.uint16,
          # int4 weights, two per byte, declared [N, K / 2] (standins._int4_as_bytes retypes them to uint8)
          "QINT4X2": np.uint8}


def _size_caches(model, num_blocks: int, dtype: Optional[str] = None) -> None:
    """The KV caches' first dimension (their blocks) set to the pool's size, in a parsed MindIR: the graphs index them
    only through block tables and slots, so any size loads (docs/architecture.md, "The KV cache: a pool of blocks").
    `dtype` "float32": float32 caches where the folder's are bfloat16 (InferConfig.kv_cache_dtype: only the CPU
    kernels' ops touch a kernel-layout cache, and they take either dtype)."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.folder import is_kv_cache

    for param in model.graph.parameter:
        if is_kv_cache(param.name.rsplit(":", 1)[-1]):
            param.dims[0] = int(num_blocks)
            if dtype == "float32":
                param.data_type = mind_ir_pb2.TensorProto.DataType.Value("FLOAT")


def _check_cache_dtype(model, path: str, spec) -> None:
    """A graph's KV caches are of the dtype its folder's yaml says (infer.kv_cache: what the pool is sized by)."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.errors import InferError
    from lite_runtime.folder import MINDIR_DTYPES, is_kv_cache

    for param in model.graph.parameter:
        name = param.name.rsplit(":", 1)[-1]
        if is_kv_cache(name):
            got = MINDIR_DTYPES.get(mind_ir_pb2.TensorProto.DataType.Name(param.data_type), "another dtype")
            if got != spec.dtype:
                raise InferError(f"{path}: its KV cache {name} is {got}, the folder's yaml says {spec.dtype} "
                                 "(infer.kv_cache); the graphs and the yaml are not of one export: re-export the "
                                 "folder")
            return


def _param_nbytes(shape, dtype) -> int:
    """Bytes of a parameter of `shape` and numpy `dtype` (_NUMPY's)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


ARENA_ALIGN = 4096  # each weight's place in the huge-page arena starts at a page (_into_huge_pages)


def _arena_slot(nbytes: int) -> int:
    """The arena bytes a weight of `nbytes` takes (to the next ARENA_ALIGN)."""
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


def _parameter_arrays(model, path: str) -> Dict[str, np.ndarray]:
    """Each parameter of a parsed MindIR as a numpy array: external data memory-mapped copy-on-write, and the KV
    caches zeros of their (pool-sized) shape.

    Nothing is read here; pages come in as the graph touches them. The caches are calloc'd zero pages: memory only as
    blocks are written, a block at a time. Embedded data (graphs not written by our export) is copied.
    """
    from lite_runtime.folder import is_kv_cache

    from mindspore.train import mind_ir_pb2

    from lite_runtime.errors import InferError

    type_name = mind_ir_pb2.TensorProto.DataType.Name
    maps: Dict[str, np.memmap] = {}
    arrays = {}
    for param in model.graph.parameter:
        name = param.name.rsplit(":", 1)[-1]
        dtype = _NUMPY.get(type_name(param.data_type))
        if dtype is None:
            raise InferError(f"{path}: parameter {name} has dtype {type_name(param.data_type)}, which the ms "
                             "backend cannot run; re-export with --dtype float32")
        shape = tuple(param.dims)
        nbytes = _param_nbytes(shape, dtype)
        if is_kv_cache(name):
            arrays[name] = np.zeros(shape, dtype)
            continue
        if param.raw_data:
            data = np.frombuffer(param.raw_data, dtype=dtype).copy()
        else:
            ext = param.external_data
            location = os.path.join(os.path.dirname(path), ext.location)
            if location not in maps:
                try:
                    maps[location] = np.memmap(location, dtype=np.uint8, mode="c")
                except (OSError, ValueError) as exc:
                    raise InferError(f"{location}: cannot map the weights file of {path} ({exc}); "
                                     "re-copy the model folder") from None
                _ask_huge_pages(maps[location]._mmap)
            if ext.length != nbytes or ext.offset + nbytes > maps[location].size:
                raise InferError(f"{location}: parameter {name} ({nbytes} bytes at offset {ext.offset}) is not in "
                                 "the weights file; re-copy the model folder")
            data = maps[location][ext.offset:ext.offset + nbytes].view(dtype)
        arrays[name] = data.reshape(shape)
    return arrays


HUGE_PAGE = 2 << 20  # x86-64's and aarch64's (4 KiB base pages) transparent huge page


def _ask_huge_pages(region) -> None:
    """madvise(MADV_HUGEPAGE) on an mmap object, before its pages are touched: the kernel then maps it in 2 MiB pages
    where it can (transparent huge pages, "madvise" mode, every distribution's default or "always"). A decode step
    reads every weight once, a TLB miss per 4 KiB page with small pages: with huge pages the CPU kernels read faster
    (docs/performance-log.md 46: the int8 head 1.3x on an Intel Xeon VM). For the weights file's mapping the page
    cache must hold the file in 2 MiB folios (a filesystem with large folios: xfs, ext4 from Linux 6.16): a cold
    read makes them (older 6.x kernels map them huge only in a mapping so advised), pages cached before in small
    folios stay small. Nothing changes where the kernel cannot (no THP, Python without MADV_HUGEPAGE)."""
    import mmap

    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and region is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: small pages, as before
            pass


def _huge_arena(nbytes: int) -> np.ndarray:
    """nbytes (uint8) of private anonymous memory at a 2 MiB boundary, asked to be huge pages (_ask_huge_pages): the
    home of the weights our kernels read (_into_huge_pages). Pages are zero until written."""
    import mmap

    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # not MAP_SHARED: shmem, no huge pages
    _ask_huge_pages(region)
    whole = np.frombuffer(region, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    return whole[start:start + nbytes]


def _into_huge_pages(arrays: Dict[str, np.ndarray], names, bands,
                     threads: int) -> Optional[Tuple[np.ndarray, Dict[str, int]]]:
    """The weights `names` (those our CPU kernels read: _kernel_weights, and the `bands`) copied from the weights file's
    mapping into one private arena of huge pages (_huge_arena), on every core, each at a 4 KiB boundary; arrays[name]
    then points there, `bands` are repacked there into bands of 16 rows (_repack), and the mapping's pages they came
    from are let go (_unmap_pages). A decode step streams these weights whole: from
    4 KiB pages it pays a TLB miss per page (two page-table walks in a VM), from 2 MiB pages a 512th of them
    (docs/performance-log.md 46, an Intel Xeon VM: the 0.5B step 1.12x int4, 1.16x int8, 1.16x bf16). Copied
    whatever the page cache holds: the file's own mapping in 2 MiB folios (a file read cold on Linux 6.18, ext4)
    read a bf16 folder's layers at 0.6x the arena's pace there, for a reason not found. Cost: the copy at load
    (0.35-0.7 s a GB here), and those weights are this process's own memory, not page cache another process shares;
    the KV pool is sized after them, and where they do not fit only the bands are copied (lite_runtime/memory.py
    weights_copy_bytes). MSLITE_LLM_HUGE_PAGES=0 copies nothing (bands repacked in place, into the mapping's private
    4 KiB copies, as before). Returns the arena and each weight's byte offset in it (what arena calls hand our ops:
    lite_runtime/backends/arena.py), or None when nothing was copied."""
    if os.environ.get("MSLITE_LLM_HUGE_PAGES") == "0":
        for name in sorted(bands):
            _repack(arrays[name])  # in the copy-on-write mapping: these pages become private
        return None
    names = sorted(n for n in names if n in arrays)
    at, offsets = 0, []
    for name in names:
        offsets.append(at)
        at += _arena_slot(arrays[name].nbytes)
    if not names:
        return None
    arena = _huge_arena(at)
    pieces = []  # (destination, source) bytes, 16 MiB at most: the copy (and its page faults) on every core
    for name, offset in zip(names, offsets):
        source = arrays[name].reshape(-1).view(np.uint8)
        for a in range(0, source.nbytes, 16 << 20):
            b = min(a + (16 << 20), source.nbytes)
            pieces.append((arena[offset + a:offset + b], source[a:b]))
    with ThreadPoolExecutor(max_workers=max(1, min(threads, 8))) as pool:  # the backend's threads (cpu_threads)
        list(pool.map(lambda piece: np.copyto(*piece), pieces))
    for name, offset in zip(names, offsets):
        source = arrays[name]
        copy = arena[offset:offset + source.nbytes].view(source.dtype).reshape(source.shape)
        if name in bands:
            _repack(copy)
        arrays[name] = copy
        _unmap_pages(source)
    return arena, dict(zip(names, offsets))


def _repack(q: np.ndarray) -> None:
    """q (a weight of `_repacked_weights`) into bands of 16 rows in place: int4 (uint8) by cpu_kernels.repack_int4_r16,
    int8 by cpu_kernels.repack_int8_r16."""
    import cpu_kernels

    (cpu_kernels.repack_int4_r16 if q.dtype == np.uint8 else cpu_kernels.repack_int8_r16)(q)


def _unmap_pages(view: np.ndarray) -> None:
    """The whole pages under `view` (a view of the weights file's copy-on-write mapping, copied: never read again)
    dropped from this process (madvise MADV_DONTNEED; a later read would map the file's bytes again). They stay in
    the page cache, reclaimable, and are not counted in this process's RSS beside their copy. (Where the cache holds
    2 MiB folios, a read of a neighbour still mapped maps its whole folio again.)"""
    import mmap

    region = getattr(view, "_mmap", None)
    if region is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = view.ctypes.data - np.frombuffer(region, np.uint8, count=1).ctypes.data
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        region.madvise(mmap.MADV_DONTNEED, first, last - first)


def _kernel_weights(model) -> set:
    """The parameters (names without their graph's prefix) a node calling our CPU kernels (cpu_kernels) reads, through
    Load and Depend: the matrices and vectors a step streams. Not the KV caches (those stay the runtime's zero pages)
    nor what only MindSpore's own ops or our lookups read (cpu_kernels.ROW_READERS: an untied embedding, Gather's or
    our kernel's, touches a few rows a step: mapped, only those pages are ever read; a 7B's bfloat16 table is 1 GB)."""
    import cpu_kernels

    from lite_runtime.folder import is_kv_cache

    funcs, _, resolve = _our_calls(model)
    params = {p.name for p in model.graph.parameter}
    reads = set()
    for node in model.graph.node:
        if funcs.get(node.op_type.rpartition("::")[2]) not in (None, *cpu_kernels.ROW_READERS):
            reads.update(n for n in map(resolve, node.input) if n in params)
    return {n.rsplit(":", 1)[-1] for n in reads if not is_kv_cache(n.rsplit(":", 1)[-1])}


def _relocate_kernels(model, path: str) -> None:
    """Point Custom ops that call our CPU kernels at this machine's library (see cpu_kernels)."""
    import cpu_kernels

    from lite_runtime.errors import InferError

    try:
        cpu_kernels.retarget(model, cpu_kernels.local_func)
    except FileNotFoundError as exc:
        raise InferError(f"{path}: the graph calls mslite-llm's CPU kernels, but {exc}") from None
    unknown = cpu_kernels.unknown_functions(model)
    if unknown:
        raise InferError(f"{path}: the graph calls CPU kernels this installation of mslite-llm does not have "
                         f"({', '.join(unknown)}): the folder was exported by another version; run it with that "
                         "version, or re-export it with this one")


def _int4_params(model, int8: bool = False) -> set:
    """The int4 weights of a parsed MindIR: its uint8 parameters of rank 2 (cpu_kernels' q [N, K / 2]) and 3 (a
    mixture of experts' stacked q [E, N, K / 2]); with `int8`, its int8 weights too (int8 parameters of rank 2, q
    [N, K], and 3, not a KV cache)."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.folder import is_kv_cache

    types = {mind_ir_pb2.TensorProto.DataType.Value("UINT8")}
    if int8:
        types.add(mind_ir_pb2.TensorProto.DataType.Value("INT8"))
    return {p.name for p in model.graph.parameter if p.data_type in types and len(p.dims) in (2, 3)
            and not is_kv_cache(p.name.rsplit(":", 1)[-1])}


def _our_calls(model):
    """Of a parsed MindIR: ({Custom primitive calling one of our ops: its function's name}, op_of(node): a node's
    operator, resolve(name): a node input back through Load and Depend to what they pass on). A graph that writes the
    KV cache reads its parameters through Load (and Depend passes its first input on): those outputs are the parameter
    itself."""
    import cpu_kernels

    funcs = {}
    for prim in model.primitives:
        for attr in prim.attribute:
            if attr.name == "func_name":
                func = attr.s.decode("utf-8", "replace")
                if cpu_kernels.names_our_library(func):
                    funcs[prim.name] = func.rpartition(":")[2]
    kind = {p.name: p.op_type for p in model.primitives}
    op_of = lambda node: kind.get(node.op_type.rpartition("::")[2], node.op_type)
    alias = {}
    for node in model.graph.node:
        if op_of(node) in ("Load", "Depend") and node.input:
            for out in node.output:
                alias[out] = node.input[0]
    resolve = lambda name: resolve(alias[name]) if name in alias else name
    return funcs, op_of, resolve


def _quant_op_inputs(model, int8: bool = False):
    """Per Custom primitive of a parsed MindIR that calls one of our ops: (its function, and per node the int4
    weights it reads, each as (parameter, the scale parameter after it)); and the int4 parameters any other node
    reads (_int4_params; our lookups among them, cpu_kernels.ROW_READERS: they read the table as stored); with
    `int8`, the int8 weights likewise."""
    import cpu_kernels

    params = {p.name: p for p in model.graph.parameter}
    int4 = _int4_params(model, int8)
    funcs, op_of, resolve = _our_calls(model)
    consumers = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    ops, others = {}, set()
    for node in model.graph.node:
        op = op_of(node)
        inputs = [resolve(name) for name in node.input]
        reads = [(name, inputs[i + 1] if i + 1 < len(inputs) else None)
                 for i, name in enumerate(inputs) if name in int4]
        if not reads or op in ("Load", "Depend", "UpdateState"):  # Depend's second input only orders
            continue
        prim = node.op_type.rpartition("::")[2]
        if prim in funcs and funcs[prim] not in cpu_kernels.ROW_READERS:
            ops.setdefault(prim, (funcs[prim], []))[1].append(reads)
        elif op == "MakeTuple" and all(op_of(c) == "UpdateState" for out in node.output for c in consumers.get(out, ())):
            continue  # a side effect's ordering, not a read
        else:
            others.update(name for name, _ in reads)
    return ops, others, params


def _repacked_weights(models, int8: bool) -> set:
    """The quantized weights (parameter names without their graph's prefix) the runtime repacks at load into bands of
    16 rows (int4: cpu_kernels.repack_int4_r16; int8, biased too: cpu_kernels.repack_int8_r16), over every graph of the
    folder (`models`, an iterable: not read where nothing is repacked). Those only our quantized ops read (R16_OPS),
    whose every op reads its quantized weights all banded or none (an R16 name reads them all so), with a scale after
    them whose groups take the banded form here: int4 where cpu_kernels.int4_r16_runs (AVX-512 VNNI or AVX2, x in
    int8), int8 with `int8` (the caller copies the weights: repacked in the copy, not in the file's pages) where
    cpu_kernels.int8_r16_runs (AVX-512 VNNI, x in int8; docs/architecture.md "int8 in bands of 16 rows"). Everything
    else stays as stored (a tied embedding the Gather reads, an odd K, another CPU or mode). MSLITE_LLM_INT4_BANDS=0
    keeps every int4 weight as stored, MSLITE_LLM_INT8_BANDS=0 every int8 one (the row-major forms: an A/B, or a
    suspicion).
    """
    import cpu_kernels

    int4 = cpu_kernels.bands_here(4)
    int8 = int8 and cpu_kernels.bands_here(8)
    if not int4 and not int8:
        return set()

    short = lambda name: name.rsplit(":", 1)[-1]
    fits, blocked, op_sets = {}, set(), []
    for model in models:
        ops, others, params = _quant_op_inputs(model, int8=True)  # an R16 op reads every int8 weight as banded
        blocked.update(short(n) for n in others)
        for function, nodes in ops.values():
            names = {short(n) for reads in nodes for n, _ in reads}
            op_sets.append(names)
            if function not in cpu_kernels.R16_OPS:
                blocked.update(names)
                continue
            for reads in nodes:
                for name, scale in reads:
                    q, sp = params[name], params.get(scale)  # q [(E,) N, K (int4: K / 2)], its scale [(E,) G, N]
                    four = q.data_type == q.UINT8
                    k = (2 if four else 1) * int(q.dims[-1])
                    ok = (sp is not None and len(sp.dims) == len(q.dims) and list(sp.dims[:-2]) == list(q.dims[:-2])
                          and int(sp.dims[-2]) > 0 and int(sp.dims[-1]) == int(q.dims[-2])
                          and k % int(sp.dims[-2]) == 0
                          and (int4 and cpu_kernels.int4_r16_runs(k, k // int(sp.dims[-2])) if four else
                               int8 and cpu_kernels.int8_r16_runs(k, k // int(sp.dims[-2]))))
                    fits[short(name)] = fits.get(short(name), True) and bool(ok)
    bands = {name for name, ok in fits.items() if ok and name not in blocked}
    changed = True
    while changed:  # an op with some weights banded and some not: none of them
        changed = False
        for names in op_sets:
            if names & bands and not names <= bands:
                bands -= names
                changed = True
    return bands


# The name a shared weight's second parameter takes (_split_shared_weights): the parameter's own, then this
KERNELS_COPY = ".kernels"


def _split_shared_weights(model) -> int:
    """A quantized weight that one of our R16 ops (cpu_kernels.R16_OPS) reads and another node reads too (a tied
    embedding: the graph's Gather looks up a few rows, the head's matmul reads it whole) is split in a parsed MindIR:
    our ops read a second parameter of the same data (its name + KERNELS_COPY, through a Load of its own where they read
    the first through one), which the runtime may repack (_repacked_weights) and copies into huge pages
    (_kernel_weights); the other nodes read the first, as stored in the file's mapping. Returns how many weights. The
    folder is unchanged; every graph of it is split the same way, so the second parameter is shared across them like
    the first (docs/architecture.md, "int8 in bands of 16 rows")."""
    import cpu_kernels

    ops, others, params = _quant_op_inputs(model, int8=True)
    ours = {name for function, nodes in ops.values() if function in cpu_kernels.R16_OPS
            for reads in nodes for name, _ in reads}
    shared = sorted(ours & others)
    if not shared:
        return 0
    funcs, op_of, _ = _our_calls(model)
    loads = {node.output[0]: node for node in model.graph.node
             if op_of(node) == "Load" and node.input and node.input[0] in shared}  # a Load's output -> the Load
    twins = {}  # a Load's output -> its twin over the second parameter
    split = set()
    out = []
    for node in model.graph.node:
        if funcs.get(node.op_type.rpartition("::")[2]) not in (None, *cpu_kernels.ROW_READERS):  # a lookup: as stored
            for j, name in enumerate(node.input):
                if name in shared:
                    node.input[j] = name + KERNELS_COPY
                    split.add(name)
                elif name in loads:
                    if name not in twins:
                        load = loads[name]
                        twin = type(load)()
                        twin.CopyFrom(load)
                        twin.input[0] = load.input[0] + KERNELS_COPY
                        twin.output[0] = load.output[0] + KERNELS_COPY
                        twin.name = load.name + KERNELS_COPY
                        twins[name] = twin
                        out.append(twin)  # before its first reader
                    node.input[j] = twins[name].output[0]
                    split.add(loads[name].input[0])
        out.append(node)
    for name in sorted(split):
        copy = model.graph.parameter.add()
        copy.CopyFrom(params[name])
        copy.name = name + KERNELS_COPY
    from lite_runtime.backends.standins import set_nodes

    set_nodes(model, out)
    return len(split)


def _use_bands(model, bands: set) -> int:
    """Point each of our quantized ops whose quantized weights are all in `bands` (_repacked_weights) at its R16 name
    (cpu_kernels.R16_OPS); returns how many primitives."""
    import cpu_kernels

    if not bands:
        return 0
    ops, _, _ = _quant_op_inputs(model, int8=True)
    renamed = 0
    for prim in model.primitives:
        if prim.name not in ops:
            continue
        function, nodes = ops[prim.name]
        names = {n.rsplit(":", 1)[-1] for reads in nodes for n, _ in reads}
        if not names or not names <= bands:
            continue
        for attr in prim.attribute:
            text = attr.s.decode("utf-8", "replace") if attr.s else ""
            if text.endswith(":" + function):
                attr.s = (text[:-len(function)] + cpu_kernels.R16_OPS[function]).encode()
        renamed += 1
    return renamed


def _substitute_standins(model, path: str, counts: Dict[str, int]) -> None:
    """Replace the Ascend fused operators of a `--graph fused` graph by their CPU stand-ins (backends/standins.py)."""
    import cpu_kernels

    from lite_runtime.backends import standins
    from lite_runtime.errors import InferError

    def local(function: str) -> str:
        try:
            return cpu_kernels.local_func(function)
        except FileNotFoundError as exc:
            raise InferError(f"{path}: the graph calls Ascend's fused operators, whose CPU stand-ins are in "
                             f"mslite-llm's kernel library, but {exc}") from None

    for op, n in standins.substitute(model, local, path).items():
        counts[op] = counts.get(op, 0) + n


def _join_ranks(folder) -> int:
    """This process's rank in a tensor-parallel folder's group (MindSpore's collectives, set up by msrun)."""
    from mindspore.communication import get_group_size, get_rank, init
    from mindspore.communication.management import GlobalComm

    from lite_runtime.errors import InferError

    tp = folder.tp_size
    if not GlobalComm.INITED:
        if "MS_WORKER_NUM" not in os.environ:
            raise InferError(f"{folder.path}: the folder is split over {tp} ranks (--tp_size {tp}); run one process "
                             f"per rank under MindSpore's launcher: msrun --worker_num {tp} --local_worker_num {tp} "
                             "<your script>")
        init()
    if get_group_size() != tp:
        raise InferError(f"{folder.path}: the folder is split over {tp} ranks, but this job has {get_group_size()} "
                         f"processes; launch it with msrun --worker_num {tp}")
    return get_rank()


def _retarget_collectives(model) -> None:
    """The graphs' collectives (AllReduce, and AllGather of vocab-parallel logits) name HCCL's world group (what
    Lite on Atlas runs); here it is MindSpore's own."""
    from mindspore.communication.management import GlobalComm

    for prim in model.primitives:
        if prim.op_type in ("AllReduce", "AllGather"):
            for attr in prim.attribute:
                if attr.name == "group":
                    attr.s = GlobalComm.WORLD_COMM_GROUP.encode()


def _load_without_data(ms, model, name: str):
    """mindspore.load of a parsed MindIR with its parameters' data (embedded or external) cleared.

    Clears the fields on `model` itself; read its specs and data locations first.
    """
    for param in model.graph.parameter:
        param.ClearField("raw_data")
        param.ClearField("external_data")
    with tempfile.TemporaryDirectory(prefix="mslite-llm-") as tmp:
        stripped = os.path.join(tmp, name)
        with open(stripped, "wb") as fh:
            fh.write(model.SerializeToString())
        return ms.load(stripped)


def _set_cpu_threads(ms, threads) -> int:
    """MindSpore's CPU kernels default to a pool of 25-30 threads whatever the machine; use the cores we have.

    It can be set once per process; a process that set it already keeps its own choice.
    """
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ms.device_context.cpu.op_tuning.threads_num(int(threads))
    except RuntimeError:
        pass
    return int(threads)


class MsBackend:
    """Graphs are read and compiled on first use (`prepare` or `run`), not at construction.

    Loading a graph is cheap (0.1 s for the 0.5B shape: the proto holds no weights); compiling it is
    not (0.6-0.8 s each on 2 cores). A folder has a prefill graph per prompt bucket, and a request
    needs one of them and the inc graph, so constructing reads nothing and the first request pays for
    exactly the graphs it uses; the generator compiles the common ones while it is idle.
    """

    name = "ms"

    def __init__(self, config) -> None:
        ms, nn = _mindspore()
        if (config.compute_dtype or config.dtype) == "bfloat16":
            from lite_runtime.errors import InferError

            raise InferError(f"{config.prefill_model_path}: a bfloat16 graph has no CPU kernels in MindSpore; "
                             "run it with backend 'mslite' on Atlas A2, or re-export with --dtype float32")
        ms.set_context(mode=ms.GRAPH_MODE)
        threads = _set_cpu_threads(ms, config.cpu_threads)
        import cpu_kernels

        cpu_kernels.set_threads(threads)
        self._threads = threads
        self._ms, self._nn = ms, nn
        self._tp = config.tp_size > 1
        if self._tp:  # a tensor-parallel folder: this process runs its rank's graphs (every rank steps together)
            config = dataclasses.replace(config, rank_id=_join_ranks(config.folder))
        self.config = config  # the caller's, with the rank resolved: a copy (the caller's is not changed)
        if config.folder is not None:  # a float16 folder too big for MindSpore's float32 copies: say so now
            from lite_runtime.memory import refuse_if_too_big

            refuse_if_too_big(config.folder, int(config.rank_id) if self._tp else 0)
        # copy the CPU kernels' weights into huge pages at load where that memory is there (_into_huge_pages)
        from lite_runtime.memory import weights_copy_bytes

        self._copy_weights = config.folder is None or weights_copy_bytes(
            config.folder, int(config.rank_id) if self._tp else 0) > 0
        # a tied embedding: our ops read a copy of their own, which can be banded (_split_shared_weights)
        self._split_shared = self._copy_weights and cpu_kernels.library_path() is not None and \
            os.environ.get("MSLITE_LLM_HUGE_PAGES") != "0" and (cpu_kernels.int8_r16_runs(64, 64) or
                                                               cpu_kernels.int4_r16_runs(64, 64))
        self._paths = config.graph_paths()
        self._num_blocks = int(config.num_blocks)  # the KV pool's blocks (the runner's plan: lite_runtime/engine/kv_pool.py)
        self._kv_dtype = config.kv_cache_dtype  # None: the folder's (float32 for check's exact replays: _size_caches)
        self._folder = config.folder  # (None: graph files without their folder)
        self._parsed = {}  # key -> parsed proto, read for its specs and not loaded yet
        self.specs = {}
        self.cells = {}
        self._compiled = set()
        self._launchers = {}  # key -> the compiled graph's run (_launcher), after its first call
        self._owned = {}  # parameter name -> the Parameter every graph shares (weights and KV cache)
        self._owner = ""  # the graph whose parameters the others share
        self._bands = set()  # int4 and int8 weights repacked into bands of 16 rows at load (_repacked_weights)
        self._weights: Dict[str, np.ndarray] = {}  # parameter name -> its array (not the KV caches), from the first graph
        self._arena = None  # (the huge-page arena, weight -> byte offset in it): _into_huge_pages
        # our ops handed the arena and a table rather than a tensor per weight (arena.py; MSLITE_LLM_ARENA_CALLS=0: not;
        # nor with a library built before the arena call: the graphs as exported)
        self._arena_calls = os.environ.get("MSLITE_LLM_ARENA_CALLS") != "0" and \
            cpu_kernels.has_function(cpu_kernels.ARENA_CALL)
        # a call's inputs copied into Tensors of their own: Tensor.from_numpy (no copy, ~60 us less a SmolLM2 step)
        # deadlocks, as MindSpore's actor threads free a graph's device addresses, which then take the GIL to let go
        # of the numpy array while the launching thread holds it (docs/performance-log.md 57)
        self._tensor = ms.Tensor
        # graphs of our kernels and a few small ops run directly, without MindSpore's executor (direct.py; "Direct
        # steps"): key -> its plan; the others' keys -> why not (MSLITE_LLM_DIRECT_STEPS=0: none)
        self._direct = os.environ.get("MSLITE_LLM_DIRECT_STEPS") != "0" and cpu_kernels.library_path() is not None
        self.plans: Dict[str, object] = {}
        self.unplanned: Dict[str, str] = {}
        self._caches: Dict[str, np.ndarray] = {}  # KV cache name -> the array its Parameter holds
        self.standins: Dict[str, int] = {}  # fused op -> nodes replaced by CPU stand-ins, over the graphs loaded
        if cpu_kernels.library_path() is None:  # say so at load, not at the first decode step
            _relocate_kernels(self._parse("inc"), self._paths["inc"])

    def _parse(self, key: str):
        if key not in self.specs:
            model = _read_mindir(self._paths[key])
            self.specs[key] = mindir_specs(model)
            if self._split_shared:
                _split_shared_weights(model)
            self._parsed[key] = model
        return self._parsed.get(key)

    def _cell(self, key: str):
        cell = self.cells.get(key)
        if cell is not None:
            return cell
        import cpu_kernels

        from lite_runtime.backends import arena as arena_calls
        from lite_runtime.folder import is_kv_cache

        path = self._paths[key]
        model = self._parse(key)
        if not self._owned and _int4_params(model, int8=True):  # the first graph of a quantized folder: which
            # weights every graph of the folder can read repacked (the others parsed only where a form needs it)
            self._bands = _repacked_weights((self._parse(k) for k in self._paths), self._copy_weights)
        del self._parsed[key]
        if self._folder is not None:
            _check_cache_dtype(model, path, self._folder.kv_cache)
        _size_caches(model, self._num_blocks, self._kv_dtype)
        arrays = _parameter_arrays(model, path) if not self._owned else None  # read before the data is cleared
        if arrays is not None:
            copied = set(self._bands)
            if self._copy_weights:  # what our kernels read in any graph (a prefill's last norm may not be)
                copied |= _kernel_weights(model).union(*(_kernel_weights(self._parse(k)) for k in self._paths
                                                         if k != key))
            self._arena = _into_huge_pages(arrays, copied, self._bands, self._threads)
            if self._arena is not None:
                arrays[arena_calls.ARENA_PARAMETER] = self._arena[0]
            self._weights = {name: a for name, a in arrays.items() if not is_kv_cache(name)}
            self._caches = {name: a for name, a in arrays.items() if is_kv_cache(name)}
        _relocate_kernels(model, path)
        _use_bands(model, self._bands)
        _substitute_standins(model, path, self.standins)
        if self._arena is not None and self._arena_calls:
            arena_calls.call_through_arena(model, self._arena[1], self._arena[0].nbytes, cpu_kernels.function_address,
                                           cpu_kernels.local_func(cpu_kernels.ARENA_CALL), cpu_kernels.ROW_READERS)
        if self._tp:
            _retarget_collectives(model)
        plan_model = model if self._direct else None  # (a plan reads the proto's nodes, not its parameters' data)
        cell = self._nn.GraphCell(_load_without_data(self._ms, model, os.path.basename(path)))
        params = list(cell.get_parameters())
        if arrays is None:
            missing = next((p.name for p in params if p.name not in self._owned and p.name not in self._weights
                            and not is_kv_cache(p.name)), None)
            if missing is not None:
                from lite_runtime.errors import InferError

                raise InferError(f"{path}: parameter {missing} is not in {self._paths[self._owner]}; the graphs "
                                 "do not belong to one export")
        for param in params:
            if param.name in self._owned:
                param.set_data(self._owned[param.name])
            elif arrays is not None or param.name in self._weights:  # (a weight the first graph did not read itself:
                # an arena call's, or the arena)
                self._owned[param.name] = param
                array = (arrays if arrays is not None else self._weights)[param.name]
                if param.dtype == self._ms.bfloat16:
                    # numpy has no bfloat16: the bits are read as uint16 and viewed as MindSpore's numpy bfloat16.
                    # A MindSpore-side view (Tensor.view) would be copied at the first run (1 GB for the 0.5B shape)
                    from mindspore.common import np_dtype

                    array = array.view(np_dtype.bfloat16)
                param.set_data(self._ms.Tensor.from_numpy(array))
            else:  # a KV cache after use_cache_dtype: zeros of its shape and dtype, ours (a direct step writes the
                # memory MindSpore's graphs read), shared from here on
                self._owned[param.name] = param
                bf16 = param.dtype == self._ms.bfloat16
                array = np.zeros(tuple(param.shape), np.uint16 if bf16 else self._ms.dtype_to_nptype(param.dtype))
                self._caches[param.name] = array
                if bf16:
                    from mindspore.common import np_dtype

                    array = array.view(np_dtype.bfloat16)
                param.set_data(self._ms.Tensor.from_numpy(array))
        if arrays is not None:
            self._owner = key
        if plan_model is not None:
            self._plan(key, plan_model)
        self.cells[key] = cell
        return cell

    def _plan(self, key: str, model) -> None:
        """A direct run of graph `key` where it is our kernels and a few small ops (direct.py; "Direct steps")."""
        import cpu_kernels

        from lite_runtime.backends import direct

        try:
            self.plans[key] = direct.build(model, {**self._weights, **self._caches}, cpu_kernels._library())
        except direct.NoPlan as exc:
            self.unplanned[key] = str(exc)

    def use_cache_dtype(self, dtype: Optional[str]) -> None:
        """The graphs rebuilt with KV caches of `dtype` ("float32", or None: the folder's own), every weight Parameter
        kept (no second copy of the weights): check runs its x-exact replays on float32 caches, then its serving
        replay on the folder's bfloat16 ones (InferConfig.kv_cache_dtype). The new caches start as zeros: the pool's
        contents are gone (ModelRunner.use_cache_dtype forgets them)."""
        from lite_runtime.folder import is_kv_cache

        with MINDSPORE_LOCK:
            self._kv_dtype = dtype
            self._owned = {name: p for name, p in self._owned.items() if not is_kv_cache(name)}
            self.cells, self._compiled, self._launchers, self._parsed, self.specs = {}, set(), {}, {}, {}
            self.plans, self.unplanned = {}, {}
            self._caches = {}  # the new caches' arrays are made as the graphs load (_cell)
            self.standins = {}  # counted again as the graphs load

    def input_specs(self, key: str) -> Tuple[TensorSpec, ...]:
        self._parse(key)
        return self.specs[key][0]

    def prepare(self, key: str) -> None:
        """Load and compile `key` without running it: no input is read and the KV cache is left as it is."""
        if key in self._compiled:
            return
        with MINDSPORE_LOCK:
            self._prepare(key)

    def _prepare(self, key: str) -> None:
        cell = self._cell(key)
        if key in self.plans:  # run directly: nothing for MindSpore to compile
            self._compiled.add(key)
            return
        args = [self._tensor(np.ones(s.shape, s.dtype)) for s in self.specs[key][0]]
        # what GraphCell.__call__ does before compile_and_run, then the compile half of it
        cell.phase = "graph_load_from_mindir"
        cell._add_attr("graph_load_from_mindir", cell.graph)
        with _collector_paused():
            cell.compile(*args)
        self._compiled.add(key)

    def run(self, key: str, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        with MINDSPORE_LOCK:
            cell = self._cell(key)
            plan = self.plans.get(key)
            if plan is not None:
                self._compiled.add(key)
                return plan.run(bind_inputs(key, [s.name for s in self.specs[key][0]], inputs))
            args = [self._tensor(a) for a in bind_inputs(key, [s.name for s in self.specs[key][0]], inputs)]
            launch = self._launchers.get(key)
            if launch is not None:
                return launch(args)
            with contextlib.nullcontext() if key in self._compiled else _collector_paused():  # the first call compiles
                out = cell(*args).asnumpy()
            if key not in self._launchers:  # asked once: None (the cell's call) stays None
                self._launchers[key] = _launcher(cell)
        self._compiled.add(key)
        return out
