"""The int8/int4 weight matmuls and WeightQuantBatchMatmul's CPU stand-in (cpu_kernels/matmul_quant.cc): each run as a
MindSpore aot Custom op in a graph-mode Cell against a float64 numpy reference of the format's formula, with the int4
nibbles unpacked here independently of the C++; plus the exact error codes, the plain C++ path, and thread counts.

Format: W [N, K] (N outputs, K inputs) in G groups of g = K / G inputs per row, W[n, k] = (q[n, k] + offset[k // g, n])
* scale[k // g, n]; q int8 [N, K], or uint8 [N, K / 2] with q[n, 2j] in byte j's low nibble and q[n, 2j + 1] in its high
nibble, two's complement.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library_path() is None, reason="the CPU kernel library is not built")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QM, QMO, WQBMM = cpu_kernels.QUANT_MATMUL, cpu_kernels.QUANT_MATMUL_OFFSET, cpu_kernels.ATLAS_WEIGHT_QUANT_BATCH_MATMUL
ROUNDOFF = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # unit roundoff of each output dtype


# ---- the format, in numpy ---------------------------------------------------------------------------------------

def random_q(rng, bits: int, n: int, k: int) -> np.ndarray:
    """Random signed integers of `bits` bits, the full range (ends included)."""
    lo = -(1 << (bits - 1))
    q = rng.integers(lo, -lo, (n, k)).astype(np.int8)
    q[0, :2] = lo, -lo - 1
    return q


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 [N, K] in -8..7 -> uint8 [N, K / 2]: q[:, 2j] in byte j's low nibble, q[:, 2j + 1] in its high nibble."""
    u = q.astype(np.uint8) & 0x0F
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [N, K / 2] -> the signed values [N, K] (float64), read from the bytes by arithmetic, not by pack_int4."""
    b = packed.astype(np.int64)
    lo, hi = b % 16, b // 16
    out = np.empty((b.shape[0], 2 * b.shape[1]), np.float64)
    out[:, 0::2] = np.where(lo >= 8, lo - 16, lo)
    out[:, 1::2] = np.where(hi >= 8, hi - 16, hi)
    return out


def integers(q_stored: np.ndarray) -> np.ndarray:
    """The integers a stored q holds, float64 [N, K]."""
    return unpack_int4(q_stored) if q_stored.dtype == np.uint8 else q_stored.astype(np.float64)


def dequantize(q_stored: np.ndarray, scale: np.ndarray, offset=None) -> np.ndarray:
    """W [N, K] float64 = (q + offset[k // g]) * scale[k // g]."""
    q = integers(q_stored)
    g = q.shape[1] // scale.shape[0]
    s = np.repeat(scale.astype(np.float64), g, axis=0).T
    o = 0.0 if offset is None else np.repeat(offset.astype(np.float64), g, axis=0).T
    return (q + o) * s


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to dtype, as float32."""
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_values(bf16_bits(a))
    return a.astype(np.float32)


def int16_rounding(x: np.ndarray, wq: np.ndarray, group: int, int4: bool = False) -> np.ndarray:
    """The most that the decode form's rounding of x can move each output [M, N], wq = q * scale [N, K] (W without its
    offsets, which meet x's exact sums): up to 16 rows of x, with K and the group whole blocks of 32 inputs, x is
    rounded to int16 per block of 32 (scale max |x| / 32767: at most half a step, max / 65534, per input), or for int4
    weights whose K is a multiple of 64 and group 32 or a multiple of 64 to int8 (scale max |x| / 127: the default mode,
    ACTIVATIONS_INT8), and the products are exact integers (matmul_quant.cc, "the decode form"). So |error| <= sum over
    k of step_k / 2 * |wq[n, k]|. 0 where the form does not run."""
    m, k = x.shape
    if m > 16 or k % 32 or group % 32:
        return np.zeros((m, wq.shape[0]))
    largest = 127 if int4 and k % 64 == 0 and (group % 64 == 0 or group == 32) else 32767
    step = np.abs(x.astype(np.float64)).reshape(m, k // 32, 32).max(axis=2) / largest  # [M, K / 32]
    return (np.repeat(step, 32, axis=1) / 2) @ np.abs(wq).T


def check(y, ref, what: str, roundoff: float = 0.0, rounding=0.0) -> None:
    """Within 1e-5 of the reference's largest magnitude (plus the rounding of each output to its dtype, and the
    decode form's rounding of x: int16_rounding)."""
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape, what
    bad = ~(np.abs(y - ref) <= 1e-5 * np.abs(ref).max() + roundoff * np.abs(ref) + rounding)  # NaN counts as bad
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} outputs off, worst {np.abs(y - ref).max()}"


# ---- MindSpore aot Custom ops -----------------------------------------------------------------------------------

_NETS = {}


def run_custom(function: str, *arrays):
    """The function as an aot Custom op in a graph-mode Cell (one per function: MindSpore compiles it per input
    signature). numpy arrays; bfloat16 ones given as (uint16 bits, "bfloat16"). Returns y as numpy (bfloat16: bits)."""
    import mindspore as ms
    from mindspore import nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if function not in _NETS:
        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.op = ops.Custom(cpu_kernels.local_func(cpu_kernels.graph_func(function)),
                                     out_shape=lambda x, q, *_: (x[0], q[0]), out_dtype=lambda x, *_: x,
                                     func_type="aot")

            def construct(self, *args):
                return self.op(*args)

        _NETS[function] = Net()
    tensors = [ms.Tensor.from_numpy(np.ascontiguousarray(a[0])).view(ms.bfloat16) if isinstance(a, tuple)
               else ms.Tensor(a) for a in arrays]
    y = _NETS[function](*tensors)
    if y.dtype == ms.bfloat16:
        return y.asnumpy().view(np.uint16)
    return y.asnumpy()


def case(rng, bits: int, m: int, n: int, k: int, groups: int, with_offset: bool):
    """(x, q as stored, scale, offset or None) of float32 random data."""
    x = rng.standard_normal((m, k), dtype=np.float32)
    q = random_q(rng, bits, n, k)
    stored = q if bits == 8 else pack_int4(q)
    assert np.array_equal(integers(stored), q)  # the packer against the independent unpacker
    scale = (rng.random((groups, n), dtype=np.float32) + 0.5) * (0.02 if bits == 8 else 0.3)
    offset = rng.standard_normal((groups, n), dtype=np.float32) * 2 if with_offset else None
    return x, stored, scale, offset


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_offset", [False, True])
def test_quant_matmul_against_numpy(bits, with_offset):
    """Per channel and groups of 32/64/128 by 1, 3, 17 and 130 rows of x (the decode form, the GEMM, tasks over
    threads), an odd number of outputs (33: a partial tile). Each run takes a checkerboard half of the 16 (group, rows)
    pairs (MindSpore compiles each shape): every pair runs as int8 and as int4, once with offset and once without."""
    rng = np.random.default_rng(bits * 10 + with_offset)
    n, k = 33, 256
    half = int((bits == 4) != with_offset)
    for i, g in enumerate((k, 32, 64, 128)):
        for j, m in enumerate((1, 3, 17, 130)):
            if (i + j) % 2 != half:
                continue
            x, q, scale, offset = case(rng, bits, m, n, k, k // g, with_offset)
            args = (x, q, scale) + ((offset,) if with_offset else ())
            y = run_custom(QMO if with_offset else QM, *args)
            assert y.dtype == np.float32
            w = dequantize(q, scale, offset)
            check(y, x.astype(np.float64) @ w.T, f"int{bits} g={g} M={m}",
                  rounding=int16_rounding(x, dequantize(q, scale), g, bits == 4))


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_matmul_at_decode_size_on_all_threads(bits):
    """The 0.5B MLP's shape (outputs over threads), groups of 32 with offsets, 1 row (the decode form) and 20 (the
    GEMM on dequantized panels; the buffered form on the plain C++ path)."""
    rng = np.random.default_rng(5 + bits)
    n, k = 4864, 896
    for m in (1, 20):
        x, q, scale, offset = case(rng, bits, m, n, k, k // 32, True)
        w = dequantize(q, scale, offset)
        check(run_custom(QMO, x, q, scale, offset), x.astype(np.float64) @ w.T, f"int{bits} M={m}",
              rounding=int16_rounding(x, dequantize(q, scale), 32, bits == 4))


@pytest.mark.parametrize("bits", [8, 4])
def test_groups_that_are_not_a_multiple_of_8(bits):
    """Groups of 12 and 15 inputs (int4: a group boundary inside a byte), per channel over 30 inputs."""
    rng = np.random.default_rng(11 + bits)
    for k, g in ((36, 12), (30, 15), (30, 30)):
        for m in (1, 7):
            x, q, scale, offset = case(rng, bits, m, 19, k, k // g, True)
            check(run_custom(QMO, x, q, scale, offset), x.astype(np.float64) @ dequantize(q, scale, offset).T,
                  f"int{bits} K={k} g={g} M={m}")


def stored_as(a: np.ndarray, dtype: str):
    """(what run_custom is given for a float32 array in dtype, float64 of the values it holds)."""
    if dtype == "bfloat16":
        bits = bf16_bits(a)
        return (bits, "bfloat16"), bf16_values(bits).astype(np.float64)
    held = a.astype(np.float16 if dtype == "float16" else np.float32)
    return held, held.astype(np.float64)


def output_values(y: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_values(y).astype(np.float64) if dtype == "bfloat16" else y.astype(np.float64)


def standin_reference(x64, q, scale64, offset64, dtype: str) -> np.ndarray:
    """The stand-in's documented semantics: (q + offset) * scale in float32 from the dtype's values, rounded to the
    dtype (the weight Ascend multiplies), then x . W^T (here in float64)."""
    qi = integers(q).astype(np.float32)
    g = qi.shape[1] // scale64.shape[0]
    s = np.repeat(scale64.astype(np.float32), g, axis=0).T
    o = np.float32(0) if offset64 is None else np.repeat(offset64.astype(np.float32), g, axis=0).T
    w = as_dtype((qi + o) * s, dtype)  # float32 add, float32 multiply, as the kernel
    return x64 @ w.astype(np.float64).T


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_weight_quant_batch_matmul_standin_against_numpy(dtype):
    """int8/int4, per channel (group size 0) and groups of 32, with and without offset, 33 outputs; each combination
    once, with 1 or 17 rows (each twice per bit width)."""
    rng = np.random.default_rng({"float16": 1, "bfloat16": 2, "float32": 3}[dtype])
    n, k = 33, 128
    for bits, group_size, with_offset, m in ((8, 0, False, 17), (8, 0, True, 1), (8, 32, False, 1), (8, 32, True, 17),
                                              (4, 0, False, 1), (4, 0, True, 17), (4, 32, False, 17), (4, 32, True, 1)):
        x, q, scale, offset = case(rng, bits, m, n, k, k // (group_size or k), with_offset)
        xs, x64 = stored_as(x, dtype)
        ss, s64 = stored_as(scale, dtype)
        args = [xs, q, ss]
        o64 = None
        if with_offset:
            os_, o64 = stored_as(offset, dtype)
            args.append(os_)
        args.append(np.array([group_size], np.float32))
        y = run_custom(WQBMM, *args)
        assert y.dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype)), y.dtype
        check(output_values(y, dtype), standin_reference(x64, q, s64, o64, dtype),
              f"{dtype} int{bits} group {group_size} offset {with_offset} M={m}", ROUNDOFF[dtype])


# ---- ctypes: exact codes, exact rounding, code paths, threads ----------------------------------------------------

def call_kernel(function: str, *arrays, dtypes=None) -> int:
    """Call a kernel function as MindSpore's aot runtime does (dtype names default to the arrays')."""
    lib = ctypes.CDLL(cpu_kernels.library_path())
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_rows = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shape_rows])
    names = (ctypes.c_char_p * n)(*[(d or str(a.dtype)).encode() for d, a in zip(dtypes or [None] * n, arrays)])
    return getattr(lib, function)(n, params, ndims, shapes, names, None, None)


def test_library_holds_the_quant_kernels_and_is_newer_than_their_sources():
    lib = ctypes.CDLL(cpu_kernels.library_path())
    for function in (QM, QMO, WQBMM):
        assert hasattr(lib, function) and function in cpu_kernels.FUNCTIONS
    here = os.path.dirname(cpu_kernels.__file__)
    newest = max(os.path.getmtime(os.path.join(here, f))
                 for f in ("matmul_quant.cc", "matmul_quant.h", "pool.cc", "pool.h", "common.h", "dtypes.h", "registry.cc"))
    assert os.path.getmtime(cpu_kernels.library_path()) >= newest, "rebuild: python setup.py build_ext --inplace"


def test_the_error_codes():
    x, s, y = np.zeros((2, 64), np.float32), np.ones((2, 5), np.float32), np.zeros((2, 5), np.float32)
    q8, q4 = np.zeros((5, 64), np.int8), np.zeros((5, 32), np.uint8)
    assert call_kernel(QM, x, q8, s, y) == 0 and call_kernel(QM, x, q4, s, y) == 0
    assert call_kernel(QMO, x, q8, s, s, y) == 0
    assert call_kernel(QM, x, q8, s) == 1 and call_kernel(QMO, x, q8, s, y) == 1  # wrong number of tensors
    for dtype in ("int16", "int32", "float32", "int4", "uint16"):  # q of another dtype
        assert call_kernel(QM, x, q8, s, y, dtypes=[None, dtype, None, None]) == 2, dtype
        assert call_kernel(QMO, x, q8, s, s, y, dtypes=[None, dtype, None, None, None]) == 2, dtype
    assert call_kernel(QM, x.astype(np.float16), q8, s, y) == 2  # x, scale, offset, y stay float32
    assert call_kernel(QMO, x, q8, s, s.astype(np.float16), y) == 2
    assert call_kernel(QM, x, q8, s[0], y) == 3  # scale [N]: rank
    assert call_kernel(QM, x, np.zeros((5, 63), np.int8), s, y) == 4  # q's K
    assert call_kernel(QM, x, np.zeros((5, 31), np.uint8), s, y) == 4  # int4: K / 2 bytes
    assert call_kernel(QM, np.zeros((2, 63), np.float32), np.zeros((5, 63), np.int8), s, y) == 4  # K not / G (2)
    assert call_kernel(QM, x, q8, np.ones((3, 5), np.float32), y) == 4  # K = 64 not divisible by G = 3
    assert call_kernel(QM, x, q8, np.ones((0, 5), np.float32), y) == 4  # no groups
    assert call_kernel(QM, np.zeros((2, 63), np.float32), np.zeros((5, 31), np.uint8), np.ones((1, 5), np.float32),
                       y) == 4  # int4 with an odd K
    assert call_kernel(QMO, x, q8, s, np.ones((1, 5), np.float32), y) == 4  # offset's groups
    assert call_kernel(QM, x, q8, np.ones((2, 4), np.float32), y) == 4  # scale's outputs
    assert call_kernel(QM, x, q8, s, np.zeros((2, 6), np.float32)) == 4  # y's shape


def test_the_standin_error_codes():
    x, s, y = np.zeros((2, 64), np.float16), np.ones((2, 5), np.float16), np.zeros((2, 5), np.float16)
    q8 = np.zeros((5, 64), np.int8)
    attrs = np.array([32], np.float32)
    assert call_kernel(WQBMM, x, q8, s, attrs, y) == 0 and call_kernel(WQBMM, x, q8, s, s, attrs, y) == 0
    assert call_kernel(WQBMM, x, q8, s, y) == 1 and call_kernel(WQBMM, x, q8, s, s, s, attrs, y) == 1
    assert call_kernel(WQBMM, x, q8, s, attrs, y, dtypes=[None, "int32", None, None, None]) == 2  # q's dtype
    assert call_kernel(WQBMM, x, q8, s.astype(np.float32), attrs, y) == 2  # scale not of x's dtype
    assert call_kernel(WQBMM, x, q8, s, s.astype(np.float32), attrs, y) == 2  # nor the offset
    assert call_kernel(WQBMM, x, q8, s, attrs, y.astype(np.float32)) == 2  # nor y
    assert call_kernel(WQBMM, x, q8, s, attrs.astype(np.float16), y) == 2  # attrs float32
    assert call_kernel(WQBMM, x, q8, s, np.array([48], np.float32), y) == 4  # G * group size = 96 != K = 64
    assert call_kernel(WQBMM, x, q8, s, np.array([0], np.float32), y) == 4  # per channel with G = 2
    assert call_kernel(WQBMM, x, q8, s, np.array([64], np.float32), y) == 4  # group size K with G = 2
    assert call_kernel(WQBMM, x, q8, s[:1], np.array([0], np.float32), y) == 0  # per channel, G = 1
    assert call_kernel(WQBMM, x, q8, s[:1], np.array([64], np.float32), y) == 0  # one group of K
    assert call_kernel(WQBMM, x, q8, s, np.array([32, 0], np.float32), y) == 4  # attrs [1]
    for bad in (-32, 31.5, np.nan):
        assert call_kernel(WQBMM, x, q8, s, np.array([bad], np.float32), y) == 6, bad


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_standin_rounds_the_dequantized_weight_to_the_activation_dtype(dtype):
    """x = [1, 1, 0, ...]: y[n] = round(W[n, 0] + W[n, 1]) with each W rounded to the dtype first (the float32 sum of
    two such values is exact): equal to the bit, and not what the unrounded weights give."""
    rng = np.random.default_rng(9)
    n, k = 200, 64
    q = random_q(rng, 8, n, k)
    scale = rng.random((2, n), dtype=np.float32) + 0.5
    x = np.zeros((1, k), np.float32)
    x[0, :2] = 1
    (xs, _), (ss, s64) = stored_as(x, dtype), stored_as(scale, dtype)
    xs, ss = (xs[0], ss[0]) if dtype == "bfloat16" else (xs, ss)
    y = np.zeros((1, n), np.uint16 if dtype == "bfloat16" else np.float16)
    assert call_kernel(WQBMM, xs, q, ss, np.array([32], np.float32), y,
                       dtypes=[dtype, "int8", dtype, "float32", dtype]) == 0
    w32 = q[:, :2].astype(np.float32) * s64[0].astype(np.float32)[:, None]
    rounded = as_dtype(as_dtype(w32, dtype).sum(axis=1, dtype=np.float32), dtype)
    unrounded = as_dtype(w32.sum(axis=1, dtype=np.float32), dtype)
    got = output_values(y[0], dtype).astype(np.float32)
    assert np.array_equal(got, rounded)
    assert not np.array_equal(got, unrounded)


def matmul_case_results(threads_list=(None,)):
    """y of a few cases (the decode form, buffered, odd groups: the plain float form) for each thread count; checks them on the way."""
    lib = ctypes.CDLL(cpu_kernels.library_path())
    results = []
    try:
        for threads in threads_list:
            if threads is not None:
                lib.MsliteLlmSetThreads(threads)
            for bits, m, n, k, g in ((8, 1, 1000, 1024, 32), (4, 3, 1000, 1024, 64), (4, 40, 300, 512, 512),
                                     (8, 130, 33, 256, 128), (4, 2, 700, 1500, 30)):
                rng = np.random.default_rng(bits + m + n)
                x, q, scale, offset = case(rng, bits, m, n, k, k // g, True)
                y = np.full((m, n), np.nan, np.float32)
                assert call_kernel(QMO, x, q, scale, offset, y) == 0
                w = dequantize(q, scale, offset)
                check(y, x.astype(np.float64) @ w.T, f"int{bits} M={m} N={n} K={k}",
                      rounding=int16_rounding(x, dequantize(q, scale), g, bits == 4))
                results.append(((bits, m), y))
    finally:
        lib.MsliteLlmSetThreads(0)
    return results


def test_results_do_not_depend_on_the_thread_count():
    """Each output is one task's sum: the same bits on 1, 2 or 3 threads."""
    results = matmul_case_results((1, 2, 3))
    per_count = len(results) // 3
    for i, (key, y) in enumerate(results):
        assert np.array_equal(y, results[i % per_count][1]), key


def test_set_threads_reaches_the_quant_kernels(monkeypatch):
    """The quantized matmuls run on the library's one pool (cpu_kernels/pool.cc) with its one thread count: set_threads
    sets it once."""
    calls = []

    class Library:
        def __getattr__(self, name):
            return lambda value: calls.append((name, value.value))

    monkeypatch.setattr(cpu_kernels, "_loaded", Library())
    cpu_kernels.set_threads(3)
    assert calls == [("MsliteLlmSetThreads", 3)]


def exact_activation_cases():
    """The decode form (1, 4 and 16 rows; K whole blocks) with x exact (cpu_kernels.set_quant_activations("exact")):
    within float32's rounding of the float64 product (2e-6 of the sums' magnitude), far inside int16's allowance;
    then int16 again, outside that tight bound (the switch reaches the kernels through MindSpore's calls)."""
    rng = np.random.default_rng(77)
    try:
        for mode in ("exact", "int16", "int8"):
            assert cpu_kernels.set_quant_activations(mode) == mode
            for bits, with_offset, g in ((8, False, 256), (4, True, 32), (4, False, 128), (8, True, 64)):
                for m in (1, 4, 16):
                    x, q, scale, offset = case(rng, bits, m, 40, 256, 256 // g, with_offset)
                    args = (x, q, scale) + ((offset,) if with_offset else ())
                    y = run_custom(QMO if with_offset else QM, *args).astype(np.float64)
                    ref = x.astype(np.float64) @ dequantize(q, scale, offset).T
                    size = np.abs(x).astype(np.float64) @ np.abs(dequantize(q, scale, offset)).T
                    tight = np.all(np.abs(y - ref) <= 2e-6 * size)
                    assert tight == (mode == "exact"), (mode, bits, with_offset, g, m, np.abs(y - ref).max())
    finally:
        cpu_kernels.set_quant_activations(None)


def test_exact_activations_are_float32s_arithmetic():
    exact_activation_cases()


def rounded_to_int8_blocks(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the decode form rounds it for int4 weights in the default mode (matmul_quant.cc ACTIVATIONS_INT8):
    per row and block of 32, rint(x * (127 / max |x|)) * (max |x| / 127), ties to even, in float32; float64 out."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.where(top > 0, np.float32(127) / np.where(top > 0, top, np.float32(1)), np.float32(0)).astype(np.float32)
    return (np.rint(blocks * inv) * (top / np.float32(127))).astype(np.float64).reshape(m, k)


def int8_activation_cases():
    """int4 weights whose K is a multiple of 64 and group 32 or a multiple of 64, 1 to 16 rows of x (every tile of the
    x86 forms, a partial one of each: N 1, 7, 33, 40), per channel and groups of 32 (each block its own weight scale),
    64 and 128, K 192 to 896 (576: SmolLM2's, not whole 128s), with and without offsets, in the default mode: the
    product of x rounded to int8 per block of 32 (rounded_to_int8_blocks) and q * scale, plus the offsets times x's
    exact sums, to float32's rounding of the sums (2e-6 of their magnitude): the form's only rounding is x's, by its
    documented rule. In int16 mode (set_quant_activations("int16")) the same cases are outside that bound of the int8
    rounding and within int16's."""
    rng = np.random.default_rng(8)
    lib = ctypes.CDLL(cpu_kernels.library_path())
    try:
        for mode in ("int8", "int16"):
            assert cpu_kernels.set_quant_activations(mode) == mode
            for k, g in ((256, 64), (576, 576), (576, 64), (896, 128), (192, 192), (256, 32), (576, 32)):
                for n, m, with_offset in ((1, 1, True), (7, 2, False), (33, 3, True), (40, 4, False), (33, 5, False),
                                          (40, 7, True), (33, 16, True)):
                    x, q, scale, offset = case(rng, 4, m, n, k, k // g, with_offset)
                    y = np.full((m, n), np.nan, np.float32)
                    args = (x, q, scale) + ((offset,) if with_offset else ()) + (y,)
                    assert call_kernel(QMO if with_offset else QM, *args) == 0
                    wq = dequantize(q, scale)
                    ref = rounded_to_int8_blocks(x) @ wq.T
                    if with_offset:
                        ref += x.astype(np.float64) @ (dequantize(q, scale, offset) - wq).T
                    size = np.abs(x).astype(np.float64) @ np.abs(dequantize(q, scale, offset)).T
                    tight = bool(np.all(np.abs(y - ref) <= 2e-6 * size))
                    where = (mode, k, g, n, m, with_offset, float(np.abs(y - ref).max()))
                    assert tight == (mode == "int8"), where
                    if mode == "int16":
                        check(y, x.astype(np.float64) @ dequantize(q, scale, offset).T, str(where),
                              rounding=int16_rounding(x, wq, g))
    finally:
        cpu_kernels.set_quant_activations(None)
        lib.MsliteLlmSetThreads(0)


def test_int4_takes_x_in_int8_by_its_documented_rounding():
    int8_activation_cases()


def run_on_path(isa: str, script: str) -> None:
    """`script` (this module importable as `t`) in a new process whose kernels load with MSLITE_LLM_CPU_KERNELS_ISA=isa
    (the path is chosen when the library loads); fails with its stderr when it exits non-zero."""
    env = dict(os.environ, MSLITE_LLM_CPU_KERNELS_ISA=isa,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_plain_cpp_path_gives_the_same_answers():
    """MSLITE_LLM_CPU_KERNELS_ISA=generic (machines without AVX2/FMA), in a new process."""
    run_on_path("generic", """
        import ctypes, sys
        import cpu_kernels, test_quant_kernels as t
        lib = ctypes.CDLL(cpu_kernels.library_path())
        lib.MsliteLlmIsa.restype = ctypes.c_char_p
        if lib.MsliteLlmIsa() != b"generic":
            sys.exit("isa: " + lib.MsliteLlmIsa().decode())
        t.matmul_case_results()
        t.test_standin_rounds_the_dequantized_weight_to_the_activation_dtype("bfloat16")
        t.exact_activation_cases()
        t.int8_activation_cases()
    """)


def test_the_avx2_path_gives_the_same_answers():
    """MSLITE_LLM_CPU_KERNELS_ISA=avx2 (an AVX2 machine, and the AVX-512 one without VNNI), in a new process: the
    quantized decode form is AVX2's; the default on an AVX-512 VNNI CPU is avx512_vnni (each path tested here)."""
    if cpu_kernels.isa() not in ("avx2", "avx512"):
        pytest.skip(f"not an x86 machine with AVX2 (path {cpu_kernels.isa()})")
    run_on_path("avx2", """
        import sys
        import cpu_kernels, test_quant_kernels as t
        if (cpu_kernels.isa(), cpu_kernels.quant_form()) != ("avx2", "avx2"):
            sys.exit(f"path {cpu_kernels.isa()} {cpu_kernels.quant_form()}")
        t.matmul_case_results()
        t.exact_activation_cases()
        t.int8_activation_cases()
        t.test_int4_in_bands_of_16_rows_is_the_row_major_weights_answer()
        t.test_int8_in_bands_of_16_rows_is_the_int8_weights_answer()
    """)


@pytest.mark.parametrize("form,streams", [("avx512_vnni", 1), ("avx512_vnni", 2), ("avx512_vnni", 3),
                                          ("avx512_vnni", 4), ("avx2", 1), ("avx2", 2)])
def test_int4_bands_of_one_row_in_any_number_of_streams(form, streams, monkeypatch):
    """One row of x against banded int4 reads whole bands in several streams at once (4 on Intel's CPUs, 1 on others,
    the AVX2 form at most 2; MSLITE_LLM_CPU_KERNELS_INT4_STREAMS forces each, in a new process on each form's path):
    every count gives the row-major op's answer as the one-stream form does (88 outputs: 5 bands and a tail, runs of
    unequal length)."""
    if form == "avx512_vnni" and cpu_kernels.quant_form() != "avx512_vnni":
        pytest.skip(f"the AVX-512 VNNI form does not run here ({cpu_kernels.quant_form()})")
    if form == "avx2" and cpu_kernels.isa() not in ("avx2", "avx512"):
        pytest.skip(f"not an x86 machine with AVX2 (path {cpu_kernels.isa()})")
    monkeypatch.setenv("MSLITE_LLM_CPU_KERNELS_INT4_STREAMS", str(streams))
    run_on_path("native" if form == "avx512_vnni" else "avx2", f"""
        import sys  # "native": the CPU's own path (not a name the library knows)
        import cpu_kernels, test_quant_kernels as t
        if cpu_kernels.quant_form() != "{form}":
            sys.exit(f"form {{cpu_kernels.quant_form()}}")
        t.test_int4_in_bands_of_16_rows_is_the_row_major_weights_answer()
    """)


def banded8(q: np.ndarray) -> np.ndarray:
    """int8 q [N, K] as repack_int8_r16 lays it out (cpu_kernels/matmul_quant.h), built here from the rule: every byte
    biased (q ^ 0x80); per band of 16 rows and block b of 32 inputs, 512 bytes, 8 runs of 64, run j bytes 4j..4j+3 of
    each of the 16 rows in row order; the rows past the bands row-major. Returned as uint8."""
    n, k = q.shape
    n16 = n - n % 16
    out = q.view(np.uint8) ^ np.uint8(0x80)
    bands = out[:n16].reshape(n16 // 16, 16, k // 32, 8, 4)  # band, row, block, run, byte
    out[:n16] = bands.transpose(0, 2, 3, 1, 4).reshape(n16, k)  # band, block, run, row, byte
    return out


def test_int8_in_bands_of_16_rows_is_the_int8_weights_answer():
    """The R16 ops read int8 weights repacked in place by MsliteLlmRepackInt8R16 (biased, in bands of 16 rows: the
    layout rule `banded8`), N with and without a partial band (1, 7, 16, 33, 40, 88, 300: tasks over both threads, one
    row of x in several streams), 1 to 40 rows of x (the decode form, the GEMM past 16), groups of 32 (llama.cpp's Q8_0:
    each block its own weight scale) to per channel, with and without offsets. Where the banded form runs
    (int8_r16_runs: the AVX-512 VNNI form, x in int8, K a multiple of 64, the group too or 32): x rounded to int8 per
    block of 32 (rounded_to_int8_blocks) times q * scale, plus the offsets times x's exact sums, to float32's rounding
    of the sums (2e-6 of their magnitude): the form's only rounding is x's, by its documented rule, as llama.cpp's Q8_0
    rounds it; past 16 rows too (a prompt's: the bands' form takes any rows, or AMX tiles where they run). Otherwise
    (the int16 and exact modes, another form) the R16 ops compute the float32 product (1e-5 of the magnitude from
    float64's). K of 48 (not whole blocks): not repacked, and an R16 op refuses it
    (error 4)."""
    rng = np.random.default_rng(18)
    try:
        for mode in ("int8", "int16", "exact"):
            assert cpu_kernels.set_quant_activations(mode) == mode
            assert cpu_kernels.int8_r16_runs(896, 128) == (cpu_kernels.quant_form() == "avx512_vnni")
            assert cpu_kernels.int8_r16_runs(896, 32) == (cpu_kernels.quant_form() == "avx512_vnni")
            assert not cpu_kernels.int8_r16_runs(96, 96) and not cpu_kernels.int8_r16_runs(896, 96)
            for k, g in ((256, 64), (576, 576), (896, 128), (576, 64), (128, 128), (256, 32), (576, 32)):
                for n, m, with_offset in ((1, 1, True), (7, 2, False), (16, 1, False), (33, 3, True), (40, 4, False),
                                          (88, 1, False), (300, 1, True), (300, 5, False), (33, 9, False),
                                          (33, 16, True), (40, 17, False), (300, 40, True)):
                    x, q, scale, offset = case(rng, 8, m, n, k, k // g, with_offset)
                    r = q.copy()
                    cpu_kernels.repack_int8_r16(r)
                    assert np.array_equal(r.view(np.uint8), banded8(q)), (k, n)
                    args = (scale,) + ((offset,) if with_offset else ())
                    function = QMO if with_offset else QM
                    yb = np.full((m, n), np.nan, np.float32)
                    assert call_kernel(cpu_kernels.R16_OPS[function], x, r, *args, yb) == 0
                    w = dequantize(q, scale, offset)
                    size = np.abs(x).astype(np.float64) @ np.abs(w).T
                    where = (mode, k, g, n, m, with_offset)
                    # the prompt's rows too (past 16) take x in int8: the bands' form (or AMX tiles) for any rows
                    if mode == "int8" and cpu_kernels.int8_r16_runs(k, g):
                        wq = dequantize(q, scale)
                        ref = rounded_to_int8_blocks(x) @ wq.T
                        if with_offset:
                            ref += x.astype(np.float64) @ (w - wq).T
                        assert np.all(np.abs(yb - ref) <= 2e-6 * size), where + (float(np.abs(yb - ref).max()),)
                    else:
                        assert np.all(np.abs(yb - x.astype(np.float64) @ w.T) <= 1e-5 * size), where
        x, q, scale, _ = case(rng, 8, 2, 16, 48, 1, False)
        with pytest.raises(ValueError, match="int8 weights of 48 inputs are not whole blocks of 32: not repacked"):
            cpu_kernels.repack_int8_r16(q.copy())
        assert call_kernel(cpu_kernels.R16_OPS[QM], x, q, scale, np.zeros((2, 16), np.float32)) == 4
    finally:
        cpu_kernels.set_quant_activations(None)


def int4_tiles() -> bool:
    """Whether banded int4 weights take AMX tiles here (tiles() "amx" with the VNNI form: AMX-INT8)."""
    return cpu_kernels.tiles() == "amx" and cpu_kernels.quant_form() == "avx512_vnni"


@pytest.mark.parametrize("bits", [8, 4])
def test_bands_by_amx_tiles_are_the_vector_forms_answer_bit_for_bit(bits):
    """Where this machine has AMX (tiles() "amx"), banded int8 weights against 2 to 16 rows of x, and int4 ones
    against 8 to 16, take the tiles (tdpbsud: x's int8 against the biased bytes, a band's block one tile of B; int4's
    nibbles widened to such a tile, q + 8; matmul_quant.cc qbands_amx): the same integers, scales and order of float
    sums as the vector form, so the same float32s bit for bit, whatever the rows
    of x, the outputs (a partial band, a row-major tail, 2 to 4 bands a stream, both threads), the groups (32: one
    block a group; 64 to per channel) and the offsets. One row keeps the vector form (bound by the bytes). A prompt's
    rows (past 16) take the tiles too, 16 at a time, x in int8 as a step's: each row's answer is that row's alone."""
    if cpu_kernels.set_tiles(True) != "amx" or not int4_tiles():
        pytest.skip(f"no AMX tiles here (quantized decode {cpu_kernels.quant_form()})")
    rng = np.random.default_rng(46 + bits)
    repack = cpu_kernels.repack_int8_r16 if bits == 8 else cpu_kernels.repack_int4_r16
    try:
        for k, g in ((256, 64), (576, 576), (896, 128), (256, 32), (576, 32)):
            for n, m, with_offset in ((16, 2, False), (33, 3, True), (40, 5, False), (88, 9, True), (300, 8, False),
                                      (300, 16, True), (1000, 9, False), (1000, 1, False)):
                x, q, scale, offset = case(rng, bits, m, n, k, k // g, with_offset)
                repack(q)
                args = (scale,) + ((offset,) if with_offset else ())
                out = []
                for on in (True, False):
                    cpu_kernels.set_tiles(on)
                    y = np.full((m, n), np.nan, np.float32)
                    assert call_kernel(cpu_kernels.R16_OPS[QMO if with_offset else QM], x, q, *args, y) == 0
                    out.append(y)
                assert np.array_equal(out[0], out[1]), (k, g, n, m, with_offset)
            # a prompt's rows (past 16: 16 a tile, the last tile partly x's): each row as a step of that row alone
            # computes it (one row: the vector form), bit for bit
            assert cpu_kernels.set_tiles(True) == "amx"
            x, q, scale, offset = case(rng, bits, 41, 88, k, k // g, True)
            repack(q)
            y = np.full((41, 88), np.nan, np.float32)
            assert call_kernel(cpu_kernels.R16_OPS[QMO], x, q, scale, offset, y) == 0
            for r in (0, 15, 16, 33, 40):
                one = np.full((1, 88), np.nan, np.float32)
                assert call_kernel(cpu_kernels.R16_OPS[QMO], x[r:r + 1].copy(), q, scale, offset, one) == 0
                assert np.array_equal(y[r], one[0]), (k, g, r)
    finally:
        cpu_kernels.set_tiles(True)


def test_amx_tiles_are_named_by_the_cpu_and_held_off_on_request(monkeypatch):
    """tiles(): "amx" on a CPU whose flags (as the kernel reports them) hold amx_tile, and amx_int8 beside the VNNI
    form or amx_bf16 beside the AVX512-BF16 one, else "none"; MSLITE_LLM_CPU_KERNELS_AMX=0, or a path forced without
    the CPU's extensions (MSLITE_LLM_CPU_KERNELS_ISA=avx512), holds it to "none" (new processes: both are read at
    load), and set_tiles(True) cannot turn on what is not granted."""
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    here = "amx_tile" in flags and ((cpu_kernels.quant_form() == "avx512_vnni" and "amx_int8" in flags) or
                                    (cpu_kernels.bf16_form() == "avx512_bf16" and "amx_bf16" in flags))
    assert cpu_kernels.tiles() == ("amx" if here else "none")
    check = """
        import sys
        import cpu_kernels
        if (cpu_kernels.tiles(), cpu_kernels.set_tiles(True)) != ("none", "none"):
            sys.exit(f"tiles {cpu_kernels.tiles()}")
    """
    run_on_path("avx512", check)
    monkeypatch.setenv("MSLITE_LLM_CPU_KERNELS_AMX", "0")
    run_on_path("native", check)


def test_the_quantized_decode_form_is_named_by_the_cpu():
    """cpu_kernels.quant_form(): avx512_vnni on an AVX-512 CPU with VNNI (BW, VL), avx2 on other x86 CPUs."""
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    want = {"avx512": "avx512_vnni" if {"avx512bw", "avx512vl", "avx512_vnni"} <= set(flags) else "avx2",
            "avx2": "avx2", "neon": "neon", "generic": "generic"}[cpu_kernels.isa()]
    assert cpu_kernels.quant_form() == want


@pytest.mark.parametrize("bits", [8, 4])
def test_the_full_graphs_form_computes_only_each_rows_prompt(bits):
    """MsliteLlmQuantMatmul[Offset]Valid (the full graph's form, as MsliteLlmGemmValid): x holds B rows of n tokens and
    only each row's first valid_length are computed, each as the plain op computes it (the decode form up to 16 of
    them, the GEMM beyond); the padding rows are zero (whatever x holds there); valid_length must be int32."""
    rng = np.random.default_rng(30 + bits)
    b, n, k, outs = 3, 24, 256, 40
    x, q, scale, offset = case(rng, bits, b * n, outs, k, k // 32, True)
    valid = np.array([24, 5, 0], np.int32)
    y = np.full((b * n, outs), np.nan, np.float32)
    assert call_kernel(cpu_kernels.QUANT_MATMUL_OFFSET_VALID, x, q, scale, offset, valid, y) == 0
    for r, used in enumerate(valid):
        rows = slice(r * n, r * n + used)
        one = np.full((used, outs), np.nan, np.float32)
        if used:
            assert call_kernel(QMO, np.ascontiguousarray(x[rows]), q, scale, offset, one) == 0
            assert np.array_equal(y[rows], one)  # the same sums as the plain op on those rows
        assert not y[r * n + used:(r + 1) * n].any()  # the padding rows: zeros
    w = dequantize(q, scale, offset)
    check(y[:24], x[:24].astype(np.float64) @ w.T, f"int{bits} valid rows")
    y2 = np.zeros_like(y)
    assert call_kernel(cpu_kernels.QUANT_MATMUL_VALID, x, q, scale, valid, y2) == 0  # symmetric: no offset
    assert call_kernel(cpu_kernels.QUANT_MATMUL_VALID, x, q, scale, valid.astype(np.int64), y2) == 2
    assert call_kernel(cpu_kernels.QUANT_MATMUL_VALID, x, q, scale, np.zeros(5, np.int32), y2) == 4  # 72 rows / 5


@pytest.mark.parametrize("bits", [8, 4])
def test_the_zero_rows_at_either_end_are_left_out(bits):
    """The head over a score graph's rows (MsliteLlmQuantMatmul[Offset]): the zero rows at either end (a verify's idle
    step row, the piece's padding: the layers write them zero) are not computed and come out zero, what x . W^T is
    for them; the rows between are the plain call's answer on them alone, bit for bit."""
    rng = np.random.default_rng(40 + bits)
    k, outs = 256, 72
    x, q, scale, offset = case(rng, bits, 9, outs, k, k // 32, True)
    x[[0, 5, 6, 7, 8]] = 0.0
    x[2] = 0.0  # between: computed
    y = np.full((9, outs), np.nan, np.float32)
    assert call_kernel(QMO, x, q, scale, offset, y) == 0
    alone = np.full((4, outs), np.nan, np.float32)
    assert call_kernel(QMO, np.ascontiguousarray(x[1:5]), q, scale, offset, alone) == 0
    assert np.array_equal(y[1:5], alone)
    assert not y[[0, 5, 6, 7, 8]].any()
    check(y, x.astype(np.float64) @ dequantize(q, scale, offset).T, f"int{bits} zero rows",
          rounding=int16_rounding(x, dequantize(q, scale), 32, bits == 4))


def banded(q: np.ndarray) -> np.ndarray:
    """int4 q [N, K / 2] in bands of 16 rows as cpu_kernels/matmul_quant.h documents the layout, built here from the
    rule (independently of the library): per band of 16 rows and block b of 32 inputs (each row's bytes 16b..16b+15),
    256 bytes, 4 runs of 64, run j bytes 4j..4j+3 of each of the 16 rows in row order; the rows past the bands as
    they were."""
    n, kb = q.shape
    n16 = n - n % 16
    bands = q[:n16].reshape(n16 // 16, 16, kb // 16, 4, 4)  # band, row, block, run, byte
    out = q.copy()
    out[:n16] = bands.transpose(0, 2, 3, 1, 4).reshape(n16, kb)  # band, block, run, row, byte
    return out


def test_int4_in_bands_of_16_rows_is_the_row_major_weights_answer():
    """The R16 ops read int4 weights repacked in place by MsliteLlmRepackInt4R16 into bands of 16 rows (the layout
    rule: `banded`), N with and without a partial band (1, 7, 16, 33, 40, 300: tasks over both threads), 1 to 40 rows
    of x (the decode form, and past 16 a prompt's), groups of 32 to per channel, with and without offsets. In the
    default mode where the banded form runs (int4_r16_runs, whatever the mode in force: AVX-512 VNNI and AVX2) each
    output is the row-major op's to float32's reordering of the same sums (1e-6 of their magnitude) up to 16 rows,
    and past 16 (the row-major op's GEMM: x exact) x rounded to int8 per block of 32, as a step's (2e-6 of the
    magnitude from that product: the bands' form, or AMX tiles where they run); in the int16 and exact modes the R16
    ops compute the float32 product (1e-5 of the magnitude from float64's). K of 48 (not whole blocks): not repacked, and an R16 op refuses it (error 4)."""
    rng = np.random.default_rng(16)
    try:
        for mode in ("int8", "int16", "exact"):
            assert cpu_kernels.set_quant_activations(mode) == mode
            # what the runtime repacks for: the default mode's form, whatever mode is in force
            assert cpu_kernels.int4_r16_runs(896, 128) == (cpu_kernels.quant_form() in ("avx512_vnni", "avx2"))
            for k, g in ((256, 64), (576, 64), (896, 128), (256, 32), (576, 576)):
                for n, m, with_offset in ((1, 1, True), (7, 2, False), (16, 1, False), (33, 3, True), (40, 4, False),
                                          (88, 1, False), (300, 1, True), (300, 5, False), (33, 16, True),
                                          (40, 17, False), (300, 40, True)):
                    x, q, scale, offset = case(rng, 4, m, n, k, k // g, with_offset)
                    r = q.copy()
                    cpu_kernels.repack_int4_r16(r)
                    assert np.array_equal(r, banded(q)), (k, n)
                    args = (scale,) + ((offset,) if with_offset else ())
                    function = QMO if with_offset else QM
                    y, yb = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
                    assert call_kernel(function, x, q, *args, y) == 0
                    assert call_kernel(cpu_kernels.R16_OPS[function], x, r, *args, yb) == 0
                    w = dequantize(q, scale, offset)
                    size = np.abs(x).astype(np.float64) @ np.abs(w).T
                    where = (mode, k, g, n, m, with_offset)
                    if mode == "int8" and m <= 16 and cpu_kernels.int4_r16_runs(k, g):
                        assert np.all(np.abs(yb - y) <= 1e-6 * size), where
                    elif mode == "int8" and cpu_kernels.int4_r16_runs(k, g):
                        wq = dequantize(q, scale)  # the prompt's rows (the bands' form, or tiles): x in int8 as a step's
                        ref = rounded_to_int8_blocks(x) @ wq.T
                        if with_offset:
                            ref += x.astype(np.float64) @ (w - wq).T
                        assert np.all(np.abs(yb - ref) <= 2e-6 * size), where
                    else:
                        assert np.all(np.abs(yb - x.astype(np.float64) @ w.T) <= 1e-5 * size), where
        x, q, scale, _ = case(rng, 4, 2, 16, 48, 1, False)
        with pytest.raises(ValueError, match="int4 weights of 48 inputs are not whole blocks of 32: not repacked"):
            cpu_kernels.repack_int4_r16(q.copy())
        assert call_kernel(cpu_kernels.R16_OPS[QM], x, q, scale, np.zeros((2, 16), np.float32)) == 4
    finally:
        cpu_kernels.set_quant_activations(None)
