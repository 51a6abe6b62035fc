"""The export's own C, built by setup.py as `export/native/_native*.so`: round-to-nearest (rtn.c) and the golden
reference's quantized rows (golden_rows.c).

Optional, as the CPU kernel library is: without a compiler at install the export computes the same values in numpy
(export/network/quantize.py rtn, FolderRows.rows_into: tests/test_quantize.py holds the two paths equal bit for bit), only
slower; MSLITE_LLM_EXPORT_NUMPY=1 forces that path. It shares no code with cpu_kernels/: the golden references prove
those kernels, so they are never computed by them (docs/architecture.md, "Quantized folders").
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_loaded: Optional[ctypes.CDLL] = None
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def library_path() -> Optional[str]:
    """This installation's built library, or None when it was not built (no C compiler at install)."""
    found = sorted(glob.glob(os.path.join(_HERE, "_native*.so")))
    return found[0] if found else None


def _library() -> Optional[ctypes.CDLL]:
    global _loaded
    if _loaded is None:
        path = library_path()
        if path is None or os.environ.get("MSLITE_LLM_EXPORT_NUMPY"):  # the numpy path, forced (tests compare them)
            return None
        lib = ctypes.CDLL(path)
        for name in ("golden_int4_rows", "golden_int8_rows"):
            getattr(lib, name).argtypes = [_P, _I64, _I64, _P, _I64, _P]
            getattr(lib, name).restype = None
        lib.export_rtn_rows.argtypes = [_P, ctypes.c_int, _I64, _I64, ctypes.c_int, _I64, ctypes.c_int, _P, _P, _P]
        lib.export_rtn_rows.restype = ctypes.c_int
        _loaded = lib
    return _loaded


def quantized_rows(q: np.ndarray, packed: bool, scale: np.ndarray, out: np.ndarray) -> bool:
    """out [n, I] = the rows' values times their group's scale (scale [n, G]; G == 1: the values alone), as
    FolderRows.rows_into defines them, from q [n, I / 2] packed int4 (uint8) or [n, I] int8. False, touching
    nothing, when the library is not built or the arrays are not as it reads them."""
    lib = _library()
    if lib is None:
        return False
    rows, width = out.shape
    groups = scale.shape[1]
    if (q.shape != (rows, width // 2 if packed else width) or scale.shape[0] != rows or width % groups
            or (packed and (width // groups) % 2) or q.dtype != (np.uint8 if packed else np.int8)
            or scale.dtype != np.float32 or out.dtype != np.float32
            or not (q.flags.c_contiguous and scale.flags.c_contiguous and out.flags.c_contiguous)):
        return False
    (lib.golden_int4_rows if packed else lib.golden_int8_rows)(q.ctypes.data, rows, width, scale.ctypes.data,
                                                              groups, out.ctypes.data)
    return True


def rtn_rows(w: np.ndarray, bits: int, group: int, symmetric: bool, q: np.ndarray, scale: np.ndarray,
             offset: Optional[np.ndarray]) -> bool:
    """export/network/quantize.py rtn() of the rows w [n, I] (float32, or bfloat16 bits as uint16: SafetensorsFile.stored)
    into q (int8 [n, I], or int4 packed [n, I / 2] as pack_int4 packs it), scale and offset [n, G] (offset None when
    symmetric), the same values bit for bit. False when the library is not built, the arrays are not as it reads them,
    or a value is not finite (the caller then runs rtn(), which decides what that means)."""
    lib = _library()
    if lib is None or w.dtype not in (np.float32, np.uint16) or w.ndim != 2:
        return False
    rows, width = w.shape
    groups = 1 if group == 0 else width // group
    if ((group and width % group) or q.shape != (rows, width // 2 if bits == 4 else width)
            or q.dtype != (np.uint8 if bits == 4 else np.int8) or scale.shape != (rows, groups)
            or scale.dtype != np.float32 or (offset is None) != symmetric
            or (offset is not None and (offset.shape != scale.shape or offset.dtype != np.float32))
            or (bits == 4 and (width // groups) % 2)
            or not all(a.flags.c_contiguous for a in (w, q, scale) + (() if offset is None else (offset,)))):
        return False
    rc = lib.export_rtn_rows(w.ctypes.data, int(w.dtype == np.uint16), rows, width, bits, group, int(symmetric),
                             q.ctypes.data, scale.ctypes.data, None if offset is None else offset.ctypes.data)
    if rc == 2:
        raise MemoryError("export/native/rtn.c: out of memory for one group's values")
    return rc == 0
