"""GPTQ and AWQ checkpoints in (export/checkpoints/packed.py). The tests pack their own: integer weights, zeros and scales packed
as AutoGPTQ's and AutoAWQ's packers lay them out (written here from those layouts, loop by loop), saved with a
quantization_config; the same weights dequantized, W = (q - z) * s, saved as a float checkpoint beside it. Both
export to the same weights, bit for bit, and the same golden references (the float checkpoint is held to HF
transformers by the other tests). Unsupported methods and lying tensors: exact one-line refusals, nothing left."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from export.errors import ExportError
from export.checkpoints.random_checkpoint import make_checkpoint

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's qweight: [in, out] values, (32 / bits) consecutive inputs per int32, the first in the lowest bits."""
    per = 32 // bits
    out = np.zeros((values.shape[0] // per, values.shape[1]), np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= values[row * per + j].astype(np.uint32) << np.uint32(bits * j)
    return out.view(np.int32)


def pack_cols(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """Packed along the outputs: AutoGPTQ's qzeros (in order), AutoAWQ's qweight and qzeros (order AWQ_ORDER)."""
    per = 32 // bits
    order = order or list(range(per))
    out = np.zeros((values.shape[0], values.shape[1] // per), np.uint32)
    for col in range(out.shape[1]):
        for i in range(per):
            out[:, col] |= values[:, col * per + order[i]].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def quantized_pair(root: str, method: str, bits: int = 4, group: int = 32, fmt: str = "gptq",
                   g_idx: str = "identity", desc_act: bool = False, seed: int = 0):
    """(packed checkpoint, float checkpoint of its dequantized weights), from one tiny random qwen2."""
    from safetensors.numpy import load_file, save_file

    base = make_checkpoint(os.path.join(root, "base"), family="qwen2", seed=seed)
    weights = load_file(os.path.join(base, "model.safetensors"))
    rng = np.random.default_rng(seed)
    packed, floats = dict(weights), dict(weights)
    maxq = (1 << bits) - 1
    for layer in range(2):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            out_f, in_f = weights[p + ".weight"].shape
            g = in_f if group == -1 else group
            q = rng.integers(0, maxq + 1, size=(in_f, out_f), dtype=np.int64)
            if method == "gptq":  # symmetric: the zero is the middle of the range
                z = np.full((in_f // g, out_f), (maxq + 1) // 2, np.int64)
            else:
                z = rng.integers(0, maxq + 1, size=(in_f // g, out_f), dtype=np.int64)
            s = (rng.random((in_f // g, out_f)) * 0.02 + 0.001).astype(np.float16)
            groups = np.arange(in_f) // g
            w = (q.astype(np.float32) - z[groups].astype(np.float32)) * s.astype(np.float32)[groups]  # [in, out]
            floats[p + ".weight"] = np.ascontiguousarray(w.T)
            del packed[p + ".weight"]
            if method == "gptq":
                stored_z = (z - 1) & maxq if fmt == "gptq" else z
                packed[p + ".qweight"] = pack_rows(q, bits)
                packed[p + ".qzeros"] = pack_cols(stored_z, bits)
                idx = groups.astype(np.int32)
                if g_idx == "permuted":
                    idx = idx[::-1].copy()
                packed[p + ".g_idx"] = idx
            else:
                packed[p + ".qweight"] = pack_cols(q, bits, AWQ_ORDER)
                packed[p + ".qzeros"] = pack_cols(z, bits, AWQ_ORDER)
            packed[p + ".scales"] = s
    config = json.load(open(os.path.join(base, "config.json")))
    qc = ({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True, "checkpoint_format": fmt,
           "desc_act": desc_act} if method == "gptq" else
          {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})
    dirs = {}
    for name, tensors, extra in (("packed", packed, {"quantization_config": qc}), ("float", floats, {})):
        d = os.path.join(root, name)
        os.makedirs(d)
        for f in os.listdir(base):
            if f not in ("model.safetensors", "config.json"):
                with open(os.path.join(base, f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
                    dst.write(src.read())
        json.dump({**config, **extra}, open(os.path.join(d, "config.json"), "w"))
        save_file(tensors, os.path.join(d, "model.safetensors"))
        dirs[name] = d
    return dirs["packed"], dirs["float"]


def folder_weights(folder: str) -> dict:
    """Every parameter of the folder's incremental graph, by name, as the ms backend maps it."""
    import yaml
    from mindspore.train import mind_ir_pb2

    from lite_runtime.backends.ms import _parameter_arrays

    path = os.path.join(folder, yaml.safe_load(open(os.path.join(folder, "m.yaml")))["infer"]["increment_model_path"])
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(path, "rb").read())
    return _parameter_arrays(model, path)


def _export(checkpoint: str, output: str) -> str:
    """A float folder (--quantize none): the packed layers dequantized. Kept as they are (the default):
    tests/test_quantize.py."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    run_export(ExportConfig(checkpoint=checkpoint, output=output, name="m", seq_length=32, batch_size=1,
                            dtype="float32", device="cpu", quantize="none"))
    return output


@pytest.mark.parametrize("method,bits,group,fmt,desc_act", [
    ("gptq", 4, 32, "gptq", False), ("gptq", 8, 32, "gptq", False), ("gptq", 4, -1, "gptq_v2", False),
    ("gptq", 4, 32, "gptq", True),  # desc_act with g_idx the identity: nothing was reordered
    ("awq", 4, 32, "gemm", False)])
def test_a_packed_checkpoint_exports_as_its_dequantized_weights(tmp_path, method, bits, group, fmt, desc_act):
    packed, floats = quantized_pair(str(tmp_path), method, bits, group, fmt, desc_act=desc_act)
    a, b = _export(packed, str(tmp_path / "a")), _export(floats, str(tmp_path / "b"))
    weights_a, weights_b = folder_weights(a), folder_weights(b)
    assert set(weights_a) == set(weights_b)
    for name, value in weights_a.items():
        assert np.array_equal(value, weights_b[name]), name
    golden = [json.load(open(os.path.join(f, "golden.json")))["batches"] for f in (a, b)]
    assert golden[0] == golden[1]


def _refused(tmp_path, packed: str) -> str:
    with pytest.raises(ExportError) as err:
        _export(packed, str(tmp_path / "never"))
    assert not os.path.exists(tmp_path / "never")
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".never")]
    return str(err.value)


def _with_config(packed: str, **qc) -> str:
    path = os.path.join(packed, "config.json")
    config = json.load(open(path))
    config["quantization_config"] = {**config["quantization_config"], **qc}
    json.dump(config, open(path, "w"))
    return path


SUPPORTED = ("supported: gptq (bits 4 or 8, sym, desc_act false or an identity g_idx), awq (version gemm, bits 4, "
             "zero_point)")


@pytest.mark.parametrize("qc,what", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
    ({"quant_method": "exl2"}, "quant_method 'exl2'"),
    ({"quant_method": "awq", "version": "gemv"}, "awq version 'gemv'"),
    ({"sym": False}, "gptq sym false"),
    ({"bits": 3}, "gptq bits 3"),
])
def test_unsupported_methods_are_refused_by_name(tmp_path, qc, what):
    packed, _ = quantized_pair(str(tmp_path / "ckpt"), "gptq")
    path = _with_config(packed, **qc)
    assert _refused(tmp_path, packed) == f"{path}: quantization_config {what} is not supported; {SUPPORTED}"


def test_desc_act_with_a_reordered_g_idx_is_refused(tmp_path):
    packed, _ = quantized_pair(str(tmp_path / "ckpt"), "gptq", g_idx="permuted", desc_act=True)
    assert _refused(tmp_path, packed) == (
        f"{os.path.join(packed, 'model.safetensors')}: model.layers.0.mlp.down_proj.g_idx is not i // group_size (a "
        f"desc_act checkpoint whose inputs were reordered); {SUPPORTED}")


def test_a_packed_tensor_of_the_wrong_shape_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    packed, _ = quantized_pair(str(tmp_path / "ckpt"), "awq")
    file = os.path.join(packed, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.v_proj.qzeros"
    tensors[name] = np.zeros((1, tensors[name].shape[1]), np.int32)  # one group where the config implies two
    save_file(tensors, file)
    assert _refused(tmp_path, packed) == (
        f"{file}: {name} has shape [1, 4]; awq bits 4 group_size 32 needs [2, 4]")
