"""Mixture-of-experts models (issue 46), so far: Qwen3-MoE and Qwen2-MoE configs read as HF reads them, random
checkpoints in Qwen's per-expert layout, and the float32 numpy reference (export/writers/reference.py: routing and
experts computed independently) against HF transformers' own Qwen3MoeForCausalLM / Qwen2MoeForCausalLM on the same
weights: logits within 1e-4 of their magnitude, greedy tokens identical. Export refuses them by name until their
graphs exist, leaving nothing on disk."""
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


@pytest.mark.parametrize("args, option", [
    (["--device", "atlas_800i_a2"], "--device cpu"),
    (["--device", "cpu", "--dtype", "float32", "--quantize", "int8"], "--quantize none"),
    (["--device", "cpu", "--dtype", "float32", "--tp_size", "2"], "--tp_size 1"),
])
def test_export_refuses_what_the_moe_graphs_do_not_build_yet(moe_checkpoints, tmp_path, capsys, args, option):
    """The plain MoE form exports as a float CPU folder of one rank; anything else: one line naming the option,
    nothing on disk."""
    path = moe_checkpoints["qwen3_moe"]
    code = main(["-q", "--checkpoint", path, "--output", str(tmp_path / "out"), *args])
    assert (code, capsys.readouterr().err.strip()) == (
        2, f"error: {path}: model_type 'qwen3_moe' is a mixture-of-experts model, whose graphs this version builds "
           f"only with {option} (float weights, one rank, on the CPU)")
    assert os.listdir(tmp_path) == []


def test_a_packed_moe_checkpoint_exports_only_dequantized(moe_checkpoints, tmp_path, capsys):
    """A GPTQ MoE checkpoint keeps its quantization by default, which the MoE graphs do not take yet: refused, naming
    --quantize none, nothing on disk; with --quantize none its packed layers are dequantized and the folder passes
    check."""
    from lite_runtime.check import run_check
    from tests.packers import pack

    packed, _ = pack(moe_checkpoints["qwen3_moe"], str(tmp_path / "gptq"), "gptq", bits=4, group=32)
    out = str(tmp_path / "out" / "f")
    code = main(["-q", "--checkpoint", packed, "--output", out, "--device", "cpu", "--seq_length", "32"])
    assert (code, capsys.readouterr().err.strip()) == (
        2, f"error: {packed}: model_type 'qwen3_moe' is a mixture-of-experts model, whose graphs this version builds "
           "only with --quantize none (float weights, one rank, on the CPU)")
    assert not os.path.exists(os.path.dirname(out))
    assert main(["-q", "--checkpoint", packed, "--output", out, "--device", "cpu", "--seq_length", "32",
                 "--dtype", "float32", "--quantize", "none"]) == 0
    report = run_check(out, "ms")
    assert report.passed, report.verdict()


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
    assert {r.graph.split("_")[0] for r in report.rows} == {"prefill", "chunk", "score"}
    # the experts ran in the CPU kernel that reads only the chosen ones (cpu_kernels/moe.cc), in every graph
    import cpu_kernels
    from test_cpu_kernels import custom_funcs

    graphs = glob.glob(os.path.join(folder, "**", "*.mindir"), recursive=True)
    assert graphs
    for graph in graphs:
        assert any(f.endswith(":" + cpu_kernels.MOE_EXPERTS) for f in custom_funcs(graph)[0]), graph
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
    from safetensors.numpy import load_file

    from export.checkpoints.gguf import convert
    from tests.test_gguf import write_gguf

    ckpt = moe_checkpoints[name]
    weights = write_gguf(ckpt, str(tmp_path / "m.gguf"))
    config = convert(str(tmp_path / "m.gguf"), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(weights)
    for tensor, value in weights.items():
        assert np.array_equal(back[tensor], value.astype(np.float32)), tensor
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
