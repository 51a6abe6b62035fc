"""Model families (export/families): qwen2 (Qwen2.5 with YaRN), qwen3 and llama against transformers' own
Qwen2/Qwen3/LlamaForCausalLM on tiny random checkpoints: GQA and MHA, tied and untied heads, every rope
scaling type with prompts longer than the original context (set small here, so the scaling changes the
result), biases where a family has them, and the family recorded in the folder."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from export.checkpoints import random_checkpoint
from reference import exact_activations, hf_generate, hf_last_logits, hf_model, prompts, rel_err, served_limit

TOL = 1e-4
ORIGINAL = 16  # the original context of the scaled-rope checkpoints; prompts below go past it
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
LINEAR = {"rope_type": "linear", "factor": 2.0}

# name -> make_checkpoint settings (hidden 64, 2 layers, 4 query heads)
FAMILY_CHECKPOINTS = {
    "qwen2_yarn": dict(family="qwen2", num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=YARN, seed=3),
    "qwen3_gqa_untied": dict(family="qwen3", num_key_value_heads=2, tie_word_embeddings=False, head_dim=32, seed=4),
    "qwen3_mha_tied_yarn": dict(family="qwen3", num_key_value_heads=4, tie_word_embeddings=True, head_dim=16,
                                rope_scaling=YARN, seed=5),
    "llama_gqa_tied_llama3": dict(family="llama", num_key_value_heads=2, tie_word_embeddings=True,
                                  rope_scaling=LLAMA3, seed=6),
    "llama_mha_untied_linear_bias": dict(family="llama", num_key_value_heads=4, tie_word_embeddings=False,
                                         rope_scaling=LINEAR, attention_bias=True, mlp_bias=True, seed=7),
}
ROWS = [(21, 6), (13, 5)]  # two rows of different lengths on the 32-token graph, then on the 16-token one


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("families")
    llama_tok = random_checkpoint.build_tokenizer(bos=True)
    return {name: random_checkpoint.make_checkpoint(
        str(root / name), tokenizer=llama_tok if kw["family"] == "llama" else tokenizer, **kw)
        for name, kw in FAMILY_CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def family_pipes(tmp_path_factory, family_checkpoints):
    """Each checkpoint exported for the cpu profile (fp32, batch 2, seq_length 32, buckets 16 / 32) and loaded."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    root = tmp_path_factory.mktemp("family_dirs")
    pipes = {}
    for name, ckpt in family_checkpoints.items():
        out = str(root / name)
        run_export(ExportConfig(checkpoint=ckpt, output=out, name=name, seq_length=32, batch_size=2,
                                dtype="float32", device="cpu", prefill_buckets=(16,)))
        pipes[name] = pipeline("text_generation", model=out, backend="ms")
    return pipes


@pytest.mark.parametrize("name", sorted(FAMILY_CHECKPOINTS))
def test_prefill_logits_and_greedy_tokens_equal_hf(family_pipes, family_checkpoints, name):
    pipe, ckpt = family_pipes[name], family_checkpoints[name]
    assert type(hf_model(ckpt)).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                             "llama": "LlamaForCausalLM"}[FAMILY_CHECKPOINTS[name]["family"]]
    for lengths in ROWS:
        rows = prompts(2, list(lengths), seed=sum(lengths))
        logits = pipe.infer(rows).logits
        for got, row in zip(logits, rows):
            assert rel_err(got, hf_last_logits(ckpt, row)) < TOL, (lengths, len(row))
        out = pipe.generate(rows, max_new_tokens=10).sequences
        for got, row in zip(out, rows):
            assert got == hf_generate(ckpt, row, max_new_tokens=10, do_sample=False), (lengths, len(row))
    assert pipe.prefill_sizes == [16, 32]


@pytest.mark.parametrize("scaling", [YARN, LLAMA3, LINEAR,
                                     {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
                                     {**YARN, "attention_factor": 1.3}])
def test_rope_tables_equal_transformers_and_differ_from_plain_rope(scaling):
    """cos and sin as transformers' rotary embedding computes them (positions 0-63, beyond the original 16)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from export.config import ModelConfig
    from export.network.rope import rope_tables

    raw = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    hf = LlamaRotaryEmbedding(LlamaConfig(**raw, rope_parameters={"rope_theta": 10000.0, **scaling}))
    x = torch.zeros(1, 64, 16)
    cos, sin = hf(x, torch.arange(64)[None])
    ours = ModelConfig.from_dict({**raw, "rope_parameters": {"rope_theta": 10000.0, **scaling}})
    got_cos, got_sin = rope_tables(ours, 64)
    np.testing.assert_allclose(got_cos, cos[0].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(got_sin, sin[0].numpy(), rtol=0, atol=2e-6)
    plain_cos, _ = rope_tables(ModelConfig.from_dict(raw), 64)
    assert np.abs(plain_cos[ORIGINAL:] - got_cos[ORIGINAL:]).max() > 1e-2


def test_folder_records_the_family_and_the_runtime_reads_it(family_pipes):
    for name, pipe in family_pipes.items():
        folder, family = pipe.config.model_dir, FAMILY_CHECKPOINTS[name]["family"]
        assert pipe.config.model_name == family
        with open(os.path.join(folder, "manifest.json")) as fh:
            assert json.load(fh)["family"] == family
        with open(os.path.join(folder, f"{name}.yaml")) as fh:
            doc = yaml.safe_load(fh)
        assert doc["infer"]["model_name"] == doc["model"]["family"] == family


def test_llama_text_gets_the_bos_token_and_the_folder_both_eos_ids(family_pipes, family_checkpoints):
    from transformers import AutoTokenizer

    name = "llama_gqa_tied_llama3"
    pipe, ckpt = family_pipes[name], family_checkpoints[name]
    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    text = "The quick brown fox"
    ids = pipe.tokenizer(text)["input_ids"]
    assert ids == hf_tok(text)["input_ids"] and ids[0] == hf_tok.bos_token_id
    assert pipe.config.eos_token_id == [hf_tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    want = hf_tok.decode(hf_generate(ckpt, ids, max_new_tokens=8, do_sample=False))
    assert pipe.tokenizer.decode(pipe.generate([ids], max_new_tokens=8).sequences[0]) == want


@pytest.mark.parametrize("name", ["qwen3_gqa_untied", "llama_mha_untied_linear_bias"])
def test_bfloat16_cpu_folder_equals_hf_on_the_rounded_weights(tmp_path, family_checkpoints, name):
    """The CPU kernels' decode step with Qwen3's q/k norms and with Llama's o_proj / MLP biases, 16-bit matrices."""
    from export.compare import hf_model as rounded_hf
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    out = str(tmp_path / name)
    run_export(ExportConfig(checkpoint=family_checkpoints[name], output=out, name=name, seq_length=32, batch_size=2,
                            dtype="bfloat16", device="cpu", prefill_buckets=(16,)))
    pipe = pipeline("text_generation", model=out, backend="ms")
    model = rounded_hf(family_checkpoints[name], matrices_in="bfloat16", kv_in="bfloat16")  # its KV cache's too
    rows = prompts(2, [19, 7], seed=41)
    import torch

    with torch.no_grad():
        hf = [model(torch.tensor([row])).logits[0, -1].numpy() for row in rows]
        want = [[int(t) for t in model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row),
                dtype=torch.long), max_new_tokens=8, do_sample=False)[0]] for row in rows]
    with exact_activations():  # float32's form: HF's limit and tokens
        for got, ref in zip(pipe.infer(rows).logits, hf):
            assert rel_err(got, ref) < TOL
        assert pipe.generate(rows, max_new_tokens=8).sequences == want
    for got, ref in zip(pipe.infer(rows).logits, hf):  # as it serves: the folder's own limit (AVX512-BF16 form)
        assert rel_err(got, ref) < served_limit(out)


@pytest.mark.parametrize("name", ["qwen3_mha_tied_yarn", "llama_mha_untied_linear_bias"])
def test_float16_atlas_folder_passes_check_within_its_limits(tmp_path, family_checkpoints, capsys, name):
    """The artifact that ships (Atlas 800I A2, float16, MindSpore's own ops: q/k norms, biases, scaled tables), run
    here on MindSpore's CPU float16 kernels against its golden references."""
    from test_check import PASS, run_cli

    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime.check import main as check_main
    from lite_runtime.golden import TOLERANCES

    out = str(tmp_path / name)
    run_export(ExportConfig(checkpoint=family_checkpoints[name], output=out, name=name, seq_length=32, batch_size=2,
                            dtype="float16", device="atlas_800i_a2", prefill_buckets=(16,)))
    code, lines, err = run_cli(check_main, capsys, out, "--backend", "ms", "-q")
    assert code == 0, lines + [err]
    verdict = PASS.match(lines[-1])
    assert verdict and verdict.group(1) == name and verdict.group(5) == "float16"
    assert 1e-6 < float(verdict.group(4)) < TOLERANCES["float16"].rel
