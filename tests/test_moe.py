"""Mixture-of-experts models (issue 46), so far: Qwen3-MoE and Qwen2-MoE configs read as HF reads them, random
checkpoints in Qwen's per-expert layout, and the float32 numpy reference (export/writers/reference.py: routing and
experts computed independently) against HF transformers' own Qwen3MoeForCausalLM / Qwen2MoeForCausalLM on the same
weights: logits within 1e-4 of their magnitude, greedy tokens identical; CPU folders, float and quantized (the
experts in the CPU kernel, tests/test_moe_kernel.py), checked. Export refuses what it does not build yet by the
option to change, leaving nothing on disk."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from export.__main__ import main
from export.checkpoints import open_checkpoint, plan_weights
from export.checkpoints.random_checkpoint import make_checkpoint
from export.config import ModelConfig
from export.errors import ExportError
from export.writers.reference import NumpyDecoder, weight_shapes

# family, layers and experts: a dense layer among sparse ones (mlp_only_layers, decoder_sparse_step), top-k with and
# without its renormalisation, Qwen2-MoE's shared expert
CASES = {
    "qwen3_moe": dict(family="qwen3_moe", num_hidden_layers=3,
                      moe=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_step2": dict(family="qwen3_moe", num_hidden_layers=2,
                            moe=dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                     decoder_sparse_step=2)),
    "qwen2_moe": dict(family="qwen2_moe", num_hidden_layers=2,
                      moe=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                               shared_expert_intermediate_size=64)),
}
PROMPTS = [[5, 17, 200, 33, 90, 7, 64], [300, 12, 41]]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_checkpoint(str(root / name), seed=7, **kw) for name, kw in CASES.items()}


def hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_layers_and_tensors_are_hfs(moe_checkpoints, name):
    """ModelConfig.sparse marks the layers HF builds a sparse MoE block for, and weight_shapes names exactly the
    checkpoint's tensors (plan_weights refuses a missing or an unexpected one)."""
    path = moe_checkpoints[name]
    cfg = ModelConfig.from_checkpoint(path)
    model = hf_model(path)
    assert [cfg.sparse(i) for i in range(cfg.num_hidden_layers)] == [
        hasattr(layer.mlp, "experts") for layer in model.model.layers]
    where = open_checkpoint(path)
    assert sorted(plan_weights(weight_shapes(cfg), where, cfg.tie_word_embeddings)) == sorted(weight_shapes(cfg))


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_is_hf_on_the_same_weights(moe_checkpoints, name):
    """The numpy reference's last-token logits of two prompts of different lengths (in one forward), then 8 greedy
    tokens of each through its caches, against HF's model on each prompt alone and HF's generate."""
    import torch

    path = moe_checkpoints[name]
    cfg = ModelConfig.from_checkpoint(path)
    model = hf_model(path)
    ref = NumpyDecoder(cfg, open_checkpoint(path), max_positions=64)
    try:
        caches = [ref.new_cache() for _ in PROMPTS]
        ours = ref.forward(PROMPTS, caches)
        with torch.no_grad():
            theirs = np.stack([model(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), name
        tokens = [[int(np.argmax(row))] for row in ours]
        for _ in range(7):
            step = ref.forward([[t[-1]] for t in tokens], caches)
            for t, row in zip(tokens, step):
                t.append(int(np.argmax(row)))
    finally:
        ref.close()
    for prompt, got in zip(PROMPTS, tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert got == out[0, len(prompt):].tolist(), name


def test_routing_is_softmax_top_k_in_float32(moe_checkpoints):
    """The router's probabilities are a float32 softmax over every expert; the chosen ones the k largest in
    descending order, equal ones to the lower index; their weights renormalised only with norm_topk_prob."""
    path = moe_checkpoints["qwen3_moe"]
    cfg = ModelConfig.from_checkpoint(path)
    ref = NumpyDecoder(cfg, open_checkpoint(path), max_positions=16)
    try:
        h = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
        probs, chosen, weights = ref.routing(h, "model.layers.0.mlp.")
        logits = h.astype(np.float64) @ ref.where["model.layers.0.mlp.gate.weight"].read(
            "model.layers.0.mlp.gate.weight").astype(np.float64).T
        expected = np.exp(logits - logits.max(-1, keepdims=True))
        expected /= expected.sum(-1, keepdims=True)
        assert probs.dtype == np.float32 and np.allclose(probs, expected, rtol=1e-5, atol=1e-7)
        assert np.array_equal(chosen, np.argsort(-expected, axis=-1, kind="stable")[:, :2])
        top = np.take_along_axis(expected, chosen, -1)
        assert np.allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-5)
        tie = np.zeros((1, cfg.hidden_size), np.float32)  # every logit 0: all experts equal, the lowest two chosen
        assert ref.routing(tie, "model.layers.0.mlp.")[1].tolist() == [[0, 1]]
    finally:
        ref.close()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_routing_margins_are_hfs_router_gaps(moe_checkpoints, name):
    """Each token's routing margin (the reference's, per new token, over the sparse layers) is, from HF's own router
    (its input h caught by a hook, its logits by output_router_logits), the gap between the k-th and the (k+1)-th
    largest logit over the larger of the largest |logit| and ||w_a - w_b|| ||h|| / sqrt(H) (a and b those two
    experts), the smallest over the layers."""
    import torch

    path = moe_checkpoints[name]
    cfg = ModelConfig.from_checkpoint(path)
    ref = NumpyDecoder(cfg, open_checkpoint(path), max_positions=16)
    try:
        ref.forward([PROMPTS[0]], [ref.new_cache()])
        mine = ref.routing_margins
    finally:
        ref.close()
    model = hf_model(path)
    inputs, hooks = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate") and not hasattr(layer.mlp, "gate_proj"):  # a sparse block's router
            gate = layer.mlp.gate
            hooks.append(gate.register_forward_hook(lambda m, a, out: inputs.append((a[0], m.weight))))
    with torch.no_grad():
        out = model(torch.tensor([PROMPTS[0]]), output_router_logits=True)
    for hook in hooks:
        hook.remove()
    k = cfg.num_experts_per_tok
    gaps = []
    assert len(inputs) == len(out.router_logits) == sum(cfg.sparse(i) for i in range(cfg.num_hidden_layers))
    for logits, (h, w) in zip(out.router_logits, inputs):  # one [T, E] per sparse layer
        logits, h, w = (t.detach().double().numpy() for t in (logits, h.reshape(-1, h.shape[-1]), w))
        order = np.argsort(-logits, axis=-1, kind="stable")
        a, b = order[:, k - 1], order[:, k]
        rows = np.arange(len(logits))
        spread = np.linalg.norm(w[a] - w[b], axis=-1) * np.linalg.norm(h, axis=-1) / np.sqrt(h.shape[-1])
        gaps.append((logits[rows, a] - logits[rows, b]) / np.maximum(np.abs(logits).max(axis=-1), spread))
    assert np.allclose(mine, np.min(gaps, axis=0), rtol=1e-4, atol=1e-6)


def _judged(margins, errors, rel=1e-4):
    """A RowResult after judging steps whose logits are the reference's top logits plus errors[s] (relative to the
    step's scale), the reference row carrying routing `margins`."""
    from lite_runtime.golden import ReferenceRow, RowResult, Tolerance

    ref = ReferenceRow(prompt=[1, 2], routing_margin=list(margins))
    row = RowResult(0, "prefill_16", 2)
    for step, err in enumerate(errors):
        logits = np.zeros(8, np.float32)
        logits[3], logits[5] = 10.0, 4.0
        ref.record(logits, 2)
        device = logits.copy()
        device[3] += err * 10.0
        row.judge(step, device, ref, Tolerance("float32", rel))
    row.close(Tolerance("float32", rel))
    return row


def test_check_judges_a_row_up_to_its_first_near_tied_routing():
    """A token routed on a near tie (margin at most twice the limit) may take another expert on a device, and every
    later step attends to it: from that step on the row is reported (routing_tie, routing_max_rel), not failed;
    before it, and in a row without one, an error beyond the limit fails."""
    clean = _judged([0.3, 0.3, 0.3], [0.0, 5e-4, 0.0])
    assert (clean.passed, clean.routing_tie) == (False, None)
    tied = _judged([0.3, 1.5e-4, 0.3], [0.0, 5e-4, 3e-4])
    assert (tied.passed, tied.routing_tie, tied.max_rel) == (True, 1, 0.0)
    assert tied.routing_max_rel == pytest.approx(5e-4, rel=1e-3)
    early = _judged([0.3, 1.5e-4, 0.3], [5e-4, 0.0, 0.0])  # before the tie: failed
    assert (early.passed, early.routing_tie) == (False, 1)
    dense = _judged([], [0.0, 5e-5, 0.0])  # a dense model's row (no margins): judged throughout
    assert (dense.passed, dense.routing_tie) == (True, None)


def test_a_missing_expert_or_a_wrong_router_is_refused_by_name(moe_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = moe_checkpoints["qwen2_moe"]
    cfg = ModelConfig.from_checkpoint(path)
    where = open_checkpoint(path)
    gone = dict(where)
    del gone["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ExportError) as err:
        plan_weights(weight_shapes(cfg), gone, cfg.tie_word_embeddings)
    assert str(err.value) == ("checkpoint tensors do not match config.json (missing 1: "
                              "model.layers.1.mlp.experts.3.up_proj.weight); check that the weights belong to this "
                              "config")
    bad = tmp_path / "bad_router"
    bad.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            (bad / f).write_bytes(open(os.path.join(path, f), "rb").read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"][:3].copy()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ExportError) as err:
        plan_weights(weight_shapes(cfg), open_checkpoint(str(bad)), cfg.tie_word_embeddings)
    assert str(err.value) == (f"{bad / 'model.safetensors'}: tensor model.layers.0.mlp.gate.weight has shape "
                              "[3, 64], config.json implies [4, 64]; check that the weights belong to this config")


@pytest.mark.parametrize("args, why", [
    (["--quantize", "int4"], "run on Atlas through GroupedMatmulV4, whose antiquant takes int8 per channel only (int4 "
                             "in groups only without offsets), and this folder's are int4 (groups of 32, with offsets, "
                             "from rtn): export with --group_size 0 (per channel), or with --quantize none for float "
                             "experts"),
    (["--quantize", "int8", "--graph", "plain"], "run on Atlas only in the fused form (GroupedMatmulV4's antiquant), "
                                                 "which this export does not take; export for an A2/A3 profile in "
                                                 "float16 or bfloat16 without --graph plain, or with --quantize none "
                                                 "for float experts"),
    (["--quantize", "int8", "--device", "atlas_300i_duo"], "run on Atlas only in the fused form (GroupedMatmulV4's "
                                                           "antiquant), which this export does not take; export for an "
                                                           "A2/A3 profile in float16 or bfloat16 without --graph "
                                                           "plain, or with --quantize none for float experts"),
], ids=["int4_groups", "graph_plain", "310p"])
def test_export_refuses_what_the_moe_graphs_do_not_build_yet(moe_checkpoints, tmp_path, capsys, args, why):
    """Quantized experts where GroupedMatmulV4's antiquant cannot take them (groups, the plain form): one line naming
    the option, nothing on disk."""
    path = moe_checkpoints["qwen3_moe"]
    code = main(["-q", "--checkpoint", path, "--output", str(tmp_path / "out"), "--device", "atlas_800i_a2",
                 "--seq_length", "32"] + args)
    assert (code, capsys.readouterr().err.strip()) == (
        2, f"error: {path}: model_type 'qwen3_moe' is a mixture-of-experts model, whose quantized experts {why}")
    assert os.listdir(tmp_path) == []


def test_a_tp_size_that_does_not_divide_the_experts_is_refused(moe_checkpoints, tmp_path, capsys):
    path = moe_checkpoints["qwen3_moe"]
    cfg = ModelConfig.from_checkpoint(path)
    code = main(["-q", "--checkpoint", path, "--output", str(tmp_path / "out"), "--device", "cpu", "--dtype",
                 "float32", "--tp_size", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"moe_intermediate_size {cfg.moe_intermediate_size}" in err, err
    assert os.listdir(tmp_path) == []


def _rank_weights(folder: str, name: str, rank: int) -> dict:
    """Every parameter of rank `rank`'s incremental graph of a tensor-parallel folder, by name."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.backends.ms import _parameter_arrays

    path = glob.glob(os.path.join(folder, f"{name}_rank{rank}_inc_graph.mindir"))[0]
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(path, "rb").read())
    return _parameter_arrays(model, path)


@pytest.mark.parametrize("name, quantize", [("qwen3_moe", "none"), ("qwen2_moe", "int8")])
def test_experts_split_over_two_ranks_pass_check_under_msrun(moe_checkpoints, tmp_path, name, quantize):
    """--tp_size 2: every rank holds every expert's share of its columns (vLLM's tensor-parallel MoE): gate_up its
    half of the gate rows and of the up rows, down its half of the inputs; the router and Qwen2-MoE's shared expert
    whole. The partial sums meet in an AllReduce; check passes on both ranks under msrun (float32 against the
    checkpoint's reference, int8 against the folder's integers put back together)."""
    from export.checkpoints.safetensors import widen
    from test_tensor_parallel import check_under_msrun

    out = str(tmp_path / name)
    assert main(["-q", "--checkpoint", moe_checkpoints[name], "--output", out, "--name", name, "--device", "cpu",
                 "--dtype", "float32", "--seq_length", "32", "--tp_size", "2", "--quantize", quantize]) == 0
    where = open_checkpoint(moe_checkpoints[name])
    cfg = ModelConfig.from_checkpoint(moe_checkpoints[name])
    share = cfg.moe_intermediate_size // 2
    p = "model.layers.0.mlp."
    for rank in (0, 1):
        weights = _rank_weights(out, name, rank)
        assert weights[p + "experts.gate_up_proj"].shape[1] == 2 * share
        assert weights[p + "gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)
        if quantize != "none":
            continue
        cols = slice(rank * share, (rank + 1) * share)
        for e in (0, cfg.num_experts - 1):
            read = lambda n: widen(np.asarray(where[f"{p}experts.{e}.{n}.weight"].stored(f"{p}experts.{e}.{n}.weight")))
            assert np.array_equal(weights[p + "experts.gate_up_proj"][e],
                                  np.concatenate([read("gate_proj")[cols], read("up_proj")[cols]])), (rank, e)
            assert np.array_equal(weights[p + "experts.down_proj"][e], read("down_proj")[:, cols]), (rank, e)
    for log in check_under_msrun(tmp_path, out).values():
        assert "PASS" in log, log[-2000:]


def test_quantized_experts_without_the_cpu_kernels_are_refused(moe_checkpoints, tmp_path, capsys):
    path = moe_checkpoints["qwen3_moe"]
    code = main(["-q", "--checkpoint", path, "--output", str(tmp_path / "out"), "--device", "cpu", "--dtype",
                 "float32", "--quantize", "int8", "--cpu_kernels", "off"])
    assert (code, capsys.readouterr().err.strip()) == (
        2, f"error: {path}: model_type 'qwen3_moe' is a mixture-of-experts model, whose quantized experts run only in "
           "the CPU kernels, which this export does not use; export with them (the default where the library is "
           "built) or with --quantize none")
    assert os.listdir(tmp_path) == []


def _stack(folder: str, name: str, layer: int, kind: str) -> tuple:
    """A quantized folder's stacked experts of one layer: (q, scale [E, G, n], offset or None) as numpy."""
    weights = _folder_weights(folder, name)
    p = f"model.layers.{layer}.mlp.experts.{kind}"
    return weights[p], weights[p + "_scale"], weights.get(p + "_offset")


def _unpacked(q: np.ndarray) -> np.ndarray:
    """int4 bytes [..., K / 2] -> their values [..., K] (low nibble first, two's complement), by arithmetic."""
    b = q.astype(np.int16)
    lo, hi = b % 16, b // 16
    out = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float64)
    out[..., 0::2], out[..., 1::2] = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
    return out


def test_a_packed_moe_checkpoint_keeps_its_experts_integers(moe_checkpoints, tmp_path):
    """A GPTQ-Int4 MoE checkpoint (Qwen's releases: each expert packed alone) exports by default with its experts'
    integers and scales kept as they are, stacked (gate rows, then up rows), and the folder passes check."""
    from lite_runtime.check import run_check
    from tests.packers import pack

    packed, _ = pack(moe_checkpoints["qwen3_moe"], str(tmp_path / "gptq"), "gptq", bits=4, group=32)
    out = str(tmp_path / "out" / "f")
    assert main(["-q", "--checkpoint", packed, "--output", out, "--device", "cpu", "--seq_length", "32"]) == 0
    report = run_check(out, "ms")
    assert report.passed, report.verdict()
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["quantization"]["source"] == "gptq", manifest["quantization"]
    where = open_checkpoint(packed)
    q, scale, _ = _stack(out, "f", 0, "gate_up_proj")
    inter = q.shape[1] // 2
    for e in (0, 5):
        for kind, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            name = f"model.layers.0.mlp.experts.{e}.{kind}.weight"
            mine_q, mine_s, _ = where[name].quantized(name)  # the packed reader's integers [O, I], scales [O, G]
            assert np.array_equal(_unpacked(q[e][rows]), mine_q), name
            assert np.allclose(scale[e][:, rows].T, mine_s, rtol=0, atol=0), name


@pytest.mark.parametrize("name, bits", [("qwen3_moe", 8), ("qwen3_moe", 4), ("qwen2_moe", 4)])
def test_a_quantized_moe_folder_rounds_each_expert_and_passes_check(moe_checkpoints, tmp_path, name, bits):
    """--quantize int8 / int4: each expert (and Qwen2-MoE's shared expert) quantized as a linear layer
    (round-to-nearest per group of its inputs, W = (q + offset) * scale),
    stacked; check passes (the experts run in the CPU kernel, which reads their integers); each expert's dequantized
    weights, read from the folder's stacks by numpy, are the checkpoint's within half a step of their group."""
    from export.checkpoints.safetensors import widen
    from lite_runtime.check import run_check

    out = str(tmp_path / name)
    assert main(["-q", "--checkpoint", moe_checkpoints[name], "--output", out, "--name", name, "--device", "cpu",
                 "--seq_length", "32", "--quantize", f"int{bits}"]) == 0
    report = run_check(out, "ms")
    assert report.passed, report.verdict()
    where = open_checkpoint(moe_checkpoints[name])
    for kind, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        q, scale, offset = _stack(out, name, 0, kind)
        values = _unpacked(q) if bits == 4 else q.astype(np.float64)
        assert (offset is None) == (bits == 8)  # int8 symmetric, int4 with offsets (the defaults)
        e_count, groups, n = scale.shape
        k = values.shape[2]
        per_input = lambda a: np.repeat(a.astype(np.float64), k // groups, axis=1).transpose(0, 2, 1)  # [E, n, k]
        deq = (values + (0 if offset is None else per_input(offset))) * per_input(scale)
        for e in range(e_count):
            rows = n // len(parts)
            for j, part in enumerate(parts):
                w_name = f"model.layers.0.mlp.experts.{e}.{part}.weight"
                w = widen(np.asarray(where[w_name].stored(w_name))).astype(np.float64)
                step = np.repeat(scale[e][:, j * rows:(j + 1) * rows].astype(np.float64), k // groups, axis=0).T
                assert np.all(np.abs(deq[e][j * rows:(j + 1) * rows] - w) <= step / 2 * (1 + 1e-5)), w_name
    if name == "qwen2_moe":  # the shared expert quantized as a dense MLP; its gate, as the router, float
        weights = _folder_weights(out, name)
        p = "model.layers.0.mlp."
        assert weights[p + "shared_expert.gate_proj.weight"].dtype == (np.uint8 if bits == 4 else np.int8)
        assert p + "shared_expert.gate_proj.weight_scale" in weights
        assert weights[p + "shared_expert_gate.weight"].dtype == np.float32
        assert weights[p + "gate.weight"].dtype == np.float32


@pytest.fixture(scope="module")
def moe_folders(moe_checkpoints, tmp_path_factory):
    """qwen3_moe (a dense layer among sparse ones) as a float32 and a bfloat16 CPU folder, qwen2_moe (a shared
    expert) as a float32 one: batch 2, seq_length 64, the default buckets, chunk and score graphs."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("moe_folders")
    out = {}
    for name, dtype in (("qwen3_moe", "float32"), ("qwen2_moe", "float32"), ("qwen3_moe", "bfloat16")):
        out[name, dtype] = str(root / f"{name}_{dtype}")
        run_export(ExportConfig(checkpoint=moe_checkpoints[name], output=out[name, dtype], name=name, seq_length=64,
                                batch_size=2, dtype=dtype, device="cpu"))
    return out


def _folder_weights(folder: str, name: str) -> dict:
    """Every parameter of the folder's incremental graph, by name, as the ms backend maps them."""
    import yaml
    from mindspore.train import mind_ir_pb2

    from lite_runtime.backends.ms import _parameter_arrays

    infer = yaml.safe_load(open(os.path.join(folder, f"{name}.yaml")))["infer"]
    path = os.path.join(folder, infer["increment_model_path"])
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(open(path, "rb").read())
    return _parameter_arrays(model, path)


@pytest.mark.parametrize("name, dtype", [("qwen3_moe", "float32"), ("qwen2_moe", "float32"),
                                         ("qwen3_moe", "bfloat16")])
def test_a_moe_folder_passes_check_and_decodes_as_hf(moe_folders, moe_checkpoints, name, dtype):
    """`check` replays the golden references through every prefill, chunk and score graph (and the inc graphs'
    steps); the float32 folder's greedy tokens of two prompts of different lengths equal HF's generate, and its
    last-token logits HF's within 1e-4 (the bfloat16 folder: HF on its rounded weights is check's golden). The stacked
    experts in the weights file are the checkpoint's, expert by expert, stored as the folder stores its matrices."""
    import torch

    from export.checkpoints.safetensors import stored_as
    from lite_runtime import pipeline
    from lite_runtime.check import run_check

    folder = moe_folders[name, dtype]
    report = run_check(folder, "ms")
    assert report.passed, report.verdict()
    golden = json.load(open(os.path.join(folder, "golden.json")))
    for batch in golden["batches"]:
        for row in batch["rows"]:
            assert len(row["routing_margin"]) == batch["steps"] and min(row["routing_margin"]) >= 0
    assert {r.graph.split("_")[0] for r in report.rows} == {"prefill", "chunk", "score"}
    # the experts ran in the CPU kernel that reads only the chosen ones (cpu_kernels/moe.cc), in every graph: the
    # decode steps' in the layer op (qwen3_moe: no shared expert), the others' in the MoE op
    import cpu_kernels
    from test_cpu_kernels import custom_funcs

    graphs = glob.glob(os.path.join(folder, "**", "*.mindir"), recursive=True)
    assert graphs
    for graph in graphs:
        funcs = {f.rpartition(":")[2] for f in custom_funcs(graph)[0]}
        layer = "_inc_" in os.path.basename(graph) and name == "qwen3_moe"
        # (a bfloat16 folder's KV cache is bfloat16: the layer op by its name for such caches, cpu_kernels.KV16_OPS)
        want = cpu_kernels.fused_op(cpu_kernels.DECODE_MOE_LAYER, False, dtype == "bfloat16")
        assert (want if layer else cpu_kernels.MOE) in funcs, (graph, funcs)
    where = open_checkpoint(moe_checkpoints[name])
    stacked = _folder_weights(folder, name)["model.layers.0.mlp.experts.gate_up_proj"]
    for n in (0, 3):
        p = f"model.layers.0.mlp.experts.{n}."
        expected = np.concatenate([stored_as(where[p + "gate_proj.weight"].stored(p + "gate_proj.weight"), dtype),
                                   stored_as(where[p + "up_proj.weight"].stored(p + "up_proj.weight"), dtype)])
        assert np.array_equal(stacked[n], expected), n
    if dtype != "float32":
        return
    pipe = pipeline("text_generation", model=folder, backend="ms")
    model = hf_model(moe_checkpoints[name])
    logits = pipe.infer([list(p) for p in PROMPTS]).logits
    out = pipe.generate([list(p) for p in PROMPTS], max_new_tokens=8).sequences
    for prompt, got, tokens in zip(PROMPTS, logits, out):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0, -1].numpy()
            want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0].tolist()
        assert np.abs(np.asarray(got) - theirs).max() <= 1e-4 * np.abs(theirs).max(), name
        assert tokens == want, name


def test_num_experts_as_transformers_5_saves_it(moe_checkpoints, tmp_path):
    """transformers 5 writes Qwen3MoeConfig's num_experts as num_local_experts (its attribute_map): read as HF reads
    it; the two keys disagreeing is refused naming both."""
    from transformers import Qwen3MoeConfig

    path = str(tmp_path / "config.json")
    Qwen3MoeConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, hidden_size=64,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                   vocab_size=512).to_json_file(path)
    raw = json.load(open(path))
    assert "num_experts" not in raw and raw["num_local_experts"] == 6
    assert ModelConfig.from_file(path).num_experts == 6
    raw["num_experts"] = 8
    json.dump(raw, open(path, "w"))
    with pytest.raises(ExportError) as err:
        ModelConfig.from_file(path)
    assert str(err.value) == (f"{path}: num_experts (8) and num_local_experts (6) disagree; they name one field: "
                              "keep one")


def test_config_keys_are_qwens(moe_checkpoints):
    """The fields read from config.json as transformers' Qwen3MoeConfig / Qwen2MoeConfig hold them."""
    from transformers import AutoConfig

    for name, path in moe_checkpoints.items():
        ours, hf = ModelConfig.from_checkpoint(path), AutoConfig.from_pretrained(path)
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                      "decoder_sparse_step"):
            assert getattr(ours, field) == getattr(hf, field), (name, field)
        assert list(ours.mlp_only_layers) == list(hf.mlp_only_layers)
        assert ours.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)
        with open(os.path.join(path, "config.json")) as fh:
            assert json.load(fh)["model_type"] == name.split("_step")[0]


# --- GGUF (llama.cpp's qwen3moe / qwen2moe) -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_a_gguf_moe_round_trips_to_the_checkpoint(moe_checkpoints, tmp_path, name):
    """checkpoint -> GGUF as llama.cpp's converter lays it out (experts stacked [E, rows, inputs] per layer, the
    shared expert's gate 1-D, the experts' metadata keys; F32) -> our HF folder: every tensor bit for bit under its
    per-expert name, and the experts' config as HF's (norm_topk_prob as llama.cpp hard-codes it per architecture:
    these checkpoints were made so); the reference on the GGUF itself gives HF's logits of the checkpoint."""
    import torch

    from tests.test_gguf import converted_bit_for_bit

    ckpt = moe_checkpoints[name]
    config = converted_bit_for_bit(ckpt, tmp_path)
    ours, original = ModelConfig.from_dict(config), ModelConfig.from_checkpoint(ckpt)
    for field in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "qkv_bias", "qk_norm"):
        assert getattr(ours, field) == getattr(original, field), field
    assert [ours.sparse(i) for i in range(ours.num_hidden_layers)] == [
        original.sparse(i) for i in range(original.num_hidden_layers)]
    cfg = ModelConfig.from_checkpoint(str(tmp_path / "m.gguf"))
    ref = NumpyDecoder(cfg, open_checkpoint(str(tmp_path / "m.gguf")), max_positions=32)
    try:
        logits = ref.forward(PROMPTS[:1], [ref.new_cache()])[0]
    finally:
        ref.close()
    with torch.no_grad():
        theirs = hf_model(ckpt)(torch.tensor([PROMPTS[0]])).logits[0, -1].numpy()
    assert np.abs(logits - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_a_q8_gguf_moe_reads_each_expert_alone(moe_checkpoints, tmp_path):
    """Q8_0 experts (the routers kept in float, as llama-quantize keeps them): each expert's tensor is the gguf
    package's dequantization of its own rows of the stacked tensor."""
    import gguf

    from tests.test_gguf import write_gguf

    write_gguf(moe_checkpoints["qwen3_moe"], str(tmp_path / "q8.gguf"), quant="Q8_0")
    where = open_checkpoint(str(tmp_path / "q8.gguf"))
    reader = gguf.GGUFReader(str(tmp_path / "q8.gguf"))
    stacked = {t.name: t for t in reader.tensors}["blk.2.ffn_down_exps.weight"]
    whole = gguf.dequantize(stacked.data, stacked.tensor_type).reshape(8, 64, 32)
    for n in (0, 5, 7):
        name = f"model.layers.2.mlp.experts.{n}.down_proj.weight"
        assert where[name].shape(name) == (64, 32)
        assert np.array_equal(where[name].read(name), whole[n]), n
    assert where["model.layers.2.mlp.gate.weight"].stored_type("model.layers.2.mlp.gate.weight") == "gguf:F32"


def test_a_q8_gguf_moe_exports_with_its_experts_blocks_kept(moe_checkpoints, tmp_path):
    """By default a Q8_0 GGUF keeps its blocks: each expert's int8 integers in the folder's stack are the bytes of its
    own rows of llama.cpp's stacked tensor (read from the file's raw blocks: d f16, 32 x int8), and the folder passes
    check."""
    import gguf

    from lite_runtime.check import run_check
    from tests.test_gguf import write_gguf

    path = str(tmp_path / "q8.gguf")
    write_gguf(moe_checkpoints["qwen3_moe"], path, quant="Q8_0")
    out = str(tmp_path / "f")
    assert main(["-q", "--checkpoint", path, "--output", out, "--name", "f", "--device", "cpu",
                 "--seq_length", "32"]) == 0
    report = run_check(out, "ms")
    assert report.passed, report.verdict()
    assert json.load(open(os.path.join(out, "manifest.json")))["quantization"]["source"] == "gguf:Q8_0"
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.2.ffn_down_exps.weight"]
    blocks = np.asarray(raw.data).reshape(8, 64, 1, 34)  # [experts, rows, blocks of 32 inputs, bytes]
    q, scale, _ = _stack(out, "f", 2, "down_proj")
    assert np.array_equal(q, blocks[..., 2:].copy().view(np.int8).reshape(8, 64, 32))
    assert np.array_equal(scale[:, 0, :], blocks[..., :2].copy().view(np.float16)[..., 0, 0].astype(np.float32))


@pytest.mark.parametrize("key, value, message", [
    ("expert_gating_func", 2, "GGUF metadata qwen3moe.expert_gating_func is 2 (1 is softmax, 2 sigmoid): only softmax "
                              "routing is supported"),
    ("expert_group_count", 4, "GGUF metadata qwen3moe.expert_group_count is 4: grouped expert routing (DeepSeek's) is "
                              "not supported"),
    ("attention.kv_lora_rank", 512, "GGUF metadata qwen3moe.attention.kv_lora_rank is set: MLA attention "
                                    "(DeepSeek's) is not supported"),
    ("expert_weights_scale", 2.5, "GGUF metadata qwen3moe.expert_weights_scale is 2.5: scaled expert weights "
                                  "(DeepSeek's) are not supported"),
])
def test_a_gguf_moe_routed_otherwise_is_refused_by_its_key(moe_checkpoints, tmp_path, key, value, message):
    import gguf

    from tests.test_gguf import write_gguf

    path = str(tmp_path / "m.gguf")
    kind = gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32
    write_gguf(moe_checkpoints["qwen3_moe"], path, extra={f"qwen3moe.{key}": (value, kind)})
    with pytest.raises(ExportError) as err:
        ModelConfig.from_checkpoint(path)
    assert str(err.value) == f"{path}: {message}"


# --- GPTQ (Qwen's Qwen3-30B-A3B-GPTQ-Int4 layout) ------------------------------------------------------------------

@pytest.mark.parametrize("name, bits", [("qwen3_moe", 4), ("qwen2_moe", 8)])
def test_a_gptq_moe_is_read_as_its_dequantized_twin(moe_checkpoints, tmp_path, name, bits):
    """Each expert's projections (and Qwen2-MoE's shared expert's) packed by AutoGPTQ's layout (tests/packers.py,
    written independently of export/), the routers left in 16 bits: the reference on the packed checkpoint gives HF's
    logits and greedy tokens on its dequantized float twin."""
    import torch

    from tests.packers import pack

    packed, twin = pack(moe_checkpoints[name], str(tmp_path), "gptq", bits=bits, group=32)
    where = open_checkpoint(packed)
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in where
    assert not any(n.endswith(".qweight") for n in where)
    cfg = ModelConfig.from_checkpoint(packed)
    ref = NumpyDecoder(cfg, where, max_positions=32)
    try:
        caches = [ref.new_cache()]
        logits = ref.forward(PROMPTS[:1], caches)[0]
        tokens = [int(np.argmax(logits))]
        for _ in range(5):
            tokens.append(int(np.argmax(ref.forward([[tokens[-1]]], caches)[0])))
    finally:
        ref.close()
    model = hf_model(twin)
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0, -1].numpy()
        out = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert np.abs(logits - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert tokens == out[0, len(PROMPTS[0]):].tolist()
