"""The CPU kernel of a mixture of experts' experts (cpu_kernels.MOE_EXPERTS, cpu_kernels/moe.cc) against numpy in
float64: each row's chosen experts' SwiGLU from the stacked weights, weighted and summed, with float32, float16,
bfloat16 and int8/int4 (with and without offsets) weights; the experts no row chose are never read; bad calls refused
with the ops' error codes, y untouched."""
from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from test_cpu_kernels import call_kernel, stored
from test_quant_kernels import dequantize, pack_int4, random_q

MOE = cpu_kernels.MOE_EXPERTS


def silu(g):
    return g / (1 + np.exp(-g))


def reference(x, index, weights, gate_up, down):
    """float64: y[r] = sum over j of weights[r, j] * down_e(silu(gate_e(x_r)) * up_e(x_r)), e = index[r, j];
    gate_up [E, 2I, H] as float64 values, down [E, H, I]."""
    inter = down.shape[2]
    y = np.zeros((x.shape[0], down.shape[1]))
    for r in range(x.shape[0]):
        for e, w in zip(index[r], weights[r]):
            gu = gate_up[e] @ x[r].astype(np.float64)
            y[r] += w * (down[e] @ (silu(gu[:inter]) * gu[inter:]))
    return y


def routing(rng, rows: int, experts: int, top: int):
    """Each row's top distinct experts (a random permutation's first), and positive weights."""
    index = np.stack([rng.permutation(experts)[:top] for _ in range(rows)]).astype(np.int32)
    return index, rng.random((rows, top), dtype=np.float32) + 0.1


def check(y, ref, what: str) -> None:
    bad = ~(np.abs(y - ref) <= 1e-5 * np.abs(ref).max())  # NaN counts as bad
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} off, worst {np.nanmax(np.abs(y - ref))}"


@pytest.fixture
def exact():
    """The matmuls in float32's arithmetic (bfloat16 weights' AVX512-BF16 form rounds x at 8 to 64 rows)."""
    cpu_kernels.set_quant_activations("exact")
    yield
    cpu_kernels.set_quant_activations(None)


# rows: one (a decode step), 3, and 40 over 4 experts (about 20 rows each: the GEMM form)
@pytest.mark.parametrize("rows, experts, top", [(1, 8, 2), (3, 6, 3), (40, 4, 2)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_experts_against_numpy(exact, rows, experts, top, dtype):
    rng = np.random.default_rng(rows * 100 + experts)
    hidden, inter = 96, 40
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    index, weights = routing(rng, rows, experts, top)
    gu_w, gu64 = stored(rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) * 0.1, dtype)
    d_w, d64 = stored(rng.standard_normal((experts, hidden, inter), dtype=np.float32) * 0.1, dtype)
    y = np.full((rows, hidden), np.nan, np.float32)
    assert call_kernel(MOE, x, index, weights, gu_w, d_w, y,
                       dtypes=["float32", "int32", "float32", dtype, dtype, "float32"]) == 0
    check(y, reference(x, index, weights, gu64, d64), f"{dtype} {rows} rows")


def quant_stack(rng, bits: int, experts: int, n: int, k: int, groups: int, with_offset: bool):
    """(q [E, n, k or k / 2], scale [E, G, n], offset or None, the dequantized float64 [E, n, k])."""
    qs, scales, offsets, values = [], [], [], []
    for _ in range(experts):
        q = random_q(rng, bits, n, k)
        s = (rng.random((groups, n), dtype=np.float32) + 0.5) * (0.002 if bits == 8 else 0.03)
        o = rng.standard_normal((groups, n), dtype=np.float32) if with_offset else None
        q = q if bits == 8 else pack_int4(q)
        qs.append(q), scales.append(s), offsets.append(o), values.append(dequantize(q, s, o))
    return (np.stack(qs), np.stack(scales), np.stack(offsets) if with_offset else None, np.stack(values))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("rows", [1, 24])
def test_quantized_experts_against_numpy(exact, bits, with_offset, rows):
    """int8 / int4 experts, groups of 32 over hidden 128 (gate_up) and 64 (down), each expert its own scales."""
    rng = np.random.default_rng(bits + rows + with_offset)
    experts, top, hidden, inter = 5, 2, 128, 64
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    index, weights = routing(rng, rows, experts, top)
    gq, gs, go, g64 = quant_stack(rng, bits, experts, 2 * inter, hidden, hidden // 32, with_offset)
    dq, ds, do, d64 = quant_stack(rng, bits, experts, hidden, inter, inter // 32, with_offset)
    tensors = [gq, gs] + ([go] if with_offset else []) + [dq, ds] + ([do] if with_offset else [])
    qtype = "int8" if bits == 8 else "uint8"
    dtypes = ["float32", "int32", "float32"] + [qtype if t.dtype != np.float32 else "float32" for t in tensors]
    y = np.full((rows, hidden), np.nan, np.float32)
    assert call_kernel(MOE, x, index, weights, *tensors, y, dtypes=dtypes + ["float32"]) == 0
    check(y, reference(x, index, weights, g64, d64), f"int{bits} offset={with_offset} {rows} rows")


def test_experts_no_row_chose_are_not_read():
    """NaN in every expert but the chosen ones: were one read, its NaN would reach y."""
    rng = np.random.default_rng(3)
    experts, hidden, inter = 6, 32, 16
    x = rng.standard_normal((2, hidden), dtype=np.float32)
    index = np.array([[1, 4], [4, 1]], np.int32)
    weights = np.array([[0.7, 0.3], [0.6, 0.4]], np.float32)
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    d = rng.standard_normal((experts, hidden, inter), dtype=np.float32)
    gu_nan, d_nan = gu.copy(), d.copy()
    for e in (0, 2, 3, 5):
        gu_nan[e], d_nan[e] = np.nan, np.nan
    y = np.zeros((2, hidden), np.float32)
    assert call_kernel(MOE, x, index, weights, gu_nan, d_nan, y, dtypes=["float32", "int32"] + ["float32"] * 4) == 0
    check(y, reference(x, index, weights, gu.astype(np.float64), d.astype(np.float64)), "chosen only")


@pytest.mark.parametrize("what, code", [("index", 5), ("index_dtype", 2), ("down_shape", 4), ("count", 1),
                                        ("rank", 3)])
def test_bad_calls_are_refused_and_write_nothing(what, code):
    rng = np.random.default_rng(4)
    experts, hidden, inter = 4, 16, 8
    x = rng.standard_normal((2, hidden), dtype=np.float32)
    index = np.array([[0, 1], [2, experts if what == "index" else 3]], np.int32)
    weights = np.ones((2, 2), np.float32)
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    d = rng.standard_normal((experts, hidden, inter + (1 if what == "down_shape" else 0)), dtype=np.float32)
    y = np.full((2, hidden), 7.0, np.float32)
    arrays = [x, index.astype(np.int64) if what == "index_dtype" else index, weights,
              gu.reshape(experts * 2 * inter, hidden) if what == "rank" else gu, d, y]
    dtypes = ["float32", "int64" if what == "index_dtype" else "int32"] + ["float32"] * 4
    if what == "count":
        arrays, dtypes = arrays[:3] + arrays[4:], dtypes[:3] + dtypes[4:]
    assert call_kernel(MOE, *arrays, dtypes=dtypes) == code
    assert (y == 7.0).all()
