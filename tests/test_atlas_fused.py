"""The Atlas fused graph form (--graph fused): each CPU stand-in against a numpy implementation of its op's documented
formula, fused folders of every family checked on the CPU against their golden references and HF, fused and plain
folders of one checkpoint giving the same tokens, deliberate wiring errors failing check, and the refusals.

The stand-ins (cpu_kernels/atlas_ops.cc) prove the graphs' wiring, not Ascend's kernels: `check` on the device does.
"""
from __future__ import annotations

import ctypes
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library_path() is None, reason="the CPU kernel library is not built")

RNG = np.random.default_rng(7)


def _call(function: str, arrays):
    """Call a stand-in as MindSpore's aot runtime does: (nparam, params, ndims, shapes, dtypes). Returns its code."""
    lib = ctypes.CDLL(cpu_kernels.library_path())
    names = {np.float16: "float16", np.float32: "float32", np.int64: "int64", np.int32: "int32", np.bool_: "bool",
             np.int8: "int8", np.uint8: "uint8"}
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_arrays = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                     for s in shape_arrays])
    dtypes = (ctypes.c_char_p * n)(*[names[a.dtype.type].encode() for a in arrays])
    return getattr(lib, function)(n, params, ndims, shapes, dtypes, None, None)


def _attention(q, k, v, keep, scale):
    """softmax(scale * q.k^T where keep) . v per (row, head), float32, GQA: query head h reads kv head h // G."""
    b, h, sq, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((b, h, sq, d), np.float32)
    for r in range(b):
        for head in range(h):
            s = (q[r, head].astype(np.float32) @ k[r, head // g].astype(np.float32).T) * scale
            s = np.where(keep[r], s, -np.inf)
            rows = keep[r].any(-1)
            top = np.where(rows, s.max(-1, initial=-np.inf, where=keep[r]), 0)[:, None]
            p = np.where(keep[r], np.exp(np.where(keep[r], s, 0) - top), 0)
            p[rows] /= p[rows].sum(-1, keepdims=True)
            out[r, head] = p @ v[r, head // g].astype(np.float32)
    return out


@pytest.mark.parametrize("lengths", [(1, 9), (9, 9), (5, 3)])
def test_prompt_flash_attention_standin_against_numpy(lengths):
    """GQA 7:1, right-padded rows of different lengths (1 and full among them), sparse_mode 3 with the compressed
    mask: row i of a prompt sees keys 0..i of that prompt; rows past the prompt are zeros."""
    b, h, kh, s, d = 2, 7, 1, 9, 16
    q, k, v = (RNG.standard_normal(shape).astype(np.float16) for shape in ((b, h, s, d), (b, kh, s, d), (b, kh, s, d)))
    mask = np.triu(np.ones((2048, 2048), np.bool_), 1)
    lens = np.array(lengths, np.int64)
    attrs = np.array([0.25, 3, 2147483647, 0], np.float32)
    out = np.zeros_like(q)
    assert _call("MsliteLlmAtlasPromptFlashAttention", [q, k, v, mask, lens, lens, attrs, out]) == 0
    pos = np.arange(s)
    keep = np.stack([(pos[None] <= pos[:, None]) & (pos[None] < n) & (pos[:, None] < n) for n in lengths])
    want = _attention(q, k, v, keep, 0.25)
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    for r, n in enumerate(lengths):
        assert not out[r, :, n:].any()


def test_prompt_flash_attention_standin_refuses_another_mask():
    """sparse_mode 3 reads the documented compressed mask only: any other is code 7, not silently ignored."""
    q = np.zeros((1, 2, 4, 16), np.float16)
    mask = np.tril(np.ones((2048, 2048), np.bool_))
    lens = np.array([4], np.int64)
    attrs = np.array([1.0, 3, 2147483647, 0], np.float32)
    assert _call("MsliteLlmAtlasPromptFlashAttention", [q, q, q, mask, lens, lens, attrs, np.zeros_like(q)]) == 7


def test_reshape_and_cache_standin_writes_each_token_at_its_slot_and_skips_negative_ones():
    """ReshapeAndCache: token t's key and value at block slot // BS, position slot % BS of caches [NB, BS, KVN, D], in
    place; a negative slot (padding, an idle row) is not written; the output is the key; a slot past the pool is
    refused (4) before anything is written."""
    nb, bs, kh, d = 4, 4, 2, 16
    kc, vc = (RNG.standard_normal((nb, bs, kh, d)).astype(np.float16) for _ in range(2))
    old = kc.copy(), vc.copy()
    key, value = (RNG.standard_normal((3, kh * d)).astype(np.float16) for _ in range(2))
    slots = np.array([9, -1, 2], np.int32)
    out = np.zeros_like(key)
    assert _call("MsliteLlmAtlasReshapeAndCache", [key, value, kc, vc, slots, out]) == 0
    np.testing.assert_array_equal(out, key)
    for cache, before, new in ((kc, old[0], key), (vc, old[1], value)):
        want = before.copy()
        want[2, 1], want[0, 2] = new[0].reshape(kh, d), new[2].reshape(kh, d)
        np.testing.assert_array_equal(cache, want)
    kept = kc.copy()
    assert _call("MsliteLlmAtlasReshapeAndCache", [key, value, kc, vc, np.array([0, 16, 1], np.int32), out]) == 4
    np.testing.assert_array_equal(kc, kept)


@pytest.mark.parametrize("lengths", [(1, 12), (12, 5)])
def test_paged_attention_standin_against_numpy(lengths):
    """PagedAttention: query t over positions 0 .. context_lens[t] - 1 of its sequence, position p in block
    block_tables[t][p // BS] (shuffled blocks), GQA 7:1; blocks no table lists hold NaN (never read); attributes
    that disagree with the shapes are refused (6)."""
    t, h, kh, bs, d = 2, 14, 2, 4, 32
    s = 12
    m = s // bs
    k, v = (RNG.standard_normal((t, kh, s, d)).astype(np.float16) for _ in range(2))
    tables = RNG.permutation(np.arange(1, 1 + t * m)).reshape(t, m).astype(np.int32)
    kc, vc = (np.full((1 + t * m + 1, bs, kh, d), np.nan, np.float16) for _ in range(2))
    for r in range(t):
        for j in range(m):
            kc[tables[r, j]] = k[r, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
            vc[tables[r, j]] = v[r, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
    q = RNG.standard_normal((t, h, d)).astype(np.float16)
    out = np.zeros_like(q)
    attrs = np.array([h, d ** -0.5, kh], np.float32)
    lens = np.array(lengths, np.int32)
    assert _call("MsliteLlmAtlasPagedAttention", [q, kc, vc, tables, lens, attrs, out]) == 0
    keep = np.stack([(np.arange(s) < n)[None] for n in lengths])
    want = _attention(q[:, :, None], k, v, keep, d ** -0.5)[:, :, 0]
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    assert _call("MsliteLlmAtlasPagedAttention", [q, kc, vc, tables, lens, np.array([h, 1.0, 1], np.float32),
                                                  out]) == 6


def test_norm_and_rotary_standins_against_numpy():
    """RmsNorm: y = x * rstd * gamma, rstd = 1/sqrt(mean(x^2) + eps) float32 [..., 1]; AddRmsNorm the same on
    x1 + x2 (also returned); RotaryPositionEmbedding mode 0 = x * cos + rotate_half(x) * sin, cos [1, 1, S, D]."""
    x1, x2 = (RNG.standard_normal((2, 3, 64)).astype(np.float16) for _ in range(2))
    gamma = RNG.standard_normal(64).astype(np.float16)
    eps = np.array([1e-5], np.float32)
    y, rstd = np.zeros_like(x1), np.zeros((2, 3, 1), np.float32)
    assert _call("MsliteLlmAtlasRmsNorm", [x1, gamma, eps, y, rstd]) == 0
    x32 = x1.astype(np.float32)
    want_rstd = 1 / np.sqrt((x32 ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)
    np.testing.assert_allclose(y.astype(np.float32), x32 * want_rstd * gamma.astype(np.float32), rtol=2e-3, atol=2e-3)
    total = np.zeros_like(x1)
    assert _call("MsliteLlmAtlasAddRmsNorm", [x1, x2, gamma, eps, y, rstd, total]) == 0
    np.testing.assert_array_equal(total, x1 + x2)
    t32 = total.astype(np.float32)
    np.testing.assert_allclose(y.astype(np.float32), t32 / np.sqrt((t32 ** 2).mean(-1, keepdims=True) + 1e-5)
                               * gamma.astype(np.float32), rtol=2e-3, atol=2e-3)
    x = RNG.standard_normal((2, 4, 5, 16)).astype(np.float16)
    cos, sin = (RNG.standard_normal((1, 1, 5, 16)).astype(np.float16) for _ in range(2))
    out = np.zeros_like(x)
    assert _call("MsliteLlmAtlasRotaryPositionEmbedding", [x, cos, sin, np.array([0], np.float32), out]) == 0
    xf = x.astype(np.float32)
    rotated = np.concatenate([-xf[..., 8:], xf[..., :8]], -1)
    np.testing.assert_allclose(out.astype(np.float32), xf * cos.astype(np.float32) + rotated * sin.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


# ---- a mixture of experts' fused ops (export/network/moe.py FusedExperts) -----------------------------------------

def test_moe_gating_top_k_softmax_standin_against_numpy():
    """A float32 softmax over each row's experts, then its k largest in descending order, equal probabilities to the
    lower expert (torch.topk's order and the reference's); row_idx[i][j] = j * N + i, CANN's numbering; a k past the
    experts is refused (6)."""
    n, e, k = 5, 8, 3
    x = RNG.standard_normal((n, e)).astype(np.float32)
    x[1, [6, 2, 5]] = x[1].max() + 1  # three equal largest: 2, 5, 6 in that order
    y, idx, row = np.zeros((n, k), np.float32), np.zeros((n, k), np.int32), np.zeros((n, k), np.int32)
    assert _call("MsliteLlmAtlasMoeGatingTopKSoftmax", [x, np.array([k], np.float32), y, idx, row]) == 0
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(idx, want)
    assert idx[1].tolist() == [2, 5, 6]
    np.testing.assert_allclose(y, np.take_along_axis(p, want, -1), rtol=1e-6)
    np.testing.assert_array_equal(row, np.arange(n * k).reshape(k, n).T)
    assert _call("MsliteLlmAtlasMoeGatingTopKSoftmax", [x, np.array([e + 1], np.float32), y, idx, row]) == 6


def test_moe_init_routing_v2_standin_sorts_the_choices_by_expert_stably():
    """Dropless: choice (i, j), numbered i * k + j, stably sorted by expert; expanded_x[p] is the row of the p-th,
    expanded_row_idx[i * k + j] where choice (i, j) went (the direction MindSpore's drop/pad example shows); counts
    per expert (flag 2) or their running sums (flag 1); an expert id past expert_num refused (4), nothing written;
    drop/pad mode refused (6)."""
    n, k, h, e = 4, 2, 3, 5
    x = RNG.standard_normal((n, h)).astype(np.float16)
    chosen = np.array([[3, 0], [0, 3], [4, 0], [3, 1]], np.int32)

    def run(chosen, flag=2, drop_pad=0):
        outs = [np.zeros((n * k, h), np.float16), np.zeros(n * k, np.int32), np.zeros(e, np.int32),
                np.full(e, 7, np.int32)]
        attrs = np.array([0, 0, e, drop_pad, flag, 1], np.float32)
        return _call("MsliteLlmAtlasMoeInitRoutingV2", [x, chosen, attrs] + outs), outs

    code, (expanded, where, counts, before) = run(chosen)
    assert code == 0
    order = np.argsort(chosen.reshape(-1), kind="stable")
    assert order.tolist() == [1, 2, 5, 7, 0, 3, 6, 4]
    np.testing.assert_array_equal(expanded, x[order // k])
    np.testing.assert_array_equal(where[order], np.arange(n * k))
    np.testing.assert_array_equal(counts, np.bincount(chosen.reshape(-1), minlength=e))
    assert not before.any()
    code, (_, _, sums, _) = run(chosen, flag=1)
    assert code == 0 and sums.tolist() == np.cumsum(counts).tolist()
    bad = chosen.copy()
    bad[2, 1] = e
    code, (expanded, *_) = run(bad)
    assert code == 4 and not expanded.any()
    assert run(chosen, drop_pad=1)[0] == 6


def _int4_along_n(q: np.ndarray) -> np.ndarray:
    """int4 values [..., N] two per byte along N, the lower nibble first (MindSpore's qint4x2)."""
    u = (q.astype(np.int16) & 15).astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


@pytest.mark.parametrize("weights", ["float16", "int8_offset", "int4_groups"])
def test_grouped_matmul_v4_standin_against_numpy(weights):
    """Each expert's rows (consecutive, counts or running sums; an expert with none) times its [K, N] matrix: float16,
    int8 per channel with an offset, int4 per group of K ((w + offset) * scale, CANN's antiquant); rows past the
    groups are zeros; a group list past the rows is refused (4) before anything is written."""
    m, kk, nn, e = 7, 32, 6, 4
    counts = np.array([2, 0, 4, 1], np.int64)
    x = RNG.standard_normal((m, kk)).astype(np.float16)
    if weights == "float16":
        w = (RNG.standard_normal((e, kk, nn)) * 0.2).astype(np.float16)
        tensors, dense = [w], w.astype(np.float32)
    elif weights == "int8_offset":
        q = RNG.integers(-128, 128, (e, kk, nn)).astype(np.int8)
        scale = (RNG.random((e, nn)) * 0.01 + 0.001).astype(np.float16)
        offset = RNG.standard_normal((e, nn)).astype(np.float16)
        tensors = [q, scale, offset]
        dense = (q + offset.astype(np.float32)[:, None]) * scale.astype(np.float32)[:, None]
    else:
        q = RNG.integers(-8, 8, (e, kk, nn))
        scale = (RNG.random((e, 4, nn)) * 0.05 + 0.01).astype(np.float16)
        tensors = [_int4_along_n(q), scale]
        dense = q * np.repeat(scale.astype(np.float32), kk // 4, axis=1)

    def run(group_list, list_type=1):
        y = np.full((m, nn), np.nan, np.float16)
        w, *quant = tensors
        code = _call("MsliteLlmAtlasGroupedMatmulV4", [x, w, group_list] + quant
                     + [np.array([3, 0, list_type, 0], np.float32), y])
        return code, y

    code, y = run(counts)
    assert code == 0
    expert = np.repeat(np.arange(e), counts)
    want = np.stack([x[r].astype(np.float32) @ dense[expert[r]] for r in range(m)])
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    code, y_sums = run(np.cumsum(counts), list_type=0)
    assert code == 0 and np.array_equal(y_sums, y)
    fewer = np.array([2, 0, 2, 1], np.int64)
    code, y = run(fewer)
    assert code == 0 and not y[5:].any() and np.array_equal(y[:2], run(counts)[1][:2])
    code, y = run(np.array([2, 0, 4, 2], np.int64))
    assert code == 4 and np.isnan(y).all()


def test_moe_token_unpermute_standin_weighs_each_rows_choices():
    """out[i] = sum over j of permuted_tokens[sorted_indices[i * k + j]] * probs[i][j], float32 sums; as CANN's
    kernel, a term whose index is past the rows or whose probability is exactly 0 is skipped (a NaN row there does
    not reach the output); padded_mode is refused (6)."""
    n, k, h = 3, 2, 4
    tokens = RNG.standard_normal((n * k, h)).astype(np.float16)
    index = RNG.permutation(n * k).astype(np.int32)
    probs = RNG.random((n, k)).astype(np.float32)
    probs[0, 1] = 0
    tokens[index[1]] = np.nan
    index[2] = n * k  # row 1's first choice: past the rows

    def run(attrs=(0,)):
        out = np.zeros((n, h), np.float16)
        return _call("MsliteLlmAtlasMoeTokenUnpermute", [tokens, index, probs, np.array(attrs, np.float32), out]), out

    code, out = run()
    assert code == 0
    want = np.zeros((n, h), np.float32)
    for i in range(n):
        for j in range(k):
            if index[i * k + j] < n * k and probs[i, j]:
                want[i] += tokens[index[i * k + j]].astype(np.float32) * probs[i, j]
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    assert run((1,))[0] == 6


def test_the_layout_enum_is_mindspores():
    from mindspore.ops._utils.arg_handler import str_to_enum

    from lite_runtime.backends.standins import LAYOUT_BNSD

    assert str_to_enum("PromptFlashAttention", "input_layout", "BNSD") == LAYOUT_BNSD


# ---- fused folders, end to end on the CPU ------------------------------------------------------------------------

FUSED_OPS = {"PromptFlashAttention", "ReshapeAndCache", "PagedAttention", "RmsNorm", "AddRmsNorm",
             "RotaryPositionEmbedding"}


def _export(checkpoint: str, out: str, **kw):
    from export.config import ExportConfig
    from export.pipeline import run_export

    settings = dict(seq_length=32, batch_size=2, dtype="float16", device="atlas_800i_a2", prefill_buckets=(8,),
                    block_size=16)  # a sequence spans two blocks
    settings.update(kw)
    run_export(ExportConfig(checkpoint=checkpoint, output=out, name=os.path.basename(out), **settings))
    return out


def test_the_default_atlas_folder_is_fused_and_passes_check_with_stand_ins(atlas_exported):
    """Buckets, batch 2 with rows of different lengths, the chunk graph at offsets: every fused op substituted,
    PASS."""
    from lite_runtime.check import run_check

    report = run_check(atlas_exported["float16"], "ms")
    assert report.passed, report.verdict()
    assert report.graph == "fused" and set(report.standins) == FUSED_OPS
    assert {r.graph for r in report.rows} == {"prefill_8", "prefill_32", "chunk_32", "score_32"}
    assert "proves the graphs' wiring, not Ascend's kernels" in report.form_line()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_qwen3_and_llama_fused_folders_pass_check(family, tokenizer, tmp_path):
    """Qwen3's per-head q/k norms through RmsNorm on [B, n, H, D]; Llama with biases (attention_bias, mlp_bias)."""
    from export.checkpoints import random_checkpoint
    from lite_runtime.check import run_check

    extra = dict(head_dim=32) if family == "qwen3" else dict(attention_bias=True, mlp_bias=True)
    ckpt = random_checkpoint.make_checkpoint(str(tmp_path / "ckpt"), family=family, seed=3, **extra,
                                                tokenizer=None if family == "llama" else tokenizer)
    report = run_check(_export(ckpt, str(tmp_path / "fused")), "ms")
    assert report.passed, report.verdict()
    assert report.graph == "fused" and set(report.standins) == FUSED_OPS


def test_fused_and_plain_folders_give_the_same_greedy_tokens(atlas_exported):
    from lite_runtime import pipeline

    fused = pipeline("text_generation", model=atlas_exported["float16"], backend="ms")
    plain = pipeline("text_generation", model=atlas_exported["float16_plain"], backend="ms")
    for text in ("hello world", "the quick brown fox jumps", "a"):
        a = fused(text, max_new_tokens=12, do_sample=False)
        b = plain(text, max_new_tokens=12, do_sample=False)
        assert a == b
    assert set(fused.backend.standins) == FUSED_OPS and not plain.backend.standins


def _miswire_swap_kv(monkeypatch):
    import export.network.atlas_layers as layers

    qkv = layers.FusedDecoderLayer._qkv

    def swapped(self, *args):
        q, k, v = qkv(self, *args)
        return q, v, k

    monkeypatch.setattr(layers.FusedDecoderLayer, "_qkv", swapped)


def _miswire_scale(monkeypatch):
    import export.network.atlas_layers as layers

    monkeypatch.setattr(layers, "attention_scale", lambda d: 2.0 / d ** 0.5)


def _one_short(valid_length):  # module level, imports outside: MindSpore's graph compiler parses it
    return ops.cast(valid_length - 1, ms.int64)


def _miswire_length(monkeypatch):
    import export.network.model as model

    monkeypatch.setattr(model, "lengths_int64", _one_short)


@pytest.mark.parametrize("miswire", [_miswire_swap_kv, _miswire_scale, _miswire_length],
                         ids=["swapped_k_v", "wrong_scale", "length_off_by_one"])
def test_a_wrong_wiring_fails_check(miswire, checkpoints, tmp_path, monkeypatch):
    """What a stand-in would share with a mis-wired graph, the golden references (float32 numpy) do not."""
    from lite_runtime.check import run_check

    miswire(monkeypatch)
    report = run_check(_export(checkpoints["gqa_tied"], str(tmp_path / "bad")), "ms")
    assert not report.passed
    assert "greedy tokens diverge" in report.verdict()


def test_a_chunk_that_forgets_its_offset_fails_check(checkpoints, tmp_path, monkeypatch):
    """The chunk graph's PagedAttention told that the piece's sequence begins with the piece (its queries' context
    lengths without `start`): the prefill graphs pass and the chunk replay, which writes each prompt's second half
    from the middle, fails."""
    import export.network.atlas_layers as layers
    from mindspore import ops

    from lite_runtime.check import run_check

    chunk = layers.FusedDecoderLayer.chunk

    def without_start(self, x, cos, sin, ctx, b, n):
        lengths = ctx["lengths"]
        piece = lengths[b:] - lengths[b:b + 1] + 1  # 1..n: as if the piece started at position 0
        wrong = {"slots": ctx["slots"], "tables": ctx["tables"], "lengths": ops.cat((lengths[:b], piece))}
        return chunk(self, x, cos, sin, wrong, b, n)

    monkeypatch.setattr(layers.FusedDecoderLayer, "chunk", without_start)
    report = run_check(_export(checkpoints["gqa_tied"], str(tmp_path / "bad")), "ms")
    assert {r.graph for r in report.rows if not r.passed} == {"chunk_32", "score_32"}  # both take pieces at an offset
    assert {r.graph for r in report.rows if r.passed} == {"prefill_8", "prefill_32"}


@pytest.mark.parametrize("device, dtype, why", [
    ("atlas_800", "float16", "device profile 'atlas_800' (Ascend910A) has no fused attention operators we can use"),
    ("atlas_300i_duo", "float16",
     "device profile 'atlas_300i_duo' (Ascend310P): the 310P's PagedAttention and ReshapeAndCache keep the paged KV "
     "cache in the FRACTAL_NZ layout, which this export does not write; its folders take the plain form (the blocks "
     "through Gather and ScatterNdUpdate)"),
    ("atlas_800i_a2", "float32", "the fused attention operators take float16 or bfloat16, not float32"),
    ("cpu", "float32", "device profile 'cpu' (CPU) has no fused attention operators we can use"),
])
def test_graph_fused_where_it_cannot_run_is_refused(device, dtype, why, checkpoints, tmp_path, capsys):
    from export.__main__ import main

    code = main(["--checkpoint", checkpoints["gqa_tied"], "--output", str(tmp_path / "x"), "--device", device,
                 "--dtype", dtype, "--graph", "fused", "--seq_length", "16", "-q"])
    assert code == 2
    assert capsys.readouterr().err == f"error: --graph fused: {why}; export --graph plain\n"
    assert not os.path.exists(tmp_path / "x")


def test_auto_is_plain_where_the_fused_ops_cannot_run(checkpoints, tmp_path):
    """atlas_800 (910A) and float32 Atlas folders: the plain form, with nothing substituted at load."""
    import yaml

    out = _export(checkpoints["gqa_tied"], str(tmp_path / "a800"), device="atlas_800", prefill_buckets=())
    with open(os.path.join(out, "a800.yaml"), encoding="utf-8") as fh:
        assert yaml.safe_load(fh)["infer"]["graph"] == "plain"


def test_tiling_sink_is_on_exactly_where_the_fused_form_is_the_default():
    from export.devices import PROFILES

    for name, profile in PROFILES.items():
        with open(profile.ini_path, encoding="ascii") as fh:
            lines = [line.strip() for line in fh if not line.startswith("#")]
        assert ("ge.tiling_schedule_optimize=1" in lines) == profile.fused, name


def test_a_fused_folder_split_over_two_ranks_passes_check_under_msrun(checkpoints, tmp_path):
    """tp_size 2: each rank's fused graphs (its heads, vocab-parallel tables, AllReduce/AllGather in float16)."""
    from test_tensor_parallel import check_under_msrun

    folder = _export(checkpoints["gqa_tied"], str(tmp_path / "tpf"), prefill_buckets=(16,), tp_size=2)
    for log in check_under_msrun(tmp_path, folder).values():
        assert "PASS tpf on backend ms: 4 prompts, " in log  # tensor parallel: no chunk graph (not served)
        assert "graph form: fused; Ascend's fused operators ran as CPU stand-ins" in log


def test_a_fused_op_written_differently_is_refused_by_name(atlas_exported, tmp_path):
    """The stand-ins follow MindSpore 2.10's op definitions: a node with other inputs is a one-line error, not a
    wrong answer."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.backends import standins
    from lite_runtime.errors import InferError

    path = os.path.join(atlas_exported["float16"], "atlas_float16_inc_graph.mindir")
    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    prims = {p.name: p.op_type for p in model.primitives}
    node = next(n for n in model.graph.node if prims.get(n.op_type[len("REF::"):]) == "PagedAttention")
    node.input.append(node.input[-1])
    with pytest.raises(InferError) as err:
        standins.substitute(model, lambda f: f, path)
    assert str(err.value) == (f"{path}: PagedAttention has 17 inputs where MindSpore 2.10 writes 16; the CPU "
                              "stand-ins follow 2.10's definitions: re-export with mindspore 2.10 to check it here")
