"""The `ms` backend's arena calls (lite_runtime/backends/arena.py; cpu_kernels/registry.cc MsliteLlmArenaCall): each
of our ops handed the huge-page arena and a table instead of a tensor per weight. The kernel against the op it wraps,
its refusals of a table that does not fit, the rewritten graph's shape, and every graph kind's logits bit for bit
against the same folder loaded without them (MSLITE_LLM_ARENA_CALLS=0), on float32, bfloat16, int8 and int4 folders."""
from __future__ import annotations

import contextlib
import os
import struct

import numpy as np
import pytest

import cpu_kernels
from lite_runtime.backends import arena as arena_calls
from test_quant_kernels import call_kernel

pytestmark = pytest.mark.skipif(cpu_kernels.library_path() is None, reason="the CPU kernel library is not built")


def _table(function: str, entries, passed: int, blob: bytes = b"", magic: int = arena_calls.MAGIC) -> np.ndarray:
    """A table as arena.py writes it: entries (where, offset, dtype code, dims); `blob` after them."""
    words = [magic, cpu_kernels.function_address(function), len(entries), passed]
    for where, offset, code, dims in entries:
        words += [where, offset, code, len(dims), *dims]
    raw = struct.pack(f"<{len(words)}q", *words) + blob + b"\0" * (-len(blob) % 8)
    return np.frombuffer(raw, np.int64).copy()


def test_an_arena_call_is_the_op_it_wraps_and_refuses_a_table_that_does_not_fit():
    """MsliteLlmRmsNorm (x [N, E], w [E], eps [1] -> y) through MsliteLlmArenaCall: w at a place in the arena, eps
    folded into the table, x passed; y bit for bit the op's own. A table of another version, a place past the arena's
    end, a dtype or rank outside the kernel's, or a count of passed inputs the call does not have: the kernel's error
    code (1 a table that does not fit the call, 2 dtype, 3 rank, 4 a place outside), y untouched."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    eps = np.array([1e-6], np.float32)
    want = np.zeros((3, 40), np.float32)
    assert call_kernel(cpu_kernels.RMS_NORM, x, w, eps, want) == 0
    arena = np.zeros(4096, np.uint8)
    arena[256:256 + w.nbytes] = w.view(np.uint8)
    head = 8 * (4 + 4 + 4 + 1 + 4 + 1)  # the blob (eps) after three entries of ranks 0, 1, 1
    good = [(arena_calls.PASSED, 0, 0, []), (arena_calls.IN_ARENA, 256, 0, [40]), (arena_calls.IN_TABLE, head, 0, [1])]
    call = lambda table, y, passed=(x,): call_kernel(cpu_kernels.ARENA_CALL, table, arena, *passed, y)
    y = np.zeros_like(want)
    assert call(_table(cpu_kernels.RMS_NORM, good, 1, eps.tobytes()), y) == 0
    assert np.array_equal(y, want)

    def refused(entries, code, passed=1, magic=arena_calls.MAGIC, inputs=(x,)):
        y = np.full_like(want, 7.0)
        assert call(_table(cpu_kernels.RMS_NORM, entries, passed, eps.tobytes(), magic), y, inputs) == code
        assert (y == 7.0).all()

    refused(good, 1, magic=arena_calls.MAGIC + 1)
    refused([good[0], (arena_calls.IN_ARENA, 4096 - 4 * 39, 0, [40]), good[2]], 4)  # 4 bytes past the end
    refused([good[0], (arena_calls.IN_ARENA, -4, 0, [40]), good[2]], 4)
    refused([good[0], good[1], (arena_calls.IN_TABLE, head + 8, 0, [2])], 4)  # past the table's end
    refused([good[0], (arena_calls.IN_ARENA, 256, 17, [40]), good[2]], 2)
    refused([good[0], (arena_calls.IN_ARENA, 256, 0, [1] * 9), good[2]], 3)
    refused(good, 1, passed=2)  # says two follow the arena; the call has one and y
    refused(good, 1, passed=0, inputs=())  # x passed, but the table's entry says passed: none left


def _graph(path):
    from lite_runtime.backends.ms import _read_mindir

    return _read_mindir(path)


def test_a_folder_calling_the_arena_call_is_refused_at_load(exported):
    """MsliteLlmArenaCall takes a function's address from its table: only the runtime writes one, at load. A graph
    that names it (a folder from elsewhere) is refused like any function the library does not list."""
    from lite_runtime import InferError
    from lite_runtime.backends.ms import _relocate_kernels

    path = os.path.join(exported["gqa_tied"], "gqa_tied_inc_graph.mindir")
    model = _graph(path)
    for prim in model.primitives:
        for attr in prim.attribute:
            if attr.s and attr.s.decode().endswith(":" + cpu_kernels.DECODE_LAYER):
                attr.s = attr.s.decode().replace(cpu_kernels.DECODE_LAYER, cpu_kernels.ARENA_CALL).encode()
    with pytest.raises(InferError) as err:
        _relocate_kernels(model, path)
    assert str(err.value) == (
        f"{path}: the graph calls CPU kernels this installation of mslite-llm does not have (MsliteLlmArenaCall): "
        "the folder was exported by another version; run it with that version, or re-export it with this one")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, checkpoints):
    """float32 (tied head, prompt buckets), bfloat16 (untied: the table our lookup reads stays out of the arena), int8
    and int4 (Qwen3: per-head norms; Llama) folders, each with chunk and score graphs and step graphs of 1 and 2 rows."""
    from export.checkpoints import random_checkpoint
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("arena")
    qwen3 = random_checkpoint.make_checkpoint(str(root / "qwen3"), family="qwen3", seed=5)
    llama = random_checkpoint.make_checkpoint(str(root / "llama"), family="llama", seed=6)
    plans = {"float32": (checkpoints["gqa_tied"], dict(dtype="float32", prefill_buckets=(8,))),
             "bfloat16": (checkpoints["mha_untied"], dict(dtype="bfloat16")),
             "int8": (llama, dict(dtype="bfloat16", quantize="int8")),
             "int4": (qwen3, dict(dtype="bfloat16", quantize="int4", group_size=32))}
    out = {}
    for name, (ckpt, kw) in plans.items():
        out[name] = str(root / name)
        run_export(ExportConfig(checkpoint=ckpt, output=out[name], name=name, seq_length=32, batch_size=2,
                                device="cpu", block_size=8, **kw))
    return out


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _run_every_graph(pipe):
    """A prompt prefilled, three steps (one row, then two: both step graphs), a chunk beside a step, a score piece, a
    prompt through the prefill graph: every output, copied."""
    from lite_runtime.engine.runner import SequenceBlocks, StepRow

    r = pipe.runner
    a, b = SequenceBlocks(r.pool), SequenceBlocks(r.pool)
    a.reserve(32), b.reserve(32)
    prompt = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64]
    out = [r.prefill([prompt], [a.blocks]).copy()]
    token, length = int(np.argmax(out[-1][0])), len(prompt) + 1
    out.append(r.step([StepRow(token, length, a.blocks), None]).copy())
    out.append(r.prefill([prompt[:6]], [b.blocks]).copy())
    for i in range(2):
        out.append(r.step([StepRow(token, length + 1 + i, a.blocks), StepRow(9 + i, 7 + i, b.blocks)]).copy())
    step, last = r.chunk([8, 9, 10], 8, b.blocks, [StepRow(token, length + 3, a.blocks), None])
    out += [step.copy(), np.array(last, copy=True)]
    out.append(np.array(r.chunk([11, 12, 13, 14], 11, b.blocks, r.idle(), every=True)[1], copy=True))
    c = SequenceBlocks(r.pool)
    c.reserve(32)
    r.prefill_in_pieces = False  # the prefill graph itself (one prompt goes in pieces by default)
    try:
        out.append(r.prefill([prompt[:7]], [c.blocks]).copy())
    finally:
        r.prefill_in_pieces = True
    a.release(commit=False), b.release(commit=False), c.release(commit=False)
    return out


def _load(folder):
    from lite_runtime import pipeline

    return pipeline("text_generation", model=folder, backend="ms", warm_up="none", chunk_graphs=True,
                    score_graphs=True)


def _mindspore_and_direct(folder):
    """(the folder loaded with MSLITE_LLM_DIRECT_STEPS=0: MindSpore runs every graph; the folder loaded as by
    default: direct steps)."""
    with _env("MSLITE_LLM_DIRECT_STEPS", "0"):
        plain = _load(folder)
    return plain, _load(folder)


def _assert_bit_for_bit(got, want, *label):
    assert len(got) == len(want) == 9
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and np.array_equal(g, w), (*label, i)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_arena_calls_change_no_bit_of_any_graphs_output(folders, kind):
    """The folder loaded with arena calls (the default) and with MSLITE_LLM_ARENA_CALLS=0 (a tensor per weight), every
    graph run by MindSpore:
    prefill, step (graphs of 1 and 2 rows), chunk and score logits bit for bit equal; the default's step graph hands
    our ops the arena, and no layer's weight as a Parameter of its own."""
    from lite_runtime.folder import is_kv_cache

    with _env("MSLITE_LLM_DIRECT_STEPS", "0"):  # MindSpore runs every graph (the direct steps: below)
        with _env("MSLITE_LLM_ARENA_CALLS", "0"):
            plain = _load(folders[kind])
        pipe = _load(folders[kind])
    _assert_bit_for_bit(_run_every_graph(pipe), _run_every_graph(plain), kind)
    backend = pipe.backend
    arena, places = backend._arena
    inc = {p.name for p in backend._cell("inc").get_parameters()}
    assert arena_calls.ARENA_PARAMETER in inc
    assert backend._owned[arena_calls.ARENA_PARAMETER].data_ptr() == arena.ctypes.data
    # what stays a Parameter of the graph: the caches, the embedding's a lookup reads, and those a Load reads (the
    # final norm's and the head's: their Load orders a side effect, the op reads the arena); no layer's
    assert places and not {n for n in inc & set(places) if ".layers." in n}, sorted(inc & set(places))
    assert all(n.startswith(("model.embed_tokens.", "model.norm.", "lm_head.")) for n in inc
               if not is_kv_cache(n) and n != arena_calls.ARENA_PARAMETER), sorted(inc)
    plain_inc = {p.name for p in plain.backend._cell("inc").get_parameters()}
    assert arena_calls.ARENA_PARAMETER not in plain_inc and set(places) & plain_inc


def test_the_rewrite_hands_an_op_a_table_the_arena_and_its_other_inputs(folders):
    """arena.call_through_arena on an int4 step graph: each layer op's weights leave its inputs (the table holds their
    places) and its constants are folded into the table; what stays is the table, the arena, the activations, KV
    caches and the step's lengths and tables in their order, then the side effect's monad; the weights' Parameters
    nothing else reads are gone, the arena's is there."""
    from lite_runtime.backends.ms import _our_calls, _relocate_kernels

    path = os.path.join(folders["int4"], "int4_inc_graph.mindir")
    model = _graph(path)
    _relocate_kernels(model, path)
    funcs, op_of, resolve = _our_calls(model)
    weight = lambda name: resolve(name).rsplit(":", 1)[-1] in places
    before = {n.name: list(n.input) for n in model.graph.node if n.op_type.rpartition("::")[2] in funcs}
    constants = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    updates = {o for n in model.graph.node if op_of(n) == "UpdateState" for o in n.output}
    params = {p.name.rsplit(":", 1)[-1]: p for p in model.graph.parameter}
    weights = sorted(n for n, p in params.items() if "layers." in n and "cache" not in n)
    places, at = {}, 0
    for name in weights:
        places[name] = at
        at += 4096
    n = arena_calls.call_through_arena(model, places, at, cpu_kernels.function_address,
                                       cpu_kernels.local_func(cpu_kernels.ARENA_CALL), cpu_kernels.ROW_READERS)
    layers = [name for name, inputs in before.items() if any(map(weight, inputs))]
    assert n == len(layers) == 2  # the two layers' ops (the head reads the tied table: not a place here)
    nodes = {node.name: node for node in model.graph.node}
    outputs = {o: node for node in model.graph.node for o in node.output}
    names = {p.name.rsplit(":", 1)[-1] for p in model.graph.parameter}
    assert arena_calls.ARENA_PARAMETER in names and not names & set(places)
    for name in layers:
        node, old = nodes[name], before[name]
        table = outputs[node.input[0]]
        assert table.op_type == "Constant" and table.attribute[0].tensors[0].data_type == \
            type(table.attribute[0].tensors[0]).DataType.Value("INT64")
        assert node.input[1].endswith(":" + arena_calls.ARENA_PARAMETER)
        kept = [i for i in old if not weight(i) and i not in constants]
        assert list(node.input[2:]) == kept  # the others in their order, the monad (UpdateState's) last
        assert kept[-1] in updates
        assert len(node.input) <= len(old) - 20, (len(node.input), len(old))
        raw = table.attribute[0].tensors[0].raw_data
        words = struct.unpack("<4q", raw[:32])
        assert words[0] == arena_calls.MAGIC and words[2] == len(old) - 1 and words[3] == len(kept) - 1


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_direct_steps_change_no_bit_of_any_graphs_output(folders, kind):
    """The default (step, chunk and score graphs run directly: lite_runtime/backends/direct.py) against
    MSLITE_LLM_DIRECT_STEPS=0 (MindSpore runs every graph): prefill (in pieces and through the prefill graph), step
    (1 and 2 rows), chunk and score logits bit for bit equal, on the folder's KV caches and again on float32 ones
    (use_cache_dtype: the caches are new arrays, the plans built again on them); the prefill graphs (MindSpore's
    ops) have no plan and say why."""
    plain, pipe = _mindspore_and_direct(folders[kind])
    for dtype in (None, "float32"):
        if dtype is not None:
            plain.runner.use_cache_dtype(dtype)
            pipe.runner.use_cache_dtype(dtype)
        _assert_bit_for_bit(_run_every_graph(pipe), _run_every_graph(plain), kind, dtype)
        backend = pipe.backend
        cells = set(backend.cells)
        assert {k for k in cells if not k.startswith("prefill")} <= set(backend.plans), backend.unplanned
        assert set(backend.plans) | set(backend.unplanned) == cells
        assert "inc" in backend.plans and any(k.startswith("chunk") for k in backend.plans) \
            and any(k.startswith("score") for k in backend.plans)
        # the prefill graphs hold MindSpore's SiLU, MatMul, Tile
        assert all(k.startswith("prefill") and v.startswith("op ") for k, v in backend.unplanned.items())
        assert not plain.backend.plans


def test_a_direct_steps_kernel_error_names_the_op(folders):
    """An id outside the table (what the runner never sends) through the int8 folder's step graph run directly: our
    lookup's error code, raised naming the op, as MindSpore reports a failed kernel; nothing else changed."""
    from lite_runtime import pipeline
    from lite_runtime.backends.direct import KernelError

    pipe = pipeline("text_generation", model=folders["int8"], backend="ms", warm_up="none")
    backend = pipe.backend
    backend.prepare("inc")
    assert "inc" in backend.plans
    inputs = {s.name.rsplit(":", 1)[-1]: np.zeros(s.shape, s.dtype) for s in backend.input_specs("inc")}
    ids = next(name for name in inputs if name.endswith("input_ids"))
    inputs[ids][...] = 10 ** 6
    with pytest.raises(KernelError) as err:
        backend.run("inc", inputs)
    assert str(err.value) == f"{cpu_kernels.EMBED_QUANT} returned error 5 in a direct step"


@pytest.mark.parametrize("kind,checkpoint,tied", [("int8", "gqa_tied", True), ("int4", "mha_untied", False)])
def test_folders_exported_before_the_lookup_kernel_run_directly_too(tmp_path, checkpoints, monkeypatch, kind,
                                                                    checkpoint, tied):
    """A quantized CPU folder exported before MsliteLlmEmbedQuant looks its table up by plain ops (an int8 table:
    Gather, Cast, Transpose, Mul; an untied int4 one: its bytes unpacked by FloorDiv and Stack too): its step, chunk and
    score graphs still run directly, bit for bit as MindSpore runs them."""
    import export.network.layers as layers
    from export.config import ExportConfig
    from export.pipeline import run_export

    monkeypatch.setattr(layers, "kernel_embed_quant", lambda packed: None)  # the lookup as those folders have it
    out = str(tmp_path / kind)
    run_export(ExportConfig(checkpoint=checkpoints[checkpoint], output=out, name=kind, seq_length=32, batch_size=2,
                            device="cpu", block_size=8, dtype="bfloat16", quantize=kind, group_size=32))
    monkeypatch.undo()
    graph = open(os.path.join(out, f"{kind}_inc_graph.mindir"), "rb").read()
    assert cpu_kernels.EMBED_QUANT.encode() not in graph and (b"FloorDiv" in graph) == (not tied)
    plain, pipe = _mindspore_and_direct(out)
    _assert_bit_for_bit(_run_every_graph(pipe), _run_every_graph(plain), kind)
    assert "inc" in pipe.backend.plans and not plain.backend.plans, pipe.backend.unplanned


def test_a_mixture_of_experts_runs_directly_where_its_graph_is_our_ops(tmp_path):
    """Qwen3-MoE (int4 experts, our MoE op; the chunk graph's fused q/k/v op gives three outputs, taken by
    TupleGetItem): every step, chunk and score graph runs directly, bit for bit as MindSpore runs it. Qwen2-MoE's
    shared expert is MindSpore's ops (SiLU, Sigmoid, MatMul): no plan, MindSpore runs those graphs, and says why."""
    from export.checkpoints import random_checkpoint
    from export.config import ExportConfig
    from export.pipeline import run_export

    for family, quantize in (("qwen3_moe", "int4"), ("qwen2_moe", None)):
        ckpt = random_checkpoint.make_checkpoint(str(tmp_path / ("ckpt-" + family)), family=family, seed=3)
        out = str(tmp_path / family)
        run_export(ExportConfig(checkpoint=ckpt, output=out, name=family, seq_length=32, batch_size=2, device="cpu",
                                block_size=8, dtype="bfloat16",
                                **(dict(quantize=quantize, group_size=32) if quantize else {})))
        plain, pipe = _mindspore_and_direct(out)
        _assert_bit_for_bit(_run_every_graph(pipe), _run_every_graph(plain), family)
        backend = pipe.backend
        if family == "qwen3_moe":
            assert sorted(backend.plans) == sorted(k for k in backend.cells if not k.startswith("prefill"))
        else:
            assert not backend.plans and backend.unplanned["inc"] == "op SiLU"
