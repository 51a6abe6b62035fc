"""Our CPU GEMV kernel (cpu_kernels): against numpy, where export puts it, and what happens without it."""
from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

import cpu_kernels
from reference import hf_generate, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_kernel(function: str, *arrays: np.ndarray, dtypes=None) -> int:
    """Call an exported kernel function the way MindSpore's aot CPU kernel does."""
    lib = ctypes.CDLL(cpu_kernels.library_path())
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_rows = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shape_rows])
    names = (ctypes.c_char_p * n)(*[(d or "float32").encode() for d in (dtypes or [None] * n)])
    return getattr(lib, function)(n, params, ndims, shapes, names, None, None)


def test_library_was_built_at_install():
    assert cpu_kernels.library_path() is not None, cpu_kernels.BUILD_HINT
    # a failed rebuild leaves the previous library in place (the extension is optional): the tests would run it
    here = os.path.dirname(cpu_kernels.__file__)
    sources = [os.path.join(here, f) for f in os.listdir(here) if f.endswith((".cc", ".h"))]
    newest = max(os.path.getmtime(f) for f in sources)
    assert os.path.getmtime(cpu_kernels.library_path()) >= newest, (
        f"{cpu_kernels.library_path()} is older than its sources: rebuild (pip install -e . or python setup.py "
        "build_ext --inplace) and read the compiler's errors")


@pytest.mark.parametrize("rows,inp,out", [(1, 896, 300), (3, 37, 5), (4, 4864, 896), (2, 7, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_against_numpy(rows, inp, out, bias):
    rng = np.random.default_rng(rows * inp + out)
    x = rng.standard_normal((rows, inp), dtype=np.float32)
    w = rng.standard_normal((out, inp), dtype=np.float32)
    b = rng.standard_normal((out,), dtype=np.float32)
    y = np.full((rows, out), np.nan, np.float32)
    args = (x, w, b, y) if bias else (x, w, y)
    assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV, *args) == 0
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("bias", [False, True])
def test_gemv_leaves_out_the_zero_rows_at_either_end(bias):
    """A graph's layers write its idle and padding rows zero; the head (GEMV over every row of the graph) computes only
    the rows between the zero rows at either end: those come out as the plain call on them alone gives them, bit for
    bit, and the zero rows as b (or 0), what x . W^T + b is for them. A zero row between nonzero ones is computed."""
    rng = np.random.default_rng(7)
    inp, out = 576, 300
    x = rng.standard_normal((9, inp), dtype=np.float32)
    x[[0, 6, 7, 8]] = 0.0
    x[3] = 0.0  # between: computed
    x[7, 5] = -0.0  # a negative zero is zero
    w = rng.standard_normal((out, inp), dtype=np.float32)
    b = rng.standard_normal((out,), dtype=np.float32)
    y = np.full((9, out), np.nan, np.float32)
    args = (x, w, b, y) if bias else (x, w, y)
    assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV, *args) == 0
    alone = np.full((5, out), np.nan, np.float32)
    middle = np.ascontiguousarray(x[1:6])
    assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV,
                       *((middle, w, b, alone) if bias else (middle, w, alone))) == 0
    assert np.array_equal(y[1:6], alone)
    for r in (0, 6, 7, 8):
        assert np.array_equal(y[r], b if bias else np.zeros(out, np.float32))
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    x[:] = 0.0  # every row zero: nothing computed, every row b (or 0)
    y[:] = np.nan
    assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV, *args) == 0
    assert np.array_equal(y, np.broadcast_to(b if bias else np.zeros(out, np.float32), y.shape))


def test_gemv_refuses_what_it_cannot_compute():
    x, w, y = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.float32), np.zeros((2, 3), np.float32)
    assert call_kernel(cpu_kernels.GEMV, x, w) == 1  # wrong number of tensors
    assert call_kernel(cpu_kernels.GEMV, x, w, y, dtypes=["float16", None, None]) == 2
    assert call_kernel(cpu_kernels.GEMV, x, np.zeros((3, 9), np.float32), y) == 4  # inner sizes differ
    assert call_kernel(cpu_kernels.GEMV, x, w, np.zeros((2, 4), np.float32)) == 4  # output shape


WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 as uint16 bit patterns: the upper 16 bits, rounded to nearest even."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def stored(w: np.ndarray, dtype: str):
    """(w as the kernel is given it in `dtype`, float64 of exactly the values it holds)."""
    if dtype == "float32":
        return w, w.astype(np.float64)
    if dtype == "float16":
        half = w.astype(np.float16)
        return half, half.astype(np.float64)
    bits = bf16_bits(w)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 to nearest, ties to even (as vcvtne2ps2bf16 rounds), back in float32: the rule the
    AVX512-BF16 form documents, written here on its own."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def bf16_tiles() -> bool:
    """Whether bfloat16 weights take AMX tiles here (cpu_kernels.tiles() "amx" beside the AVX512-BF16 form: every CPU
    with AMX has AMX-BF16 and AVX512-BF16)."""
    return cpu_kernels.tiles() == "amx" and cpu_kernels.bf16_form() == "avx512_bf16"


def x_as_computed(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the kernels multiply it: rounded to bfloat16 where bfloat16 weights meet 8 rows of x or more where the CPU
    has AVX512-BF16 (cpu_kernels.bf16_form()): up to 64 rows in its rows form, past that, of a width that is whole
    blocks of 32, in its GEMM or in AMX tiles (bf16_tiles), unless the activations are held exact; else as given."""
    rows, width = x.shape
    if (dtype == "bfloat16" and cpu_kernels.bf16_form() == "avx512_bf16" and cpu_kernels.quant_activations() != "exact"
            and rows >= cpu_kernels.BF16_MIN_ROWS and (rows <= cpu_kernels.BF16_MAX_ROWS or width % 32 == 0)):
        return bf16_rounded(x)
    return x


def check_matmul(dtype: str, bias: bool, rows_list, outs, ins, seed: int = 0) -> None:
    """Every (M, O, I) against float64 numpy on the stored weights, within 1e-5 of sum |x||w| (+|b|) per output; x
    as the kernels multiply it (x_as_computed)."""
    rng = np.random.default_rng(seed)
    for rows in rows_list:
        for out in outs:
            for inp in ins:
                x = rng.standard_normal((rows, inp), dtype=np.float32)
                w, w64 = stored(rng.standard_normal((out, inp), dtype=np.float32), dtype)
                b = rng.standard_normal((out,), dtype=np.float32)
                y = np.full((rows, out), np.nan, np.float32)
                args = (x, w, b, y) if bias else (x, w, y)
                names = ["float32", dtype, "float32", "float32"][:len(args) - 1] + ["float32"]
                assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV, *args, dtypes=names) == 0
                x64 = x_as_computed(x, dtype).astype(np.float64)
                ref = x64 @ w64.T + (b if bias else 0)
                scale = np.abs(x64) @ np.abs(w64).T + (np.abs(b) if bias else 0)
                bad = ~(np.abs(y - ref) <= 1e-5 * scale)  # NaN (an output never written) counts as bad
                assert not bad.any(), f"{dtype} M={rows} O={out} I={inp}: {int(bad.sum())} outputs off"


ODD_ROWS, ODD_OUTS, ODD_INS = (1, 2, 5, 7, 17, 100), (1, 15, 17, 300), (1, 7, 9, 896)


def check_rows_alike(dtype: str) -> None:
    """A row of x comes out bit for bit alike alone and among 2 to 9 rows (a decode step's row and the same row in a
    verify of 8 drafts: speculative decoding's greedy tokens are then plain decoding's), on the paths that promise it:
    AVX2 and the plain C++ one (test_each_code_path_gives_the_same_answers runs it on both)."""
    rng = np.random.default_rng(11)
    for out, inp in ((300, 576), (17, 9), (64, 100)):
        x = rng.standard_normal((9, inp), dtype=np.float32)
        w, _ = stored(rng.standard_normal((out, inp), dtype=np.float32), dtype)
        b = rng.standard_normal((out,), dtype=np.float32)
        names = ["float32", dtype, "float32", "float32"]
        for rows in range(2, 10):
            y = np.full((rows, out), np.nan, np.float32)
            assert call_kernel(cpu_kernels.GEMV_BIAS, np.ascontiguousarray(x[:rows]), w, b, y, dtypes=names) == 0
            for r in (0, rows - 1):
                one = np.full((1, out), np.nan, np.float32)
                assert call_kernel(cpu_kernels.GEMV_BIAS, np.ascontiguousarray(x[r:r + 1]), w, b, one,
                                   dtypes=names) == 0
                assert np.array_equal(one[0], y[r]), (dtype, out, inp, rows, r)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_with_any_weight_dtype_matches_float64_on_odd_shapes(dtype, bias):
    """Few rows (GEMV tiles) and many (packed GEMM), outputs and inputs off every tile and vector width."""
    check_matmul(dtype, bias, ODD_ROWS, ODD_OUTS, ODD_INS)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_matmul_prefill_shapes_span_several_input_blocks_and_tasks(dtype):
    """The 0.5B down projection's input width (several packed blocks), rows of x split across threads."""
    check_matmul(dtype, True, (17, 64, 100), (130,), (4864,), seed=1)


def test_matmul_result_does_not_depend_on_the_thread_count():
    lib = ctypes.CDLL(cpu_kernels.library_path())
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 896), dtype=np.float32)
    w = bf16_bits(rng.standard_normal((1000, 896), dtype=np.float32))
    results = []
    try:
        for threads in (1, 2, 3):
            lib.MsliteLlmSetThreads(threads)
            for rows in (1, 40):  # GEMV and GEMM
                y = np.full((rows, 1000), np.nan, np.float32)
                assert call_kernel(cpu_kernels.GEMV, x[:rows], w, y, dtypes=["float32", "bfloat16", "float32"]) == 0
                results.append((threads, rows, y))
    finally:
        lib.MsliteLlmSetThreads(0)
    for threads, rows, y in results:
        assert np.array_equal(y, next(r for t, m, r in results if m == rows)), (threads, rows)


def test_matmul_refuses_weights_of_other_dtypes():
    x, y = np.zeros((2, 8), np.float32), np.zeros((2, 3), np.float32)
    for dtype in ("float64", "int8", "int32"):
        assert call_kernel(cpu_kernels.GEMV, x, np.zeros((3, 8), np.float32), y,
                           dtypes=["float32", dtype, "float32"]) == 2
    assert call_kernel(cpu_kernels.GEMV_BIAS, x, np.zeros((3, 8), np.float16), np.zeros(3, np.float16), y,
                       dtypes=["float32", "float16", "float16", "float32"]) == 2  # the bias stays float32


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("ids_dtype", ["int32", "int64"])
def test_embed_copies_and_widens_the_rows_of_the_ids(dtype, ids_dtype):
    rng = np.random.default_rng(3)
    table, table64 = stored(rng.standard_normal((50, 37), dtype=np.float32), dtype)
    for n in (1, 7, 3000):  # 3000 x 37 floats: split across threads
        ids = rng.integers(0, 50, n).astype(ids_dtype)
        ids[0], ids[-1] = 0, 49
        y = np.full((n, 37), np.nan, np.float32)
        assert call_kernel(cpu_kernels.EMBED, ids, table, y, dtypes=[ids_dtype, dtype, "float32"]) == 0
        assert np.array_equal(y, table64[ids].astype(np.float32))  # widening is exact


def test_embed_ids_of_any_shape_give_that_shape_plus_the_row():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([[3, 1], [0, 2]], np.int32)
    y = np.full((2, 2, 3), np.nan, np.float32)
    assert call_kernel(cpu_kernels.EMBED, ids, table, y, dtypes=["int32", "float32", "float32"]) == 0
    assert np.array_equal(y, table[ids])


def test_embed_refuses_ids_outside_the_table_and_writes_nothing():
    table = np.ones((10, 4), np.float32)
    for ids_dtype, bad in (("int32", 10), ("int32", -1), ("int64", 2 ** 40), ("int64", -(2 ** 40))):
        ids = np.array([1, bad, 2], ids_dtype)
        y = np.full((3, 4), np.nan, np.float32)
        assert call_kernel(cpu_kernels.EMBED, ids, table, y, dtypes=[ids_dtype, "float32", "float32"]) == 5
        assert np.isnan(y).all()


def test_embed_refuses_what_it_cannot_compute():
    ids, table, y = np.zeros(3, np.int32), np.zeros((10, 4), np.float32), np.zeros((3, 4), np.float32)
    f32 = "float32"
    assert call_kernel(cpu_kernels.EMBED, ids, table) == 1
    assert call_kernel(cpu_kernels.EMBED, ids.astype(np.int16), table, y, dtypes=["int16", f32, f32]) == 2
    assert call_kernel(cpu_kernels.EMBED, ids, table.astype(np.float64), y, dtypes=["int32", "float64", f32]) == 2
    assert call_kernel(cpu_kernels.EMBED, ids, table, y.astype(np.float16), dtypes=["int32", f32, "float16"]) == 2
    assert call_kernel(cpu_kernels.EMBED, ids, table[0], y, dtypes=["int32", f32, f32]) == 3
    assert call_kernel(cpu_kernels.EMBED, ids, table, np.zeros((3, 5), np.float32), dtypes=["int32", f32, f32]) == 4
    assert call_kernel(cpu_kernels.EMBED, ids, table, np.zeros((2, 4), np.float32), dtypes=["int32", f32, f32]) == 4


def embed_quant_reference(ids, q, scale, offset, packed):
    """The plain ops' lookup (export/network/layers.py Embedding._lookup) in numpy, float32 step by step."""
    rows = q[ids.reshape(-1)]
    if packed:  # input 2j in the low nibble, two's complement
        nib = np.stack((rows & 15, rows >> 4), -1).reshape(rows.shape[0], -1).astype(np.int32)
        rows = nib - (nib >= 8) * 16
    x = rows.astype(np.float32)
    g = scale.shape[0]
    x = x.reshape(x.shape[0], g, -1)
    if offset is not None:
        x = x + offset[:, ids.reshape(-1)].T[:, :, None]
    x = x * scale[:, ids.reshape(-1)].T[:, :, None]
    return x.reshape(*ids.shape, -1)


@pytest.mark.parametrize("packed,groups,with_offset", [(False, 1, False), (False, 4, True), (True, 1, True),
                                                       (True, 9, True), (True, 3, False)])
def test_embed_quant_equals_the_plain_ops_bit_for_bit(packed, groups, with_offset):
    """A quantized table's lookup (MsliteLlmEmbedQuant): int8 rows or int4 two a byte, a float32 scale (and offset)
    per group of a row, ids of any shape, int32 or int64; enough ids to run on the pool's threads too."""
    rng = np.random.default_rng(groups * 10 + packed)
    vocab, width = 97, 72 * groups
    q = rng.integers(0, 256, (vocab, width // 2)).astype(np.uint8) if packed else \
        rng.integers(-128, 128, (vocab, width)).astype(np.int8)
    scale = rng.standard_normal((groups, vocab), dtype=np.float32)
    offset = rng.standard_normal((groups, vocab), dtype=np.float32) if with_offset else None
    for ids_dtype, shape in (("int32", (5,)), ("int64", (2, 3)), ("int32", (20000 // groups,))):
        ids = rng.integers(0, vocab, shape).astype(ids_dtype)
        ids.reshape(-1)[0], ids.reshape(-1)[-1] = 0, vocab - 1
        y = np.full(shape + (width,), np.nan, np.float32)
        tensors = (ids, q, scale) + ((offset,) if with_offset else ()) + (y,)
        dtypes = [ids_dtype, "uint8" if packed else "int8"] + ["float32"] * (len(tensors) - 2)
        assert call_kernel(cpu_kernels.EMBED_QUANT, *tensors, dtypes=dtypes) == 0
        assert np.array_equal(y, embed_quant_reference(ids, q, scale, offset, packed))


def test_embed_quant_refuses_what_it_cannot_compute_and_writes_nothing():
    ids, q, s = np.array([1, 2], np.int32), np.zeros((10, 8), np.int8), np.ones((2, 10), np.float32)
    f32, i8 = "float32", "int8"

    def code(*tensors, dtypes):
        y = tensors[-1]
        before = y.copy()
        got = call_kernel(cpu_kernels.EMBED_QUANT, *tensors, dtypes=dtypes)
        assert got == 0 or np.array_equal(y, before, equal_nan=True)
        return got

    y = np.full((2, 8), np.nan, np.float32)
    assert code(ids, q, y, dtypes=["int32", i8, f32]) == 1
    assert code(ids, q, s, s, s, y, dtypes=["int32", i8, f32, f32, f32, f32]) == 1
    assert code(ids, q.astype(np.int16), s, y, dtypes=["int32", "int16", f32, f32]) == 2
    assert code(ids, q, s.astype(np.float16), y, dtypes=["int32", i8, "float16", f32]) == 2
    assert code(ids.astype(np.int16), q, s, y, dtypes=["int16", i8, f32, f32]) == 2
    assert code(ids, q[0], s, y, dtypes=["int32", i8, f32, f32]) == 3
    assert code(ids, q, s[0], y, dtypes=["int32", i8, f32, f32]) == 3
    assert code(ids, q, np.ones((3, 10), np.float32), y, dtypes=["int32", i8, f32, f32]) == 4  # 8 in groups of 3
    assert code(ids, q, np.ones((2, 11), np.float32), y, dtypes=["int32", i8, f32, f32]) == 4  # not the vocabulary
    assert code(ids, q, s, np.ones((1, 10), np.float32), y, dtypes=["int32", i8, f32, f32, f32]) == 4
    assert code(ids, q, s, np.full((2, 9), np.nan, np.float32), dtypes=["int32", i8, f32, f32]) == 4
    assert code(ids, q.view(np.uint8)[:, :4].copy(), s, np.full((2, 8), np.nan, np.float32),
                dtypes=["int32", "uint8", f32, f32]) == 0  # int4: 4 bytes a row are 8 inputs
    assert code(ids, q.view(np.uint8)[:, :3].copy(), np.ones((2, 10), np.float32), np.full((2, 6), np.nan, np.float32),
                dtypes=["int32", "uint8", f32, f32]) == 4  # int4 groups of 3 inputs: a byte split between groups
    for bad in (10, -1):
        assert code(np.array([1, bad], np.int32), q, s, y, dtypes=["int32", i8, f32, f32]) == 5


def test_bfloat16_weights_at_several_rows_round_x_to_bfloat16_where_the_cpu_has_avx512_bf16():
    """The AVX512-BF16 form (cpu_kernels.bf16_form): 5 to 64 rows of x against bfloat16 weights multiply x rounded to
    bfloat16 (its rows form), and more rows of a width in whole blocks of 32 too (its GEMM: a prompt's rows, a chunk
    call's), fewer rows and more of a width off 32 keep x exact (the float32 rows form, the float32 GEMM), and the
    exact activations (check's replays) hold every row to float32's form; at the SmolLM2 and 0.5B widths, and widths
    off 32. Where AMX tiles run (bf16_tiles), from 5 rows of a width in whole blocks of 32 with no upper bound, x
    rounded alike; set_tiles(False) gives the rows past 64 to the vector form's GEMM, x rounded as well."""
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    want = "avx512_bf16" if cpu_kernels.isa() == "avx512" and {"avx512_bf16", "avx512bw", "avx512vl"} <= flags \
        else "float32"
    assert cpu_kernels.bf16_form() == want
    check_matmul("bfloat16", True, (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 64, 65, 71, 144), (3, 47, 64, 129, 576),
                 (31, 33, 576, 896, 1056), seed=5)
    x = np.random.default_rng(6).standard_normal((9, 576), dtype=np.float32)
    w, w64 = stored(np.random.default_rng(7).standard_normal((40, 576), dtype=np.float32), "bfloat16")
    y = np.empty((9, 40), np.float32)
    assert call_kernel(cpu_kernels.GEMV, x, w, y, dtypes=["float32", "bfloat16", "float32"]) == 0
    exact = x.astype(np.float64) @ w64.T
    rounded = bf16_rounded(x).astype(np.float64) @ w64.T
    assert np.abs(y - (rounded if want == "avx512_bf16" else exact)).max() <= 1e-5 * np.abs(exact).max()
    if want == "avx512_bf16":  # the rounding is real: further from x exact than float32's sums could be
        assert np.abs(y - exact).max() > 1e-4 * np.abs(exact).max()
    if bf16_tiles():  # the prompt's rows: rounded in the tiles, and in the vector form's GEMM with the tiles off
        xp = np.random.default_rng(9).standard_normal((100, 576), dtype=np.float32)
        exact_p, rounded_p = xp.astype(np.float64) @ w64.T, bf16_rounded(xp).astype(np.float64) @ w64.T
        yp = np.empty((100, 40), np.float32)
        try:
            for on, want_p in ((True, rounded_p), (False, rounded_p)):
                cpu_kernels.set_tiles(on)
                assert call_kernel(cpu_kernels.GEMV, xp, w, yp, dtypes=["float32", "bfloat16", "float32"]) == 0
                assert np.abs(yp - want_p).max() <= 1e-5 * np.abs(exact_p).max(), on
        finally:
            cpu_kernels.set_tiles(True)
    try:
        assert cpu_kernels.set_quant_activations("exact") == "exact"
        check_matmul("bfloat16", False, (2, 8, 9, 16), (47,), (576,), seed=8)
        assert call_kernel(cpu_kernels.GEMV, x, w, y, dtypes=["float32", "bfloat16", "float32"]) == 0
        assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    finally:
        cpu_kernels.set_quant_activations(None)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_each_code_path_gives_the_same_answers(isa):
    """The plain C++ path (machines without AVX2/FMA/F16C), the AVX2 one (machines without AVX-512) and AVX-512
    without its extensions' forms (a CPU without AVX512_BF16 and VNNI: bf16_form float32), forced at load by the
    environment, in a new process; this process runs whatever the machine has."""
    script = textwrap.dedent(f"""
        import ctypes, sys
        import cpu_kernels, test_cpu_kernels as t
        lib = ctypes.CDLL(cpu_kernels.library_path())
        lib.MsliteLlmIsa.restype = ctypes.c_char_p
        if lib.MsliteLlmIsa() != b"{isa}":
            sys.exit("isa: " + lib.MsliteLlmIsa().decode())
        for dtype in t.WEIGHT_DTYPES:
            t.check_matmul(dtype, True, t.ODD_ROWS, t.ODD_OUTS, t.ODD_INS)
            if "{isa}" != "avx512":  # AVX-512's one-row form sums in its own order (matmul16.cc seq_rows512)
                t.check_rows_alike(dtype)
            t.test_embed_copies_and_widens_the_rows_of_the_ids(dtype, "int64")
        t.test_embed_refuses_ids_outside_the_table_and_writes_nothing()
        import test_fused_kernels as f
        for d, bs in ((64, 64), (80, 16)):
            f.test_attention_of_prompts_at_real_head_sizes(d, bs)
        f.test_attention_rows_read_the_sequence_each_query_names()
        f.test_decode_attention_reads_each_sequences_blocks_in_place_with_gqa()
        f.test_a_bfloat16_cache_is_attended_as_a_float32_cache_of_its_values(9, 3, 64, 64, (1100, 513, 1, 0, 300), 0)
        f.test_a_bfloat16_cache_is_attended_as_a_float32_cache_of_its_values(4, 4, 80, 128, (45, 7), 0)
        f.test_bfloat16_caches_are_written_rounded_to_nearest_even()
        f.test_a_verifys_query_is_its_step_past_a_chunks_edge(9, 3, 505, 64)
    """)
    env = dict(os.environ, MSLITE_LLM_CPU_KERNELS_ISA=isa,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if isa in ("avx2", "avx512") and "isa: generic" in proc.stderr:
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    if isa == "avx512" and "isa: avx2" in proc.stderr:
        pytest.skip("this CPU has no AVX-512")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lib = ctypes.CDLL(cpu_kernels.library_path())
    lib.MsliteLlmIsa.restype = ctypes.c_char_p
    assert lib.MsliteLlmIsa() in (b"avx512", b"avx2", b"generic")


def test_mindspore_graph_runs_our_kernels_on_bfloat16_parameters():
    """A real ops.Custom (aot) in a graph-mode Cell: embedding and matmul read bfloat16 Parameters."""
    import mindspore as ms
    from mindspore import nn, ops

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    lib = cpu_kernels.library_path()

    class Net(nn.Cell):
        def __init__(self, table_bits, w_bits, b):
            super().__init__()
            self.table = ms.Parameter(ms.Tensor.from_numpy(table_bits).view(ms.bfloat16), name="table",
                                      requires_grad=False)
            self.w = ms.Parameter(ms.Tensor.from_numpy(w_bits).view(ms.bfloat16), name="w", requires_grad=False)
            self.b = ms.Parameter(ms.Tensor(b), name="b", requires_grad=False)
            self.embed = ops.Custom(f"{lib}:{cpu_kernels.EMBED}", out_shape=lambda ids, t: (ids[0], t[1]),
                                    out_dtype=lambda ids, t: ms.float32, func_type="aot")
            self.matmul = ops.Custom(f"{lib}:{cpu_kernels.GEMV_BIAS}", out_shape=lambda x, w, b: (x[0], w[0]),
                                     out_dtype=lambda x, w, b: x, func_type="aot")

        def construct(self, ids):
            return self.matmul(self.embed(ids, self.table), self.w, self.b)

    rng = np.random.default_rng(4)
    table, table64 = stored(rng.standard_normal((64, 40), dtype=np.float32), "bfloat16")
    w, w64 = stored(rng.standard_normal((300, 40), dtype=np.float32), "bfloat16")
    b = rng.standard_normal(300, dtype=np.float32)
    net = Net(table, w, b)
    assert net.w.dtype == ms.bfloat16 and net.table.dtype == ms.bfloat16
    for n in (3, 20):  # GEMV and GEMM
        ids = rng.integers(0, 64, n).astype(np.int32)
        y = net(ms.Tensor(ids)).asnumpy()
        ref = table64[ids] @ w64.T + b
        assert y.dtype == np.float32 and y.shape == (n, 300)
        assert np.abs(y - ref).max() <= 1e-5 * (np.abs(table64[ids]) @ np.abs(w64).T + np.abs(b)).max()


def graph_model(graph_path: str):
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(graph_path, "rb") as fh:
        model.ParseFromString(fh.read())
    return model


def custom_funcs(graph_path: str):
    """(Counter of Custom func names among primitives, number of graph nodes that call a Custom primitive)."""
    model = graph_model(graph_path)
    funcs = collections.Counter(a.s.decode() for p in model.primitives for a in p.attribute if a.name == "func_name")
    calls = sum(1 for node in model.graph.node if node.op_type.startswith("REF::Custom"))
    return funcs, calls


def test_decode_graph_calls_our_kernels_and_prefill_only_for_few_rows(exported):
    folder = exported["gqa_tied"]
    with open(os.path.join(folder, "manifest.json")) as fh:
        graphs = {g["role"]: g["file"] for g in json.load(fh)["graphs"]}
    funcs, calls = custom_funcs(os.path.join(folder, graphs["inc"]))
    # stored by library name only, never by the exporting machine's path
    assert set(funcs) == {f"mslite_llm_cpu_kernels.so:{f}" for f in (
        cpu_kernels.GEMV, cpu_kernels.RMS_NORM, cpu_kernels.DECODE_LAYER)}
    # per layer one call (norm + q/k/v + RoPE + the cache writes, attention, o_proj + residual + norm + gate/up + SiLU
    # + down + residual); then the final norm and the lm_head. No ScatterNdUpdate: the cache is written in place
    assert calls == 2 + 2
    assert not {p.op_type for p in graph_model(os.path.join(folder, graphs["inc"])).primitives} & {
        "ScatterNdUpdate", "ScatterUpdate", "Assign"}
    # the full graph (2 rows x 32 tokens): per layer the decode step's first kernel (norm, q/k/v, RoPE, the cache
    # write in place) over every token, the kernels' attention (causal by each token's length) and the
    # post-attention norm; MindSpore's MatMul for o_proj and the MLP; the lm_head's GEMV on each row's last token.
    # No cache write op and no mask: ~20 nodes a layer for MindSpore to compile, not ~100
    prefill = os.path.join(folder, graphs["prefill"])
    assert custom_funcs(prefill) == (collections.Counter({f"mslite_llm_cpu_kernels.so:{f}": 1 for f in (
        cpu_kernels.DECODE_QKV, cpu_kernels.DECODE_ATTENTION, cpu_kernels.RMS_NORM, cpu_kernels.GEMV)}), 3 * 2 + 1)
    assert not {p.op_type for p in graph_model(prefill).primitives} & {
        "ScatterNdUpdate", "ScatterUpdate", "Assign", "BatchMatMul", "Softmax"}
    # a bucket of at most KERNEL_PREFILL_MAX_ROWS rows (2 x 8) runs every matmul through the kernel
    from export.network.layers import KERNEL_PREFILL_MAX_ROWS

    bucketed = exported["gqa_tied_buckets"]
    with open(os.path.join(bucketed, "manifest.json")) as fh:
        by_tokens = {g["tokens"]: g["file"] for g in json.load(fh)["graphs"] if g["role"] == "prefill"}
    assert 2 * 8 <= KERNEL_PREFILL_MAX_ROWS < 2 * 16
    assert custom_funcs(os.path.join(bucketed, by_tokens[8]))[1] == 7 * 2 + 1
    # above (2 x 16): o_proj and the MLP through MatMul, the layer's first half still the kernels'
    assert custom_funcs(os.path.join(bucketed, by_tokens[16]))[1] == 3 * 2 + 1
    with open(os.path.join(folder, "gqa_tied.yaml")) as fh:
        assert yaml.safe_load(fh)["infer"]["cpu_kernels"] is True


def test_cpu_kernels_off_gives_plain_graphs_and_the_same_tokens(tmp_path, checkpoints):
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    out = str(tmp_path / "plain")
    run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="plain", seq_length=32,
                            batch_size=2, dtype="float32", device="cpu", cpu_kernels="off"))
    assert custom_funcs(os.path.join(out, "plain_inc_graph.mindir")) == (collections.Counter(), 0)
    rows = prompts(2, [5, 9], seed=31)
    got = pipeline("text_generation", model=out, backend="ms").generate(rows, max_new_tokens=8).sequences
    assert got == [hf_generate(checkpoints["gqa_tied"], r, max_new_tokens=8, do_sample=False) for r in rows]


def test_generation_never_writes_the_weights_file(pipes, exported):
    """The weights file is mapped copy-on-write: KV cache writes stay in the process."""
    folder = exported["gqa_tied"]
    pipes["gqa_tied"].generate(prompts(2, [6, 3], seed=5), max_new_tokens=10)
    with open(os.path.join(folder, "manifest.json")) as fh:
        want = json.load(fh)["files"]["gqa_tied_variables/data_0"]["sha256"]
    with open(os.path.join(folder, "gqa_tied_variables", "data_0"), "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == want


def test_without_the_built_library(tmp_path, exported, checkpoints):
    """An install whose kernel library was not built (no compiler): export and load say what to do."""
    shadow = tmp_path / "install" / "cpu_kernels"
    shadow.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "cpu_kernels", "__init__.py"), shadow / "__init__.py")
    folder = exported["gqa_tied"]
    script = textwrap.dedent(f"""
        import cpu_kernels
        assert cpu_kernels.__file__.startswith({str(tmp_path)!r}) and cpu_kernels.library_path() is None
        from export.__main__ import main
        main(["-q", "--checkpoint", {checkpoints["gqa_tied"]!r}, "--output", {str(tmp_path / "out")!r},
              "--device", "cpu", "--seq_length", "16", "--cpu_kernels", "on"])
        from lite_runtime import InferError, pipeline
        try:
            pipeline("text_generation", model={folder!r}, backend="ms")
        except InferError as exc:
            print("error:", exc, file=__import__("sys").stderr)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "install"), ROOT]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert errors == [
        "error: --cpu_kernels on: the CPU kernel library is not built; " + cpu_kernels.BUILD_HINT,
        f"error: {os.path.join(folder, 'gqa_tied_inc_graph.mindir')}: the graph calls mslite-llm's CPU kernels, but "
        f"the mslite-llm CPU kernel library is not built in {shadow}; {cpu_kernels.BUILD_HINT}",
    ]
    assert not (tmp_path / "out").exists()


def test_a_graph_calling_kernels_this_installation_lacks_is_refused_at_load(exported):
    """A folder exported by another mslite-llm version may call a kernel this library does not have (or call one with
    a contract it does not keep): loading names the graph and the functions, before MindSpore is handed a library
    path it would fail to resolve at the first run."""
    from lite_runtime import InferError
    from lite_runtime.backends.ms import _relocate_kernels

    folder = exported["gqa_tied"]
    path = os.path.join(folder, "gqa_tied_inc_graph.mindir")
    model = graph_model(path)
    renamed = 0
    for prim in model.primitives:
        for attr in prim.attribute:
            if attr.s and attr.s.decode().endswith(cpu_kernels.DECODE_LAYER):
                attr.s = attr.s.decode().replace(cpu_kernels.DECODE_LAYER, "MsliteLlmFromAFutureVersion").encode()
                renamed += 1
    assert renamed == 2  # func_name and uniq_name
    with pytest.raises(InferError) as err:
        _relocate_kernels(model, path)
    assert str(err.value) == (
        f"{path}: the graph calls CPU kernels this installation of mslite-llm does not have "
        "(MsliteLlmFromAFutureVersion): the folder was exported by another version; run it with that version, or "
        "re-export it with this one")
    _relocate_kernels(graph_model(path), path)  # the folder as exported loads
