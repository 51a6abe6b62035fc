"""Mixture-of-experts models (issue 46), so far: Qwen3-MoE and Qwen2-MoE configs read as HF reads them, random
checkpoints in Qwen's per-expert layout, and the float32 numpy reference (export/writers/reference.py: routing and
experts computed independently) against HF transformers' own Qwen3MoeForCausalLM / Qwen2MoeForCausalLM on the same
weights: logits within 1e-4 of their magnitude, greedy tokens identical. Export refuses them by name until their
graphs exist, leaving nothing on disk."""
from __future__ import annotations

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
                               shared_expert_intermediate_size=48)),
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


def test_export_refuses_a_mixture_of_experts_until_its_graphs_exist(moe_checkpoints, tmp_path, capsys):
    path = moe_checkpoints["qwen3_moe"]
    code = main(["-q", "--checkpoint", path, "--output", str(tmp_path / "out"), "--device", "cpu"])
    assert (code, capsys.readouterr().err.strip()) == (
        2, f"error: {path}: model_type 'qwen3_moe' is a mixture-of-experts model, whose graphs this version cannot "
           "build yet; export a dense checkpoint (qwen2, qwen3, llama)")
    assert os.listdir(tmp_path) == []


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
