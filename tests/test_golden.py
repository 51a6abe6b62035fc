"""Golden references written at export: the plan's rules, the float32 numpy reference against HF, the manifest."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from export.writers.golden import plan_batches
from reference import hf_model
from hiding import hide

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def golden_of(folder: str) -> dict:
    with open(os.path.join(folder, "golden.json")) as fh:
        return json.load(fh)


@pytest.mark.parametrize("sizes, seq, batch, want", [
    # every prefill graph gets a batch whose longest row needs that graph; rows of different lengths
    ((8, 16, 32), 32, 2, [(8, [6, 3], 16), (16, [12, 6], 16), (32, [17, 8], 16)]),
    ((32,), 32, 1, [(32, [17], 16)]),
    # a long folder: three quarters of each graph, capped at 256 tokens, but always past the graph below
    ((32, 128, 512, 2048), 2048, 1, [(32, [24], 16), (128, [96], 16), (512, [256], 16), (2048, [513], 16)]),
    ((1024,), 1024, 4, [(1024, [256, 192, 128, 64], 16)]),
    # a short cache: prompts shrink to leave 16 steps, but a graph's lead must still need that graph,
    # so the 16-token graph's prompt fills the cache and has one step (the prefill's)
    ((15, 16), 16, 1, [(15, [1], 16), (16, [16], 1)]),
])
def test_plan(sizes, seq, batch, want):
    assert plan_batches(sizes, seq, batch) == want


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_golden_equals_hf(exported, checkpoints, name):
    """The numpy reference's greedy tokens and top-k logits against HF's forward over prompt + tokens."""
    import torch

    doc = golden_of(exported[name])
    assert (doc["format"], doc["format_version"], doc["prompt_source"], doc["top_k"]) == (
        "mslite-llm-golden", 1, "tokenizer.json", 8)
    worst = 0.0
    for batch in doc["batches"]:
        for row in batch["rows"]:
            with torch.no_grad():
                logits = hf_model(checkpoints[name])(torch.tensor([row["prompt"] + row["tokens"]])).logits[0].numpy()
            n = len(row["prompt"])
            for t, token in enumerate(row["tokens"]):
                ref = logits[n - 1 + t]
                assert row["top_ids"][t] == [int(i) for i in np.argsort(-ref, kind="stable")[:8]]
                assert token == row["top_ids"][t][0]
                worst = max(worst, float(np.abs(ref[row["top_ids"][t]] - row["top_logits"][t]).max()
                                     / np.abs(ref).max()))
                assert row["scale"][t] == pytest.approx(float(np.abs(ref).max()), rel=1e-5)
    assert worst < 1e-5


def test_golden_covers_every_prefill_graph(exported):
    doc = golden_of(exported["gqa_tied_buckets"])  # graphs of 8, 16 and 32 tokens, batch 2
    assert [(b["graph"], [len(r["prompt"]) for r in b["rows"]], b["steps"]) for b in doc["batches"]] == [
        ("prefill_8", [6, 3], 16), ("prefill_16", [12, 6], 16), ("prefill_32", [17, 8], 16)]
    assert all(len(r["tokens"]) == b["steps"] for b in doc["batches"] for r in b["rows"])


def test_manifest_lists_golden_and_exporter(exported):
    import mindspore

    folder = exported["gqa_tied"]
    with open(os.path.join(folder, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["golden"] == "golden.json"
    with open(os.path.join(folder, "golden.json"), "rb") as fh:
        data = fh.read()
    assert manifest["files"]["golden.json"] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    from importlib.metadata import version

    assert manifest["exported_with"] == {"mindspore": mindspore.__version__, "mslite_llm": version("mslite-llm")}


def test_bf16_checkpoint_golden_uses_its_exact_weights(tmp_path, checkpoints):
    """A bf16 checkpoint is widened exactly: the golden equals HF computing in float32 on the same bf16 weights."""
    import torch
    from transformers import Qwen2ForCausalLM

    from export.config import ModelConfig
    from export.writers.golden import compute

    model = Qwen2ForCausalLM.from_pretrained(checkpoints["gqa_tied"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    cfg = ModelConfig.from_file(str(tmp_path / "bf16" / "config.json"))
    doc = compute(cfg, str(tmp_path / "bf16"), [16], 16, 1)
    row = doc["batches"][0]["rows"][0]
    assert doc["prompt_source"] == "random"  # no tokenizer.json in this copy: seeded random ids
    with torch.no_grad():
        ref = model.float()(torch.tensor([row["prompt"]])).logits[0, -1].numpy()
    assert row["tokens"][0] == int(ref.argmax())
    assert np.abs(ref[row["top_ids"][0]] - row["top_logits"][0]).max() / np.abs(ref).max() < 1e-5


HIDE_TORCH = hide(("torch", "transformers")) + """
from export.__main__ import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] in HIDDEN for m in sys.modules)
sys.exit(code)
"""


def test_export_with_golden_needs_no_torch(tmp_path, checkpoints):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-c", HIDE_TORCH, "-q", "--checkpoint", checkpoints["mha_untied"],
                           "--output", str(out), "--device", "cpu", "--seq_length", "24"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # seq_length 24 on cpu gets the default 16-token bucket: one more graph, and a golden prompt per graph
    assert proc.stdout.startswith(f"exported {out}: 16 files, ") and "golden references: 2 prompts in " in proc.stdout
    assert golden_of(str(out))["batches"][0]["rows"][0]["tokens"]


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_reference_reads_exactly_the_networks_weights(checkpoints, name):
    """The numpy reference and the MindSpore network expect the same checkpoint tensors, names and shapes."""
    from export.config import ModelConfig
    from export.network.model import CausalLM
    from export.writers.reference import NumpyDecoder

    cfg = ModelConfig.from_file(os.path.join(checkpoints[name], "config.json"))
    net = CausalLM(cfg, 1, 8)
    params = {p.name: tuple(p.shape) for p in net.get_parameters() if not p.name.endswith(("key_cache", "value_cache"))}
    assert NumpyDecoder(cfg, {}, 8).weight_shapes() == params
