"""Quantized CPU folders of many shapes, checked as they are and after a tamper: the two sides of check's derived
limits (issue 43, goal 2). Used by tests/test_check_limits.py (a few shapes drawn by hypothesis) and by
benchmarks/measure_check_limits.py --quantized (the sweep behind docs/checking.md's table).

A folder comes from a tiny random checkpoint (export/checkpoints/random_checkpoint.py), quantized by the export (round to
nearest) or packed first as a GPTQ or AWQ checkpoint (tests/packers.py) and imported. A tamper edits the folder's
weights file after export and re-hashes the manifest (what a careless copy tool or a wrong writer would leave, and
only the replay can tell): one group's scale times 1.01, or one nibble of a weight inverted (its four bits; for int4
that weight q becomes -1 - q)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Spec:
    """One folder: the checkpoint's shape and how its linear layers are quantized."""

    hidden: int
    layers: int = 2
    tied: bool = True
    bits: int = 4
    group: int = 32  # 0: per channel (int8 only)
    symmetric: bool = False
    source: str = "rtn"  # rtn (python -m export --quantize), gptq or awq (packed, then imported)
    seed: int = 0

    def name(self) -> str:
        return (f"h{self.hidden}-L{self.layers}-{'tied' if self.tied else 'untied'}-{self.source}-int{self.bits}-"
                f"g{self.group}-{'sym' if self.symmetric else 'asym'}-s{self.seed}")

    def checkpoint_shape(self) -> Dict[str, Any]:
        heads = max(2, self.hidden // 64)
        return dict(hidden_size=self.hidden, intermediate_size=(self.hidden * 11 // 4 + 127) // 128 * 128,
                    num_hidden_layers=self.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                    vocab_size=1024, tie_word_embeddings=self.tied, seed=self.seed)


def make_folder(root: str, spec: Spec, family: str = "qwen2") -> str:
    """Export spec's folder for the CPU under `root` (once: an existing one is reused)."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from export.checkpoints.random_checkpoint import make_checkpoint

    folder = os.path.join(root, spec.name())
    if os.path.isdir(folder):
        return folder
    ckpt = make_checkpoint(os.path.join(root, "ckpt-" + spec.name()), family=family, **spec.checkpoint_shape())
    kw: Dict[str, Any] = {}
    if spec.source == "rtn":
        kw = dict(quantize=f"int{spec.bits}", group_size=spec.group)
        if spec.bits == 4 and spec.symmetric:
            raise ValueError("the export's int4 has offsets; a symmetric int4 folder comes from gptq")
    else:
        from tests.packers import pack

        ckpt, _ = pack(ckpt, os.path.join(root, "packed-" + spec.name()), spec.source, bits=spec.bits,
                       group=spec.group or -1, sym=spec.symmetric)
    run_export(ExportConfig(checkpoint=ckpt, output=folder, name="m", seq_length=48, batch_size=2, device="cpu",
                            prefill_buckets=(16,), **kw))
    return folder


def _rehash(folder: str, rel: str) -> None:
    path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(path))
    data = open(os.path.join(folder, rel), "rb").read()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    json.dump(manifest, open(path, "w"))


def _parameter(folder: str, name: str):
    """(the weights file, relative, and the parameter's bytes there as a writable array of its dtype and shape)."""
    from mindspore.train import mind_ir_pb2

    stem = json.load(open(os.path.join(folder, "manifest.json")))["name"]
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(os.path.join(folder, f"{stem}_inc_graph.mindir"), "rb").read())
    param = next(p for p in model.graph.parameter if p.name.rsplit(":", 1)[-1] == name)
    ext = param.external_data
    data = np.fromfile(os.path.join(folder, ext.location), np.uint8)
    type_name = mind_ir_pb2.TensorProto.DataType.Name(param.data_type)
    dtype = {"FLOAT": np.float32, "INT8": np.int8, "UINT8": np.uint8, "BFLOAT16": np.uint16}[type_name]
    view = data[ext.offset:ext.offset + ext.length].view(dtype).reshape(tuple(param.dims))
    return ext.location, data, view


def tamper(folder: str, out: str, kind: str, rng: np.random.Generator, layer: Optional[int] = None,
           linear: Optional[str] = None) -> Dict[str, Any]:
    """A copy of `folder` at `out` with one tamper (`kind` scale or nibble of a quantized folder, row of a bfloat16 one)
    in a linear layer (drawn by `rng` unless given); returns where."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    from lite_runtime.folder import load_folder

    n_layers = int(load_folder(out, verify=False).model["config"]["num_hidden_layers"])
    layer = int(rng.integers(n_layers)) if layer is None else layer
    linear = LINEARS[int(rng.integers(len(LINEARS)))] if linear is None else linear
    name = f"model.layers.{layer}.{linear}.weight"
    if kind == "row":  # a bfloat16 folder: one weight row 1 % off, rounded back to bfloat16
        rel, data, w = _parameter(out, name)
        o = int(rng.integers(w.shape[0]))
        bits = ((w[o].astype(np.uint32) << 16).view(np.float32) * np.float32(1.01)).view(np.uint32)
        w[o] = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        where = {"tensor": name, "row": o}
    elif kind == "scale":
        rel, data, scale = _parameter(out, name + "_scale")
        g, o = int(rng.integers(scale.shape[0])), int(rng.integers(scale.shape[1]))
        scale[g, o] *= np.float32(1.01)
        where = {"tensor": name + "_scale", "group": g, "output": o}
    else:
        rel, data, q = _parameter(out, name)
        o, j = int(rng.integers(q.shape[0])), int(rng.integers(q.shape[1]))
        q.view(np.uint8)[o, j] ^= np.uint8(0x0F)
        where = {"tensor": name, "row": o, "byte": j}
    data.tofile(os.path.join(out, rel))
    _rehash(out, rel)
    return where


def check(folder: str) -> Dict[str, Any]:
    """python -m lite_runtime.check's report on the ms backend, in figures: the worst error of the replays with x
    exact and of the int16 replay, their derived limits, and the verdict."""
    from lite_runtime.check import FAST_SUFFIX, run_check

    report = run_check(folder, backend="ms")
    exact = [r.max_rel for r in report.rows if not r.graph.endswith(FAST_SUFFIX[report.fast_mode])]
    fast = [r.max_rel for r in report.rows if r.graph.endswith(FAST_SUFFIX[report.fast_mode])]
    return {"passed": report.passed, "exact": max(exact), "int16": max(fast) if fast else None,
            "exact_limit": report.tolerance.rel, "int16_limit": report.fast.rel if report.fast else None,
            "diverged": sum(r.first_divergence is not None for r in report.rows), "verdict": report.verdict()}
