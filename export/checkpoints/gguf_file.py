"""A GGUF file read defensively: its header, metadata and tensor table parsed with every count, length and offset
checked against the bytes the file holds before anything is read or allocated, so a truncated or hostile file is a
one-line error naming the file and the field, never a huge allocation or a hang. Tensor data stays in a memory map;
`dequantized` turns one tensor into float32 with the gguf package's own dequantizers.

The layout (llama.cpp's gguf.h, gguf-py's constants): "GGUF", version (2 or 3), tensor count and metadata count
(uint64); each metadata entry a string key, a uint32 type and a value (arrays: element type, uint64 count, elements;
strings: uint64 length, UTF-8 bytes); each tensor a name, uint32 n_dims (at most 4), uint64 dims (fastest first),
uint32 ggml type, uint64 offset into the data section, which starts at the next multiple of `general.alignment`
(default 32) after the table. Little-endian only (a big-endian file's version reads as a huge number: refused).
"""
from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np

from export.errors import ExportError

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays are legal; deeper is not something a model file holds
DEFAULT_ALIGNMENT = 32
# metadata value types: (struct format, size) of the fixed-size ones; 8 string, 9 array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: Tuple[int, ...]  # numpy order (slowest first): GGUF lists dimensions fastest first
    ggml_type: int
    type_name: str
    offset: int  # absolute, in the file
    nbytes: int


def _block(ggml_type: int) -> Tuple[str, int, int]:
    """(name, elements per block, bytes per block) of a ggml tensor type, from the gguf package."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise KeyError(ggml_type) from None
    block, size = GGML_QUANT_SIZES[kind]
    return kind.name, block, size


class _Cursor:
    def __init__(self, buf, path: str) -> None:
        self.buf, self.pos, self.path, self.end = buf, 0, path, len(buf)

    def fail(self, field: str, what: str) -> ExportError:
        return ExportError(f"{self.path}: GGUF {field}: {what} (at byte {self.pos} of {self.end}); the file is "
                           "damaged or not a GGUF, re-download it")

    def need(self, n: int, field: str) -> None:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(field, f"needs {n} bytes, {self.end - self.pos} are left")

    def scalar(self, fmt: str, size: int, field: str):
        self.need(size, field)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, field: str) -> int:
        return self.scalar("<I", 4, field)

    def u64(self, field: str) -> int:
        return self.scalar("<Q", 8, field)

    def string(self, field: str) -> str:
        n = self.u64(field + " length")
        self.need(n, field)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(field, "not UTF-8") from None

    def value(self, kind: int, field: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.scalar(*_SCALARS[kind], field)
        if kind == _STRING:
            return self.string(field)
        if kind != _ARRAY:
            raise self.fail(field, f"unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise self.fail(field, f"arrays nested deeper than {MAX_NESTING}")
        elem = self.u32(field + " element type")
        count = self.u64(field + " count")
        if elem in _NUMPY:  # one read, checked first
            size = _SCALARS[elem][1]
            self.need(count * size, field)
            out = np.frombuffer(self.buf, dtype=_NUMPY[elem], count=count, offset=self.pos).copy()
            self.pos += count * size
            return out.astype(bool).tolist() if elem == 7 else out.tolist()
        if elem == _STRING:
            self.need(count * 8, field)  # every string has its 8-byte length: the count cannot pass the file's end
        elif elem == _ARRAY:
            self.need(count * 12, field)
        else:
            raise self.fail(field, f"unknown array element type {elem}")
        return [self.value(elem, field, depth + 1) for _ in range(count)]


def open_gguf_file(path: str) -> "GGUFFile":
    """The parsed file, parsed once per export: the CLI's default dtype, the config, the tensors, the golden prompts'
    tokenizer and the folder's tokenizer files all read the same metadata (a 152K-token vocabulary is parsed in
    Python). Keyed by the file's identity and modification time, so a rewritten file is parsed again."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ExportError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return _cached(os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached(path: str, inode: int, size: int, mtime_ns: int) -> "GGUFFile":
    return GGUFFile(path)


class GGUFFile:
    """The header, metadata (`metadata`: key -> Python value) and tensor table (`tensors`) of one GGUF file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            raise ExportError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        cur = _Cursor(self._map, path)
        cur.need(4, "magic")
        if bytes(self._map[:4]) != b"GGUF":
            raise ExportError(f"{path}: not a GGUF file (it does not begin with 'GGUF')")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise ExportError(f"{path}: GGUF version {self.version} is not read; supported: 2, 3 (little-endian)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        cur.need(n_kv * 13, "metadata count")  # key length, type and a 1-byte value at least
        self.metadata: Dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            kind = cur.u32(f"metadata {key!r} type")
            self.metadata[key] = cur.value(kind, f"metadata {key!r}")
        cur.need(n_tensors * 24, "tensor count")  # name length, n_dims, type and offset at least
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ExportError(f"{path}: GGUF metadata general.alignment is {alignment!r}; it must be a power of two")
        table = []
        for i in range(n_tensors):
            name = cur.string(f"tensor {i} name")
            n_dims = cur.u32(f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.fail(f"tensor {name!r} n_dims", f"{n_dims}, expected 1 to {MAX_DIMS}")
            dims = [cur.u64(f"tensor {name!r} dims") for _ in range(n_dims)]
            table.append((name, dims, cur.u32(f"tensor {name!r} type"), cur.u64(f"tensor {name!r} offset")))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: List[GGUFTensor] = []
        seen = set()
        for name, dims, kind, offset in table:
            if name in seen:
                raise ExportError(f"{path}: GGUF tensor {name!r} is listed twice")
            seen.add(name)
            try:
                type_name, block, block_bytes = _block(kind)
            except KeyError:
                raise ExportError(f"{path}: GGUF tensor {name!r} has ggml type {kind}, which the gguf package does "
                                  "not know") from None
            count = 1
            for d in dims:
                count *= d
            if any(d == 0 for d in dims) or dims[0] % block:
                raise ExportError(f"{path}: GGUF tensor {name!r} dims {dims} do not fit {type_name} blocks of {block}")
            nbytes = count // block * block_bytes
            begin = data_start + offset
            if offset % alignment or begin + nbytes > size:
                raise ExportError(f"{path}: GGUF tensor {name!r} ({type_name}, dims {dims}) at offset {offset} needs "
                                  f"bytes {begin}..{begin + nbytes} of a {size}-byte file; the file is truncated or "
                                  "damaged, re-download it")
            self.tensors.append(GGUFTensor(name, tuple(reversed(dims)), kind, type_name, begin, nbytes))

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as stored (a view of the memory map), one row of blocks per row of the tensor."""
        data = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        rows = int(np.prod(tensor.shape[:-1], dtype=np.int64))
        return data.reshape(rows, tensor.nbytes // rows)

    def dequantized_rows(self, tensor: GGUFTensor, first: int, count: int) -> np.ndarray:
        """Rows [first, first + count) of the tensor seen as [rows, last dimension] (one expert of a stacked [E, O, I]
        tensor: its O rows), in float32, dequantizing those rows only."""
        from gguf import GGMLQuantizationType, dequantize

        raw = self.raw(tensor)[first:first + count]
        try:
            values = dequantize(raw, GGMLQuantizationType(tensor.ggml_type))
        except NotImplementedError:
            raise ExportError(f"{self.path}: GGUF tensor {tensor.name} has type {tensor.type_name}, which the gguf "
                              "package cannot dequantize") from None
        return np.asarray(values, dtype=np.float32).reshape(count, tensor.shape[-1])

    def dequantized(self, tensor: GGUFTensor) -> np.ndarray:
        """float32 values in numpy order, by the gguf package's dequantizer for the tensor's type."""
        from gguf import GGMLQuantizationType, dequantize

        kind = GGMLQuantizationType(tensor.ggml_type)
        raw = self.raw(tensor)
        try:
            values = dequantize(raw, kind)
        except NotImplementedError:
            raise ExportError(f"{self.path}: GGUF tensor {tensor.name} has type {tensor.type_name}, which the gguf "
                              "package cannot dequantize") from None
        return np.asarray(values, dtype=np.float32).reshape(tensor.shape)
