"""Quantized folders (issue 31): int8/int4 linear layers from a float checkpoint (round-to-nearest), and kept as they
are from GPTQ, AWQ and GGUF Q8_0/Q4_0/Q4_1 files; on the CPU (cpu_kernels/quant.cc) and in the Atlas fused form
(WeightQuantBatchMatmul, CPU stand-in). Each folder is held to HF transformers on the weights it holds, dequantized
(export.compare), its golden references replay (check), its integers are the source's bit for bit where the
checkpoint was quantized already, and every refusal is one exact line that leaves nothing behind."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from export.errors import ExportError
from export.writers.golden import LEAD_CAP, agreement_rows, plan_batches
from export.network.quantize import choose_group, dequantize, pack_int4, rtn, unpack_int4
from export.checkpoints.random_checkpoint import make_checkpoint

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


# ------------------------------------------------------------------------------------------------------ the numbers

@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), group=st.sampled_from([32, 64]), bits=st.sampled_from([4, 8]),
       seed=st.integers(0, 2 ** 31), spread=st.floats(1e-4, 1e3))
def test_rtn_is_within_half_a_step_and_packs_losslessly(rows, groups, group, bits, seed, spread):
    w = (np.random.default_rng(seed).standard_normal((rows, groups * group)) * spread).astype(np.float32)
    q, scale, offset = rtn(w, bits, group, symmetric=bits == 8)
    assert q.dtype == np.int8 and scale.shape == (rows, groups)
    lo, hi = (-127, 127) if bits == 8 else (-8, 7)
    assert q.min() >= lo and q.max() <= hi
    back = dequantize(q, scale, offset)
    step = np.repeat(scale, group, axis=1)
    assert np.all(np.abs(back - w) <= step * 0.5 + np.abs(w) * 1e-6 + 1e-30)
    if bits == 4:
        assert np.array_equal(unpack_int4(pack_int4(q)), q)


def test_int4_packing_is_low_nibble_first():
    q = np.array([[1, -2, 7, -8]], np.int8)
    assert pack_int4(q).tolist() == [[0xE1, 0x87]]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [0, 32, 128])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_round_to_nearest_in_c_is_numpys_bit_for_bit(stored, group, bits, symmetric):
    """export/native/rtn.c against rtn() (numpy, the documented rule): integers, scales and offsets bit for bit, on
    groups of every kind: normal weights, exact ties (x / scale at k + 0.5), all zero, constant, one-signed, subnormal,
    near float32's largest; a value that is not finite leaves the choice to rtn()."""
    from export import native
    from export.checkpoints.safetensors import widen

    _assert_native_built("rtn.c")
    rng = np.random.default_rng([stored == "bfloat16", group, bits, symmetric])
    width = 256
    g = width if group == 0 else group
    rows = [rng.standard_normal(width) * 0.02, np.zeros(width), np.full(width, 0.375),
            -np.abs(rng.standard_normal(width)), rng.standard_normal(width) * 1e-40,
            rng.uniform(-3.4e38, 3.4e38, width), np.resize(np.arange(-8, 8) + 0.5, width)]
    ties = np.resize(np.arange(-16, 16) + 0.5, width)  # with each group's largest at a power of two: x / scale exact
    ties[::g] = 2.0 ** (bits - 1) - 1 if symmetric else 16.0
    rows.append(ties)
    rows += [rng.standard_normal(width) * 10.0 ** rng.integers(-30, 30) for _ in range(8)]
    w = np.stack(rows).astype(np.float32)
    if stored == "bfloat16":
        w = (w.view(np.uint32) >> 16).astype(np.uint16)
    want_q, want_scale, want_offset = rtn(widen(w), bits, group, symmetric)
    if bits == 4:
        want_q = pack_int4(want_q)
    q, scale = np.empty_like(want_q), np.empty_like(want_scale)
    offset = None if symmetric else np.empty_like(want_scale)
    assert native.rtn_rows(w, bits, group, symmetric, q, scale, offset)
    assert np.array_equal(q, want_q)
    assert np.array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    assert symmetric or np.array_equal(offset.view(np.uint32), want_offset.view(np.uint32))
    bad = widen(w).copy()
    bad[3, 5] = np.inf
    assert not native.rtn_rows(bad, bits, group, symmetric, q, scale, offset)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [0, 32, 64, 128])
def test_the_golden_rows_in_c_are_numpys_bit_for_bit(tmp_path, bits, group):
    """export/native/golden_rows.c (the golden reference's quantized rows, its own library) against the numpy path it
    stands in for (FolderRows.rows_into) and against dequantize's (q + offset) * scale through `finish`: every byte
    value, every sign, scales of every magnitude including subnormal and zero. The helper must be built here (CI
    compiles it at install): a missing build would silently run the numpy path."""
    import subprocess
    import sys

    from export import native
    from export.network.quantize import FolderRows

    _assert_native_built("golden_rows.c")
    rng = np.random.default_rng(bits * 1000 + group)
    rows, width = 37, 512
    groups = 1 if group == 0 else width // group
    values = np.arange(256, dtype=np.uint8) if bits == 4 else np.arange(-128, 128).astype(np.int8)
    q = rng.permutation(np.resize(values, rows * (width // 2 if bits == 4 else width))).reshape(rows, -1)
    scale = (rng.standard_normal((rows, groups)) * 10.0 ** rng.integers(-40, 10, (rows, groups))).astype(np.float32)
    scale[0, 0], scale[1, 0] = 0.0, -np.float32(1e-45)  # zero, and a subnormal's sign
    offset = rng.integers(-8, 8, (rows, groups)).astype(np.float32)
    layer = FolderRows([q], None, bits == 4, scale, offset)
    fast = layer.rows_into(3, 30, np.full((27, width), np.nan, np.float32))
    script = ("import numpy as np, sys; from export.network.quantize import FolderRows; a = np.load(sys.argv[1]); "
              "l = FolderRows([a['q']], None, bool(a['packed']), a['scale'], a['offset']); "
              "np.save(sys.argv[2], l.rows_into(3, 30, np.full((27, a['width']), np.nan, np.float32)))")
    np.savez(tmp_path / "in.npz", q=q, packed=bits == 4, scale=scale, offset=offset, width=width)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.npz"), str(tmp_path / "numpy.npy")], check=True,
                   env={**os.environ, "MSLITE_LLM_EXPORT_NUMPY": "1"})  # the numpy path, in a process of its own
    plain = np.load(tmp_path / "numpy.npy")
    assert np.array_equal(fast.view(np.uint32), plain.view(np.uint32))
    # and the finished product is the dequantized matrix's
    x = rng.standard_normal((2, width)).astype(np.float32)
    y = x @ fast.T
    layer.finish(3, 30, x, y)
    whole = dequantize(unpack_int4(q) if bits == 4 else q, scale, offset)[3:30]
    np.testing.assert_allclose(y, x @ whole.T, rtol=1e-4, atol=1e-4 * np.abs(x @ np.abs(whole).T).max())


def _assert_native_built(source: str) -> None:
    """export/native's library is built here (CI compiles it at install: a missing or stale build would silently test
    the numpy path against itself) and newer than `source`."""
    from export import native

    assert native.library_path() is not None, "build it: python setup.py build_ext --inplace"
    here = os.path.dirname(native.__file__)
    assert os.path.getmtime(native.library_path()) >= os.path.getmtime(os.path.join(here, source)), \
        "rebuild: python setup.py build_ext --inplace"


@pytest.mark.parametrize("requested,bits,inputs,chosen,noted", [
    (None, 4, [576, 576, 1536], 64, True),  # SmolLM2: 128 does not divide 576
    (None, 4, [896, 896, 4864], 128, False),  # Qwen2-0.5B
    (None, 8, [576], 0, False),  # int8: per channel
    (128, 4, [96, 96, 160], 32, True),
    (64, 4, [80], 0, True),  # nothing of at least 32 divides 80: per channel
    (0, 4, [576], 0, False),
])
def test_the_group_size_divides_every_layer(requested, bits, inputs, chosen, noted):
    group, note = choose_group(requested, bits, inputs)
    assert group == chosen and bool(note) == noted


# ------------------------------------------------------------------------------------------------------ folders

def _export(checkpoint: str, output: str, **kw) -> str:
    from export.config import ExportConfig
    from export.pipeline import run_export

    run_export(ExportConfig(checkpoint=checkpoint, output=output, name="m", seq_length=kw.pop("seq_length", 32),
                            batch_size=1, dtype=kw.pop("dtype", "float32"), device=kw.pop("device", "cpu"), **kw))
    return output


def _manifest(folder: str) -> dict:
    return json.load(open(os.path.join(folder, "manifest.json")))


INT8_ROWS = {"bits": 8, "group_size": 0, "symmetric": True, "source": "rtn"}


def _record(bits: int, group: int, symmetric: bool, source: str, tables: dict) -> dict:
    """The manifest's quantization: the linear layers' method and the tables' (export/network/quantize.py TablePlan.record)."""
    return {"bits": bits, "group_size": group, "symmetric": symmetric, "source": source, "tables": tables}


def _tables(embedding: dict, head=None) -> dict:
    """A tables record: the embedding's, and the head's (None: "tied")."""
    return {"embedding": embedding, "head": "tied" if head is None else head}


def _check_and_compare(checkpoint: str, folder: str, capsys, fused: bool = False) -> None:
    """check replays the golden references; export.compare holds the folder and those references to HF transformers
    on the folder's dequantized weights."""
    pytest.importorskip("torch")
    from export.compare import main as compare_main
    from lite_runtime.check import main as check_main

    assert check_main([folder, "--backend", "ms", "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("PASS m on backend ms:"), out
    if fused:
        assert "WeightQuantBatchMatmul x" in next(line for line in out if line.startswith("graph form:")), out
    assert compare_main(["--checkpoint", checkpoint, "--model_dir", folder, "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("PASS m on backend ms:") and "greedy tokens identical" in out[-2], out
    assert out[-1].startswith("stored golden references against HF: greedy tokens identical"), out


def _float_weights(checkpoint: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(checkpoint, "model.safetensors"))


@pytest.mark.parametrize("family,bits,group", [("qwen2", 8, None), ("qwen3", 4, None), ("llama", 4, 32)])
def test_a_quantized_cpu_folder_is_what_its_checkpoint_rounds_to(tmp_path, capsys, monkeypatch, family, bits, group):
    from export.compare import folder_linears
    from lite_runtime.folder import load_folder

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family=family, seed=3, tie_word_embeddings=family != "llama")
    folder = _export(ckpt, str(tmp_path / "q"), quantize=f"int{bits}", group_size=group)
    manifest = _manifest(folder)
    want_group = (0 if bits == 8 else 64) if group is None else group  # hidden size 64: int4's 128 -> 64
    assert manifest["format_version"] == 4
    # an untied embedding in an int4 folder: int4 with offsets, groups of 128 or what divides the hidden size (64)
    own_embedding = family == "llama" and bits == 4
    # RTN tables: int8 per row, from the checkpoint's float32 (an untied embedding int4 in an int4 folder)
    rtn_embedding = {"bits": 4, "group_size": 64, "symmetric": False, "source": "rtn"} if own_embedding else INT8_ROWS
    tables = _tables({**rtn_embedding, "from": "float32"},
                     {**INT8_ROWS, "from": "float32"} if family == "llama" else None)
    assert manifest["quantization"] == _record(bits, want_group, bits == 8, "rtn", tables)
    golden = json.load(open(os.path.join(folder, "golden.json")))
    assert golden["quantization"] == manifest["quantization"]
    assert set(golden["agreement"]) >= {"tokens", "greedy_agreement", "top1_match", "max_logit_error"}
    # every linear layer is quantized; each value within half a step of the checkpoint's
    weights, floats = folder_linears(load_folder(folder)), _float_weights(ckpt)
    tables = ["model.embed_tokens.weight"] + ([] if family != "llama" else ["lm_head.weight"])
    assert sorted(weights) == sorted([f"model.layers.{i}.{lin}.weight" for i in range(2) for lin in LINEARS] + tables)
    for name, values in weights.items():
        w = floats[name].astype(np.float32)
        table = name in tables and not (own_embedding and name == "model.embed_tokens.weight")  # int8 per row
        g = w.shape[1] if want_group == 0 or table else (64 if name in tables else want_group)
        blocks = w.reshape(w.shape[0], -1, g)
        step = (np.abs(blocks).max(2) / 127 if bits == 8 or table else (np.maximum(blocks.max(2), 0) - np.minimum(
            blocks.min(2), 0)) / 15)
        assert np.all(np.abs(values - w).reshape(blocks.shape) <= step[..., None] * 0.5 + 1e-6), name
    _check_and_compare(ckpt, folder, capsys)
    _assert_banded(folder, bits, tied=family != "llama")
    # `--speculative auto`: prompt lookup on for an int8 folder on the x86 forms, an int4 one where its matrices are
    # banded on AVX-512 VNNI (measured to pay there)
    import cpu_kernels
    from lite_runtime import InferConfig
    from lite_runtime.serve.cli import lookup_pays

    want = cpu_kernels.quant_form() in ("avx2", "avx512_vnni") if bits == 8 else \
        cpu_kernels.quant_form() == "avx512_vnni" and cpu_kernels.int4_r16_runs(64, 64)
    assert lookup_pays(InferConfig.from_folder(folder)) == want
    if family == "qwen2":
        _assert_agreement_is_hf(ckpt, folder, golden)
        _assert_refused_by_kernels_without_quantized_ops(folder, monkeypatch)


def _assert_banded(folder: str, bits: int, tied: bool) -> None:
    """Where the banded form runs (cpu_kernels.int4_r16_runs: AVX-512 VNNI or AVX2, x in int8; int8_r16_runs: AVX-512
    VNNI, x in int8), loading a quantized folder repacks exactly its layer weights, which only our quantized ops read,
    into bands of 16 rows (the layouts' rules: test_quant_kernels.banded, banded8), and every decode step's op that
    reads them calls its R16 name, and the int8 head is banded where the int8 form runs: an untied one itself, a tied
    one (the graph's Gather reads it too) as a second parameter of the same data that only the head's matmul reads
    (`_split_shared_weights`, ms.KERNELS_COPY); the embedding the Gather reads stays as stored. Elsewhere nothing is
    repacked. Its greedy tokens are HF's either way (_check_and_compare ran on this machine's
    form)."""
    import cpu_kernels
    from lite_runtime import pipeline
    from lite_runtime.backends.ms import _parameter_arrays, _read_mindir
    from test_cpu_kernels import graph_model
    from test_quant_kernels import banded, banded8

    pipe = pipeline("text_generation", model=folder, backend="ms", warm_up="none")
    pipe.generate([[1, 2, 3]], max_new_tokens=2)
    backend = pipe.backend
    layers = {f"model.layers.{i}.{lin}.weight" for i in range(2) for lin in LINEARS}
    from lite_runtime.backends.ms import KERNELS_COPY

    head_name = "model.embed_tokens.weight" + KERNELS_COPY if tied else "lm_head.weight"
    head = {head_name} if cpu_kernels.int8_r16_runs(64, 64) else set()
    # hidden 64 (and intermediate 128), in groups of 32 or 64 or per channel: the banded form runs for all or none
    if not (cpu_kernels.int4_r16_runs(64, 32) if bits == 4 else cpu_kernels.int8_r16_runs(64, 64)):
        assert backend._bands == head
        return
    assert backend._bands == layers | head
    path = os.path.join(folder, "m_inc_graph.mindir")
    stored = _parameter_arrays(_read_mindir(path), path)
    for name in layers | head:
        data = stored[name.removesuffix(KERNELS_COPY)]
        want = banded(data) if data.dtype == np.uint8 else banded8(data).view(np.int8)
        assert np.array_equal(backend._weights[name], want), name  # as our ops read it (the arena's place)
    assert np.array_equal(backend._owned["model.embed_tokens.weight"].asnumpy(), stored["model.embed_tokens.weight"])
    calls = {a.s.decode().rpartition(":")[2] for p in graph_model(path).primitives for a in p.attribute
             if a.name == "func_name"}
    model = graph_model(path)
    from lite_runtime.backends.ms import _split_shared_weights, _use_bands

    assert _split_shared_weights(model) == (1 if tied else 0)
    assert _use_bands(model, backend._bands) >= 1  # the layers' decode op (one primitive the layers' nodes share)
    renamed = {a.s.decode().rpartition(":")[2] for p in model.primitives for a in p.attribute if a.name == "func_name"}
    layer_op = cpu_kernels.QUANTIZED_OPS[cpu_kernels.DECODE_LAYER]
    moved = {layer_op} | ({cpu_kernels.QUANT_MATMUL} if head else set())  # the head's matmul
    assert layer_op in calls and renamed == calls - moved | {cpu_kernels.R16_OPS[f] for f in moved}, renamed


def _assert_refused_by_kernels_without_quantized_ops(folder: str, monkeypatch) -> None:
    """The decode step calls the fused ops by their quantized names (cpu_kernels.QUANTIZED_OPS); an installation whose
    ops read float weights only lacks them and refuses the folder at load, naming them."""
    import cpu_kernels
    from lite_runtime import InferError
    from lite_runtime.backends.ms import _relocate_kernels
    from test_cpu_kernels import graph_model

    path = os.path.join(folder, "m_inc_graph.mindir")
    calls = {a.s.decode().rpartition(":")[2] for p in graph_model(path).primitives for a in p.attribute
             if a.name == "func_name"}
    quantized = {cpu_kernels.QUANTIZED_OPS[cpu_kernels.DECODE_LAYER]}  # the layer in one call, by its quantized name
    assert quantized <= calls and not calls & {cpu_kernels.DECODE_LAYER, cpu_kernels.DECODE_QKV,
                                               cpu_kernels.DECODE_TAIL}, calls
    monkeypatch.setattr(cpu_kernels, "FUNCTIONS", tuple(f for f in cpu_kernels.FUNCTIONS
                                                         if f not in cpu_kernels.QUANTIZED_OPS.values()))
    with pytest.raises(InferError) as err:
        _relocate_kernels(graph_model(path), path)
    assert str(err.value) == (
        f"{path}: the graph calls CPU kernels this installation of mslite-llm does not have "
        f"({', '.join(sorted(quantized))}): the folder was exported by another version; run it with that version, "
        "or re-export it with this one")


def test_the_agreement_skips_only_prompts_lengthened_to_reach_a_graph():
    """Graphs of 256 and 512 tokens at batch 2: the 512 graph's longer row (257 tokens: one more than the 256 graph
    holds) exists to run that graph; its shorter row (128) and the first batch's rows are in the agreement."""
    plan = plan_batches([256, 512], 1024, 2)
    prompts = [[0] * n for _, lengths, _ in plan for n in lengths]
    assert [len(p) for p in prompts] == [192, 96, 257, 128]
    assert agreement_rows(prompts) == [0, 1, 3]
    assert agreement_rows([[0] * n for n in plan_batches([128, 512, 1024, 2048], 4096, 1)[0][1]]) == [0]


def test_the_agreements_early_prefill_stops_when_cancelled_and_its_error_reaches_the_export(tmp_path):
    """AgreementPrefill (a quantized export's, started before its compile stage) stops between two layers when the
    export fails meanwhile (cancel), and an error in its thread is raised by `result`, in the export's thread."""
    from export.config import ModelConfig
    from export.writers.golden import AgreementPrefill
    from export.writers.reference import Stopped

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=6, num_hidden_layers=64)
    cfg = ModelConfig.from_checkpoint(ckpt)
    early = AgreementPrefill(cfg, ckpt, [64, 256], 512, 2)
    early.cancel()
    assert not early._thread.is_alive() and isinstance(early.error, (Stopped, type(None)))
    late = AgreementPrefill(cfg, ckpt, [64, 256], 512, 2)
    late._thread.join()
    late.error = OSError(5, "Input/output error", ckpt)
    with pytest.raises(OSError):
        late.result([], [])


def _assert_agreement_is_hf(checkpoint: str, folder: str, golden: dict) -> None:
    """golden.json's agreement, recomputed by HF transformers: the checkpoint's model and the folder's (its
    dequantized weights) fed each row's prompt and the folder's greedy tokens."""
    torch = pytest.importorskip("torch")
    from export.compare import hf_model, load_folder_linears
    from lite_runtime.folder import load_folder

    theirs, ours = hf_model(checkpoint), hf_model(checkpoint)
    load_folder_linears(ours, load_folder(folder))
    steps = same = before = 0
    worst = 0.0
    for batch in golden["batches"]:
        for row in batch["rows"]:
            if len(row["prompt"]) > LEAD_CAP:  # export/writers/golden.py agreement_rows
                continue
            n = len(row["tokens"])
            ids = torch.tensor([row["prompt"] + row["tokens"][:-1]])
            with torch.no_grad():
                a = ours(ids).logits[0, -n:].numpy()
                b = theirs(ids).logits[0, -n:].numpy()
            assert a.argmax(1).tolist() == row["tokens"]  # the folder's reference is the folder's
            match = a.argmax(1) == b.argmax(1)
            steps, same = steps + n, same + int(match.sum())
            before += n if match.all() else int(np.argmin(match))
            worst = max(worst, float(np.abs(a - b).max()))
    agreement = golden["agreement"]
    assert agreement["tokens"] == steps
    assert agreement["top1_match"] == pytest.approx(same / steps, abs=1e-6)
    assert agreement["greedy_agreement"] == pytest.approx(before / steps, abs=1e-6)
    assert agreement["max_logit_error"] == pytest.approx(worst, rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("bits,group,tied", [(8, 0, True), (4, 32, True), (4, 32, False)])
def test_an_atlas_quantized_folder_runs_weight_quant_batch_matmul(tmp_path, capsys, bits, group, tied):
    """The fused Atlas form: every linear layer one WeightQuantBatchMatmul (int8 per channel without offsets; int4 in
    groups with offsets, its weights qint4x2), and the head one too (int8 per row, the tied table or its own); an
    untied embedding of an int4 folder int4 in groups, uint8 two per byte, unpacked by plain ops; run here by the
    CPU stand-in; check and compare pass at float16's limits."""
    from mindspore.train import mind_ir_pb2

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=4, tie_word_embeddings=tied)
    folder = _export(ckpt, str(tmp_path / "a"), quantize=f"int{bits}", group_size=group, dtype="float16",
                     device="atlas_800i_a2", seq_length=64)
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(os.path.join(folder, "m_inc_graph.mindir"), "rb").read())
    prims = {p.name: p.op_type for p in model.primitives}
    ops = [prims.get(n.op_type[len("REF::"):]) for n in model.graph.node if n.op_type.startswith("REF::")]
    assert ops.count("WeightQuantBatchMatmul") == 2 * len(LINEARS) + 1  # and the tied int8 head
    types = {p.name.rsplit(":", 1)[-1]: mind_ir_pb2.TensorProto.DataType.Name(p.data_type)
             for p in model.graph.parameter}
    assert types["model.layers.0.mlp.up_proj.weight"] == ("INT8" if bits == 8 else "QINT4X2")
    assert types["model.layers.0.mlp.up_proj.weight_scale"] == "FLOAT16"
    assert ("model.layers.0.mlp.up_proj.weight_offset" in types) == (bits == 4)
    own_embedding = not tied and bits == 4
    assert types["model.embed_tokens.weight"] == ("UINT8" if own_embedding else "INT8")
    assert ("model.embed_tokens.weight_offset" in types) == own_embedding
    _check_and_compare(ckpt, folder, capsys, fused=True)


def test_a_runtime_before_quantized_folders_refuses_one_by_its_version(tmp_path, monkeypatch):
    from lite_runtime import folder as folder_module

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=5)
    folder = _export(ckpt, str(tmp_path / "q"), quantize="int8")
    monkeypatch.setattr(folder_module, "SUPPORTED_VERSIONS", (3,))
    with pytest.raises(folder_module.ModelFolderError) as err:
        folder_module.load_folder(folder)
    assert str(err.value) == (f"{folder}/manifest.json: format 'mslite-llm-model-folder' version 4 is not supported "
                              "(this runtime reads mslite-llm-model-folder version 3); re-export the folder")


# ------------------------------------------------------------------------------------------------------ kept as they are

def test_gptq_and_awq_layers_are_kept_as_the_checkpoint_holds_them(tmp_path, capsys):
    """No --quantize: a GPTQ (4-bit) and an AWQ checkpoint export as int4 folders in the checkpoint's own groups;
    the integers are the checkpoint's (the folder dequantizes to the checkpoint's values exactly: the float twin
    test_packed writes), and check and compare pass."""
    from export.compare import folder_linears
    from lite_runtime.folder import load_folder
    from tests.test_packed import quantized_pair

    for method in ("gptq", "awq"):
        packed, floats = quantized_pair(str(tmp_path / method), method, bits=4, group=32)
        folder = _export(packed, str(tmp_path / f"{method}_folder"))
        # the tables as the checkpoint holds them: float
        assert _manifest(folder)["quantization"] == _record(4, 32, False, method, _tables({"dtype": "float32"}))
        weights, want = folder_linears(load_folder(folder)), _float_weights(floats)
        for name, values in weights.items():
            if not name.startswith("model.layers."):
                continue
            np.testing.assert_allclose(values, want[name], rtol=0, atol=1e-7 * np.abs(want[name]).max(), err_msg=name)
        _check_and_compare(packed, folder, capsys)  # HF from the config, the layers dequantized (export.compare)


@pytest.mark.parametrize("kind,bits,symmetric", [("Q8_0", 8, True), ("Q4_0", 4, True), ("Q4_1", 4, False)])
def test_a_gguf_keeps_its_q8_0_q4_0_q4_1_blocks(tmp_path, capsys, kind, bits, symmetric):
    """A GGUF whose linear layers are Q8_0, Q4_0 or Q4_1 exports as int8/int4 in groups of 32, its blocks' integers
    as they are: the folder dequantizes to what the gguf package's own dequantizer gives (and transformers' GGUF
    loading, through compare), llama's q/k permutation undone."""
    gguf = pytest.importorskip("gguf")
    from export.compare import folder_linears
    from lite_runtime.folder import load_folder
    from tests.test_gguf import _gguf_name, _permute, write_gguf

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="llama", seed=6, tie_word_embeddings=False)
    path = str(tmp_path / f"m.{kind}.gguf")
    write_gguf(ckpt, path, quant=kind)
    folder = _export(path, str(tmp_path / "folder"))
    # the tables as the file holds them: the untied llama's token_embd and output in `kind`, kept
    kept = {"bits": bits, "group_size": 32, "symmetric": symmetric, "source": f"gguf:{kind}"}
    assert _manifest(folder)["quantization"] == _record(bits, 32, symmetric, f"gguf:{kind}", _tables(kept, kept))
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    for name, values in folder_linears(load_folder(folder)).items():
        t = tensors[_gguf_name(name)]  # the tables too: kept as the file's blocks
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(values.shape)
        heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
        if "q_proj" in name or "k_proj" in name:  # undo the permutation write_gguf applied
            theirs = _unpermute_rows(theirs, heads)
        np.testing.assert_allclose(values, theirs, rtol=1e-6, atol=1e-7, err_msg=name)
    assert _permute is not None
    _check_and_compare(path, folder, capsys)


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


# ------------------------------------------------------------------------------------------------------ refusals

def _refused(tmp_path, checkpoint: str, **kw) -> str:
    out = tmp_path / "refused"
    with pytest.raises(ExportError) as err:
        _export(checkpoint, str(out), **kw)
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".refused")] == []
    return str(err.value)


def test_quantization_a_device_or_a_checkpoint_cannot_take_is_refused_in_one_line(tmp_path):
    from tests.test_packed import quantized_pair

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=7)
    assert _refused(tmp_path, ckpt, quantize="int4", dtype="float16", device="atlas_300i_duo") == (
        "--device atlas_300i_duo (Atlas 300I Duo): int4 (groups of 64, with offsets, from rtn) is not supported there "
        "(WeightQuantBatchMatmul on Ascend310P: int8); export --quantize int8")
    assert _refused(tmp_path, ckpt, quantize="int8", group_size=32, dtype="float16", device="atlas_300i_duo") == (
        "--device atlas_300i_duo (Atlas 300I Duo): int8 (groups of 32, symmetric, from rtn): its "
        "WeightQuantBatchMatmul takes per-channel scales only; export --quantize int8 --group_size 0")
    assert _refused(tmp_path, ckpt, quantize="int8", dtype="float16", device="atlas_800") == (
        "--device atlas_800 (Atlas 800): int8 (per channel, symmetric, from rtn) is not supported there "
        "(WeightQuantBatchMatmul on Ascend910A: none); export float weights (--quantize none)")
    assert _refused(tmp_path, ckpt, quantize="int4", group_size=48) == (
        "--group_size 48: use 0 (per channel) or a multiple of 32")
    assert _refused(tmp_path, ckpt, group_size=64) == "--group_size needs --quantize int8 or int4"
    packed, _ = quantized_pair(str(tmp_path / "gptq"), "gptq", bits=4, group=32)
    assert _refused(tmp_path, packed, quantize="int8") == (
        f"{packed}: --quantize int8: the checkpoint is already int4 (groups of 32, with offsets, from gptq); export it "
        "as it is (no --quantize, or --quantize int4), or --quantize none for float weights")
    assert _refused(tmp_path, packed, quantize="int4", group_size=64) == (
        f"{packed}: --group_size 64: the checkpoint's layers are int4 (groups of 32, with offsets, from gptq); drop "
        "--group_size to keep them as they are")
    # round-to-nearest picks a group every rank's share holds; a checkpoint's own groups cannot be changed
    wide, _ = quantized_pair(str(tmp_path / "gptq64"), "gptq", bits=4, group=64)
    assert _refused(tmp_path, wide, tp_size=2) == (
        f"{wide}: --tp_size 2 would cut model.layers.0.self_attn.o_proj.weight's groups of 64 (32 inputs per rank); "
        "pick a --tp_size whose share is a multiple of the group size, or --quantize none for float weights")


def test_a_quantized_folder_splits_over_two_ranks_with_its_groups(tmp_path):
    """--tp_size 2, int4 in groups of 32: every rank holds its share of each layer (column-parallel: its outputs and
    their scales' columns; row-parallel: its inputs and their groups; the int8 tables' per-row scales whole where the
    rows are), and under msrun every rank replays the golden references of the whole model's dequantized weights."""
    from tests.test_tensor_parallel import check_under_msrun

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen2", seed=8)
    folder = _export(ckpt, str(tmp_path / "tp"), quantize="int4", group_size=32, tp_size=2)
    from lite_runtime.backends.ms import _parameter_arrays, _read_mindir
    from lite_runtime.folder import load_folder

    loaded = load_folder(folder)
    for rank in (0, 1):
        path = loaded.graph_paths(rank)["inc"]
        arrays = _parameter_arrays(_read_mindir(path), path)
        shapes = {n: arrays[n].shape for n in arrays if n.startswith("model.layers.0.")}
        # hidden 64, 4 heads of 16, intermediate 128: each rank 2 heads, 64 MLP columns
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 32)  # 32 of 64 outputs, 64 inputs / 2
        assert shapes["model.layers.0.self_attn.q_proj.weight_scale"] == (2, 32)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 16)  # 32 of 64 inputs, two per byte
        assert shapes["model.layers.0.self_attn.o_proj.weight_offset"] == (1, 64)  # its one group of 32
        assert shapes["model.layers.0.mlp.down_proj.weight_scale"] == (2, 64)
    logs = check_under_msrun(tmp_path, folder)
    assert len(logs) == 2
    for log in logs.values():
        assert "PASS" in log, log[-2000:]
