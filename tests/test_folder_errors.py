"""Loading a model folder: every check happens before anything runs, with a one-line error."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from lite_runtime import InferConfig, InferError, InputOfInfer, InferTask, pipeline


@pytest.fixture
def folder(tmp_path, exported):
    dst = tmp_path / "m"
    shutil.copytree(exported["gqa_tied"], dst)
    return dst


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(InferError) as err:
        fn(*args, **kwargs)
    return str(err.value)


def test_truncated_weights(folder):
    data = folder / "gqa_tied_variables" / "data_0"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size // 2])
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{data}: {size // 2} bytes, manifest.json says {size} (truncated or changed copy); re-copy the folder")


def test_truncated_graph(folder):
    graph = folder / "gqa_tied_inc_graph.mindir"
    size = graph.stat().st_size
    graph.write_bytes(graph.read_bytes()[:-10])
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{graph}: {size - 10} bytes, manifest.json says {size} (truncated or changed copy); re-copy the folder")


def test_corrupted_graph(folder):
    graph = folder / "gqa_tied_prefill_graph.mindir"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{graph}: sha256 differs from manifest.json (corrupted copy); re-copy the folder")


def test_a_copy_is_hashed_once_and_hashed_again_after_any_write(folder, tmp_path, monkeypatch):
    """verify_checksums=True trusts a file only while its stat is what it was when its sha256 matched."""
    from lite_runtime import verified

    monkeypatch.setattr(verified, "VERIFIED_CACHE", str(tmp_path / "verified.json"))
    InferConfig.from_folder(str(folder))
    records = json.loads((tmp_path / "verified.json").read_text())
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {os.path.realpath(folder / rel): entry["sha256"] for rel, entry in manifest["files"].items()} == {
        path: record[0] for path, record in records.items()}
    # the same size and modification time, another byte: ctime moves, so the copy is hashed and refused
    graph = folder / "gqa_tied_prefill_graph.mindir"
    before = graph.stat()
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    os.utime(graph, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{graph}: sha256 differs from manifest.json (corrupted copy); re-copy the folder")
    assert error_of(InferConfig.from_folder, str(folder), verify_checksums="sometimes") == (
        "verify_checksums 'sometimes' is not one of True, False, 'always'")


def test_missing_graph(folder):
    (folder / "gqa_tied_inc_graph.mindir").unlink()
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{folder / 'gqa_tied_inc_graph.mindir'}: missing (listed in manifest.json); re-copy the folder")


def test_second_yaml_and_extra_graph(folder):
    (folder / "other.yaml").write_text("infer: {}\n")
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{folder}: expected exactly one yaml, gqa_tied.yaml, found gqa_tied.yaml, other.yaml; remove the others")
    (folder / "other.yaml").unlink()
    shutil.copy(folder / "gqa_tied_inc_graph.mindir", folder / "old_inc_graph.mindir")
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{folder / 'old_inc_graph.mindir'}: graph not listed in manifest.json; remove it or re-export the folder")


def test_yaml_that_disagrees_with_the_graphs(folder):
    yaml_path = folder / "gqa_tied.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("  seq_length: 32\n  batch_size: 2\n",
                                                       "  seq_length: 64\n  batch_size: 2\n"))
    manifest = json.loads((folder / "manifest.json").read_text())  # a consistent manifest for the edited yaml
    import hashlib
    data = yaml_path.read_bytes()
    manifest["files"]["gqa_tied.yaml"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{yaml_path}: infer.kv_cache's 4 blocks of 8 do not hold seq_length 64; re-export the folder")


def test_family_is_read_from_the_folder_never_guessed(folder):
    """yaml infer.model_name picks the input mapping; the manifest's family must agree, and neither may be missing."""
    import hashlib

    yaml_path = folder / "gqa_tied.yaml"
    original = yaml_path.read_text()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["family"] == "qwen2" and "  model_name: qwen2\n" in original

    def write_yaml(text):
        yaml_path.write_text(text)
        data = yaml_path.read_bytes()
        manifest["files"]["gqa_tied.yaml"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (folder / "manifest.json").write_text(json.dumps(manifest))

    write_yaml(original.replace("  model_name: qwen2\n", "  model_name: llama\n"))
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{yaml_path}: infer.model_name 'llama' disagrees with manifest.json family 'qwen2'; re-export the folder")
    write_yaml(original.replace("  model_name: qwen2\n", ""))
    assert error_of(InferConfig.from_folder, str(folder)) == (
        f"{yaml_path}: infer.model_name is missing, so the model family (the input mapping) is unknown; "
        "re-export the folder")


def test_not_a_folder(tmp_path):
    assert error_of(pipeline, "text_generation", model=str(tmp_path), backend="ms") == (
        f"{tmp_path / 'manifest.json'}: missing; this is not a model folder written by python -m export")
    assert error_of(pipeline, "text_generation", model=str(tmp_path / "nope"), backend="ms") == (
        f"model {str(tmp_path / 'nope')!r}: not a model folder; pass a folder written by python -m export, "
        "(prefill_path, increment_path) or an InferConfig")


def test_unknown_task_backend_and_model_name(exported):
    folder = exported["gqa_tied"]
    assert error_of(pipeline, "summarization", model=folder) == (
        "task 'summarization' is not supported; supported: text_generation")
    assert error_of(pipeline, "text_generation", model=folder, backend="onnx") == (
        "backend 'onnx' is not one of mslite, ms, auto")
    assert error_of(InputOfInfer.get, "gemma") == (
        "model_name 'gemma' has no input mapping; known: llama, qwen2, qwen2_moe, qwen3, qwen3_moe")
    assert error_of(pipeline, "text_generation", model=folder, backend="ms", model_name="glm") == (
        "model_name 'glm' has no input mapping; known: llama, qwen2, qwen2_moe, qwen3, qwen3_moe")
    assert error_of(InferTask.get_infer_task, "chat", None) == "task 'chat' is not supported; supported: text_generation"
    assert error_of(InferConfig.from_folder, folder, warm_up="some") == (
        "warm_up 'some' is not one of auto, smallest, all, none")
    assert InferTask.support_list() == ["text_generation"] and InferTask.check_task_valid("text_generation")


def test_mslite_not_installed_says_what_to_do(exported):
    """mindspore_lite is really absent here (not on PyPI for this Python): the user is told how to get it."""
    from lite_runtime.backends import mslite_importable

    assert not mslite_importable()
    from export.devices import PROFILES

    config = InferConfig.from_folder(exported["gqa_tied"], target="Ascend",
                                     ge_config_path=PROFILES["atlas_800i_a2"].ini_path)
    assert error_of(pipeline, "text_generation", model=config, backend="mslite") == (
        "backend 'mslite' needs mindspore_lite, which cannot be imported here: install the mindspore_lite wheel "
        "that matches your CANN from https://www.mindspore.cn/lite/docs/en/master/use/downloads.html and source "
        "CANN's set_env.sh, or pass backend 'ms' to run on the CPU with MindSpore")


def test_prompt_too_long_and_limits_that_cannot_fit(pipes):
    pipe = pipes["gqa_tied"]  # batch 2, seq_length 32
    assert error_of(pipe.generate, [[1] * 33]) == (
        "row 0 has 33 tokens, more than the graphs' seq_length 32; shorten the prompt or re-export with a "
        "larger --seq_length")
    assert error_of(pipe.generate, [[1] * 20], max_new_tokens=20) == (
        "row 0: 20 prompt tokens + max_new_tokens 20 = 40 exceeds the graphs' seq_length 32; lower it or "
        "re-export with --seq_length 40")
    assert error_of(pipe.generate, [[1] * 20], max_length=64) == (
        "row 0: max_length 64 exceeds the graphs' seq_length 32; lower it or re-export with --seq_length 64")
    assert error_of(pipe.generate, [[1] * 20], max_length=10) == (
        "row 0: max_length 10 leaves no room after its 20 prompt tokens; raise max_length or use max_new_tokens")
    assert error_of(pipe.infer, [[1], [2], [3]]) == (
        "3 rows but the graphs were exported with batch_size 2; send at most 2 or re-export with --batch_size 3")
    assert error_of(pipe.generate, [[1, 99999]]) == (
        "row 0 has a token id outside [0, 512); was it made by another tokenizer?")
    assert error_of(pipe.generate, "abc") == (
        "input_ids is a string; generate() and infer() take token ids: call the pipeline itself for text, "
        "pipe(text), or tokenize it first")
    assert error_of(pipe.infer, ["abc"]) == "row 0 is a string; input_ids are token ids: call pipe(text) for text"
    assert error_of(pipe.generate, [[1.5]]) == (
        "row 0 has a token id 1.5 that is not an integer; input_ids are integer token ids from the tokenizer")
    import numpy as np

    assert error_of(pipe.generate, np.array([[1.0, 2.0]])) == (
        "row 0 has a token id 1.0 that is not an integer; input_ids are integer token ids from the tokenizer")
    assert error_of(pipe.generate, [[1, True]]) == (
        "row 0 has a token id True that is not an integer; input_ids are integer token ids from the tokenizer")
    # a prompt that fills the cache exactly still yields its one token
    out = pipe.generate([[1] * 31])
    assert len(out.sequences[0]) == 32 and out.finish_reasons == ["length"]


def test_a_step_checks_the_token_it_adds(pipes):
    """infer() driving a decode loop checks only the token a row adds to what its cache row holds (the rest was
    checked when it was sent): that token is still refused as a whole row's would be, and a row that does not
    extend its cache row is checked whole."""
    pipe = pipes["gqa_tied"]
    rows = [[5, 6, 7], [8, 9]]
    step = pipe.infer(rows)
    grown = [r + [t] for r, t in zip(rows, step.next_tokens)]
    assert error_of(pipe.infer, [grown[0], grown[1][:-1] + [99999]]) == (
        "row 1 has a token id outside [0, 512); was it made by another tokenizer?")
    assert error_of(pipe.infer, [grown[0], grown[1][:-1] + [2.5]]) == (
        "row 1 has a token id 2.5 that is not an integer; input_ids are integer token ids from the tokenizer")
    assert error_of(pipe.infer, [grown[0], [True] + grown[1][1:]]) == (
        "row 1 has a token id True that is not an integer; input_ids are integer token ids from the tokenizer")
    assert pipe.infer(grown).next_tokens == pipe.infer(grown).next_tokens  # the second is a prefill of the same


def test_graph_paths_without_a_folder(exported, checkpoints):
    folder = exported["mha_untied"]
    names = ("mha_untied_prefill_graph.mindir", "mha_untied_inc_graph.mindir")
    paths = tuple(os.path.join(folder, n) for n in names)
    assert error_of(pipeline, "text_generation", model=paths, backend="ms") == (
        "infer_seq_length and batch_size are needed when loading graph files without a model folder; pass the "
        "values the graphs were exported with")
    assert error_of(pipeline, "text_generation", model=paths, backend="ms", infer_seq_length=32, batch_size=2,
                    target="CPU") == (
        f"{paths[0]}: graph files without their model folder cannot run: the paged KV cache's block size and layout "
        "are the folder's (its yaml's infer.kv_cache); load the folder (pipeline(model=<folder>), run_infer_main.py "
        "--model_dir)")


@pytest.mark.parametrize("version", [1, 2])
def test_a_folder_exported_before_the_paged_cache_is_refused_with_re_export(folder, version):
    """Format 1 (float) and 2 (quantized) folders hold their cache as rows in the weights file: refused at load by
    name, never served another way."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format_version"] = version
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert error_of(pipeline, "text_generation", model=str(folder), backend="ms") == (
        f"{folder / 'manifest.json'}: format version {version} was exported before the paged KV cache (its cache is "
        "rows in the weights file, which this runtime does not run); re-export the folder with this version's python "
        "-m export")


def test_a_kv_pool_that_cannot_hold_one_request_or_the_memory_is_refused_at_load(folder):
    """--num_blocks below one longest request (and the null block), a --kv_cache_memory larger than what is free, and
    both at once: one line each, with the numbers, before any graph loads."""
    from lite_runtime.folder import load_folder
    from lite_runtime.engine.kv_pool import GIB, plan_pool

    spec = load_folder(str(folder)).kv_cache  # blocks of 8 positions, 4 per sequence of 32
    where = str(folder)
    assert error_of(pipeline, "text_generation", model=where, backend="ms", num_blocks=4) == (
        f"{where}: a KV cache pool of 4 blocks (24 tokens, 0.000 GiB) cannot hold one request of seq_length 32 (4 "
        "blocks of 8, and the null block); give --num_blocks 5 or more (--kv_cache_memory 0.000 or more)")
    assert error_of(plan_pool, spec, 32, 2, where, kv_cache_memory=2.0, available=GIB) == (
        f"{where}: --kv_cache_memory 2 GiB is more than the 1.0 GiB free here (after the weights); give less, or "
        "--num_blocks")
    assert error_of(plan_pool, spec, 32, 2, where, num_blocks=10 ** 9, available=GIB) == (
        f"{where}: --num_blocks 1000000000 is {10 ** 9 * spec.block_bytes / GIB:.2f} GiB of KV cache, more than the "
        "1.0 GiB free here (after the weights); give fewer")
    assert error_of(plan_pool, spec, 32, 2, where, num_blocks=9, kv_cache_memory=1.0) == (
        "give --num_blocks or --kv_cache_memory, not both")
    # the smallest pool that holds one request runs it: a prompt and its answer fill the sequence's 4 blocks
    pipe = pipeline("text_generation", model=where, backend="ms", num_blocks=5)
    assert pipe.runner.pool.capacity == 4
    out = pipe.generate([[5, 6, 7]], max_new_tokens=29, eos_token_id=[])
    assert len(out.sequences[0]) == 32 and pipe.runner.pool.num_free == 4
