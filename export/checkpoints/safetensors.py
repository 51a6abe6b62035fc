"""Checkpoint weights: *.safetensors read tensor by tensor from a memory map, names and shapes checked, cast to a
folder's dtype (export/writers/weights_file.py writes them)."""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np

from export.errors import ExportError

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> (numpy dtype of the stored bits, how to widen them to a numpy float)
_STORED = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # numpy has no bfloat16: keep the bits, widen to float32 below
}
_INTEGERS = {"I32": np.int32, "U32": np.uint32, "I64": np.int64, "I16": np.int16}


class SafetensorsFile:
    """One .safetensors file: header parsed once, tensors read lazily from a memory map."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
        except (OSError, struct.error, ValueError) as exc:
            raise ExportError(f"{path}: not a readable safetensors file ({exc}); re-download it") from None
        header.pop("__metadata__", None)
        self.header: Dict[str, dict] = header
        self.data_start = 8 + size
        expected = self.data_start + max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        actual = os.path.getsize(path)
        if actual < expected:
            raise ExportError(f"{path}: truncated ({actual} of {expected} bytes); re-download or re-copy it")
        self._map: Optional[np.memmap] = None

    def names(self) -> List[str]:
        return list(self.header)

    def offset(self, name: str) -> int:
        """Where the tensor's bytes begin in the file."""
        return self.data_start + int(self.header[name]["data_offsets"][0])

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def _mapped(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def stored(self, name: str) -> np.ndarray:
        """The tensor's bits as stored, a view of the memory map: float32, float16, or uint16 for bf16."""
        info = self.header[name]
        dtype = info["dtype"]
        if dtype not in _STORED:
            raise ExportError(f"{self.path}: tensor {name} has dtype {dtype}; expected F32, F16 or BF16")
        begin, end = info["data_offsets"]
        raw = self._mapped()[self.data_start + begin:self.data_start + end]
        shape = tuple(info["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORED[dtype]).itemsize
        if raw.size != expected:  # the file's size was checked on open: its header contradicts itself
            raise ExportError(f"{self.path}: tensor {name} spans {raw.size} bytes but its shape {list(shape)} "
                              f"needs {expected}; the header is damaged, re-download the file")
        return raw.view(_STORED[dtype]).reshape(shape)

    def integers(self, name: str) -> np.ndarray:
        """An integer tensor's values (a packed GPTQ/AWQ tensor, a g_idx), a view of the memory map."""
        info = self.header[name]
        dtype = _INTEGERS.get(info["dtype"])
        if dtype is None:
            raise ExportError(f"{self.path}: tensor {name} has dtype {info['dtype']}; expected an integer type "
                              f"({', '.join(_INTEGERS)})")
        begin, end = info["data_offsets"]
        raw = self._mapped()[self.data_start + begin:self.data_start + end]
        shape = tuple(info["shape"])
        if raw.size != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise ExportError(f"{self.path}: tensor {name} spans {raw.size} bytes but its shape {list(shape)} "
                              "needs another size; the header is damaged, re-download the file")
        return raw.view(dtype).reshape(shape)

    def will_need(self, name: str) -> None:
        """Start reading the tensor's pages in the background (madvise WILLNEED); a hint, never an error."""
        import mmap

        mapped = getattr(self._mapped(), "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_WILLNEED"):
            return
        begin, end = self.header[name]["data_offsets"]
        start = (self.data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mapped.madvise(mmap.MADV_WILLNEED, start, self.data_start + end - start)
        except (OSError, ValueError):
            pass

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32/float16 numpy (bf16 widened to float32), a view where possible."""
        return widen(self.stored(name))


def widen(stored: np.ndarray) -> np.ndarray:
    """Stored bits (see SafetensorsFile.stored) as a float array: bf16 (uint16 bits) becomes float32, exactly."""
    if stored.dtype == np.uint16:
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16), rounded to nearest even as torch rounds; NaN stays NaN."""
    values = np.ascontiguousarray(values, np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def stored_as(stored: np.ndarray, dtype: str) -> np.ndarray:
    """A checkpoint tensor's bits (SafetensorsFile.stored) as `dtype` stores them: float32, float16, or uint16
    bfloat16 bits. A tensor already in that dtype is returned as is (a view), never rounded twice."""
    if dtype == "bfloat16":
        return stored if stored.dtype == np.uint16 else bf16_bits(widen(stored))
    return np.ascontiguousarray(widen(stored), dtype={"float32": np.float32, "float16": np.float16}[dtype])


def rounded_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values after a round trip through `dtype`: what a folder storing them in `dtype` computes with."""
    if dtype == "bfloat16":
        return widen(bf16_bits(values))
    if dtype == "float16":
        return np.asarray(values, np.float16).astype(np.float32)
    return values


def open_safetensors(folder: str) -> Dict[str, SafetensorsFile]:
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"{index_path}: unreadable shard index ({exc}); it needs a 'weight_map' object") from None
        files: Dict[str, SafetensorsFile] = {}
        where: Dict[str, SafetensorsFile] = {}
        for name, shard in sorted(weight_map.items()):
            path = os.path.join(folder, shard)
            if shard not in files:
                if not os.path.isfile(path):
                    raise ExportError(f"{path}: shard named in {INDEX_FILE} is missing; copy it into {folder}")
                files[shard] = SafetensorsFile(path)
            if name not in files[shard].header:
                raise ExportError(f"{path}: tensor {name} listed in {INDEX_FILE} is not in this shard")
            where[name] = files[shard]
        return where
    paths = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not paths:
        raise ExportError(f"{folder}: no *.safetensors weights found; save the model with safe_serialization=True")
    if len(paths) > 1:
        raise ExportError(f"{folder}: {len(paths)} .safetensors files but no {INDEX_FILE}; add the index file")
    single = SafetensorsFile(os.path.join(folder, paths[0]))
    return {name: single for name in single.names()}
