"""CPU folders with 16-bit weights (--device cpu --dtype bfloat16|float16): float32 compute on rounded matrices.

The reference is HF's Qwen2ForCausalLM in float32 with the same matrices rounded to the folder's dtype:
logits within float32's 1e-4 relative and identical greedy tokens, as for a float32 folder, with the kernels' x exact
(float32's form). Where the CPU has AVX512-BF16 a bfloat16 folder's matmuls of several rows round x to bfloat16
(cpu_kernels.bf16_form): as it serves, its logits are held to the limit derived for it at export (golden.json).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from reference import exact_activations, prompts, rel_err, served_limit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4
HALF = ("bfloat16", "float16")


def rounded_hf(checkpoint: str, dtype: str):
    from export.compare import hf_model

    return hf_model(checkpoint, matrices_in=dtype)


def hf_logits(model, row):
    import torch

    with torch.no_grad():
        return model(torch.tensor([row])).logits[0, -1].float().numpy()


def hf_greedy(model, row, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None)
    return [int(t) for t in out[0]]


@pytest.fixture(scope="module")
def half_folders(tmp_path_factory, checkpoints):
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("half")
    folders = {}
    for dtype in HALF:
        out = str(root / f"cpu_{dtype}")
        run_export(ExportConfig(checkpoint=checkpoints["mha_untied"], output=out, name=f"cpu_{dtype}", seq_length=32,
                                batch_size=2, dtype=dtype, device="cpu", prefill_buckets=(8,)))
        folders[dtype] = out
    return folders


@pytest.mark.parametrize("dtype", HALF)
def test_logits_and_greedy_tokens_equal_hf_on_the_rounded_weights(half_folders, checkpoints, dtype):
    from lite_runtime import pipeline

    ckpt = checkpoints["mha_untied"]
    model = rounded_hf(ckpt, dtype)
    pipe = pipeline("text_generation", model=half_folders[dtype], backend="ms")
    rows = prompts(2, [5, 13], seed=31)  # the 8-token bucket's graph runs for neither: 13 tokens take 32
    short = prompts(1, [6], seed=32)[0]  # the 8-token bucket, then the decode step
    with exact_activations():
        step = pipe.infer(rows)
        for got, row in zip(step.logits, rows):
            assert rel_err(got, hf_logits(model, row)) < TOL
        assert pipe.generate([short], max_new_tokens=10, eos_token_id=None).sequences[0] == hf_greedy(model, short,
                                                                                                      10)
        # the rounding is real: the unrounded float32 model is further away than float32's tolerance
        assert rel_err(pipe.infer([short]).logits[0], hf_logits(rounded_hf(ckpt, "float32"), short)) > TOL
    # as it serves (x rounded to bfloat16 at several rows where the CPU has AVX512-BF16): within the folder's limit
    for got, row in zip(pipe.infer(rows).logits, rows):
        assert rel_err(got, hf_logits(model, row)) < served_limit(half_folders[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_matrices_are_stored_in_16_bits_and_the_rest_in_float32(half_folders, dtype):
    """The weights file: every 2-D tensor at 2 bytes per value, norms and biases at 4; the yaml says so."""
    import yaml

    folder = half_folders[dtype]
    doc = yaml.safe_load(open(os.path.join(folder, f"cpu_{dtype}.yaml"), encoding="utf-8"))
    assert (doc["infer"]["dtype"], doc["infer"]["compute_dtype"]) == (dtype, "float32")
    config = doc["model"]["config"]
    e, i, v, layers = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    h, kh = config["num_attention_heads"], config["num_key_value_heads"]
    d = e // h
    matrices = [(v, e), (v, e)] + layers * [(h * d, e), (kh * d, e), (kh * d, e), (e, h * d), (i, e), (i, e), (e, i)]
    vectors = [(e,)] + layers * [(e,), (e,), (h * d,), (kh * d,), (kh * d,)]  # norms, biases

    def stored(shapes, itemsize):  # the weights file: a 64-byte header, each tensor aligned to 64 bytes (export/writers/weights_file.py)
        return sum(-(-int(np.prod(s)) * itemsize // 64) * 64 for s in shapes)

    data = os.path.getsize(os.path.join(folder, f"cpu_{dtype}_variables", "data_0"))
    assert data == 64 + stored(matrices, 2) + stored(vectors, 4)  # no KV cache: the runtime's pool holds it


def test_check_holds_a_half_weights_folder_to_its_limits(half_folders, capsys):
    """float16: float32's limit. bfloat16: limits derived at export from its own arithmetic (golden.json `limits`:
    x exact, and x rounded to bfloat16 as the AVX512-BF16 form rounds it), replayed both ways."""
    from lite_runtime.check import main as check_main

    code = check_main([half_folders["float16"], "--backend", "ms", "-q"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, out
    assert "float32 limit 1e-04" in out[-1] and out[-1].startswith("PASS")
    with open(os.path.join(half_folders["bfloat16"], "golden.json"), encoding="utf-8") as fh:
        limits = json.load(fh)["limits"]
    assert set(limits) == {"exact", "bf16"} and 0 < limits["exact"]["rel"] < TOL <= limits["bf16"]["rel"]
    code = check_main([half_folders["bfloat16"], "--backend", "ms", "-q"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0, out
    # as it serves: the prefill graphs, and the server's pieces (chunk graphs) and a verify's rows (score graphs)
    assert out[-1].startswith("PASS") and re.search(r"again through the prefill, chunk( and score)? graphs with "
                                                    r"bfloat16 activations", out[-1]), out[-1]
    assert f"limit {limits['exact']['rel']:.1e}, derived for this folder" in out[-1]
    assert f"(limit {limits['bf16']['rel']:.1e}, derived for this folder)" in out[-1]
    line = next(x for x in out if x.startswith("activations:"))
    assert "x rounded to bfloat16 in the matmuls of several rows" in line and "@bf16" in line


def test_a_bfloat16_checkpoint_is_copied_bit_for_bit(tmp_path, checkpoints):
    """Weights already in bfloat16 are not rounded again: the folder computes exactly what the checkpoint says."""
    import torch
    from transformers import Qwen2ForCausalLM

    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    src = checkpoints["gqa_tied"]
    model = Qwen2ForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ckpt = tmp_path / "bf16"
    model.save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), ckpt / f)
    out = str(tmp_path / "folder")
    run_export(ExportConfig(checkpoint=str(ckpt), output=out, name="bf16", seq_length=16, batch_size=1,
                            dtype="bfloat16", device="cpu", prefill_buckets=()))
    pipe = pipeline("text_generation", model=out, backend="ms")
    row = prompts(1, [6], seed=2)[0]
    with exact_activations():
        assert rel_err(pipe.infer([row]).logits[0], hf_logits(model.float(), row)) < TOL
    weights = pipe.backend._owned["model.layers.0.mlp.up_proj.weight"].asnumpy()  # bfloat16 -> float32
    assert np.array_equal(weights, model.model.layers[0].mlp.up_proj.weight.float().detach().numpy())


def test_a_cpu_export_keeps_a_16_bit_checkpoints_dtype_by_default(tmp_path, checkpoints):
    """`--device cpu` without --dtype: a bf16 checkpoint gives a bf16-weights folder, a float32 one a float32 folder."""
    import torch
    import yaml
    from transformers import Qwen2ForCausalLM

    src = checkpoints["gqa_tied"]
    ckpt = tmp_path / "bf16"
    Qwen2ForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), ckpt / f)
    for name, checkpoint, expected in (("a", str(ckpt), "bfloat16"), ("b", src, "float32")):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "export", "-q", "--checkpoint", checkpoint, "--output", str(out),
                               "--device", "cpu", "--seq_length", "16", "--prefill_buckets", "none"],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with open(out / f"{name}.yaml", encoding="utf-8") as fh:
            infer = yaml.safe_load(fh)["infer"]
        assert (infer["dtype"], infer["compute_dtype"]) == (expected, "float32")


def test_speculative_auto_is_prompt_lookup_on_float32_and_bfloat16_cpu_folders(half_folders, serve_folder):
    """`--speculative auto` (lite_runtime/serve/cli.py lookup_pays): on where it was measured to pay, float32 and
    bfloat16 CPU folders; off on float16 ones (not measured). (int8 folders: test_quantize.py.)"""
    from lite_runtime import InferConfig
    from lite_runtime.serve.cli import lookup_pays

    assert lookup_pays(InferConfig.from_folder(serve_folder))  # float32
    assert lookup_pays(InferConfig.from_folder(half_folders["bfloat16"]))
    assert not lookup_pays(InferConfig.from_folder(half_folders["float16"]))
