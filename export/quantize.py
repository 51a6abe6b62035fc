"""Quantized linear layers (weight-only, W8A16 / W4A16): the method a folder's linear layers are stored with, the
round-to-nearest quantizer, and the two views export takes of a quantized checkpoint (docs/architecture.md,
"Quantized folders").

One format for every source (round-to-nearest here, GPTQ, AWQ, GGUF's Q8_0/Q4_0/Q4_1): a linear layer y = x W^T,
W [O, I], is held as
- `<layer>.weight`: q, signed integers: int8 [O, I], or int4 packed two to a byte as uint8 [O, I / 2] (input 2j
  in the low nibble, 2j + 1 in the high one, two's complement: -8..7);
- `<layer>.weight_scale` [G, O] and, unless the method is symmetric, `<layer>.weight_offset` [G, O], in the
  folder's compute dtype: G groups of g = I / G consecutive inputs (G = 1: per channel);
- meaning W[o, i] = (q[o, i] + offset[i // g, o]) * scale[i // g, o].
That is Ascend's WeightQuantBatchMatmul (aclnnWeightQuantBatchMatmulV2: ANTIQUANT(weight) = (weight +
antiquantOffset) * antiquantScale, per-group scale (ceil(K / g), N), the weight given transposed as [N, K]) and
the CPU kernels' (cpu_kernels/quant.cc) alike, so one folder format serves both.

The embedding and the output head stay in the folder's dtype: they are read one row per token (the embedding) or
are the one matrix whose error every logit carries (the head), and llama.cpp's own default keeps the head at 6
bits or more.

Two views of one quantized checkpoint (`Quantized`):
- `folder_tensors()`: what the weights file holds (q, scales, offsets), each tensor computed once, whole, in a
  worker of export/weights_file.py;
- `meaning_tensors()`: each layer's weight as the float32 values the folder means, dequantized block by block as
  the float32 reference (export/reference.py) reads it: the golden references hold the folder to what it holds.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from export.errors import ExportError
from export.weights import rounded_to, widen

LINEAR_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # tensor parallel: split along the inputs
SCALE, OFFSET = "_scale", "_offset"  # suffixes of a weight's companions: `<layer>.weight_scale`
CHOICES = ("none", "int8", "int4")
# --group_size defaults, by bits. int8: per channel, what MindIE's W8A16 and every Atlas card (the 310P series takes
# no other) run. int4: groups of 128, msModelSlim's and vllm-ascend's W4A16 default and GPTQ's/AWQ's usual; where
# 128 does not divide a layer's inputs (SmolLM2's hidden size is 576) the largest power of two that divides them all
# (576: 64), at least 32 (llama.cpp's block). Measured: docs/quantization.md.
DEFAULT_GROUP = {8: 0, 4: 128}
MIN_GROUP = 32


TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(LINEAR_SUFFIXES)


@dataclass(frozen=True)
class QuantMethod:
    """How a folder's linear layers are stored: `bits` 8 or 4, `group_size` inputs per scale (0: per channel),
    `symmetric` (no offsets), `source`: rtn, gptq, awq, or gguf:<type>."""

    bits: int
    group_size: int
    symmetric: bool
    source: str

    def groups(self, inputs: int) -> int:
        return 1 if self.group_size == 0 else inputs // self.group_size

    def label(self) -> str:
        group = "per channel" if self.group_size == 0 else f"groups of {self.group_size}"
        return (f"int{self.bits} ({group}, {'symmetric' if self.symmetric else 'with offsets'}, from "
                f"{self.source})")

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def record(self) -> Dict[str, Any]:
        """What the manifest, the yaml and golden.json say: this method, and the tables' (embedding, head)."""
        return {**self.to_dict(), "tables": {"bits": 8, "group_size": 0, "symmetric": True}}

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "QuantMethod":
        return cls(int(raw["bits"]), int(raw["group_size"]), bool(raw["symmetric"]), str(raw["source"]))


# The embedding and the head of every quantized folder: int8, a scale per row (per channel: the head's outputs, the
# embedding's tokens, one scale serving both when they are one tied table), whatever the linear layers' bits. Why:
# docs/quantization.md (the tables are a third of a small model and a seventh of a 7B; in 4 bits they cost the most
# perplexity, llama.cpp keeps its head at 6 bits or more; in 8 bits per row, the lookup is a gather and a multiply).
TABLE_METHOD = QuantMethod(8, 0, True, "rtn")


# ---------------------------------------------------------------------------------------------------------- numbers

def rtn(w: np.ndarray, bits: int, group: int, symmetric: bool) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Round-to-nearest of float rows w [R, I] -> (q int8 [R, I], scale [R, G], offset [R, G] or None), float32.

    Symmetric: scale = max|w| / (2^(bits-1) - 1), q = round(w / scale). With offsets (int4's default): the group's
    [min, max] over 2^bits - 1 steps, an integer zero point z = round(-min / scale) in [0, 2^bits - 1], unsigned
    u = round(w / scale) + z in [0, 2^bits - 1], stored as q = u - 2^(bits-1) with offset = 2^(bits-1) - z, so that
    (q + offset) * scale = (u - z) * scale (AWQ's and GPTQ's zero-point form)."""
    rows, inputs = w.shape
    g = inputs if group == 0 else group
    x = np.asarray(w, np.float32).reshape(rows, inputs // g, g)
    half = 1 << (bits - 1)
    if symmetric:
        top = half - 1
        scale = np.abs(x).max(axis=2) / top
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(x / scale[..., None]), -top, top).astype(np.int8)
        return q.reshape(rows, inputs), scale.astype(np.float32), None
    levels = (1 << bits) - 1
    lo, hi = np.minimum(x.min(axis=2), 0.0), np.maximum(x.max(axis=2), 0.0)
    scale = (hi - lo) / levels
    scale[scale == 0] = 1.0
    zero = np.clip(np.rint(-lo / scale), 0, levels)
    u = np.clip(np.rint(x / scale[..., None]) + zero[..., None], 0, levels)
    q = (u - half).astype(np.int8)
    return q.reshape(rows, inputs), scale.astype(np.float32), (half - zero).astype(np.float32)


def dequantize(q: np.ndarray, scale: np.ndarray, offset: Optional[np.ndarray]) -> np.ndarray:
    """q int8 [R, I], scale/offset [R, G] -> float32 [R, I]: (q + offset) * scale, group by group."""
    rows, inputs = q.shape
    groups = scale.shape[1]
    x = q.reshape(rows, groups, inputs // groups).astype(np.float32)
    if offset is not None:
        x += offset[..., None]
    x *= scale[..., None]
    return x.reshape(rows, inputs)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in -8..7, [R, I] (I even) -> uint8 [R, I / 2]: input 2j in the low nibble, 2j + 1 in the high."""
    u = q.astype(np.uint8) & np.uint8(0x0F)
    return (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """pack_int4's inverse: uint8 [R, I / 2] -> int8 [R, I]."""
    lo = (packed & np.uint8(0x0F)).astype(np.int8)
    hi = (packed >> np.uint8(4)).astype(np.int8)
    q = np.empty((packed.shape[0], packed.shape[1] * 2), np.int8)
    q[:, 0::2], q[:, 1::2] = lo, hi
    q[q > 7] -= 16
    return q


def choose_group(requested: Optional[int], bits: int, inputs: List[int]) -> Tuple[int, Optional[str]]:
    """The group size every layer's input size (each rank's, under tensor parallelism) is a multiple of, and a note
    when it is not the one asked for: the requested (or default) size if it divides them all, else the largest power
    of two below it that does, at least MIN_GROUP; per channel (0) when none does."""
    want = DEFAULT_GROUP[bits] if requested is None else requested
    if want == 0 or all(i % want == 0 for i in inputs):
        return want, None
    g = 1 << (want.bit_length() - 1)
    while g >= MIN_GROUP and any(i % g for i in inputs):
        g //= 2
    chosen = g if g >= MIN_GROUP else 0
    sizes = ", ".join(str(i) for i in sorted(set(inputs)))
    return chosen, (f"group size {want} does not divide the layers' input sizes ({sizes}); using "
                    f"{chosen if chosen else 'per channel'}")


# ---------------------------------------------------------------------------------------------------------- sources

class Quantized:
    """A checkpoint (`where`: name -> source, export/weights.py's interface) with its linear layers quantized by
    `method`. Each layer's (q [O, I] int8, scale [G, O], offset [G, O] or None), float32 scales, comes from
    `layer_source(name)` when the checkpoint holds it quantized in this very format (GPTQ, AWQ, GGUF), else from
    round-to-nearest of its float values, in blocks of rows (float32 in memory: one block)."""

    BLOCK_ROWS_BYTES = 32 << 20

    def __init__(self, where: Dict[str, Any], method: QuantMethod, compute_dtype: str,
                 native: Optional[Callable[[str], Optional[Callable[[], Tuple]]]] = None) -> None:
        self.where, self.method, self.compute_dtype = where, method, compute_dtype
        self.native = native or (lambda name: None)
        self.layers = [n for n in where if is_linear(n) or n in TABLES]
        for name in self.layers:
            o, i = where[name].shape(name)
            g = self.method_of(name).group_size
            if g and i % g:
                raise ExportError(f"{where[name].path}: {name} has {i} inputs, not a multiple of group size {g}; "
                                  "pass a --group_size that divides it")
            if self.method_of(name).bits == 4 and i % 2:
                raise ExportError(f"{where[name].path}: {name} has an odd number of inputs ({i}); int4 packs two "
                                  "per byte: export with --quantize int8")

    def method_of(self, name: str) -> QuantMethod:
        return self.method if is_linear(name) else TABLE_METHOD

    def quantized(self, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """(q int8 [O, I], scale float32 [O, G], offset float32 [O, G] or None) of one layer, scales and offsets
        rounded to the folder's compute dtype (what the folder holds)."""
        m = self.method_of(name)
        load = self.native(name) if is_linear(name) else None
        if load is not None:
            q, scale, offset = load()
        else:
            src = self.where[name]
            stored = src.stored(name)
            o, i = stored.shape
            step = max(1, self.BLOCK_ROWS_BYTES // (4 * i))
            q = np.empty((o, i), np.int8)
            scale = np.empty((o, m.groups(i)), np.float32)
            offset = None if m.symmetric else np.empty((o, m.groups(i)), np.float32)
            for a in range(0, o, step):
                bq, bs, bo = rtn(widen(np.asarray(stored[a:a + step])), m.bits, m.group_size, m.symmetric)
                q[a:a + step], scale[a:a + step] = bq, bs
                if offset is not None:
                    offset[a:a + step] = bo
        if not m.symmetric and offset is None:
            offset = np.zeros_like(scale)
        scale = rounded_to(np.asarray(scale, np.float32), self.compute_dtype)
        offset = None if m.symmetric else rounded_to(np.asarray(offset, np.float32), self.compute_dtype)
        return q, scale, offset

    def folder_tensors(self) -> Dict[str, Any]:
        """`where` as the weights file holds it: every quantized layer's weight, scale (and offset)."""
        view = FolderTensors(self)
        out = {n: src for n, src in self.where.items() if n not in view.layer_of and n not in self.layers}
        out.update({n: view for n in view.names()})
        return out

    def meaning_tensors(self) -> Dict[str, Any]:
        """`where` with each quantized layer's weight as the float32 values the folder means."""
        view = MeaningTensors(self)
        return {n: (view if n in self.layers else src) for n, src in self.where.items()}


class FolderTensors:
    """The weights file's view (export/weights_file.py): `<layer>.weight` (int8, or packed int4 as uint8),
    `<layer>.weight_scale` and `<layer>.weight_offset` [G, O]. A layer is quantized once, by whichever of its tensors
    a worker asks for first; the others take its result, which is dropped once all are taken."""

    def __init__(self, quantized: Quantized) -> None:
        self.q = quantized
        self.path = "quantized weights"
        self.layer_of: Dict[str, str] = {}
        self._shapes: Dict[str, Tuple[Tuple[int, ...], str]] = {}
        for name in quantized.layers:
            m = quantized.method_of(name)
            o, i = quantized.where[name].shape(name)
            g = m.groups(i)
            self.layer_of[name] = name
            self._shapes[name] = ((o, i // 2), "uint8") if m.bits == 4 else ((o, i), "int8")
            for suffix in (SCALE,) + (() if m.symmetric else (OFFSET,)):
                self.layer_of[name + suffix] = name
                self._shapes[name + suffix] = ((g, o), quantized.compute_dtype)
        self._locks: Dict[str, threading.Lock] = {n: threading.Lock() for n in quantized.layers}
        self._done: Dict[str, Dict[str, np.ndarray]] = {}
        self.header = {n: {"shape": list(s)} for n, (s, _) in self._shapes.items()}

    def names(self) -> List[str]:
        return list(self._shapes)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name][0]

    def dtype(self, name: str) -> str:
        return self._shapes[name][1]

    def offset(self, name: str) -> int:
        """Where the layer lies in its checkpoint, so the weights file keeps the checkpoint's order; a layer's scale
        and offset come right after its weight (sorted by name at equal offsets)."""
        layer = self.layer_of[name]
        return self.q.where[layer].offset(layer)

    def will_need(self, name: str) -> None:
        layer = self.layer_of[name]
        self.q.where[layer].will_need(layer)

    def materialize(self, name: str) -> np.ndarray:
        """The tensor's bytes as the weights file holds them (called from a worker thread)."""
        layer = self.layer_of[name]
        with self._locks[layer]:
            parts = self._done.get(layer)
            if parts is None:
                q, scale, offset = self.q.quantized(layer)
                parts = {layer: pack_int4(q) if self.q.method_of(layer).bits == 4 else q}
                parts[layer + SCALE] = _as_dtype(np.ascontiguousarray(scale.T), self.q.compute_dtype)
                if offset is not None:
                    parts[layer + OFFSET] = _as_dtype(np.ascontiguousarray(offset.T), self.q.compute_dtype)
                self._done[layer] = parts
            out = parts.pop(name)
            if not parts:
                del self._done[layer]
        return out

    def stored(self, name: str) -> np.ndarray:
        raise ExportError(f"{name}: a quantized tensor is materialized by the weights writer; this is a bug in "
                          "export, please report it")


def _as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    from export.weights import stored_as

    return stored_as(np.ascontiguousarray(values, np.float32), dtype)


class MeaningTensors:
    """The reference's view: `stored(<layer>.weight)` is an array-like [O, I] whose row slices are the float32
    weights the folder means, dequantized from the layer's quantized form (computed once per `stored` call: one
    pass of the reference)."""

    def __init__(self, quantized: Quantized) -> None:
        self.q = quantized
        self.path = "quantized weights"

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.q.where[name].shape(name)

    def offset(self, name: str) -> int:
        return self.q.where[name].offset(name)

    def will_need(self, name: str) -> None:
        self.q.where[name].will_need(name)

    def stored(self, name: str) -> "DequantizedRows":
        return DequantizedRows(*self.q.quantized(name))

    def read(self, name: str) -> np.ndarray:
        rows = self.stored(name)
        return rows[0:rows.shape[0]]


class DequantizedRows:
    """q, scale, offset of one layer ([O, I], [O, G]) as a float32 matrix read by row slices."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, q: np.ndarray, scale: np.ndarray, offset: Optional[np.ndarray]) -> None:
        self.q, self.scale, self.offset = q, scale, offset
        self.shape = q.shape

    def __getitem__(self, rows) -> np.ndarray:
        """Rows by a slice or an array of indices (the embedding's lookup), as float32."""
        return dequantize(self.q[rows], self.scale[rows], None if self.offset is None else self.offset[rows])


# ---------------------------------------------------------------------------------------------------------- resolve

def native_method(where: Dict[str, Any]) -> Optional[QuantMethod]:
    """The method a quantized checkpoint's layers are stored in, when it has one (GPTQ, AWQ, a GGUF whose linear
    layers are Q8_0, Q4_0 or Q4_1), else None."""
    sources = {id(src): src for name, src in where.items() if is_linear(name)}.values()
    methods = {getattr(src, "native_method", lambda: None)() for src in sources}
    methods.discard(None)
    if len(methods) > 1:
        raise ExportError(f"the checkpoint's layers are quantized in more than one way ({', '.join(sorted(m.label() for m in methods))}); "
                          "export with --quantize none")
    return next(iter(methods), None)


def resolve(requested: Optional[str], group_size: Optional[int], where: Dict[str, Any], inputs: List[int],
            checkpoint: str) -> Tuple[Optional[QuantMethod], List[str]]:
    """The folder's method from --quantize / --group_size and what the checkpoint holds, and notes for the user.

    None (no --quantize): a quantized checkpoint keeps its method, a float one stays float. `none`: float (a
    quantized checkpoint dequantized). int8/int4 of a float checkpoint: round-to-nearest. Of a quantized one: its
    own method when the bits agree (a --group_size that differs from the file's is refused), else refused."""
    native = native_method(where)
    if requested == "none" or (requested is None and native is None):
        if group_size is not None:
            raise ExportError("--group_size needs --quantize int8 or int4")
        return None, []
    if native is not None:
        bits = {"int8": 8, "int4": 4}.get(requested or "", native.bits)
        if bits != native.bits:
            raise ExportError(f"{checkpoint}: --quantize {requested}: the checkpoint is already {native.label()}; "
                              f"export it as it is (no --quantize, or --quantize int{native.bits}), or "
                              "--quantize none for float weights")
        if group_size is not None and group_size != native.group_size:
            raise ExportError(f"{checkpoint}: --group_size {group_size}: the checkpoint's layers are {native.label()}"
                              "; drop --group_size to keep them as they are")
        return native, [f"linear layers kept as the checkpoint holds them: {native.label()}"]
    bits = {"int8": 8, "int4": 4}[requested]
    if group_size is not None and group_size < 0:
        raise ExportError(f"--group_size {group_size}: pass a positive size, or 0 for per channel")
    if group_size and (group_size < MIN_GROUP or group_size % MIN_GROUP):
        raise ExportError(f"--group_size {group_size}: use 0 (per channel) or a multiple of {MIN_GROUP}")
    group, note = choose_group(group_size, bits, inputs)
    method = QuantMethod(bits, group, symmetric=bits == 8, source="rtn")
    return method, ([note] if note else []) + [f"linear layers quantized: {method.label()}"]
