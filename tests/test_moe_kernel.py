"""The CPU kernel of a mixture of experts' sparse MLP (cpu_kernels.MOE, cpu_kernels/moe.cc) against numpy in float64:
the router, a softmax, the top k (renormalised or not), each row's chosen experts' SwiGLU from the stacked weights,
weighted and summed, with float32, float16, bfloat16 and int8/int4 (with and without offsets) weights, alone or as the
layer's residual form (h + MoE(RMSNorm(h))); the experts no row chose are never read; bad calls refused with the ops'
error codes, y untouched."""
from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from test_cpu_kernels import call_kernel, stored
from test_quant_kernels import dequantize, pack_int4, random_q

MOE = cpu_kernels.MOE


def silu(g):
    return g / (1 + np.exp(-g))


def route(x, router, top: int, norm: bool):
    """float64: each row's top experts by softmax of x . router^T (equal ones to the lower index), and their
    probabilities (divided by their sum with `norm`)."""
    logits = x.astype(np.float64) @ router.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top]
    weights = np.take_along_axis(probs, index, -1)
    return index, weights / weights.sum(-1, keepdims=True) if norm else weights


def reference(x, router, top, norm, gate_up, down):
    """float64: y[r] = sum over the chosen e of weight * down_e(silu(gate_e(x_r)) * up_e(x_r)); router [E, H],
    gate_up [E, 2I, H], down [E, H, I] as float64 values."""
    index, weights = route(x, router, top, norm)
    inter = down.shape[2]
    y = np.zeros((x.shape[0], down.shape[1]))
    for r in range(x.shape[0]):
        for e, w in zip(index[r], weights[r]):
            gu = gate_up[e] @ x[r].astype(np.float64)
            y[r] += w * (down[e] @ (silu(gu[:inter]) * gu[inter:]))
    return y


def rms_norm(h, w, eps):
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w


def layout(top: int, norm: bool, residual: bool) -> np.ndarray:
    return np.array([top, int(norm), int(residual)], np.int32)


def check(y, ref, what: str) -> None:
    bad = ~(np.abs(y - ref) <= 1e-5 * np.abs(ref).max())  # NaN counts as bad
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.size} off, worst {np.nanmax(np.abs(y - ref))}"


@pytest.fixture
def exact():
    """The matmuls in float32's arithmetic (bfloat16 weights' AVX512-BF16 form rounds x from 5 rows)."""
    cpu_kernels.set_quant_activations("exact")
    yield
    cpu_kernels.set_quant_activations(None)


# rows: one (a decode step), 3, and 40 over 4 experts (about 20 rows each: the GEMM form)
@pytest.mark.parametrize("rows, experts, top, norm", [(1, 8, 2, True), (3, 6, 3, False), (40, 4, 2, True)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_float_experts_against_numpy(exact, rows, experts, top, norm, dtype):
    rng = np.random.default_rng(rows * 100 + experts)
    hidden, inter = 96, 40
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    r_w, r64 = stored(rng.standard_normal((experts, hidden), dtype=np.float32), dtype)
    gu_w, gu64 = stored(rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) * 0.1, dtype)
    d_w, d64 = stored(rng.standard_normal((experts, hidden, inter), dtype=np.float32) * 0.1, dtype)
    y = np.full((rows, hidden), np.nan, np.float32)
    assert call_kernel(MOE, layout(top, norm, False), x, r_w, gu_w, d_w, y,
                       dtypes=["int32", "float32", dtype, dtype, dtype, "float32"]) == 0
    check(y, reference(x, r64, top, norm, gu64, d64), f"{dtype} {rows} rows")


@pytest.mark.parametrize("rows", [1, 5])
def test_the_residual_form_is_h_plus_the_moe_of_its_norm(exact, rows):
    """layout residual 1: h, ln_w, eps in place of x, y = h + MoE(RMSNorm(h)) (the layer after its attention)."""
    rng = np.random.default_rng(rows)
    experts, top, hidden, inter, eps = 6, 2, 64, 32, 1e-6
    h = rng.standard_normal((rows, hidden), dtype=np.float32) * 3
    ln_w = rng.random(hidden, dtype=np.float32) + 0.5
    router = rng.standard_normal((experts, hidden), dtype=np.float32)
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) * 0.1
    d = rng.standard_normal((experts, hidden, inter), dtype=np.float32) * 0.1
    y = np.full((rows, hidden), np.nan, np.float32)
    assert call_kernel(MOE, layout(top, True, True), h, ln_w, np.array([eps], np.float32), router, gu, d, y,
                       dtypes=["int32"] + ["float32"] * 7) == 0
    x = rms_norm(h, ln_w, eps)
    want = h + reference(x, router.astype(np.float64), top, True, gu.astype(np.float64), d.astype(np.float64))
    check(y, want, f"residual {rows} rows")


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


@pytest.mark.parametrize("bits, banded", [(8, False), (4, False), (4, True)])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("rows", [1, 24, 60])  # 60: about 24 rows an expert, past the rows form (the GEMM)
def test_quantized_experts_against_numpy(exact, bits, banded, with_offset, rows):
    """int8 / int4 experts, groups of 32 over hidden 128 (gate_up) and 64 (down), each expert its own scales; int4
    also in bands of 16 rows, each expert's matrix repacked alone (cpu_kernels.repack_int4_r16 on the stack), read by
    the op's R16 name, as the runtime gives it an int4 folder's experts where the banded form runs."""
    rng = np.random.default_rng(bits + rows + with_offset)
    experts, top, hidden, inter = 5, 2, 128, 64
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    router = rng.standard_normal((experts, hidden), dtype=np.float32)
    gq, gs, go, g64 = quant_stack(rng, bits, experts, 2 * inter, hidden, hidden // 32, with_offset)
    dq, ds, do, d64 = quant_stack(rng, bits, experts, hidden, inter, inter // 32, with_offset)
    tensors = [gq, gs] + ([go] if with_offset else []) + [dq, ds] + ([do] if with_offset else [])
    qtype = "int8" if bits == 8 else "uint8"
    dtypes = ["int32", "float32", "float32"] + [qtype if t.dtype != np.float32 else "float32" for t in tensors]
    if banded:
        for q in (gq, dq):
            cpu_kernels.repack_int4_r16(q)
    y = np.full((rows, hidden), np.nan, np.float32)
    assert call_kernel(cpu_kernels.R16_OPS[MOE] if banded else MOE, layout(top, False, False), x, router, *tensors,
                       y, dtypes=dtypes + ["float32"]) == 0
    check(y, reference(x, router.astype(np.float64), top, False, g64, d64),
          f"int{bits} offset={with_offset} banded={banded} {rows} rows")


@pytest.mark.parametrize("residual", [False, True])
def test_the_full_graphs_form_computes_each_prompts_rows_only(exact, residual):
    """valid_length [B] before y: x holds B prompts of n rows, only each one's first valid_length are computed; the
    padding rows (NaN here: computed, they would stay NaN) come out 0, or h in the residual form."""
    rng = np.random.default_rng(11)
    experts, top, hidden, inter, n, eps = 6, 2, 32, 16, 5, 1e-6
    valid = np.array([3, 0, 5], np.int32)
    h = rng.standard_normal((3 * n, hidden), dtype=np.float32)
    pad = np.concatenate([np.arange(b * n + v, (b + 1) * n) for b, v in enumerate(valid)])
    h[pad] = np.nan
    ln_w = rng.random(hidden, dtype=np.float32) + 0.5
    router = rng.standard_normal((experts, hidden), dtype=np.float32)
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32) * 0.1
    d = rng.standard_normal((experts, hidden, inter), dtype=np.float32) * 0.1
    y = np.full_like(h, 7.0)
    lead = [h, ln_w, np.array([eps], np.float32)] if residual else [h]
    assert call_kernel(MOE, layout(top, True, residual), *lead, router, gu, d, valid, y,
                       dtypes=["int32"] + ["float32"] * (len(lead) + 3) + ["int32", "float32"]) == 0
    live = np.setdiff1d(np.arange(3 * n), pad)
    x = rms_norm(h[live], ln_w, eps) if residual else h[live]
    want = reference(x, router.astype(np.float64), top, True, gu.astype(np.float64), d.astype(np.float64))
    check(y[live], want + (h[live] if residual else 0), f"valid rows, residual={residual}")
    if residual:
        assert np.isnan(y[pad]).all()  # h as it was
    else:
        assert (y[pad] == 0).all()


def test_experts_no_row_chose_are_not_read():
    """NaN in every expert the router does not choose (experts 1 and 4, by a router whose rows favour them): were
    one read, its NaN would reach y."""
    rng = np.random.default_rng(3)
    experts, hidden, inter = 6, 32, 16
    x = np.abs(rng.standard_normal((2, hidden), dtype=np.float32))
    router = np.full((experts, hidden), -1.0, np.float32)
    router[1], router[4] = 1.0, 0.9
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    d = rng.standard_normal((experts, hidden, inter), dtype=np.float32)
    gu_nan, d_nan = gu.copy(), d.copy()
    for e in (0, 2, 3, 5):
        gu_nan[e], d_nan[e] = np.nan, np.nan
    y = np.zeros((2, hidden), np.float32)
    assert call_kernel(MOE, layout(2, True, False), x, router, gu_nan, d_nan, y,
                       dtypes=["int32"] + ["float32"] * 5) == 0
    assert route(x, router.astype(np.float64), 2, True)[0].tolist() == [[1, 4], [1, 4]]
    check(y, reference(x, router.astype(np.float64), 2, True, gu.astype(np.float64), d.astype(np.float64)),
          "chosen only")


def test_equal_probabilities_go_to_the_lower_expert():
    """A router whose rows are all equal: every expert has the same probability, and the lowest k are chosen (as the
    float32 reference's stable sort), each weighted 1 / E (not renormalised) or 1 / k."""
    experts, hidden, inter = 5, 16, 8
    x = np.ones((1, hidden), np.float32)
    router = np.ones((experts, hidden), np.float32)
    gu = np.zeros((experts, 2 * inter, hidden), np.float32)
    gu[:, :inter] = 1.0  # gate 16, up 16 * (e + 1): expert e's SwiGLU is a known multiple of e + 1
    for e in range(experts):
        gu[e, inter:] = e + 1
    d = np.ones((experts, hidden, inter), np.float32)
    for norm, share in ((False, 1 / experts), (True, 1 / 3)):
        y = np.zeros((1, hidden), np.float32)
        assert call_kernel(MOE, layout(3, norm, False), x, router, gu, d, y, dtypes=["int32"] + ["float32"] * 5) == 0
        one = inter * (16 / (1 + np.exp(-16.0))) * 16  # expert 0's output per hidden unit
        assert np.allclose(y, share * one * (1 + 2 + 3), rtol=1e-6), norm


@pytest.mark.parametrize("what, code", [("layout_dtype", 2), ("layout_size", 3), ("top", 4), ("router_shape", 4),
                                        ("down_shape", 4), ("count", 1), ("rank", 3)])
def test_bad_calls_are_refused_and_write_nothing(what, code):
    rng = np.random.default_rng(4)
    experts, hidden, inter = 4, 16, 8
    x = rng.standard_normal((2, hidden), dtype=np.float32)
    lay = layout(experts + 1 if what == "top" else 2, True, False)
    if what == "layout_size":
        lay = lay[:2].copy()
    router = rng.standard_normal((experts + (1 if what == "router_shape" else 0), hidden), dtype=np.float32)
    gu = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    d = rng.standard_normal((experts, hidden, inter + (1 if what == "down_shape" else 0)), dtype=np.float32)
    y = np.full((2, hidden), 7.0, np.float32)
    arrays = [lay.astype(np.int64) if what == "layout_dtype" else lay, x, router,
              gu.reshape(experts * 2 * inter, hidden) if what == "rank" else gu, d, y]
    dtypes = ["int64" if what == "layout_dtype" else "int32"] + ["float32"] * 5
    if what == "count":
        arrays, dtypes = arrays[:3] + arrays[4:], dtypes[:3] + dtypes[4:]
    assert call_kernel(MOE, *arrays, dtypes=dtypes) == code
    assert (y == 7.0).all()
