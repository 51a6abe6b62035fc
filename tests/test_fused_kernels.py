"""cpu_kernels' fused decode-step ops against float64 numpy, called as MindSpore's aot CPU kernel calls them.

The decode graphs that use them are checked against HF end to end (test_generate, test_golden,
test_half_weights); these pin each op's own math, shapes and error codes, including the GEMM form
(more rows than the decode step has), GQA, and rows of different lengths in the attention.
"""
from __future__ import annotations

import numpy as np
import pytest

import cpu_kernels
from test_cpu_kernels import call_kernel, stored, x_as_computed


def close(got, ref, scale=None):
    return np.abs(got - ref).max() <= 1e-5 * (np.abs(ref).max() if scale is None else scale)


def rope64(x, cos, sin, d):  # x [M, heads*D]
    m = x.shape[0]
    h = x.reshape(m, -1, d)
    rot = np.concatenate([-h[..., d // 2:], h[..., :d // 2]], -1)
    return (h * cos[:, None, :] + rot * sin[:, None, :]).reshape(m, -1)


def test_rms_norm():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 896), dtype=np.float32), rng.standard_normal(896, dtype=np.float32)
    y = np.full_like(x, np.nan)
    assert call_kernel(cpu_kernels.RMS_NORM, x, w, np.array([1e-6], np.float32), y) == 0
    x64 = x.astype(np.float64)
    assert close(y, w * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6))
    assert call_kernel(cpu_kernels.RMS_NORM, x, w[:5], np.array([1e-6], np.float32), y) == 4


@pytest.mark.parametrize("rows", [1, 2, 20])  # 20: past the GEMV form, the GEMM one
def test_qkv_rope(rows):
    rng = np.random.default_rng(rows)
    e, h, kh, d = 96, 6, 2, 16
    x = rng.standard_normal((rows, e), dtype=np.float32)
    mats = [(rng.standard_normal((o, e), dtype=np.float32), rng.standard_normal(o, dtype=np.float32))
            for o in (h * d, kh * d, kh * d)]
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    outs = [np.full((rows, w.shape[0]), np.nan, np.float32) for w, _ in mats]
    assert call_kernel(cpu_kernels.QKV_ROPE, x, *[t for m in mats for t in m], cos, sin, *outs) == 0
    plain = [x.astype(np.float64) @ w.T.astype(np.float64) + b for w, b in mats]
    refs = [rope64(plain[0], cos, sin, d), rope64(plain[1], cos, sin, d), plain[2]]
    scale = max(np.abs(p).max() for p in plain)
    for got, ref in zip(outs, refs):
        assert close(got, ref, scale)
    assert call_kernel(cpu_kernels.QKV_ROPE, x, *[t for m in mats for t in m], cos, sin, *outs[:2]) == 1


@pytest.mark.parametrize("rows", [1, 20])
def test_qkv_rope_with_per_head_norms(rows):
    """Qwen3's form: q_norm / k_norm (RMSNorm over each head's D) between the projections and RoPE."""
    rng = np.random.default_rng(100 + rows)
    e, h, kh, d, eps = 96, 4, 2, 32, 1e-6
    x = rng.standard_normal((rows, e), dtype=np.float32)
    mats = [(rng.standard_normal((o, e), dtype=np.float32), np.zeros(o, np.float32)) for o in (h * d, kh * d, kh * d)]
    qn, kn = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    outs = [np.full((rows, w.shape[0]), np.nan, np.float32) for w, _ in mats]
    eps_t = np.array([eps], np.float32)
    assert call_kernel(cpu_kernels.QKV_ROPE, x, *[t for m in mats for t in m], cos, sin, qn, kn, eps_t, *outs) == 0

    def head_norm(y, w):
        heads = y.reshape(rows, -1, d)
        return (w * heads / np.sqrt((heads ** 2).mean(-1, keepdims=True) + eps)).reshape(rows, -1)

    plain = [x.astype(np.float64) @ w.T.astype(np.float64) for w, _ in mats]
    refs = [rope64(head_norm(plain[0], qn), cos, sin, d), rope64(head_norm(plain[1], kn), cos, sin, d), plain[2]]
    for got, ref in zip(outs, refs):
        assert close(got, ref)
    assert call_kernel(cpu_kernels.QKV_ROPE, x, *[t for m in mats for t in m], cos, sin, qn[:8], kn, eps_t,
                       *outs) == 4


def paged(contiguous, block_size, rng, spare=2):
    """Caches given per sequence, [R, KH, S, D] (row r's positions 0..S-1), as the kernels hold them: a pool [NB, KH,
    BS, D] whose blocks are handed out shuffled (each row's block table skips and runs in any order), the null block
    0 and `spare` blocks no table lists full of NaN (never read). Returns (pool, tables [R, M] int32)."""
    r, kh, s, d = contiguous.shape
    m = -(-s // block_size)
    tables = rng.permutation(np.arange(1, 1 + r * m + spare))[:r * m].reshape(r, m).astype(np.int32)
    pool = np.full((1 + r * m + spare, kh, block_size, d), np.nan, np.float32)
    for row in range(r):
        for j in range(m):
            part = contiguous[row, :, j * block_size:(j + 1) * block_size]
            pool[tables[row, j], :, :part.shape[1]] = part
    return pool, tables


def slots_at(tables, rows, positions, block_size):
    """The slot of position positions[i] of the sequence whose table is tables[rows[i]] (-1 where a position is
    negative: not written)."""
    return np.array([-1 if p < 0 else tables[r, p // block_size] * block_size + p % block_size
                     for r, p in zip(rows, positions)], np.int32)


@pytest.mark.parametrize("rows, qk_norm, positions", [(1, False, [2]), (3, True, [2, 11, -1]),
                                                      (4, False, [-1, 2, -1, 11])])
def test_decode_qkv_normalises_projects_rotates_and_writes_the_cache_in_place(rows, qk_norm, positions):
    """The decode step's first op: the input RMSNorm, q/k/v, Qwen3's head norms, RoPE, and k, v written into the
    paged caches at each row's slot (a negative slot: an idle or padding row, not projected: its q zero, nothing
    written; nothing else of the caches changes); a slot past the pool is refused before anything is written."""
    rng = np.random.default_rng(200 + rows)
    e, h, kh, d, s, bs, eps = 96, 4, 2, 16, 12, 4, 1e-6
    x = rng.standard_normal((rows, e), dtype=np.float32)
    ln = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    mats = [(rng.standard_normal((o, e), dtype=np.float32), rng.standard_normal(o, dtype=np.float32))
            for o in (h * d, kh * d, kh * d)]
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    contiguous = [rng.standard_normal((rows + 1, kh, s, d), dtype=np.float32) for _ in range(2)]  # a row more
    kc, tables = paged(contiguous[0], bs, rng)
    caches = [kc, repage(contiguous[1], tables, bs, kc.shape[0])]
    before = [c.copy() for c in caches]
    positions = np.array(positions)  # -1: an idle row, written nowhere
    slots = slots_at(tables, range(rows), positions, bs)
    norms = [(1 + 0.1 * rng.standard_normal(d)).astype(np.float32) for _ in range(2)] if qk_norm else []
    q = np.full((rows, h * d), np.nan, np.float32)
    eps_t = np.array([eps], np.float32)
    args = [x, ln, eps_t, *[t for m in mats for t in m], cos, sin, *caches, slots, *norms, q]
    types = [None] * 13 + ["int32"] + [None] * (len(norms) + 1)
    assert call_kernel(cpu_kernels.DECODE_QKV, *args, dtypes=types) == 0

    def head_norm(y, w):
        heads = y.reshape(rows, -1, d)
        return (w * heads / np.sqrt((heads ** 2).mean(-1, keepdims=True) + eps)).reshape(rows, -1)

    x64 = x.astype(np.float64)
    normed = ln * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps)
    plain = [normed @ w.T.astype(np.float64) + b for w, b in mats]
    if qk_norm:
        plain[0], plain[1] = head_norm(plain[0], norms[0]), head_norm(plain[1], norms[1])
    q_ref, k_ref = rope64(plain[0], cos, sin, d), rope64(plain[1], cos, sin, d)
    q_ref[slots < 0] = 0  # an idle row: never read, not computed
    assert close(q, q_ref) and not q[slots < 0].any()
    for cache, old, ref in zip(caches, before, (k_ref, plain[2])):
        written = np.zeros(cache.shape, bool)
        for r, slot in enumerate(slots):
            if slot >= 0:
                written[slot // bs, :, slot % bs] = True
                assert close(cache[slot // bs, :, slot % bs], ref[r].reshape(kh, d))
        assert np.array_equal(cache[~written], old[~written], equal_nan=True)  # nothing else moved
    kept = [c.copy() for c in caches]
    args[13] = np.array([caches[0].shape[0] * bs, 0, 0][:rows], np.int32)  # past the pool's last slot
    assert call_kernel(cpu_kernels.DECODE_QKV, *args, dtypes=types) == 4
    assert all(np.array_equal(c, k, equal_nan=True) for c, k in zip(caches, kept))


def test_decode_qkv_writes_a_prompt_of_each_sequence():
    """The CPU prefill graph's form: N = B x n rows of x, n tokens of each sequence in turn, each written at its own
    slot (padding at slot -1: nowhere); the same q and cache values as the decode form token by token."""
    rng = np.random.default_rng(7)
    b, n, e, h, kh, d, s, bs, eps = 2, 5, 64, 4, 2, 16, 8, 2, 1e-6
    x = rng.standard_normal((b * n, e), dtype=np.float32)
    ln = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    mats = [t for o in (h * d, kh * d, kh * d) for t in (rng.standard_normal((o, e), dtype=np.float32),
                                                         rng.standard_normal(o, dtype=np.float32))]
    angle = rng.uniform(0, 6, (b * n, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    eps_t = np.array([eps], np.float32)
    types = [None] * 13 + ["int32", None]
    kc, tables = paged(np.zeros((b, kh, s, d), np.float32), bs, rng)
    caches = [kc, kc.copy()]
    before = [c.copy() for c in caches]
    positions = [p if p < 4 or r == 0 else -1 for r in range(b) for p in range(n)]  # row 1: a prompt of 4, padded
    slots = slots_at(tables, np.repeat(np.arange(b), n), positions, bs)
    q = np.full((b * n, h * d), np.nan, np.float32)
    assert call_kernel(cpu_kernels.DECODE_QKV, x, ln, eps_t, *mats, cos, sin, *caches, slots, q, dtypes=types) == 0
    for i in range(b * n):  # the reference: each token alone through the decode form
        one = [c.copy() for c in before]
        q1 = np.full((1, h * d), np.nan, np.float32)
        assert call_kernel(cpu_kernels.DECODE_QKV, x[i:i + 1], ln, eps_t, *mats, cos[i:i + 1], sin[i:i + 1], *one,
                           slots[i:i + 1], q1, dtypes=types) == 0
        assert close(q[i:i + 1], q1.astype(np.float64))
        if slots[i] >= 0:
            for cache, ref in zip(caches, one):
                at = (slots[i] // bs, slice(None), slots[i] % bs)
                assert close(cache[at], ref[at].astype(np.float64))
    untouched = np.ones(caches[0].shape, bool)
    for slot in slots[slots >= 0]:
        untouched[slot // bs, :, slot % bs] = False
    for cache, old in zip(caches, before):
        assert np.array_equal(cache[untouched], old[untouched], equal_nan=True)


def test_write_cache_writes_each_token_at_its_slot_and_skips_negative_ones():
    """The chunk graph's writes (MsliteLlmWriteCache): k, v [N, KH*D] at slot_mapping, -1 skipped; a slot past the
    pool refused before anything is written."""
    rng = np.random.default_rng(3)
    nb, kh, bs, d = 5, 2, 4, 8
    kc, vc = (rng.standard_normal((nb, kh, bs, d), dtype=np.float32) for _ in range(2))
    old = [kc.copy(), vc.copy()]
    k, v = (rng.standard_normal((3, kh * d), dtype=np.float32) for _ in range(2))
    slots = np.array([13, -1, 4], np.int32)
    flag = np.zeros(1, np.float32)
    types = [None] * 4 + ["int32", None]
    assert call_kernel(cpu_kernels.WRITE_CACHE, k, v, kc, vc, slots, flag, dtypes=types) == 0
    for cache, before, new in ((kc, old[0], k), (vc, old[1], v)):
        want = before.copy()
        for i, slot in enumerate(slots):
            if slot >= 0:
                want[slot // bs, :, slot % bs] = new[i].reshape(kh, d)
        assert np.array_equal(cache, want)
    kept = [kc.copy(), vc.copy()]
    assert call_kernel(cpu_kernels.WRITE_CACHE, k, v, kc, vc, np.array([0, 20, 1], np.int32), flag,
                       dtypes=types) == 4
    assert np.array_equal(kc, kept[0]) and np.array_equal(vc, kept[1])


def test_norm_swiglu_is_the_norm_then_swiglu():
    rng = np.random.default_rng(9)
    rows, e, o, eps = 2, 64, 40, 1e-6
    hid = rng.standard_normal((rows, e), dtype=np.float32)
    ln = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    wg, wu = rng.standard_normal((o, e), dtype=np.float32), rng.standard_normal((o, e), dtype=np.float32)
    y = np.full((rows, o), np.nan, np.float32)
    assert call_kernel(cpu_kernels.NORM_SWIGLU, hid, ln, np.array([eps], np.float32), wg, wu, y) == 0
    h64 = hid.astype(np.float64)
    n = ln * h64 / np.sqrt((h64 ** 2).mean(-1, keepdims=True) + eps)
    g, u = n @ wg.T, n @ wu.T
    assert close(y, g / (1 + np.exp(-g)) * u, np.abs(g).max() * np.abs(u).max())


@pytest.mark.parametrize("rows,wdtype", [(1, "float32"), (2, "bfloat16"), (9, "bfloat16"), (20, "float16")])
def test_decode_tail_is_o_proj_residual_norm_mlp_residual(rows, wdtype):
    rng = np.random.default_rng(11 + rows)
    a, e, inter, eps = 48, 64, 160, 1e-6
    attn, x = rng.standard_normal((rows, a), dtype=np.float32), rng.standard_normal((rows, e), dtype=np.float32)
    ln = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    wo, wg, wu, wd = (0.1 * rng.standard_normal(s, dtype=np.float32) for s in ((e, a), (inter, e), (inter, e), (e, inter)))
    if wdtype == "float16":  # the weights as the kernel reads them: 16-bit values, compared exactly widened
        wo, wg, wu, wd = (w.astype(np.float16) for w in (wo, wg, wu, wd))
    elif wdtype == "bfloat16":
        wo, wg, wu, wd = ((w.view(np.uint32) >> 16).astype(np.uint16) for w in (wo, wg, wu, wd))
    wide = [w.astype(np.float64) if w.dtype != np.uint16 else (w.astype(np.uint32) << 16).view(np.float32).astype(
        np.float64) for w in (wo, wg, wu, wd)]
    y = np.full((rows, e), np.nan, np.float32)
    dtypes = [None, wdtype, None, None, None, wdtype, wdtype, wdtype, None]
    assert call_kernel(cpu_kernels.DECODE_TAIL, attn, wo, x, ln, np.array([eps], np.float32), wg, wu, wd, y,
                       dtypes=dtypes) == 0
    def xs(v):  # each matmul's x as the kernels multiply it (rounded to bfloat16 in the AVX512-BF16 form)
        return x_as_computed(np.asarray(v, np.float32), wdtype).astype(np.float64)

    h = x + xs(attn) @ wide[0].T
    n = ln * h / np.sqrt((h ** 2).mean(-1, keepdims=True) + eps)
    g, u = xs(n) @ wide[1].T, xs(n) @ wide[2].T
    want = h + xs(g / (1 + np.exp(-g)) * u) @ wide[3].T
    assert close(y, want, np.abs(want).max())
    assert call_kernel(cpu_kernels.DECODE_TAIL, attn, wo, x[:, :5], ln, np.array([eps], np.float32), wg, wu, wd, y,
                       dtypes=dtypes) == 4  # a residual of the wrong width: refused, nothing computed


@pytest.mark.parametrize("valid", [0, 1, 7, 19, 20, 25, -3])
def test_the_chunk_graphs_ops_compute_their_valid_rows_only(valid):
    """DECODE_LAYER_VALID and QKV_ROPE_VALID (the chunk graph's layer in one call, and its q/k/v where a layer takes
    several; valid int32 [1] first): their first `valid` rows are the plain op's on those rows alone, bit for bit, the
    cache writes too; the padding rows after them come out zero and write nothing (a count past the rows: all of
    them; below 0: none). A count that is not int32 [1] is refused."""
    rng = np.random.default_rng(31)
    rows, e, h, kh, d, inter = 20, 96, 6, 2, 16, 160
    live = min(max(valid, 0), rows)
    x = rng.standard_normal((rows, e), dtype=np.float32)
    mats = [t for o in (h * d, kh * d, kh * d) for t in (0.1 * rng.standard_normal((o, e), dtype=np.float32),
                                                         rng.standard_normal(o, dtype=np.float32))]
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    count = np.array([valid], np.int32)
    outs = [np.full((rows, o), np.nan, np.float32) for o in (h * d, kh * d, kh * d)]
    assert call_kernel(cpu_kernels.QKV_ROPE_VALID, count, x, *mats, cos, sin, *outs,
                       dtypes=["int32"] + [None] * 12) == 0
    alone = [np.full((live, o), np.nan, np.float32) for o in (h * d, kh * d, kh * d)]
    if live:
        assert call_kernel(cpu_kernels.QKV_ROPE, x[:live], *mats, cos[:live], sin[:live], *alone) == 0
    for got, want in zip(outs, alone):
        assert np.array_equal(got[:live], want) and not got[live:].any()

    # the layer in one call (DECODE_LAYER_VALID): a step row at position 29 of sequence 0, then a piece of 19 tokens
    # of sequence 1 at positions 4..22, written at their slots; its output rows and the caches after it against
    # DECODE_LAYER over the first `live` rows alone (the same slots, lengths and tables), the rows past them zero and
    # their slots not written
    bs, blocks = 8, 12
    ln, eps = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32), np.array([1e-6], np.float32)
    wo, wg, wu, wd = (0.1 * rng.standard_normal(s, dtype=np.float32)
                      for s in ((e, h * d), (inter, e), (inter, e), (e, inter)))
    tables = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    slot_of = lambda row, pos: int(tables[row, pos // bs]) * bs + pos % bs
    slots = np.array([slot_of(0, 29)] + [slot_of(1, 4 + i) for i in range(rows - 1)], np.int32)
    lengths = np.array([30] + [5 + i for i in range(rows - 1)], np.int32)
    query_rows = np.array([0] + [1] * (rows - 1), np.int32)
    layout = np.array([14, 7, 11], np.int32)
    types = ["int32"] + [None] * 13 + ["int32"] * 4 + [None] * 8

    def layer(n, valid_count=None):
        caches = [np.random.default_rng(5).standard_normal((blocks, kh, bs, d), dtype=np.float32) for _ in range(2)]
        y = np.full((n, e), np.nan, np.float32)
        args = [layout, x[:n], ln, eps, *mats, cos[:n], sin[:n], *caches, slots[:n], lengths[:n], query_rows[:n],
                tables, wo, x[:n], ln, eps, wg, wu, wd, y]
        if valid_count is None:
            assert call_kernel(cpu_kernels.DECODE_LAYER, *args, dtypes=types) == 0
        else:
            assert call_kernel(cpu_kernels.DECODE_LAYER_VALID, valid_count, *args, dtypes=["int32"] + types) == 0
        return y, caches

    y, caches = layer(rows, count)
    if live:
        want, want_caches = layer(live)
        assert np.array_equal(y[:live], want)
        for got, ref in zip(caches, want_caches):
            assert np.array_equal(got, ref)
    else:  # nothing written
        fresh = [np.random.default_rng(5).standard_normal((blocks, kh, bs, d), dtype=np.float32) for _ in range(2)]
        assert all(np.array_equal(c, f) for c, f in zip(caches, fresh))
    assert not y[live:].any()

    bad = [layout, x, ln, eps, *mats, cos, sin, *caches, slots, lengths, query_rows, tables, wo, x, ln, eps, wg, wu,
           wd, y]
    assert call_kernel(cpu_kernels.DECODE_LAYER_VALID, count.astype(np.int64), *bad, dtypes=["int64"] + types) == 2
    assert call_kernel(cpu_kernels.QKV_ROPE_VALID, np.array([3, 4], np.int32), x, *mats, cos, sin, *outs,
                       dtypes=["int32"] + [None] * 12) == 4


@pytest.mark.parametrize("lead, trail, count", [(3, 2, None), (1, 0, None), (0, 4, None), (2, 1, 12), (5, 0, 5)])
def test_the_layer_leaves_out_idle_rows_at_either_end(lead, trail, count):
    """DECODE_LAYER (and its valid form): rows whose slot is negative at the start and the end of the rows it computes
    (an idle step row before a verify's piece, an inc graph's rows past its live ones) are left out: the live rows
    come out bit for bit as the layer over them alone, the caches as it leaves them, the idle rows zero; with a
    valid count, the rows past it are padding (zero) and the idle rows before them are left out too (`count` 5 with 5
    idle rows first: every row idle, all zero, nothing written). Where the tail's x is another tensor than x the
    layer computes every row, the live ones as close as float32 sums allow."""
    rng = np.random.default_rng(41)
    live_n, e, h, kh, d, inter, bs, blocks = 9, 64, 4, 2, 16, 96, 8, 12
    rows = lead + live_n + trail
    x = rng.standard_normal((rows, e), dtype=np.float32)
    mats = [t for o in (h * d, kh * d, kh * d) for t in (0.1 * rng.standard_normal((o, e), dtype=np.float32),
                                                         rng.standard_normal(o, dtype=np.float32))]
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    ln, eps = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32), np.array([1e-6], np.float32)
    wo, wg, wu, wd = (0.1 * rng.standard_normal(s, dtype=np.float32)
                      for s in ((e, h * d), (inter, e), (inter, e), (e, inter)))
    tables = np.array([[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8]], np.int32)  # row 0: an idle row's (the null block)
    slot_of = lambda row, pos: int(tables[row, pos // bs]) * bs + pos % bs
    # the live rows: a step row at position 20 of sequence 1, then 8 tokens of sequence 2 at positions 3..10
    slots = np.array([-1] * lead + [slot_of(1, 20)] + [slot_of(2, 3 + i) for i in range(live_n - 1)] + [-1] * trail,
                     np.int32)
    lengths = np.array([1] * lead + [21] + [4 + i for i in range(live_n - 1)] + [1] * trail, np.int32)
    query_rows = np.array([0] * lead + [1] + [2] * (live_n - 1) + [0] * trail, np.int32)
    layout = np.array([14, 7, 11], np.int32)
    types = ["int32"] + [None] * 13 + ["int32"] * 4 + [None] * 8
    live = slice(lead, lead + live_n)

    def layer(a, b, valid_count=None, tail_x=None):
        caches = [np.random.default_rng(5).standard_normal((blocks, kh, bs, d), dtype=np.float32) for _ in range(2)]
        y = np.full((b - a, e), np.nan, np.float32)
        args = [layout, x[a:b], ln, eps, *mats, cos[a:b], sin[a:b], *caches, slots[a:b], lengths[a:b],
                query_rows[a:b], tables, wo, x[a:b] if tail_x is None else tail_x, ln, eps, wg, wu, wd, y]
        if valid_count is None:
            assert call_kernel(cpu_kernels.DECODE_LAYER, *args, dtypes=types) == 0
        else:
            assert call_kernel(cpu_kernels.DECODE_LAYER_VALID, np.array([valid_count], np.int32), *args,
                               dtypes=["int32"] + types) == 0
        return y, caches

    fresh = [np.random.default_rng(5).standard_normal((blocks, kh, bs, d), dtype=np.float32) for _ in range(2)]
    y, caches = layer(0, rows, count)
    if count is not None and count <= lead:  # every row idle or padding
        assert not y.any() and all(np.array_equal(c, f) for c, f in zip(caches, fresh))
        return
    end = rows if count is None else count
    want, want_caches = layer(lead, min(end, lead + live_n))
    assert np.array_equal(y[lead:lead + len(want)], want)
    assert not y[:lead].any() and not y[lead + len(want):].any()
    for got, ref in zip(caches, want_caches):
        assert np.array_equal(got, ref)
    if count is None:
        y2, _ = layer(0, rows, tail_x=x.copy())  # the tail's x not found as x: every row computed
        assert close(y2[live], want)


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_swiglu_and_projection_with_residual(rows):
    rng = np.random.default_rng(10 + rows)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    wg, wu = rng.standard_normal((300, 64), dtype=np.float32), rng.standard_normal((300, 64), dtype=np.float32)
    y = np.full((rows, 300), np.nan, np.float32)
    assert call_kernel(cpu_kernels.SWIGLU, x, wg, wu, y) == 0
    g, u = x.astype(np.float64) @ wg.T, x.astype(np.float64) @ wu.T
    assert close(y, g / (1 + np.exp(-g)) * u, np.abs(g).max() * np.abs(u).max())
    r = rng.standard_normal((rows, 300), dtype=np.float32)
    z = np.full_like(r, np.nan)
    assert call_kernel(cpu_kernels.GEMV_ADD, x, wg, r, z) == 0
    assert close(z, g + r, np.abs(g).max() + np.abs(r).max())
    assert call_kernel(cpu_kernels.GEMV_ADD, x, wg, r[:, :5], z) == 4


@pytest.mark.parametrize("rows", [1, 9, 16, 20, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_swiglu_at_a_real_models_width(rows, dtype):
    """SwiGLU over 4864 outputs (Qwen2-0.5B's MLP: a task of the AMX tiles' form is 144 outputs, longer than a GEMV
    task's 128) at a step's rows, a verify's (9), the GEMV form's last (16) and a prompt's: every output the numpy
    SwiGLU of the stored weights, and the product with a residual the same. (The up product's buffer was sized for
    128 outputs a task: at 9-16 rows with tiles it overflowed and rows overwrote each other's last outputs.)"""
    rng = np.random.default_rng(rows)
    inter, hidden = 4864, 896
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    (wg, wg64), (wu, wu64) = (stored(rng.standard_normal((inter, hidden), dtype=np.float32) * 0.05, dtype)
                              for _ in range(2))
    y = np.full((rows, inter), np.nan, np.float32)
    dtypes = [None, dtype, dtype, None]
    assert call_kernel(cpu_kernels.SWIGLU, x, wg, wu, y, dtypes=dtypes) == 0
    xc = x_as_computed(x, dtype).astype(np.float64)
    g, u = xc @ wg64.T, xc @ wu64.T
    bound = 1e-5 * (np.abs(xc) @ np.abs(wg64).T) * (np.abs(xc) @ np.abs(wu64).T).max()
    assert (np.abs(y - g / (1 + np.exp(-g)) * u) <= bound).all()
    r = rng.standard_normal((rows, inter), dtype=np.float32)
    z = np.full_like(r, np.nan)
    assert call_kernel(cpu_kernels.GEMV_ADD, x, wg, r, z, dtypes=[None, dtype, None, None]) == 0
    assert (np.abs(z - (g + r)) <= 1e-5 * (np.abs(xc) @ np.abs(wg64).T) + 1e-6 * np.abs(r)).all()


ATTENTION_TYPES = [None, None, None, "int32", "int32", "int32", None]


def test_decode_attention_reads_each_sequences_blocks_in_place_with_gqa():
    """Query i over the first lengths[i] positions of the blocks its table lists, read where they are (shuffled
    blocks; positions past a length and blocks no table lists are NaN: never read); wrong dtypes (2) and a table
    entry outside the pool (4) are refused."""
    rng = np.random.default_rng(7)
    b, h, kh, s, d, bs = 2, 6, 2, 40, 16, 8
    q = rng.standard_normal((b, h * d), dtype=np.float32)
    k, v = (rng.standard_normal((b, kh, s, d), dtype=np.float32) for _ in range(2))
    valid = np.array([5, 33], np.int32)
    k[0, :, 5:] = v[0, :, 5:] = np.nan  # past row 0's length: must not be read
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    out = np.full_like(q, np.nan)
    rows = np.arange(b, dtype=np.int32)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, tables, out,
                       dtypes=ATTENTION_TYPES) == 0
    check_attention(out, q, k, v, valid, rows)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, tables, out) == 2  # int32 inputs
    bad = tables.copy()
    bad[1, 2] = kp.shape[0]  # a block past the pool, inside row 1's length
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, bad, out, dtypes=ATTENTION_TYPES) == 4
    long = valid.copy()
    long[0] = tables.shape[1] * bs + 1  # longer than its table reaches
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, long, rows, tables, out, dtypes=ATTENTION_TYPES) == 4


def repage(contiguous, tables, block_size, blocks):
    """Caches per sequence [R, KH, S, D] into a pool of `blocks` blocks through the given tables (NaN elsewhere)."""
    r, kh, s, d = contiguous.shape
    pool = np.full((blocks, kh, block_size, d), np.nan, np.float32)
    for row in range(r):
        for j in range(tables.shape[1]):
            part = contiguous[row, :, j * block_size:(j + 1) * block_size]
            pool[tables[row, j], :, :part.shape[1]] = part
    return pool


def check_attention(out, q, k, v, valid, rows):
    """Each query row i of `out` against float64 softmax attention over positions [0, valid[i]) of sequence rows[i]
    (k, v given per sequence: [R, KH, S, D]), query head h reading kv head h // (H / KH)."""
    kh, d = k.shape[1], k.shape[3]
    h = q.shape[1] // d
    for i, (row, n) in enumerate(zip(rows, valid)):
        for head in range(h):
            kv = head // (h // kh)
            qh = q[i, head * d:(head + 1) * d].astype(np.float64)
            scores = k[row, kv, :n].astype(np.float64) @ qh / np.sqrt(d)
            p = np.exp(scores - scores.max())
            ref = (p / p.sum()) @ v[row, kv, :n].astype(np.float64)
            assert close(out[i, head * d:(head + 1) * d], ref, np.nanmax(np.abs(v)))


def test_attention_rows_read_the_sequence_each_query_names():
    """The chunk graph's form: query i reads the sequence whose table is tables[rows[i]] up to lengths[i]; the step's
    rows and a piece's tokens, which all read one sequence at growing lengths, in one call; an idle row reads the
    null block (length 1, a table of zeros)."""
    rng = np.random.default_rng(8)
    b, h, kh, s, d, bs = 3, 4, 2, 32, 8, 4
    k, v = (rng.standard_normal((b, kh, s, d), dtype=np.float32) for _ in range(2))
    rows = np.array([0, 1, 2, 3, 1, 1, 1], np.int32)  # four step rows (3: idle), then three piece tokens of row 1
    valid = np.array([4, 9, 1, 1, 10, 11, 12], np.int32)
    q = rng.standard_normal((len(rows), h * d), dtype=np.float32)
    k[1, :, 12:] = v[1, :, 12:] = np.nan  # past the longest query of row 1: never read
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    kp[0] = vp[0] = 0.0  # the null block: what an idle row reads
    tables = np.concatenate([tables, np.zeros((1, tables.shape[1]), np.int32)])
    out = np.full_like(q, np.nan)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, tables, out,
                       dtypes=ATTENTION_TYPES) == 0
    check_attention(out[:3], q[:3], k, v, valid[:3], rows[:3])
    check_attention(out[4:], q[4:], k, v, valid[4:], rows[4:])
    assert np.array_equal(out[3], np.zeros_like(out[3]))
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows[:5], tables, out,
                       dtypes=ATTENTION_TYPES) == 4


@pytest.mark.parametrize("d, bs", [(64, 64), (128, 16), (80, 128)])
def test_attention_of_prompts_at_real_head_sizes(d, bs):
    """The CPU prefill graph's form at Qwen's head sizes (64, 128; 80: a size not a multiple of the 32-value output
    blocks), in blocks of 16, 64 and 128: two rows' prompts, each token reading its own sequence up to its position
    (blocks of 8 queries of one row), GQA 7:1 as the 0.5B shape's; scores large enough that most of each softmax
    underflows to zero."""
    rng = np.random.default_rng(d)
    h, kh, s, lengths = 14, 2, 320, (300, 45)
    k, v = (rng.standard_normal((2, kh, s, d), dtype=np.float32) for _ in range(2))
    rows = np.concatenate([np.full(n, r, np.int32) for r, n in enumerate(lengths)])
    valid = np.concatenate([np.arange(1, n + 1, dtype=np.int32) for n in lengths])
    q = (rng.standard_normal((len(rows), h * d)) * np.where(np.arange(len(rows)) % 3 == 0, 8.0, 1.0)[:, None]
         ).astype(np.float32)
    for r, n in enumerate(lengths):
        k[r, :, n:] = v[r, :, n:] = np.nan  # past each row's prompt: never read
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    out = np.full_like(q, np.nan)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, tables, out,
                       dtypes=ATTENTION_TYPES) == 0
    check_attention(out, q, k, v, valid, rows)


@pytest.mark.parametrize("h, kh", [(9, 3), (14, 2)])
def test_a_querys_attention_alone_is_its_attention_among_a_prompts(h, kh):
    """A query's output is the same bit for bit whether it runs alone (a decode step's row) or among a piece's
    queries (a verify's 9, a prompt's 70 after a cached context of 130), whichever rows share its task: the value
    rows' weighted sum takes several query rows at once on some paths, each row's sums in the one-row order.
    SmolLM2's heads (9 over 3) and Qwen2-0.5B's (14 over 2); head size 64, blocks of 64 positions."""
    rng = np.random.default_rng(h)
    d, bs, ctx, n = 64, 64, 130, 70
    k, v = (rng.standard_normal((1, kh, ctx + n, d), dtype=np.float32) for _ in range(2))
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    q = rng.standard_normal((n, h * d), dtype=np.float32)
    valid = np.arange(ctx + 1, ctx + n + 1, dtype=np.int32)
    for m in (9, n):
        together = np.full((m, h * d), np.nan, np.float32)
        assert call_kernel(cpu_kernels.DECODE_ATTENTION, q[:m], kp, vp, valid[:m], np.zeros(m, np.int32), tables,
                           together, dtypes=ATTENTION_TYPES) == 0
        for i in range(m):
            alone = np.full((1, h * d), np.nan, np.float32)
            assert call_kernel(cpu_kernels.DECODE_ATTENTION, q[i:i + 1], kp, vp, valid[i:i + 1],
                               np.zeros(1, np.int32), tables, alone, dtypes=ATTENTION_TYPES) == 0
            assert np.array_equal(alone[0], together[i]), (m, i)
    check_attention(together, q, k, v, valid, np.zeros(n, np.int32))


@pytest.mark.parametrize("h, kh, ctx, bs", [(9, 3, 505, 64), (14, 2, 1020, 64), (9, 3, 1530, 16)])
def test_a_verifys_query_is_its_step_past_a_chunks_edge(h, kh, ctx, bs):
    """Past 512 positions a decode step's query is read in chunks whose sums are merged (AttentionJob::split); the
    queries of a verify (9 after `ctx`, across the edge of a chunk: 512, 1024, 1536) are chunked the same way, and a
    query of one chunk ends as the merge does, so each query's output is the same bit for bit as a step's of the same
    length (speculative decoding's greedy tokens rest on it). SmolLM2's and Qwen2-0.5B's heads, head size 64."""
    rng = np.random.default_rng(ctx)
    d, n = 64, 9
    k, v = (rng.standard_normal((1, kh, ctx + n, d), dtype=np.float32) for _ in range(2))
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    q = rng.standard_normal((n, h * d), dtype=np.float32)
    valid = np.arange(ctx + 1, ctx + n + 1, dtype=np.int32)
    rows = np.zeros(n, np.int32)
    together = np.full((n, h * d), np.nan, np.float32)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, valid, rows, tables, together,
                       dtypes=ATTENTION_TYPES) == 0
    for i in range(n):
        alone = np.full((1, h * d), np.nan, np.float32)
        assert call_kernel(cpu_kernels.DECODE_ATTENTION, q[i:i + 1], kp, vp, valid[i:i + 1], rows[:1], tables, alone,
                           dtypes=ATTENTION_TYPES) == 0
        assert np.array_equal(alone[0], together[i]), i
    check_attention(together, q, k, v, valid, rows)


@pytest.mark.parametrize("bs", [64, 16, 512])
def test_decode_attention_over_long_contexts_in_chunks(bs):
    """A decode step's long contexts, split into chunks of positions whose softmax sums are merged (attention.cc
    AttentionJob::split): SmolLM2's GQA 9:3 at head size 64; contexts one position either side of a chunk's edge, a
    long one whose largest score is in its last chunk and one whose largest is in its first, a context of one
    position, and an idle row (length 0: zeros); positions past each length are NaN (never read)."""
    rng = np.random.default_rng(bs)
    h, kh, d, s = 9, 3, 64, 1100
    lengths = np.array([1100, 513, 512, 1, 0, 700], np.int32)
    b = len(lengths)
    k, v = (rng.standard_normal((b, kh, s, d), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((b, h * d), dtype=np.float32)
    k[0, :, 1090] = 6.0 * q[0].reshape(h, d)[::h // kh]  # row 0: the spike in its last chunk
    k[5, :, 3] = 6.0 * q[5].reshape(h, d)[::h // kh]  # row 5: in its first
    for r, n in enumerate(lengths):
        k[r, :, n:] = v[r, :, n:] = np.nan
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    rows = np.arange(b, dtype=np.int32)
    out = np.full_like(q, np.nan)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, kp, vp, lengths, rows, tables, out,
                       dtypes=ATTENTION_TYPES) == 0
    live = lengths > 0
    check_attention(out[live], q[live], k[live], v[live], lengths[live], np.arange(int(live.sum())))
    assert np.array_equal(out[4], np.zeros_like(out[4]))


@pytest.mark.parametrize("bias", [False, True])
def test_gemm_over_the_prompt_rows_only(bias):
    """The full graph's matmul: rows of n tokens, right-padded; each row's first valid_length tokens are computed
    (the GEMM form for 20, the GEMV one for 3), the padding rows are zero, even where x holds garbage."""
    rng = np.random.default_rng(7)
    batch, n, e, o = 2, 24, 64, 40
    x = rng.standard_normal((batch * n, e), dtype=np.float32)
    w, b = rng.standard_normal((o, e), dtype=np.float32), rng.standard_normal(o, dtype=np.float32)
    valid = np.array([20, 3], np.int32)
    y = np.full((batch * n, o), np.nan, np.float32)
    args = (x, w, b, valid, y) if bias else (x, w, valid, y)
    names = ["int32" if a is valid else "float32" for a in args]
    assert call_kernel(cpu_kernels.GEMM_VALID, *args, dtypes=names) == 0
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    for r, used in enumerate(valid):
        rows = slice(r * n, r * n + used)
        assert close(y[rows], ref[rows])
        assert not y[r * n + used:(r + 1) * n].any()
    three = ["float32", "float32", "int32", "float32"]
    assert call_kernel(cpu_kernels.GEMM_VALID, x, w, np.arange(5, dtype=np.int32), y, dtypes=three) == 4  # 48 rows
    assert call_kernel(cpu_kernels.GEMM_VALID, x, w, valid.astype(np.int64), y,
                       dtypes=["float32", "float32", "int64", "float32"]) == 2


# ---- quantized weights: each op given q, scale[, offset] as export/network/layers.py Linear.weights() passes them --------

def _quantized(rng, w: np.ndarray, bits: int, group: int, offset: bool):
    """(tensors the op takes for W [O, I], the float32 W they stand for): q int8 [O, I] or int4 uint8 [O, I/2] (low
    nibble first), scale [G, O] float32 and, with offset, offset [G, O]; W = (q + offset) * scale."""
    from test_quant_kernels import dequantize, pack_int4

    o, i = w.shape
    g = group or i
    lo = -(1 << (bits - 1))
    q = rng.integers(lo, -lo, (o, i)).astype(np.int8)
    scale = np.ascontiguousarray(np.abs(w).reshape(o, i // g, g).max(-1).T / -lo + 1e-3, np.float32)  # [G, O]
    off = rng.uniform(-1, 1, scale.shape).astype(np.float32) if offset else None
    stored = q if bits == 8 else pack_int4(q)
    tensors = [stored, scale] + ([off] if offset else [])
    return tensors, dequantize(stored, scale, off).astype(np.float32)


@pytest.mark.parametrize("bits,group,offset,rows,mode", [(8, 0, False, 1, "int16"), (4, 32, True, 1, "int16"),
                                                          (4, 0, False, 3, "int16"), (4, 0, False, 3, "int8"),
                                                          (4, 64, True, 2, "int8"), (8, 64, True, 20, "int16"),
                                                          (4, 32, False, 20, "int16")])
def test_fused_ops_take_quantized_weights(bits, group, offset, rows, mode):
    """Every fused op with int8/int4 weights (per channel or in groups, with or without offsets; the decode form up to
    16 rows, the buffered GEMM beyond) against the same op on the float32 weights they stand for: within the decode
    form's rounding of x (matmul_quant.cc; test_quant_kernels.int16_rounding bounds one matmul): in int16 mode
    (set_quant_activations("int16")) a loose 2e-4 of each output's scale through the norms and SiLU; in the default
    mode, where int4 weights whose inputs are a multiple of 64 and group 32 or a multiple of 64 take x in int8 (its
    exact rounding is test_quant_kernels' int8_activation_cases), 2e-2 (x's int8 rounding moves these outputs up to 0.6
    % of their scale). Exact codes for a scale of the wrong shape."""
    assert cpu_kernels.set_quant_activations(mode) == mode
    try:
        _fused_ops_take_quantized_weights(bits, group, offset, rows, 2e-4 if mode == "int16" else 2e-2)
    finally:
        cpu_kernels.set_quant_activations(None)


def _fused_ops_take_quantized_weights(bits, group, offset, rows, rel):
    rng = np.random.default_rng(bits * 100 + group + rows)
    e, h, kh, d, inter, s, eps = 128, 4, 2, 32, 192, 24, 1e-6
    f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    eps_t = np.array([eps], np.float32)
    x, ln = f32(rows, e), (1 + 0.1 * f32(e)).astype(np.float32)
    weights = {name: _quantized(rng, 0.1 * f32(*shape), bits, group, offset)
               for name, shape in (("q", (h * d, e)), ("k", (kh * d, e)), ("v", (kh * d, e)), ("o", (e, h * d)),
                                   ("g", (inter, e)), ("u", (inter, e)), ("d", (e, inter)))}
    quant = {n: t for n, (t, _) in weights.items()}
    plain = {n: [w] for n, (_, w) in weights.items()}
    biases = [f32(h * d), f32(kh * d), f32(kh * d)]
    angle = rng.uniform(0, 6, (rows, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)

    def run(function, out_shapes, build):
        """The op on quantized and on float weights: (outputs, outputs) after checking both return 0."""
        results = []
        for ws in (quant, plain):
            outs = [np.full(shape, np.nan, np.float32) for shape in out_shapes]
            args, types = build(ws)
            names = [t or str(a.dtype) for t, a in zip(types or [None] * len(args), args)] + ["float32"] * len(outs)
            assert call_kernel(function, *args, *outs, dtypes=names) == 0, function
            results.append(outs)
        return results

    def agree(got, want, what):
        tol = rel * np.abs(want).max() + 1e-6
        assert np.abs(got - want).max() <= tol, f"{what}: {np.abs(got - want).max()} > {tol}"

    qkv = lambda ws: [t for n, b in zip("qkv", biases) for t in ws[n] + [b]]  # noqa: E731
    got, want = run(cpu_kernels.QKV_ROPE, [(rows, h * d), (rows, kh * d), (rows, kh * d)],
                    lambda ws: ([x] + qkv(ws) + [cos, sin], None))
    for a, b, what in zip(got, want, "qkv"):
        agree(a, b, f"qkv_rope {what}")
    caches = {}

    def decode_qkv_args(ws):
        caches[id(ws)] = [np.zeros((rows + 1, kh, s, d), np.float32) for _ in range(2)]  # blocks of s positions
        slots = (np.arange(rows, dtype=np.int32)[::-1] + 1) * s + 3  # each row's position 3, in blocks rows..1
        args = [x, ln, eps_t] + qkv(ws) + [cos, sin] + caches[id(ws)] + [slots.astype(np.int32)]
        return args, [None] * (len(args) - 1) + ["int32"]
    got, want = run(cpu_kernels.DECODE_QKV, [(rows, h * d)], decode_qkv_args)
    agree(got[0], want[0], "decode_qkv q")
    for a, b in zip(caches[id(quant)], caches[id(plain)]):
        agree(a, b, "decode_qkv cache")
    attn, r = f32(rows, h * d), f32(rows, e)
    got, want = run(cpu_kernels.GEMV_ADD, [(rows, e)], lambda ws: ([attn] + ws["o"] + [r], None))
    agree(got[0], want[0], "gemv_add")
    got, want = run(cpu_kernels.SWIGLU, [(rows, inter)], lambda ws: ([x] + ws["g"] + ws["u"], None))
    agree(got[0], want[0], "swiglu")
    got, want = run(cpu_kernels.NORM_SWIGLU, [(rows, inter)], lambda ws: ([x, ln, eps_t] + ws["g"] + ws["u"], None))
    agree(got[0], want[0], "norm_swiglu")
    got, want = run(cpu_kernels.DECODE_TAIL, [(rows, e)],
                    lambda ws: ([attn] + ws["o"] + [r, ln, eps_t] + ws["g"] + ws["u"] + ws["d"], None))
    agree(got[0], want[0], "decode_tail")
    # a scale of the wrong shape is refused (4); a count that fits no arity (1)
    y = np.zeros((rows, e), np.float32)
    bad = [attn, quant["o"][0], quant["o"][1][:, :-1]] + quant["o"][2:] + [r, y]
    assert call_kernel(cpu_kernels.GEMV_ADD, *bad, dtypes=[str(a.dtype) for a in bad]) == 4
    short = [attn, quant["o"][0], r, y]
    assert call_kernel(cpu_kernels.GEMV_ADD, *short, dtypes=[str(a.dtype) for a in short]) == 1


def bf16_pool(pool):
    """A float32 cache pool as a bfloat16 one: (its values rounded to nearest even as the kernels write them, as
    float32; the bfloat16 bits, uint16). NaN stays NaN."""
    from export.checkpoints.safetensors import bf16_bits, widen

    bits = bf16_bits(pool)
    return widen(bits), bits


BF16_ATTENTION_TYPES = [None, "bfloat16", "bfloat16", "int32", "int32", "int32", None]


@pytest.mark.parametrize("h, kh, d, bs, lengths, piece", [
    (9, 3, 64, 64, (1100, 513, 1, 0, 300), 0),  # SmolLM2's decode step: long contexts in chunks, an idle row
    (14, 2, 64, 16, (130,), 70),  # Qwen2-0.5B's heads: a piece of 70 after 130 (blocks of queries)
    (4, 4, 80, 128, (45, 7), 0),  # MHA (one query row a task), a head size not a multiple of the 32-value blocks
    (28, 4, 128, 64, (600,), 9),  # a 7B shape's heads: a verify of 9 after 600
])
def test_a_bfloat16_cache_is_attended_as_a_float32_cache_of_its_values(h, kh, d, bs, lengths, piece):
    """The attention over bfloat16 caches (a folder with bfloat16 weights keeps its KV cache so: cpu_kernels/paged.h)
    computes bit for bit what it computes over float32 caches holding the same, rounded, values: each block is widened
    exactly before the same kernels read it. Under both names (MsliteLlmPagedAttention and its Kv16 twin); caches of
    two dtypes are refused (2)."""
    rng = np.random.default_rng(h * d + bs)
    s = max(lengths) + piece
    k, v = (rng.standard_normal((len(lengths), kh, s, d), dtype=np.float32) for _ in range(2))
    if piece:  # one sequence: its context, then a piece's tokens each reading up to itself
        rows = np.zeros(piece, np.int32)
        valid = np.arange(lengths[0] + 1, lengths[0] + piece + 1, dtype=np.int32)
    else:
        rows = np.arange(len(lengths), dtype=np.int32)
        valid = np.array(lengths, np.int32)
    for r in range(len(lengths)):
        k[r, :, int(valid[rows == r].max(initial=0)):] = np.nan  # past the longest query of each row: never read
    kp, tables = paged(k, bs, rng)
    vp = repage(v, tables, bs, kp.shape[0])
    (k32, k16), (v32, v16) = bf16_pool(kp), bf16_pool(vp)
    q = rng.standard_normal((len(rows), h * d), dtype=np.float32)
    want = np.full_like(q, np.nan)
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, k32, v32, valid, rows, tables, want,
                       dtypes=ATTENTION_TYPES) == 0
    for name in (cpu_kernels.DECODE_ATTENTION, cpu_kernels.KV16_OPS[cpu_kernels.DECODE_ATTENTION]):
        got = np.full_like(q, np.nan)
        assert call_kernel(name, q, k16, v16, valid, rows, tables, got, dtypes=BF16_ATTENTION_TYPES) == 0
        assert np.array_equal(got, want), name
    live = valid > 0
    check_attention(want[live], q[live], bf16_pool(k)[0], bf16_pool(v)[0], valid[live], rows[live])
    mixed = [None, None, "bfloat16", "int32", "int32", "int32", None]
    assert call_kernel(cpu_kernels.DECODE_ATTENTION, q, k32, v16, valid, rows, tables, got, dtypes=mixed) == 2


def test_bfloat16_caches_are_written_rounded_to_nearest_even():
    """MsliteLlmWriteCache and MsliteLlmPagedDecodeQkv into bfloat16 caches: each written key and value is the float32
    one the float32 caches get, rounded to nearest even (ties to the even one, as torch's and MindSpore's Cast); a
    negative slot writes nothing; nothing else of the caches changes."""
    from export.checkpoints.safetensors import bf16_bits

    rng = np.random.default_rng(11)
    nb, kh, bs, d = 5, 2, 4, 8
    k, v = (rng.standard_normal((3, kh * d), dtype=np.float32) for _ in range(2))
    k.view(np.uint32)[0, :4] = (k.view(np.uint32)[0, :4] & 0xFFFF0000) | 0x8000  # exact ties: odd and even
    k.view(np.uint32)[0, 1] |= 0x10000
    slots = np.array([13, -1, 4], np.int32)
    flag = np.zeros(1, np.float32)
    caches = [rng.integers(0, 1 << 16, (nb, kh, bs, d)).astype(np.uint16) for _ in range(2)]
    before = [c.copy() for c in caches]
    types = [None, None, "bfloat16", "bfloat16", "int32", None]
    for name in (cpu_kernels.WRITE_CACHE, cpu_kernels.KV16_OPS[cpu_kernels.WRITE_CACHE]):
        caches = [c.copy() for c in before]
        assert call_kernel(name, k, v, *caches, slots, flag, dtypes=types) == 0
        for cache, old, new in zip(caches, before, (k, v)):
            want = old.copy()
            for i, slot in enumerate(slots):
                if slot >= 0:
                    want[slot // bs, :, slot % bs] = bf16_bits(new[i]).reshape(kh, d)
            assert np.array_equal(cache, want), name
    assert call_kernel(cpu_kernels.WRITE_CACHE, k, v, caches[0], caches[1].view(np.float16), slots, flag,
                       dtypes=[None, None, "bfloat16", "float16", "int32", None]) == 2

    # the decode step's op: the same q, and the float32 caches' writes rounded
    e, h = 32, 4
    x = rng.standard_normal((3, e), dtype=np.float32)
    ln = np.ones(e, np.float32)
    mats = [t for o in (h * d, kh * d, kh * d) for t in (rng.standard_normal((o, e), dtype=np.float32),
                                                         rng.standard_normal(o, dtype=np.float32))]
    angle = rng.uniform(0, 6, (3, d // 2)).astype(np.float32)
    cos, sin = np.cos(np.tile(angle, 2)).astype(np.float32), np.sin(np.tile(angle, 2)).astype(np.float32)
    eps = np.array([1e-6], np.float32)
    f32 = [np.zeros((nb, kh, bs, d), np.float32) for _ in range(2)]
    b16 = [np.zeros((nb, kh, bs, d), np.uint16) for _ in range(2)]
    q32, q16 = (np.full((3, h * d), np.nan, np.float32) for _ in range(2))
    assert call_kernel(cpu_kernels.DECODE_QKV, x, ln, eps, *mats, cos, sin, *f32, slots, q32,
                       dtypes=[None] * 13 + ["int32", None]) == 0
    assert call_kernel(cpu_kernels.KV16_OPS[cpu_kernels.DECODE_QKV], x, ln, eps, *mats, cos, sin, *b16, slots, q16,
                       dtypes=[None] * 11 + ["bfloat16", "bfloat16", "int32", None]) == 0
    assert np.array_equal(q16, q32)
    for got, full in zip(b16, f32):
        assert np.array_equal(got, bf16_bits(full))
