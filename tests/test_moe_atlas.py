"""Mixture-of-experts folders for Atlas (issue 46): the fused form through Ascend's MoE operators
(MoeGatingTopKSoftmax, MoeInitRoutingV2, GroupedMatmulV4, MoeTokenUnpermute; export/network/moe.py FusedExperts),
float and quantized (GroupedMatmulV4's antiquant), of one rank and tensor parallel under msrun, and the plain form,
checked on the CPU through the ops' stand-ins (cpu_kernels/atlas_ops.cc, each tested against numpy in
tests/test_atlas_fused.py). The checkpoints' routers are made decisive so that a float16 replay judges every step:
with random routers most steps are routing near ties, which check reports and does not fail."""
from __future__ import annotations

import glob
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from export.__main__ import main
from export.checkpoints import open_checkpoint
from export.checkpoints.random_checkpoint import make_checkpoint
from export.config import ModelConfig
from export.network.layers import ew_mul, ew_silu
from test_atlas_fused import _export  # the fused tests' small Atlas export: float16, batch 2, blocks of 16
from test_moe import CASES, _folder_weights, _rank_weights, _stack


def decisive_routers(path: str, offset: float = 30.0) -> None:
    """Rewrites a random checkpoint (untied head) so that every routing is decisive. Each router becomes coefficients
    times one unit vector u shared by the layers (a permutation of -(E-1)/2 .. (E-1)/2 per layer), and each token's
    embedding row gains +-offset * u (a sign per token): a token's router logits are its projection on u times those
    coefficients, and that projection keeps its sign and stays far from 0 through the layers (the random layers add
    about unit-sized parts to each coordinate of the residual stream). A token picks the top k experts or the bottom
    k by that sign, the gap between the last chosen and the first one not chosen is one projection, 2 / (E - 1) of
    the largest logit's magnitude, and the reference's routing margin (export/writers/reference.py
    NumpyDecoder.routing: also relative to ||w_a - w_b|| ||h|| / sqrt(H), the gap's size for an h of no particular
    direction) is far from the near tie a float16 folder's check stops judging at (2x its 1e-2 limit). With random
    routers most steps of a float16 replay are near ties, and a miswired graph would pass as "reported, not
    failed"."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    u = None
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name.endswith(".mlp.gate.weight") or name == "model.embed_tokens.weight":
                if u is None:
                    u = rng.standard_normal(w.shape[1])
                    u /= np.linalg.norm(u)
            if name.endswith(".mlp.gate.weight"):
                coef = rng.permutation(np.arange(w.shape[0]) - (w.shape[0] - 1) / 2)
                tensors[name] = (coef[:, None] * u[None]).astype(w.dtype)
            elif name == "model.embed_tokens.weight":
                sign = rng.choice([-1.0, 1.0], size=w.shape[0])
                tensors[name] = (w + offset * sign[:, None] * u[None]).astype(w.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


MOE_OPS = {"MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4", "MoeTokenUnpermute"}


@pytest.fixture(scope="module")
def decisive_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_decisive")
    out = {}
    for name in ("qwen3_moe", "qwen2_moe", "qwen3_moe_step2"):
        out[name] = make_checkpoint(str(root / name), seed=7, tie_word_embeddings=False, **CASES[name])
        decisive_routers(out[name])
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "qwen3_moe_step2"])
def test_an_atlas_moe_folder_runs_ascends_moe_ops_and_passes_check(decisive_checkpoints, tmp_path, name):
    """--device atlas_800i_a2, float16: the fused form by default, its sparse layers through MoeGatingTopKSoftmax,
    MoeInitRoutingV2, GroupedMatmulV4 and MoeTokenUnpermute (CPU stand-ins here); every prefill, chunk and score
    graph passes check with every step judged (no routing near tie). The stacks are GroupedMatmul's [E, K, N]: each
    expert's gate and up rows transposed, its down_proj transposed."""
    from export.checkpoints.safetensors import stored_as
    from lite_runtime.check import run_check

    folder = _export(decisive_checkpoints[name], str(tmp_path / "atlas"))
    report = run_check(folder, "ms")
    assert report.passed, report.verdict()
    assert report.graph == "fused" and MOE_OPS <= set(report.standins), report.standins
    assert all(r.routing_tie is None for r in report.rows)
    assert {r.graph.split("_")[0] for r in report.rows} == {"prefill", "chunk", "score"}
    where = open_checkpoint(decisive_checkpoints[name])
    weights = _folder_weights(folder, "atlas")
    layer = 0 if name != "qwen3_moe_step2" else 1
    p = f"model.layers.{layer}.mlp.experts."
    for n in (0, CASES[name]["moe"]["num_experts"] - 1):
        def read(kind, n=n):
            return stored_as(where[f"{p}{n}.{kind}.weight"].stored(f"{p}{n}.{kind}.weight"), "float16")
        assert np.array_equal(weights[p + "gate_up_proj"][n], np.concatenate([read("gate_proj"), read("up_proj")]).T)
        assert np.array_equal(weights[p + "down_proj"][n], read("down_proj").T)


def test_an_atlas_moe_folder_of_the_plain_form_passes_check(decisive_checkpoints, tmp_path):
    """The 310P (Atlas 300I Duo) takes the plain form: the routing by softmax and TopK, every expert by BatchMatMul,
    Qwen2-MoE's shared expert in float16, nothing substituted."""
    from lite_runtime.check import run_check

    folder = _export(decisive_checkpoints["qwen2_moe"], str(tmp_path / "duo"), device="atlas_300i_duo")
    report = run_check(folder, "ms")
    assert report.passed, report.verdict()
    assert report.graph == "plain" and not report.standins


def _unpermute_by_row_idx(self, x, logits):  # module level, imports outside: MindSpore's graph compiler parses it
    top, chosen, row_idx = self.top_k_softmax(logits, None, self.k)
    if self.norm:
        top = top / ops.broadcast_to(self.sum_keep(top, -1), top.shape)
    rows, _, counts, _ = self.init_routing(x, chosen, 0, 0, self.e, 0, 2, False)
    counts = ops.cast(counts, ms.int64)
    gate, up = ops.split(self._grouped(rows, self.gate_up_proj, counts), self.i, axis=-1)
    out = self._grouped(ew_mul(ew_silu(gate), up), self.down_proj, counts)
    return self.unpermute(out, row_idx.reshape(-1), ops.cast(top, self.dtype), False, None)


def test_a_miswired_fused_moe_fails_check(decisive_checkpoints, tmp_path, monkeypatch):
    """MoeTokenUnpermute given the gating's row_idx (j * N + i, MoeFinalizeRouting's numbering) where it takes
    MoeInitRoutingV2's expanded_row_idx: the stand-ins run it as written, and the float32 reference fails it."""
    import export.network.moe as moe
    from lite_runtime.check import run_check

    monkeypatch.setattr(moe.FusedExperts, "construct", _unpermute_by_row_idx)
    report = run_check(_export(decisive_checkpoints["qwen3_moe"], str(tmp_path / "bad")), "ms")
    assert not report.passed
    assert "greedy tokens diverge" in report.verdict()


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_fused_moe_folder_split_over_two_ranks_passes_check_under_msrun(decisive_checkpoints, tmp_path, quantize):
    """tp_size 2 in the fused form: each rank's [E, K, N] stacks hold every expert's share, transposed (gate_up its
    half of the gate and of the up columns, down its half of the rows); Qwen2-MoE's shared expert whole; the experts'
    partial sums in a float16 AllReduce. check passes on both ranks under msrun (int8: against the folder's integers,
    every rank's share put back in place)."""
    from export.checkpoints.safetensors import stored_as
    from test_tensor_parallel import check_under_msrun

    path = decisive_checkpoints["qwen2_moe"]
    folder = _export(path, str(tmp_path / "tpmoe"), prefill_buckets=(16,), tp_size=2, quantize=quantize,
                           group_size=0 if quantize != "none" else None)
    where = open_checkpoint(path)
    share = ModelConfig.from_checkpoint(path).moe_intermediate_size // 2
    p = "model.layers.1.mlp.experts."
    for rank in (0, 1) if quantize == "none" else ():  # the float shares are the checkpoint's slices
        weights = _rank_weights(folder, "tpmoe", rank)
        cols = slice(rank * share, (rank + 1) * share)
        for e in (0, 3):
            def read(kind, e=e):
                return stored_as(where[f"{p}{e}.{kind}.weight"].stored(f"{p}{e}.{kind}.weight"), "float16")
            assert np.array_equal(weights[p + "gate_up_proj"][e],
                                  np.concatenate([read("gate_proj")[cols], read("up_proj")[cols]]).T), (rank, e)
            assert np.array_equal(weights[p + "down_proj"][e], read("down_proj")[:, cols].T), (rank, e)
    for log in check_under_msrun(tmp_path, folder).values():
        assert "PASS tpmoe on backend ms" in log, log[-2000:]
        assert "graph form: fused" in log


@pytest.mark.parametrize("name, bits", [("qwen3_moe", 8), ("qwen2_moe", 4)])
def test_a_quantized_atlas_moe_folder_runs_grouped_matmuls_antiquant(decisive_checkpoints, tmp_path, name, bits):
    """--quantize int8 / int4 --group_size 0 for atlas_800i_a2: the experts through GroupedMatmulV4's antiquant
    (q [E, K, N], int4 two per byte along N; scales [E, 1, N] reshaped to [E, N]); check passes against the folder's
    integers with every step judged, and each expert's integers are the CPU folder's of the same rounding,
    transposed."""
    from export.network.quantize import transpose_block
    from lite_runtime.check import run_check

    path = decisive_checkpoints[name]
    folder = _export(path, str(tmp_path / "q"), quantize=f"int{bits}", group_size=0)
    report = run_check(folder, "ms")
    assert report.passed, report.verdict()
    assert MOE_OPS <= set(report.standins) and all(r.routing_tie is None for r in report.rows)
    cpu = str(tmp_path / "cpu")
    assert main(["-q", "--checkpoint", path, "--output", cpu, "--name", "cpu", "--device", "cpu", "--seq_length",
                 "32", "--quantize", f"int{bits}", "--group_size", "0"]) == 0
    for kind in ("gate_up_proj", "down_proj"):
        fused, scale, offset = _stack(folder, "q", 0, kind)
        want, want_scale, want_offset = _stack(cpu, "cpu", 0, kind)
        assert scale.shape == want_scale.shape and scale.shape[1] == 1 and (offset is None) == (bits == 8)
        for e in range(fused.shape[0]):
            assert np.array_equal(transpose_block(fused[e], bits == 4), want[e]), (kind, e)
