"""Imported quantized checkpoints run as published (issue 43, goal 1): a GPTQ or AWQ checkpoint's embedding and head
stay in the 16 bits it holds them in, a GGUF's tables keep their own blocks where the folder has a form for them
(Q8_0, Q4_0, Q4_1) and are widened where it has none (Q5_0 here, Q6_K in llama.cpp's files), a packed lm_head is
imported packed; quantizing them again is `--quantize_tables int8`, recorded, and refused for a table already held
in fewer than 8 bits. The checkpoints are packed by tests/packers.py and tests/test_gguf.py from the formats'
documentation; HF transformers on the checkpoint's dequantized weights (the packers' float twin, or transformers'
own GGUF loading) is the reference."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from export.errors import ExportError
from export.checkpoints.random_checkpoint import make_checkpoint
from tests.packers import pack
from tests.test_quantize import _check_and_compare, _export, _manifest, _tables

SHAPE = dict(hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def _params(folder: str) -> dict:
    from tests.test_packed import folder_weights

    return folder_weights(folder)


def _golden(folder: str) -> dict:
    return json.load(open(os.path.join(folder, "golden.json")))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_keep_their_16_bit_tables(tmp_path, capsys, method):
    """An untied Qwen2 packed as GPTQ (4-bit, symmetric) or AWQ (zero points), groups of 64, exported for the CPU in
    the checkpoint's float16: the embedding and the head are the checkpoint's float16 tensors bit for bit, the
    folder's reference agrees with the checkpoint's on every golden token, and check and compare (HF on the
    dequantized twin) pass."""
    from safetensors.numpy import load_file

    base = make_checkpoint(str(tmp_path / "base"), family="qwen2", tie_word_embeddings=False, seed=21, **SHAPE)
    packed, twin = pack(base, str(tmp_path / method), method, bits=4, group=64)
    folder = _export(packed, str(tmp_path / "folder"), dtype="float16")
    record = _manifest(folder)["quantization"]
    assert record["tables"] == _tables({"dtype": "float16"}, {"dtype": "float16"})
    assert (record["bits"], record["group_size"], record["source"]) == (4, 64, method)
    params, checkpoint = _params(folder), load_file(os.path.join(packed, "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert params[name].dtype == np.float16 and np.array_equal(params[name], checkpoint[name]), name
        assert name + "_scale" not in params
    agreement = _golden(folder)["agreement"]
    assert agreement["greedy_agreement"] == 1.0 and agreement["top1_match"] == 1.0
    _check_and_compare(packed, folder, capsys)
    from export.compare import main as compare_main  # the packers' float twin: HF on plain safetensors

    assert compare_main(["--checkpoint", twin, "--model_dir", folder, "-q"]) == 0
    assert "greedy tokens identical" in capsys.readouterr().out


def test_a_packed_lm_head_is_imported_packed(tmp_path, capsys):
    """Some exporters pack lm_head too: the head is imported as its integers (int4 in groups, GPTQ's zeros as
    offsets), the embedding stays float16."""
    base = make_checkpoint(str(tmp_path / "base"), family="llama", tie_word_embeddings=False, seed=22, **SHAPE)
    packed, twin = pack(base, str(tmp_path / "gptq"), "gptq", bits=4, group=32, pack_head=True)
    folder = _export(packed, str(tmp_path / "folder"), dtype="float16")
    assert _manifest(folder)["quantization"]["tables"] == _tables(
        {"dtype": "float16"}, {"bits": 4, "group_size": 32, "symmetric": False, "source": "gptq"})
    params = _params(folder)
    assert params["lm_head.weight"].dtype == np.uint8 and params["lm_head.weight_scale"].shape == (128 // 32, 512)
    from export.compare import folder_linears
    from lite_runtime.folder import load_folder
    from safetensors.numpy import load_file

    head = folder_linears(load_folder(folder))["lm_head.weight"]
    np.testing.assert_allclose(head, load_file(os.path.join(twin, "model.safetensors"))["lm_head.weight"],
                               rtol=0, atol=1e-7)
    assert _golden(folder)["agreement"]["greedy_agreement"] == 1.0
    _check_and_compare(packed, folder, capsys)


@pytest.mark.parametrize("family,types,embedding,head", [
    # SmolLM2's Q4_1 file: a tied token_embd in Q8_0, the layers Q4_1
    ("qwen2", {"model.embed_tokens.weight": "Q8_0"}, {"bits": 8, "group_size": 32, "symmetric": True,
                                                       "source": "gguf:Q8_0"}, None),
    # llama-quantize's Q4_0 of an untied model keeps the head in more bits (Q6_K; Q5_0 here, which gguf-py packs):
    # the folder has no form for it, so it is widened; the embedding's Q4_0 blocks are kept
    ("llama", {"lm_head.weight": "Q5_0"}, {"bits": 4, "group_size": 32, "symmetric": True, "source": "gguf:Q4_0"},
     {"dtype": "float32", "from": "gguf:Q5_0"}),
])
def test_a_gguf_keeps_or_widens_its_tables(tmp_path, capsys, family, types, embedding, head):
    pytest.importorskip("gguf")
    from tests.test_gguf import write_gguf

    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family=family, seed=23, tie_word_embeddings=head is None, **SHAPE)
    path = str(tmp_path / "m.gguf")
    write_gguf(ckpt, path, quant="Q4_1" if family == "qwen2" else "Q4_0", tensor_types=types)
    folder = _export(path, str(tmp_path / "folder"))
    assert _manifest(folder)["quantization"]["tables"] == _tables(embedding, head)
    assert _golden(folder)["agreement"]["greedy_agreement"] == 1.0
    _check_and_compare(path, folder, capsys)


def test_quantizing_an_imported_checkpoints_tables_is_explicit(tmp_path, capsys):
    """--quantize_tables int8 on a GPTQ checkpoint: int8 per row, said in the record and the summary; on a GGUF whose
    embedding is Q4_0: refused in one line naming the tensor, nothing written; on a float folder: refused."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from tests.test_gguf import write_gguf

    base = make_checkpoint(str(tmp_path / "base"), family="qwen2", seed=24, **SHAPE)
    packed, _ = pack(base, str(tmp_path / "gptq"), "gptq", bits=4, group=64)
    summary = run_export(ExportConfig(checkpoint=packed, output=str(tmp_path / "int8"), name="m", seq_length=32,
                                      device="cpu", quantize_tables="int8"))
    rows = {"bits": 8, "group_size": 0, "symmetric": True, "source": "rtn", "from": "float16"}
    assert _manifest(str(tmp_path / "int8"))["quantization"]["tables"] == {
        "embedding": rows, "head": "tied", "requantized": "--quantize_tables int8"}
    assert summary.quantization_lines()[0] == ("weights: linear layers int4 (groups of 64, with offsets, from gptq); "
                                               "tied embedding and head int8 per row (quantized again by "
                                               "--quantize_tables int8)")
    assert summary.agreement["greedy_agreement"] < 1.0  # the second rounding shows

    gguf_path = str(tmp_path / "m.gguf")
    write_gguf(base, gguf_path, quant="Q4_0")
    for checkpoint, option, message in (
            (gguf_path, "int8", f"{gguf_path}: --quantize_tables int8: token_embd.weight is Q4_0 (fewer than 8 bits a "
                                "weight); quantizing it again would round it onto a second, coarser grid: drop "
                                "--quantize_tables (the table is kept as the checkpoint holds it)"),
            (base, "int8", "--quantize_tables int8 needs a quantized folder (--quantize int8 or int4, or a GPTQ, AWQ or "
                           "GGUF checkpoint that is quantized)")):
        with pytest.raises(ExportError) as err:
            run_export(ExportConfig(checkpoint=checkpoint, output=str(tmp_path / "never"), name="m", seq_length=32,
                                    device="cpu", quantize_tables=option))
        assert str(err.value) == message
        assert not os.path.exists(tmp_path / "never")
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".never")]


def test_rtn_tables_can_stay_float(tmp_path, capsys):
    """--quantize int4 --quantize_tables none: the linear layers int4, the tables in the folder's dtype."""
    ckpt = make_checkpoint(str(tmp_path / "ckpt"), family="qwen3", seed=25, tie_word_embeddings=False)
    folder = _export(ckpt, str(tmp_path / "folder"), quantize="int4", quantize_tables="none")
    assert _manifest(folder)["quantization"]["tables"] == _tables({"dtype": "float32"}, {"dtype": "float32"})
    _check_and_compare(ckpt, folder, capsys)


def test_an_atlas_folder_of_a_gptq_checkpoint_keeps_its_float16_tables(tmp_path, capsys):
    """The fused Atlas form of a GPTQ import: every linear layer one WeightQuantBatchMatmul, the tables float16 (the
    embedding a gather, the head a MatMul), checked here through the stand-ins."""
    from mindspore.train import mind_ir_pb2

    base = make_checkpoint(str(tmp_path / "base"), family="qwen2", tie_word_embeddings=False, seed=26, **SHAPE)
    packed, _ = pack(base, str(tmp_path / "gptq"), "gptq", bits=4, group=64)
    folder = _export(packed, str(tmp_path / "a"), dtype="float16", device="atlas_800i_a2", seq_length=64)
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(os.path.join(folder, "m_inc_graph.mindir"), "rb").read())
    types = {p.name.rsplit(":", 1)[-1]: mind_ir_pb2.TensorProto.DataType.Name(p.data_type)
             for p in model.graph.parameter}
    assert types["model.embed_tokens.weight"] == types["lm_head.weight"] == "FLOAT16"
    assert "lm_head.weight_scale" not in types
    _check_and_compare(packed, folder, capsys, fused=True)
