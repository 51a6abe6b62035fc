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

The tables (the embedding and the output head) follow the folder's `TablePlan` (resolve_tables): in a folder this
export quantizes (round-to-nearest), int8 per row (TABLE_METHOD), an untied embedding int4 in an int4 folder (why:
docs/quantization.md); in an imported one (GPTQ, AWQ, GGUF), as the checkpoint holds them: a float table stays
float, a GGUF table in a type the folder has a form for keeps its blocks (Q8_0, Q4_0, Q4_1), any other is widened;
`--quantize_tables int8` quantizes them again, recorded as such.

Two views of one quantized checkpoint:
- `Quantized.folder_tensors()`: what the weights file holds (q, scales, offsets), each layer quantized once, whole,
  in a worker of export/writers/weights_file.py;
- `FolderMeaning`: once written, each layer's weight as the float32 values the folder means, dequantized block by
  block from its weights files as the float32 reference (export/writers/reference.py) reads it: the golden references
  hold the folder to what it holds.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from export import native
from export.errors import ExportError
from export.checkpoints.methods import QuantMethod, is_linear
from export.checkpoints.safetensors import rounded_to, widen

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


# The embedding and the head of a folder this export quantizes: int8, a scale per row (per channel: the head's outputs,
# the embedding's tokens, one scale serving both when they are one tied table), whatever the linear layers' bits. Why:
# docs/quantization.md (the tables are a third of a small model and a seventh of a 7B; in 4 bits they cost the most
# perplexity, llama.cpp keeps its head at 6 bits or more; in 8 bits per row, the lookup is a gather and a multiply).
# Also what --quantize_tables int8 makes of an imported checkpoint's tables.
TABLE_METHOD = QuantMethod(8, 0, True, "rtn")
TABLES_CHOICES = ("auto", "none", "int8")


def embedding_method(method: Optional[QuantMethod], tied: bool, hidden_size: int) -> Optional[QuantMethod]:
    """The embedding's own method, when it is not TABLE_METHOD: in an int4 folder of a model with an untied head, int4
    with offsets in groups of 128 (or the largest power of two >= 32 dividing the hidden size), as llama.cpp's Q4_0
    files keep token_embd at Q4_0. Its error reaches each token's input once and is not amplified over the vocabulary
    as the head's is; it is 7 % of a 7B's parameters, and at 8 bits made the int4 folder 4.7 % larger than llama.cpp's
    Q4_0 of the same checkpoint (docs/quantization.md). A tied table is the head too: int8 per row. So is a GGUF's
    embedding: it is quantized already, in blocks of its own, and a second 4-bit grid would add its error to theirs."""
    if method is None or method.bits != 4 or tied or method.source.startswith("gguf"):
        return None
    group, _ = choose_group(None, 4, [hidden_size])
    return QuantMethod(4, group, False, "rtn")


@dataclass(frozen=True)
class TablePlan:
    """How a quantized folder holds its tables: `embedding` and `head` each a QuantMethod, or None for float (the
    folder's matrix dtype, `float_dtype`). A tied model has one table: `head` is then the embedding's.
    `sources`: each table's type in the checkpoint, by role ("float16", "gguf:Q6_K", "gptq", ...), for the record.
    `requantized`: --quantize_tables int8 quantized an imported checkpoint's tables again."""

    embedding: Optional[QuantMethod]
    head: Optional[QuantMethod]
    tied: bool
    float_dtype: str
    sources: Tuple[Tuple[str, str], ...] = ()
    requantized: bool = False

    def method_of(self, name: str) -> Optional[QuantMethod]:
        if name == "model.embed_tokens.weight":
            return self.embedding
        return self.head if name == "lm_head.weight" else None

    def record(self) -> Dict[str, Any]:
        """{embedding: ..., head: ...}: each {bits, group_size, symmetric, source} when quantized, else {dtype}; the
        head "tied" for a tied model; `from`: the checkpoint's own type where the folder changed it."""
        sources = dict(self.sources)

        def one(role: str, m: Optional[QuantMethod]) -> Dict[str, Any]:
            out: Dict[str, Any] = ({"dtype": self.float_dtype} if m is None else
                                   {"bits": m.bits, "group_size": m.group_size, "symmetric": m.symmetric,
                                    "source": m.source})
            if role in sources and sources[role] not in (out.get("source"), out.get("dtype")):
                out["from"] = sources[role]
            return out

        out = {"embedding": one("embedding", self.embedding),
               "head": "tied" if self.tied else one("head", self.head)}
        if self.requantized:
            out["requantized"] = "--quantize_tables int8"
        return out

    def text(self) -> str:
        """The tables in words, for the export's summary."""
        def words(m: Optional[QuantMethod]) -> str:
            if m is None:
                return self.float_dtype
            if m.source == "rtn" and m.group_size == 0 and m.symmetric:
                return f"int{m.bits} per row"
            return m.label()

        again = " (quantized again by --quantize_tables int8)" if self.requantized else ""
        if self.tied:
            return f"tied embedding and head {words(self.embedding)}{again}"
        if self.embedding == self.head:
            return f"embedding and head {words(self.embedding)}{again}"
        return f"embedding {words(self.embedding)}, head {words(self.head)}{again}"


def resolve_tables(option: Optional[str], method: Optional[QuantMethod], where: Dict[str, Any], tied: bool,
                   hidden_size: int, float_dtype: str, bits_ok: Tuple[int, ...] = (8, 4), groups_ok: bool = True,
                   atlas: bool = False) -> Optional[TablePlan]:
    """The tables of a quantized folder (None for a float one), from --quantize_tables (`option`: auto, none, int8;
    None is auto) and what the checkpoint holds (docs/quantization.md, "The tables").

    auto: a folder this export quantizes (source rtn) takes TABLE_METHOD, an untied embedding in an int4 folder int4
    (embedding_method); an imported checkpoint's tables stay as it holds them: float ones float, a GGUF table whose
    type the folder has a form for on this device (Q8_0, Q4_0, Q4_1: int8/int4 in groups of 32) its blocks as they
    are, any other GGUF table widened to float. none: float tables. int8: TABLE_METHOD for both, refused for a table
    the checkpoint holds in fewer than 8 bits (a second, coarser grid). `bits_ok`, `groups_ok`: what the device's
    quantized matmul takes; `atlas`: a tied int4 table has no Atlas form (the head's WeightQuantBatchMatmul takes
    qint4x2, the lookup gathers bytes), so it is widened there."""
    option = option or "auto"
    if option not in TABLES_CHOICES:
        raise ExportError(f"--quantize_tables {option!r} is not one of {', '.join(TABLES_CHOICES)}")
    if method is None:
        if option != "auto":
            raise ExportError(f"--quantize_tables {option} needs a quantized folder (--quantize int8 or int4, or a "
                              "GPTQ, AWQ or GGUF checkpoint that is quantized)")
        return None
    names = {"embedding": "model.embed_tokens.weight", "head": "model.embed_tokens.weight" if tied else "lm_head.weight"}
    native = {role: _native_of(where, name) for role, name in names.items() if name in where}
    sources = tuple((role, _stored_type(where, name)) for role, name in names.items() if name in where)
    imported = method.source != "rtn"
    if option == "none":
        return TablePlan(None, None, tied, float_dtype, sources)
    if option == "int8":
        if imported:
            for role, name in names.items():
                low = _below_8_bits(where, name) if name in where else None
                if low is not None:
                    raise ExportError(f"{where[name].path}: --quantize_tables int8: {low}; quantizing it "
                                      "again would round it onto a second, coarser grid: drop --quantize_tables (the "
                                      "table is kept as the checkpoint holds it)")
        return TablePlan(TABLE_METHOD, TABLE_METHOD, tied, float_dtype, sources, requantized=imported)
    if not imported:
        embedding = embedding_method(method, tied, hidden_size) or TABLE_METHOD
        return TablePlan(embedding, TABLE_METHOD, tied, float_dtype, sources)

    def kept(role: str) -> Optional[QuantMethod]:
        m = native.get(role)
        if m is None or m.bits not in bits_ok or (m.group_size and not groups_ok) or (atlas and tied and m.bits == 4):
            return None
        return m

    return TablePlan(kept("embedding"), kept("head"), tied, float_dtype, sources)


def _native_of(where: Dict[str, Any], name: str) -> Optional[QuantMethod]:
    """The folder method a checkpoint's tensor is held in as it is (its source's native_method_of), or None."""
    of = getattr(where[name], "native_method_of", None)
    return of(name) if of is not None else None


def _stored_type(where: Dict[str, Any], name: str) -> str:
    """A tensor's type in its checkpoint, in words: a GGUF type (gguf:Q6_K), a packed method, or a float dtype."""
    of = getattr(where[name], "stored_type", None)
    if of is not None:
        return of(name)
    dtype = where[name].header.get(name, {}).get("dtype") if hasattr(where[name], "header") else None
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(dtype, str(dtype))


def _below_8_bits(where: Dict[str, Any], name: str) -> Optional[str]:
    """`<tensor> is <type> (<bits> bits)` when the checkpoint holds the tensor in fewer than 8 bits, else None."""
    of = getattr(where[name], "below_8_bits", None)
    return of(name) if of is not None else None


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
    # each step in place on one float32 temporary (the same operations, in the same order, as written out plainly)
    if symmetric:
        top = half - 1
        scale = np.maximum(x.max(axis=2), -x.min(axis=2)) / np.float32(top)  # max |x|
        scale[scale == 0] = 1.0
        t = np.divide(x, scale[..., None])
        np.rint(t, out=t)
        np.clip(t, -top, top, out=t)
        return t.astype(np.int8).reshape(rows, inputs), scale.astype(np.float32), None
    levels = (1 << bits) - 1
    lo, hi = np.minimum(x.min(axis=2), 0.0), np.maximum(x.max(axis=2), 0.0)
    scale = (hi - lo) / levels
    scale[scale == 0] = 1.0
    zero = np.clip(np.rint(-lo / scale), 0, levels)
    t = np.divide(x, scale[..., None])
    np.rint(t, out=t)
    t += zero[..., None]
    np.clip(t, 0, levels, out=t)
    t -= half
    return t.astype(np.int8).reshape(rows, inputs), scale.astype(np.float32), (half - zero).astype(np.float32)


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


def transpose_block(block: np.ndarray, packed: bool = False) -> np.ndarray:
    """One expert's [n, k] matrix as [k, n] (the Atlas fused form's stacks, export/writers/stacked.py), or back; int4
    (`packed`: two per byte along the last axis, pack_int4) unpacked, transposed and packed along the new last axis."""
    if packed:
        return pack_int4(np.ascontiguousarray(unpack_int4(block).T))
    return np.ascontiguousarray(block.T)


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
    """A checkpoint (`where`: name -> source, export/checkpoints/safetensors.py's interface) with its linear layers quantized by
    `method`. Each layer's (q [O, I] int8, scale [G, O], offset [G, O] or None), float32 scales, comes from
    `layer_source(name)` when the checkpoint holds it quantized in this very format (GPTQ, AWQ, GGUF), else from
    round-to-nearest of its float values, in blocks of rows (float32 in memory: one block)."""

    BLOCK_ROWS_BYTES = 32 << 20

    def __init__(self, where: Dict[str, Any], method: QuantMethod, compute_dtype: str,
                 native: Optional[Callable[[str, QuantMethod], Optional[Callable[[], Tuple]]]] = None,
                 tables: Optional[TablePlan] = None) -> None:
        """`native(name, method)`: a loader of the layer's own integers when the checkpoint holds it in `method`, else
        None. `tables`: the folder's TablePlan (None: float tables)."""
        self.where, self.method, self.compute_dtype = where, method, compute_dtype
        self.native = native or (lambda name, m: None)
        self.tables = tables
        self.layers = [n for n in where if is_linear(n) or (n in TABLES and tables is not None
                                                            and tables.method_of(n) is not None)]
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
        if is_linear(name):
            return self.method
        m = self.tables.method_of(name) if self.tables is not None else None
        if m is None:
            raise ExportError(f"{name}: not a quantized tensor of this folder; this is a bug in export, please report "
                              "it")
        return m

    def quantized(self, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """(q as the folder holds it: int8 [O, I] or int4 packed to uint8 [O, I / 2], scale float32 [O, G], offset
        float32 [O, G] or None) of one layer, scales and offsets rounded to the folder's compute dtype (what the
        folder holds). Round-to-nearest runs block by block into the packed result: memory holds the layer's
        folder form and one float32 block, never the layer as int8 when it is int4."""
        m = self.method_of(name)
        load = self.native(name, m)
        if load is not None:
            q, scale, offset = load()
            if m.bits == 4:
                q = pack_int4(q)
        else:
            src = self.where[name]
            stored = src.stored(name)
            o, i = stored.shape
            step = max(1, self.BLOCK_ROWS_BYTES // (4 * i))
            q = np.empty((o, i // 2) if m.bits == 4 else (o, i), np.uint8 if m.bits == 4 else np.int8)
            scale = np.empty((o, m.groups(i)), np.float32)
            offset = None if m.symmetric else np.empty((o, m.groups(i)), np.float32)
            for a in range(0, o, step):
                rows = np.ascontiguousarray(stored[a:a + step])
                if rows.dtype == np.float16:
                    rows = rows.astype(np.float32)  # as rtn() widens it
                b = a + rows.shape[0]
                if native.rtn_rows(rows, m.bits, m.group_size, m.symmetric, q[a:b], scale[a:b],
                                   None if offset is None else offset[a:b]):
                    continue  # the same values in C (export/native/rtn.c)
                bq, bs, bo = rtn(widen(rows), m.bits, m.group_size, m.symmetric)
                q[a:b], scale[a:b] = pack_int4(bq) if m.bits == 4 else bq, bs
                if offset is not None:
                    offset[a:b] = bo
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


class FolderTensors:
    """The weights file's view (export/writers/weights_file.py): `<layer>.weight` (int8, or packed int4 as uint8),
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
                parts = {layer: q}
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
    from export.checkpoints.safetensors import stored_as

    return stored_as(np.ascontiguousarray(values, np.float32), dtype)


class FolderMeaning:
    """The golden reference's view of a written quantized folder (export/pipeline.py runs the golden after the weights
    stage for these): `stored(<layer>)` is an array-like [O, I] whose row slices are the float32 weights the folder
    means, dequantized from the integers and scales in its weights files, every rank's part put back in place
    (`Entry.split`). Reading what was written costs one widening per block, as a 16-bit folder's reference does;
    quantizing again on each pass of the reference cost ~56 s per pass at 7B.

    Nothing the check relies on is lost by reading back: a split or a packing the graphs do not expect still makes
    their logits differ from these, and the rounding itself is the one the writer ran (`Quantized.quantized`)."""

    def __init__(self, folder: str, layouts: List[Any], transposed_experts: bool = False) -> None:
        self.path = folder
        self.layouts = layouts
        self.transposed_experts = transposed_experts  # the fused form's [E, K, N] stacks (export/writers/stacked.py)
        self._maps = [np.memmap(os.path.join(folder, layout.location), np.uint8, mode="r") for layout in layouts]
        entries = layouts[0].entries
        quantized = [n[:-len(SCALE)] for n in entries if n.endswith(SCALE) and n[:-len(SCALE)] in entries]
        # a mixture of experts' stacks (export/writers/stacked.py): each expert's layers by the checkpoint's names,
        # rows of one expert of the stack (gate_up_proj: the gate's first half of the outputs, the up's second)
        # (tensor parallel: each rank's share of an expert, gate_up's gate and up halves of its share, down's columns
        # and its groups, put back together: export/writers/stacked.py)
        self.experts: Dict[str, Tuple[str, int, int, int]] = {}
        for name in (n for n in quantized if len(entries[n].shape) == 3):
            stack = name.rsplit(".", 1)[0] + "."
            kinds = (("gate_proj", 0), ("up_proj", 1)) if name.endswith("gate_up_proj") else (("down_proj", 0),)
            for e in range(entries[name].shape[0]):
                for kind, half in kinds:
                    self.experts[f"{stack}{e}.{kind}.weight"] = (name, e, half, len(kinds))
        self.layers = [n for n in quantized if len(entries[n].shape) == 2] + list(self.experts)

    def _part(self, rank: int, name: str) -> np.ndarray:
        entry = self.layouts[rank].entries[name]
        dtype = _NUMPY_OF[entry.dtype]
        raw = self._maps[rank][entry.offset:entry.offset + entry.nbytes]
        return raw.view(dtype).reshape(entry.shape)

    def _parts(self, name: str) -> Tuple[List[np.ndarray], Optional[int]]:
        split = self.layouts[0].entries[name].split
        return ([self._part(0, name)] if split is None else [self._part(r, name) for r in range(len(self.layouts))],
                split)

    def _whole(self, name: str) -> np.ndarray:
        """A small tensor (a scale or an offset [G, O]) whole, as float32."""
        parts, split = self._parts(name)
        values = parts[0] if split is None else np.concatenate(parts, axis=split)
        return widen(np.asarray(values)).astype(np.float32, copy=False)

    def _expert(self, name: str, suffix: str = "") -> Optional[np.ndarray]:
        """One expert's q (suffix "") or scale / offset [G, n] of its stack, every rank's share put back in place:
        gate_up's ranks each hold [gate share; up share] (q rows, scale columns), down's its columns of q and its
        groups of the scales (or the whole scale, per channel)."""
        stack, e, half, halves = self.experts[name]
        if stack + suffix not in self.layouts[0].entries:
            return None
        parts, split = self._parts(stack + suffix)
        along = 0 if suffix == "" else 1  # gate_up's outputs: q's rows, the scales' columns
        pieces = []
        packed = self.layouts[0].entries[stack].dtype in ("uint8", "qint4x2")
        for part in parts:
            block = np.asarray(part[e])
            if self.transposed_experts and suffix == "":  # [k, n] back to the [n, k] below
                block = transpose_block(block, packed)
            if halves == 2:  # this rank's gate or up half of its outputs
                n = block.shape[along] // 2
                block = block[(slice(None),) * along + (slice(half * n, (half + 1) * n),)]
            pieces.append(block)
        if len(pieces) == 1:
            return pieces[0]
        axis = along if halves == 2 else (1 if suffix == "" else 0)  # down: q's columns, the scales' groups
        return np.concatenate(pieces, axis=axis)

    def shape(self, name: str) -> Tuple[int, ...]:
        if name in self.experts:
            q = self._expert(name)
            packed = self.layouts[0].entries[self.experts[name][0]].dtype in ("uint8", "qint4x2")
            return q.shape[0], q.shape[1] * (2 if packed else 1)
        parts, split = self._parts(name)
        shape = list(parts[0].shape)
        if split is not None:
            shape[split] = sum(p.shape[split] for p in parts)
        if self.layouts[0].entries[name].dtype in ("uint8", "qint4x2"):
            shape[1] *= 2
        return tuple(shape)

    def offset(self, name: str) -> int:
        if name in self.experts:
            stack, e = self.experts[name][:2]
            entry = self.layouts[0].entries[stack]
            return entry.offset + e * (entry.nbytes // entry.shape[0])
        return self.layouts[0].entries[name].offset

    def will_need(self, name: str) -> None:
        for rank, layout in enumerate(self.layouts):
            if name in self.experts:  # one expert's rows of its stack
                stack, e = self.experts[name][:2]
                entry = layout.entries[stack]
                begin, size = entry.offset + e * (entry.nbytes // entry.shape[0]), entry.nbytes // entry.shape[0]
            else:
                entry = layout.entries[name]
                begin, size = entry.offset, entry.nbytes
            start = begin - begin % mmap.PAGESIZE
            try:
                self._maps[rank]._mmap.madvise(mmap.MADV_WILLNEED, start, begin + size - start)
            except (AttributeError, OSError, ValueError):  # a platform without madvise: read by page faults
                return

    def stored(self, name: str) -> "FolderRows":
        if name in self.experts:  # one expert's rows of a stack, its scales [G, n] sliced before they are widened
            stack = self.experts[name][0]

            def scales(suffix: str) -> Optional[np.ndarray]:
                part = self._expert(name, suffix)
                return None if part is None else widen(part).astype(np.float32, copy=False).T

            return FolderRows([self._expert(name)], None, self.layouts[0].entries[stack].dtype in ("uint8", "qint4x2"),
                              scales(SCALE), scales(OFFSET))
        parts, split = self._parts(name)
        offset = name + OFFSET in self.layouts[0].entries
        return FolderRows(parts, split, self.layouts[0].entries[name].dtype in ("uint8", "qint4x2"),
                          self._whole(name + SCALE).T, self._whole(name + OFFSET).T if offset else None)

    def read(self, name: str) -> np.ndarray:
        rows = self.stored(name)
        return rows[0:rows.shape[0]]


_NUMPY_OF = {"int8": np.int8, "uint8": np.uint8, "qint4x2": np.uint8, "float16": np.float16,
             "bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}
# a packed byte -> its two int4 values as float32 (low nibble first, two's complement): one gather unpacks a block
_INT4_PAIRS = np.array([[(b & 15) - 16 * ((b & 15) >> 3), (b >> 4) - 16 * (b >> 7)] for b in range(256)], np.float32)


class FolderRows:
    """One quantized layer as the ranks' weights files hold it (q parts split along `split`, or one whole part),
    with its scale and offset [O, G] in float32: a float32 matrix [O, I] read by row slices or index arrays.

    The reference's matmul takes it in blocks of rows without dequantizing every value: `rows_into` gives
    W' = q * scale per group (q alone per channel), and `finish` completes y = x W'^T into x W^T: the per-channel
    scale on the outputs, and the offsets as (x summed per group) . (scale * offset), since
    sum_i x_i (q_i + o_g) s_g = sum_i x_i q_i s_g + (sum_{i in g} x_i) o_g s_g. So a block costs one conversion (and a
    multiply with groups), as a 16-bit one costs one widening; the sums differ from the dequantized weights' in
    float32 rounding only."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, parts: List[np.ndarray], split: Optional[int], packed: bool, scale: np.ndarray,
                 offset: Optional[np.ndarray]) -> None:
        self.parts, self.split, self.packed = parts, split, packed
        self.scale, self.offset = np.ascontiguousarray(scale), None if offset is None else np.ascontiguousarray(offset)
        rows = sum(p.shape[0] for p in parts) if split == 0 else parts[0].shape[0]
        width = sum(p.shape[1] for p in parts) if split == 1 else parts[0].shape[1]
        self.shape = (rows, width * (2 if packed else 1))
        self.scaled_offset = None if self.offset is None else self.scale * self.offset  # [O, G]

    def _q(self, rows) -> np.ndarray:
        if self.split is None:
            return np.asarray(self.parts[0][rows])
        if self.split == 1:
            return np.concatenate([np.asarray(p[rows]) for p in self.parts], axis=1)
        share = self.parts[0].shape[0]
        index = np.arange(self.shape[0])[rows]
        out = np.empty((len(index), self.parts[0].shape[1]), self.parts[0].dtype)
        owner = index // share
        for r in np.unique(owner):
            mine = owner == r
            out[mine] = self.parts[r][index[mine] - r * share]
        return out

    def rows_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """W' of rows [a, b) (q times the scale of each group; q alone per channel) in `out` (contiguous [b - a, I]),
        for `finish`."""
        q = np.ascontiguousarray(self._q(slice(a, b)))
        n = q.shape[0]
        if native.quantized_rows(q, self.packed, self.scale[a:b], out):  # the same values, in C (export/native)
            return out
        if self.packed:
            np.take(_INT4_PAIRS, q, axis=0, out=out.reshape(n, -1, 2), mode="clip")
        else:
            np.copyto(out, q, casting="unsafe")
        if self.scale.shape[1] > 1:
            groups = out.reshape(n, self.scale.shape[1], -1)
            groups *= self.scale[a:b][..., None]
        return out

    def finish(self, a: int, b: int, x: np.ndarray, y: np.ndarray) -> None:
        """y [T, b - a] = x W'^T of rows [a, b) (`rows_into`) -> x W^T, in place."""
        if self.scale.shape[1] == 1:
            y *= self.scale[a:b, 0]
        if self.scaled_offset is not None:
            sums = x.reshape(x.shape[0], self.scale.shape[1], -1).sum(axis=2)  # [T, G]
            y += sums @ self.scaled_offset[a:b].T

    def __getitem__(self, rows) -> np.ndarray:
        """Rows by a slice or an array of indices (the embedding's lookup), as float32."""
        q = self._q(rows)
        return dequantize(unpack_int4(q) if self.packed else q, self.scale[rows],
                          None if self.offset is None else self.offset[rows])


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
