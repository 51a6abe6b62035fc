"""Shared fixtures: tiny random Qwen2 checkpoints written here, their HF reference, exported folders."""
from __future__ import annotations

import os

import pytest

from export.checkpoints import random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the files that run longest go first (measured: the README end to end ~8.5 min, then these ~1.5-2.5 min each):
# under xdist (the test command's `-n 2 --dist loadfile`) the README then runs beside the rest instead of after it
FIRST = ("test_readme.py", "test_quantize.py", "test_atlas_fused.py", "test_tensor_parallel.py", "test_export.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would order files by their number of tests instead
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(FIRST)))  # stable: the rest as found


# name -> make_checkpoint settings; GQA and MHA, tied and untied heads
CHECKPOINTS = {
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, seed=0),
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, seed=1),
}


@pytest.fixture(scope="session")
def tokenizer():
    return random_checkpoint.build_tokenizer()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: random_checkpoint.make_checkpoint(str(root / name), tokenizer=tokenizer, **kw)
            for name, kw in CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def exported(tmp_path_factory, checkpoints):
    """One model folder per checkpoint (cpu profile, fp32, batch 2, seq_length 32, KV blocks of 8: a sequence spans
    four), and one with buckets."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("model_dirs")
    plans = {name: (ckpt, ()) for name, ckpt in checkpoints.items()}
    plans["gqa_tied_buckets"] = (checkpoints["gqa_tied"], (8, 16))  # prompt-length buckets 8 / 16 / 32
    folders = {}
    for name, (ckpt, buckets) in plans.items():
        out = str(root / name)
        run_export(ExportConfig(checkpoint=ckpt, output=out, name=name, seq_length=32, batch_size=2,
                                dtype="float32", device="cpu", prefill_buckets=buckets, block_size=8))
        folders[name] = out
    return folders


@pytest.fixture(scope="session")
def serve_folder(tmp_path_factory, checkpoints):
    """The server's folder: gqa_tied at batch 4, seq_length 64, buckets 16 / 32 / 64 (slot graphs of three sizes), KV
    blocks of 8 (prefix caching shares whole blocks)."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    out = str(tmp_path_factory.mktemp("serve") / "serve4")
    run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="serve4", seq_length=64,
                            batch_size=4, dtype="float32", device="cpu", prefill_buckets=(16, 32), block_size=8))
    return out


@pytest.fixture(scope="session")
def serve_pipe(serve_folder):
    from lite_runtime import pipeline

    return pipeline("text_generation", model=serve_folder, backend="ms")


@pytest.fixture(scope="session")
def pipes(exported):
    """One loaded `ms` pipeline per exported folder, shared: loading compiles both graphs."""
    from lite_runtime import pipeline

    return {name: pipeline("text_generation", model=folder, backend="ms") for name, folder in exported.items()}


@pytest.fixture(scope="session", autouse=True)
def graph_mode():
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.fixture(scope="session")
def atlas_exported(tmp_path_factory, checkpoints):
    """Folders for Atlas 800I A2 from the gqa_tied checkpoint: float16 (the profile's default, the artifact that
    ships: the fused graph form, run here with CPU stand-ins for Ascend's fused operators), the same in the plain
    form (MindSpore's CPU float16 kernels), and bfloat16 (exported here, cannot run here)."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("atlas_dirs")
    folders = {}
    for key, dtype, graph in (("float16", "float16", None), ("float16_plain", "float16", "plain"),
                              ("bfloat16", "bfloat16", None)):
        out = str(root / f"atlas_{key}")
        run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name=f"atlas_{key}", seq_length=32,
                                batch_size=2, dtype=dtype, device="atlas_800i_a2", prefill_buckets=(8,), graph=graph,
                                block_size=16))
        folders[key] = out
    return folders


@pytest.fixture(scope="session")
def score_folders(tmp_path_factory, checkpoints):
    """gqa_tied at seq_length 64 with score graphs of 4 and 16 tokens (verifies of up to 3 and 15 drafts); mha_untied
    the same (another model, the same tokenizer: a poor draft); gqa_tied without score graphs; and a checkpoint with
    another tokenizer but the same vocab_size."""
    from export.checkpoints import random_checkpoint
    from export.config import ExportConfig
    from export.pipeline import run_export

    root = tmp_path_factory.mktemp("speculative")
    other_tok = random_checkpoint.make_checkpoint(str(root / "other_tok_ckpt"), seed=3,
                                                  tokenizer=random_checkpoint.build_tokenizer(vocab_size=300))
    plans = {"target": (checkpoints["gqa_tied"], (4, 16)), "draft": (checkpoints["mha_untied"], (4, 16)),
             "no_score": (checkpoints["gqa_tied"], ()), "other_tok": (other_tok, (4,))}
    out = {}
    for name, (ckpt, scores) in plans.items():
        out[name] = str(root / name)
        run_export(ExportConfig(checkpoint=ckpt, output=out[name], name=name, seq_length=64, batch_size=2,
                                dtype="float32", device="cpu", prefill_buckets=(), chunk_sizes=(8,),
                                score_sizes=scores))
    return out
