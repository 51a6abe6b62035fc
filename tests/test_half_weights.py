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


def rounded_hf(checkpoint: str, dtype: str, kv_in=None):
    """HF on the matrices rounded to `dtype`, its keys and values to `kv_in` (default: as a CPU folder of `dtype`
    keeps its KV cache: bfloat16 for bfloat16 weights, export/config.py kv_dtype)."""
    from export.compare import hf_model

    return hf_model(checkpoint, matrices_in=dtype, kv_in=kv_in or ("bfloat16" if dtype == "bfloat16" else "float32"))


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


def calls(folder):
    """The CPU kernel functions a folder's graphs call (test_cpu_kernels.custom_funcs over each graph)."""
    from test_cpu_kernels import custom_funcs

    return {f.rpartition(":")[2] for g in os.listdir(folder) if g.endswith(".mindir")
            for f in custom_funcs(os.path.join(folder, g))[0]}


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
        # the rounding is real: the unrounded float32 model is further away than float32's tolerance, and so is a
        # bfloat16 folder from HF with float32 keys and values
        assert rel_err(pipe.infer([short]).logits[0], hf_logits(rounded_hf(ckpt, "float32"), short)) > TOL
        if dtype == "bfloat16":
            assert rel_err(pipe.infer([short]).logits[0], hf_logits(rounded_hf(ckpt, dtype, "float32"), short)) > TOL
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
    x exact, and x rounded to bfloat16 as the AVX512-BF16 form rounds it; keys and values rounded to bfloat16 as its
    KV cache holds them), replayed both ways."""
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
    # its KV cache: bfloat16 as it serves (the fast replay, whose limit's lane rounds keys and values so), float32
    # caches in the replays with x exact (float32's arithmetic end to end, against float32's limit)
    line = next(x for x in out if x.startswith("KV cache:"))
    assert line.endswith("; bfloat16 as the folder serves it in the replays with its fast path's activations, "
                         "float32 in those with x exact"), line
    assert "each key and value rounded to bfloat16 as its KV cache holds them" in limits["bf16"]["from"]


def test_a_bfloat16_checkpoint_is_copied_bit_for_bit(tmp_path, checkpoints):
    """Weights already in bfloat16 are not rounded again: the folder computes exactly what the checkpoint says."""
    import torch
    from transformers import Qwen2ForCausalLM

    from export.compare import kv_rounding_attention
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
    reference = model.float()  # its keys and values as the folder's bfloat16 KV cache holds them
    reference.set_attn_implementation(kv_rounding_attention("bfloat16"))
    with exact_activations():
        assert rel_err(pipe.infer([row]).logits[0], hf_logits(reference, row)) < TOL
    bits = pipe.backend._weights["model.layers.0.mlp.up_proj.weight"]  # as our ops read it: bfloat16 as uint16
    weights = (bits.astype(np.uint32) << 16).view(np.float32)
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


def test_a_bfloat16_folder_keeps_its_kv_cache_in_bfloat16_unless_asked(half_folders, tmp_path, checkpoints, capsys):
    """A CPU folder of a bfloat16 dtype keeps its KV cache in bfloat16 (the yaml's infer.kv_cache, whose pool
    sizing halves per token) and its graphs call the cache's ops by their bfloat16 caches' names (cpu_kernels.KV16_OPS:
    an installation without them refuses the folder at load); a float16 one keeps float32 caches;
    --kv_cache_dtype float32 keeps a bfloat16 folder's in float32. Asking for bfloat16 caches where they cannot run
    is refused at config time, in one line naming the option, and leaves nothing on disk."""
    import cpu_kernels
    import yaml

    from export.config import ExportConfig
    from export.errors import ExportError
    from export.pipeline import run_export
    from lite_runtime.folder import load_folder

    kv16 = set(cpu_kernels.KV16_OPS.values())
    folder = load_folder(half_folders["bfloat16"], verify=False)
    assert folder.kv_cache.dtype == "bfloat16"
    assert folder.kv_cache.block_bytes == 2 * folder.kv_cache.layers * folder.kv_cache.block_size * \
        folder.kv_cache.kv_heads * folder.kv_cache.head_dim * 2
    called = calls(half_folders["bfloat16"])
    assert called & kv16 and not called & set(cpu_kernels.KV16_OPS)
    assert load_folder(half_folders["float16"], verify=False).kv_cache.dtype == "float32"
    assert not calls(half_folders["float16"]) & kv16

    out = str(tmp_path / "f32kv")
    run_export(ExportConfig(checkpoint=checkpoints["mha_untied"], output=out, name="f32kv", seq_length=16,
                            batch_size=1, dtype="bfloat16", device="cpu", prefill_buckets=(), kv_cache_dtype="float32"))
    assert load_folder(out, verify=False).kv_cache.dtype == "float32" and not calls(out) & kv16

    for extra, want in ((dict(kv_cache_dtype="bfloat16", dtype="float32", cpu_kernels="off"),
                         "--kv_cache_dtype bfloat16: bfloat16 caches are read by the CPU kernels only; drop "
                         "--cpu_kernels off or the option"),
                        (dict(kv_cache_dtype="bfloat16", device="atlas_800i_a2"),
                         "--kv_cache_dtype bfloat16: on Atlas the KV cache is the compute dtype (--dtype bfloat16, as "
                         "ReshapeAndCache and PagedAttention take it); drop the option"),
                        (dict(kv_cache_dtype="float64"),
                         "--kv_cache_dtype 'float64' is not one of auto, float32, bfloat16")):
        bad = str(tmp_path / "bad")
        kwargs = dict(checkpoint=checkpoints["mha_untied"], output=bad, name="bad", seq_length=16, batch_size=1,
                      dtype="bfloat16", device="cpu", prefill_buckets=())
        kwargs.update(extra)
        with pytest.raises(ExportError) as err:
            run_export(ExportConfig(**kwargs))
        assert str(err.value) == want
        assert not os.path.exists(bad) and not [p for p in os.listdir(tmp_path) if "bad" in p]
    with open(os.path.join(half_folders["bfloat16"], "cpu_bfloat16.yaml"), encoding="utf-8") as fh:
        assert yaml.safe_load(fh)["infer"]["kv_cache"]["dtype"] == "bfloat16"


def test_an_int8_folder_of_a_bfloat16_dtype_keeps_a_bfloat16_kv_cache_and_passes_check(tmp_path, checkpoints):
    """--quantize int8 of a bfloat16 --dtype: the KV cache bfloat16 too, its quantized ops called by their bfloat16
    caches' names (cpu_kernels.KV16_OPS; banded at load where the CPU takes int8 in bands: ...Kv16R16), and `check`
    passes it: x exact with float32 caches against the tight limit, then as it serves (x in int8/int16, bfloat16
    caches) against the fast lane's, which rounds keys and values as the cache does."""
    import cpu_kernels

    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime.check import run_check
    from lite_runtime.folder import load_folder

    out = str(tmp_path / "int8")
    run_export(ExportConfig(checkpoint=checkpoints["mha_untied"], output=out, name="int8", seq_length=32,
                            batch_size=2, dtype="bfloat16", device="cpu", prefill_buckets=(8,), quantize="int8"))
    assert load_folder(out, verify=False).kv_cache.dtype == "bfloat16"
    names = calls(out)
    quant_kv16 = {cpu_kernels.fused_op(f, True, True) for f in (cpu_kernels.DECODE_QKV, cpu_kernels.DECODE_LAYER,
                                                                 cpu_kernels.DECODE_LAYER_VALID)}
    assert quant_kv16 == {"MsliteLlmQuantPagedDecodeQkvKv16", "MsliteLlmQuantPagedDecodeLayerKv16",
                          "MsliteLlmQuantPagedDecodeLayerValidKv16"}
    assert names & quant_kv16 and not names & set(cpu_kernels.QUANTIZED_OPS.values()) - {
        cpu_kernels.QUANTIZED_OPS[cpu_kernels.GEMV_ADD], cpu_kernels.QUANTIZED_OPS[cpu_kernels.QKV_ROPE],
        cpu_kernels.QUANTIZED_OPS[cpu_kernels.QKV_ROPE_VALID], cpu_kernels.QUANTIZED_OPS[cpu_kernels.NORM_SWIGLU],
        cpu_kernels.QUANTIZED_OPS[cpu_kernels.DECODE_TAIL]}
    report = run_check(out, backend="ms")
    assert report.passed, report.verdict()
    assert report.info["kv_cache_dtype"] == {"replays with x exact": "float32", "fast replay": "bfloat16"}


def test_the_kv_cache_dtype_switches_over_the_same_weights(half_folders, checkpoints):
    """check's x-exact replays run a bfloat16-cache folder on float32 caches, its serving replay on the folder's own,
    in one load (ModelRunner.use_cache_dtype: the graphs rebuilt, every weight Parameter kept, the pool's contents
    forgotten): each phase equals HF with its keys and values as that cache holds them; refused while a sequence holds
    blocks."""
    import dataclasses

    import mindspore as ms

    from lite_runtime import InferConfig, pipeline
    from lite_runtime.errors import InferError
    from lite_runtime.folder import is_kv_cache

    folder = half_folders["bfloat16"]
    gen = pipeline("text_generation", backend="ms",
                   model=dataclasses.replace(InferConfig.from_folder(folder, backend="ms"), kv_cache_dtype="float32"))
    rows = prompts(2, [5, 13], seed=33)
    ckpt = checkpoints["mha_untied"]

    def caches():
        return {p.dtype for n, p in gen.backend._owned.items() if is_kv_cache(n)}

    with exact_activations():
        f32 = gen.infer(rows).logits
        assert caches() == {ms.float32}
        weights = {n: p for n, p in gen.backend._owned.items() if not is_kv_cache(n)}
        with pytest.raises(ValueError, match="in use: release every sequence first"):
            gen.runner.use_cache_dtype(None)  # infer() keeps its rows' blocks
        gen.release()
        gen.runner.use_cache_dtype(None)
        bf16 = gen.infer(rows).logits
        assert caches() == {ms.bfloat16}
        assert all(gen.backend._owned[n] is p for n, p in weights.items())
    for got32, got16, row in zip(f32, bf16, rows):
        assert rel_err(got32, hf_logits(rounded_hf(ckpt, "bfloat16", "float32"), row)) < TOL
        assert rel_err(got16, hf_logits(rounded_hf(ckpt, "bfloat16"), row)) < TOL
    with pytest.raises(InferError, match="only float32"):
        gen.runner.use_cache_dtype("float16")
