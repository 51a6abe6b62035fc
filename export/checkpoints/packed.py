"""Already-quantized HF checkpoints: GPTQ (AutoGPTQ / GPTQModel layout) and AWQ (AutoAWQ's GEMM layout), read from
config.json's `quantization_config` and their packed int32 tensors. Each quantized linear layer's `qweight`,
`qzeros`, `scales` (and GPTQ's `g_idx`) are checked against the config and the layer's shape, and offered to the
rest of export under the HF name `<layer>.weight`, dequantized to float32: W[o, i] = (q[i, o] - z[g(i), o]) *
s[g(i), o]. Until quantized folders exist (issue 31), such a checkpoint exports as a float folder of those values.

The layouts, as their packers write them:
- GPTQ: `qweight` int32 [in * bits / 32, out], element i of column o in word i // (32 / bits) at bits
  (i % (32 / bits)) * bits; `qzeros` int32 [groups, out * bits / 32], packed the same way along the outputs, each
  stored as zero - 1 (checkpoint_format "gptq"; "gptq_v2" stores the zero itself); `scales` float16 [groups, out];
  `g_idx` int32 [in], the group of each input (i // group_size unless desc_act reordered them).
- AWQ GEMM: `qweight` int32 [in, out * 4 / 32], eight outputs per word with column 8c + ORDER[k] at bits 4k
  (ORDER = 0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [groups, out / 8] packed the same way; `scales` float16
  [groups, out]; the group of input i is i // group_size.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from export.errors import ExportError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = ("gptq (bits 4 or 8, sym, desc_act false or an identity g_idx), awq (version gemm, bits 4, "
             "zero_point)")
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def quantization(raw: Dict[str, Any], source: str) -> Optional[Dict[str, Any]]:
    """config.json's quantization_config, checked: None for a float checkpoint, else the method's settings
    {method, bits, group_size, zero_minus_one}. Anything else is refused by name."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ExportError(f"{source}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()

    def refuse(what: str) -> ExportError:
        return ExportError(f"{source}: quantization_config {what} is not supported; supported: {SUPPORTED}")

    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if method == "gptq":
        if bits not in (4, 8):
            raise refuse(f"gptq bits {bits!r}")
        if qc.get("sym", True) is not True:
            raise refuse("gptq sym false")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"gptq checkpoint_format {fmt!r}")
        settings = {"method": "gptq", "bits": bits, "zero_minus_one": fmt == "gptq",
                    "desc_act": bool(qc.get("desc_act", False))}
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(f"awq version {version!r}")
        if bits != 4 or qc.get("w_bit", 4) != 4:
            raise refuse(f"awq bits {bits!r}")
        if qc.get("zero_point", True) is not True:
            raise refuse("awq zero_point false")
        settings = {"method": "awq", "bits": 4, "zero_minus_one": False, "desc_act": False}
    else:
        raise refuse(f"quant_method {qc.get('quant_method')!r}")
    if not isinstance(group, int) or (group != -1 and group <= 0):
        raise refuse(f"group_size {group!r}")
    settings["group_size"] = group
    return settings


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> the unsigned values they hold, (32 / bits) per word, lowest bits first, along `axis`."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    w = words.astype(np.uint32, copy=False)
    if axis == 0:
        out = (w[:, None, :] >> shifts[None, :, None]) & np.uint32((1 << bits) - 1)
        return out.reshape(w.shape[0] * per, w.shape[1])
    out = (w[:, :, None] >> shifts[None, None, :]) & np.uint32((1 << bits) - 1)
    return out.reshape(w.shape[0], w.shape[1] * per)


class PackedLayers:
    """The checkpoint source for a GPTQ or AWQ checkpoint: the interface of export/checkpoints/safetensors.py's SafetensorsFile over
    `where` (name -> file), with every quantized layer's packed tensors shown as `<layer>.weight` [out, in]."""

    def __init__(self, where: Dict[str, Any], settings: Dict[str, Any], source: str) -> None:
        self.settings, self._where = settings, where
        self.path = source
        self.layers = sorted(name[:-len(".qweight")] for name in where if name.endswith(".qweight"))
        if not self.layers:
            raise ExportError(f"{source}: quantization_config says {settings['method']}, but no tensor is a .qweight")
        self._shapes = {layer: self._check(layer) for layer in self.layers}
        self.header = {f"{layer}.weight": {"shape": list(shape)} for layer, shape in self._shapes.items()}

    def _file(self, name: str):
        if name not in self._where:
            raise ExportError(f"{self.path}: {name} is missing (a {self.settings['method']} layer needs "
                              f"{', '.join(_PARTS[:3 if self.settings['method'] == 'awq' else 4])})")
        return self._where[name]

    def _check(self, layer: str) -> Tuple[int, int]:
        """(out, in) of the layer, every packed tensor's shape and dtype checked against the config first."""
        s = self.settings
        per = 32 // s["bits"]
        q, z, sc = (f"{layer}.{p}" for p in _PARTS[:3])
        q_shape, s_shape = (tuple(self._file(n).shape(n)) for n in (q, sc))
        if len(s_shape) != 2:
            raise self._bad(sc, s_shape, "[groups, out]")
        groups, out = s_shape
        if len(q_shape) != 2:
            raise self._bad(q, q_shape, "two dimensions")
        if s["method"] == "gptq":  # packed along the inputs
            inputs = q_shape[0] * per
            expected = {q: (q_shape[0], out), z: (groups, out // per)}
        else:  # AWQ: along the outputs
            inputs = q_shape[0]
            expected = {q: (inputs, out // per), z: (groups, out // per)}
        if out % per or inputs <= 0:
            raise self._bad(q, q_shape, f"whole words of {per} values")
        group = inputs if s["group_size"] == -1 else s["group_size"]
        if inputs % group or groups != inputs // group:
            raise self._bad(sc, s_shape, f"[{inputs} / group_size {group}, {out}]")
        for name, want in expected.items():
            got = tuple(self._file(name).shape(name))
            if got != want:
                raise self._bad(name, got, list(want))
        for name in (q, z):
            dtype = self._file(name).header[name]["dtype"]
            if dtype not in ("I32", "U32"):
                raise ExportError(f"{self._file(name).path}: {name} has dtype {dtype}; packed tensors are I32")
        if self._file(sc).header[sc]["dtype"] not in ("F16", "BF16", "F32"):
            raise ExportError(f"{self._file(sc).path}: {sc} has dtype {self._file(sc).header[sc]['dtype']}; "
                              "scales are F16, BF16 or F32")
        if s["method"] == "gptq" and f"{layer}.g_idx" in self._where:
            g = f"{layer}.g_idx"
            if tuple(self._file(g).shape(g)) != (inputs,):
                raise self._bad(g, tuple(self._file(g).shape(g)), [inputs])
            # desc_act's reordering would need the inputs permuted in every graph: refused before anything is written
            if not np.array_equal(self._raw(g).astype(np.int64), np.arange(inputs) // group):
                raise ExportError(f"{self._file(g).path}: {g} is not i // group_size (a desc_act checkpoint whose "
                                  f"inputs were reordered); supported: {SUPPORTED}")
        return out, inputs

    def _bad(self, name: str, got, want) -> ExportError:
        return ExportError(f"{self._file(name).path}: {name} has shape {list(got)}; {self.settings['method']} "
                           f"bits {self.settings['bits']} group_size {self.settings['group_size']} needs {want}")

    def _raw(self, name: str) -> np.ndarray:
        return self._file(name).integers(name)

    def dequantized(self, layer: str) -> np.ndarray:
        """The layer's weight [out, in] in float32."""
        s = self.settings
        out, inputs = self._shapes[layer]
        group = inputs if s["group_size"] == -1 else s["group_size"]
        scales = np.asarray(self._file(f"{layer}.scales").read(f"{layer}.scales"), np.float32)  # [groups, out]
        q, z = self._integers(layer, scales.shape[0], inputs)
        groups = np.arange(inputs) // group  # GPTQ's g_idx, when stored, was checked to be this (_check)
        w = (q.astype(np.float32) - z[groups].astype(np.float32)) * scales[groups]  # [in, out]
        return np.ascontiguousarray(w.T)

    def native_method(self):
        """The folder method the layers are kept in (export/network/quantize.py): the checkpoint's bits and group size, with
        offsets (half - zero: GPTQ's symmetric zeros give offsets of 0, AWQ's zero points their own)."""
        from export.checkpoints.methods import QuantMethod

        s = self.settings
        return QuantMethod(s["bits"], 0 if s["group_size"] == -1 else s["group_size"], False, s["method"])

    def native_method_of(self, name: str):
        """native_method for every packed layer (a packed lm_head too: some exporters pack it), else None."""
        return self.native_method() if name[:-len(".weight")] in self._shapes else None

    def stored_type(self, name: str) -> str:
        return self.settings["method"]

    def below_8_bits(self, name: str) -> Optional[str]:
        if self.settings["bits"] >= 8:
            return None
        return f"{name[:-len('.weight')]} is packed by {self.settings['method']} in {self.settings['bits']} bits"

    def quantized(self, name: str):
        """(q int8 [O, I], scale [O, G], offset [O, G]) float32 of one layer, the integers as the checkpoint holds
        them: q = u - 2^(bits-1), offset = 2^(bits-1) - z, so (q + offset) * scale = (u - z) * scale."""
        layer = name[:-len(".weight")]
        s = self.settings
        out, inputs = self._shapes[layer]
        half = 1 << (s["bits"] - 1)
        scales = np.asarray(self._file(f"{layer}.scales").read(f"{layer}.scales"), np.float32)  # [groups, out]
        u, z = self._integers(layer, scales.shape[0], inputs)
        q = (u.T.astype(np.int16) - half).astype(np.int8)  # [out, in]
        return np.ascontiguousarray(q), np.ascontiguousarray(scales.T), np.ascontiguousarray(
            (half - z.astype(np.float32)).T)

    def _integers(self, layer: str, groups: int, inputs: int):
        """(u [in, out], z [groups, out]) unsigned values of a layer's qweight and qzeros, unpacked."""
        s = self.settings
        bits, per = s["bits"], 32 // s["bits"]
        if s["method"] == "gptq":
            u = _unpack(self._raw(f"{layer}.qweight"), bits, axis=0)  # [in, out]
            z = _unpack(self._raw(f"{layer}.qzeros"), bits, axis=1)  # [groups, out]
            if s["zero_minus_one"]:  # stored as zero - 1, wrapping as the packer's bits do
                z = (z + 1) & np.uint32((1 << bits) - 1)
            return u, z
        order = np.argsort(np.array(AWQ_ORDER))  # nibble k holds column ORDER[k]: put them back in order
        u = _unpack(self._raw(f"{layer}.qweight"), bits, axis=1).reshape(inputs, -1, per)[:, :, order]
        z = _unpack(self._raw(f"{layer}.qzeros"), bits, axis=1).reshape(groups, -1, per)[:, :, order]
        return u.reshape(inputs, -1), z.reshape(groups, -1)

    # the checkpoint-source interface, for the layers' weights
    def names(self) -> List[str]:
        return list(self.header)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name[:-len(".weight")]]

    def offset(self, name: str) -> int:
        q = name[:-len(".weight")] + ".qweight"
        return self._where[q].offset(q)

    def stored(self, name: str) -> np.ndarray:
        return self.dequantized(name[:-len(".weight")])

    def read(self, name: str) -> np.ndarray:
        return self.stored(name)

    def will_need(self, name: str) -> None:
        q = name[:-len(".weight")] + ".qweight"
        self._where[q].will_need(q)


def open_packed(folder: str, where: Dict[str, Any]) -> Dict[str, Any]:
    """`where` (name -> file) of a checkpoint folder, with a GPTQ/AWQ checkpoint's packed tensors replaced by their
    layers' dequantized weights; a float checkpoint's unchanged."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return where  # ModelConfig.from_file reports it
    settings = quantization(raw if isinstance(raw, dict) else {}, path)
    if settings is None:
        return where
    packed = PackedLayers(where, settings, path)
    parts = {f"{layer}.{p}" for layer in packed.layers for p in _PARTS}  # a set: a 48-layer MoE has ~18K layers
    out = {name: file for name, file in where.items() if name not in parts}
    out.update({name: packed for name in packed.names()})
    return out
