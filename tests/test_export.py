"""python -m export: folder contents, manifest checksums, graphs against HF, every bad input's error."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from export.__main__ import main
from reference import exact_activations, hf_last_logits, prompts, rel_err, right_pad

TOL = 1e-4


def with_local_kernels(folder: str, graph: str, work: str) -> str:
    """`graph` as plain MindSpore can load it here: a copy in `work` whose Custom ops name this machine's
    cpu_kernels library (graphs store its bare name), next to a hard link to the folder's weights file
    (MindSpore refuses weights behind a symlink that leaves the graph's folder)."""
    import cpu_kernels
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(os.path.join(folder, graph), "rb") as fh:
        model.ParseFromString(fh.read())
    cpu_kernels.retarget(model, cpu_kernels.local_func)
    os.makedirs(work, exist_ok=True)
    for entry in os.listdir(folder):
        if entry.endswith("_variables") and not os.path.exists(os.path.join(work, entry)):
            os.makedirs(os.path.join(work, entry))
            for data in os.listdir(os.path.join(folder, entry)):
                os.link(os.path.join(folder, entry, data), os.path.join(work, entry, data))
    with open(os.path.join(work, graph), "wb") as fh:
        fh.write(model.SerializeToString())
    return os.path.join(work, graph)


def graph_cells(folder: str, work: str):
    """The seq_length prefill graph and the inc graph, each loaded on its own with mindspore.load + GraphCell."""
    import mindspore as ms
    from mindspore import nn

    with open(os.path.join(folder, "manifest.json")) as fh:
        graphs = sorted((g for g in json.load(fh)["graphs"] if not g.get("rows")),  # the batch_size graphs
                        key=lambda g: (g["role"] != "prefill", -g["tokens"]))
    with open(os.path.join(folder, manifest_yaml(folder))) as fh:
        seq_length = yaml.safe_load(fh)["infer"]["seq_length"]
    cells = tuple(nn.GraphCell(ms.load(with_local_kernels(folder, g["file"], work))) for g in (graphs[0], graphs[-1]))
    for cell in cells:
        cell.seq_length = seq_length
    return cells


def manifest_yaml(folder: str) -> str:
    with open(os.path.join(folder, "manifest.json")) as fh:
        return json.load(fh)["yaml"]


def hand_off_cache(src, dst) -> None:
    """The KV cache Parameters of the prefill cell into the incremental cell (GraphCells never share)."""
    dst_params = {p.name: p for p in dst.get_parameters()}
    for p in src.get_parameters():
        if p.name.endswith(("key_cache", "value_cache")):
            dst_params[p.name].set_data(p)


def run(cell, ids, lengths, block_size=64, written=None):
    """A prefill (ids [B, n]) or decode step (ids [B, 1]) of a graph loaded on its own: row b's sequence in blocks
    1 + b*M .. (b + 1)*M of the caches (the graph's nominal pool holds 1 + B*M), each token written at its slot: a
    prompt's positions 0..len-1 (padding nowhere), a step's position len-1 (`written`: the positions, default as
    said)."""
    import mindspore as ms

    ids = np.asarray(ids, np.int32)
    b, n = ids.shape
    m = -(-cell_seq_length(cell) // block_size)
    tables = np.array([[1 + r * m + j for j in range(m)] for r in range(b)], np.int32)
    slots = np.full((b, n), -1, np.int32)
    for r, length in enumerate(lengths):
        for i, pos in enumerate(range(length) if n > 1 else [length - 1]):
            slots[r, i] = tables[r, pos // block_size] * block_size + pos % block_size
    return cell(ms.Tensor(ids), ms.Tensor(np.asarray(lengths, np.int32)), ms.Tensor(tables),
                ms.Tensor(slots.reshape(-1))).asnumpy()


def cell_seq_length(cell) -> int:
    """The sequence length a graph's caches serve: blocks per sequence (its block table's width) times block size."""
    return cell.seq_length


def export_cli(capsys, *args) -> tuple:
    code = main(["-q", *args])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


# --- a good export -----------------------------------------------------------------------------

def test_folder_contents_and_manifest(exported):
    folder = exported["gqa_tied"]
    files = sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)
    assert files == sorted([
        "gqa_tied.yaml", "gqa_tied_prefill_graph.mindir", "gqa_tied_inc_graph.mindir", "gqa_tied_inc_1rows_graph.mindir",
        "gqa_tied_chunk_8_graph.mindir",
        "gqa_tied_chunk_graph.mindir", "gqa_tied_score_8_graph.mindir", "gqa_tied_score_graph.mindir",
        "gqa_tied_variables/data_0",
        "config.ini", "manifest.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "generation_config.json", "golden.json"])
    with open(os.path.join(folder, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert manifest["format_version"] == 3 and manifest["yaml"] == "gqa_tied.yaml"
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert {g["variables"] for g in manifest["graphs"]} == {"gqa_tied_variables/data_0"}
    for rel, entry in manifest["files"].items():
        with open(os.path.join(folder, rel), "rb") as fh:
            data = fh.read()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, rel
    specs = {(g["role"], g["tokens"]): (g["inputs"], g["outputs"]) for g in manifest["graphs"]
             if g["role"] != "inc" or not g.get("rows")}
    # every graph reads and writes the paged KV cache through block tables (blocks of 8: a sequence of 32 spans 4)
    # and slots (block * 8 + position in it; -1 writes nowhere)
    paged = [{"name": "block_tables", "dtype": "int32", "shape": [2, 4]}]
    assert specs["prefill", 32] == ([{"name": "input_ids", "dtype": "int32", "shape": [2, 32]},
                                     {"name": "valid_length", "dtype": "int32", "shape": [2]}] + paged +
                                    [{"name": "slot_mapping", "dtype": "int32", "shape": [64]}],
                                    [{"name": "logits", "dtype": "float32", "shape": [2, 512]}])
    # the chunk graphs (for lite_runtime.serve): the decode step of both rows and a piece of one more sequence at an
    # offset, cpu's 8 and 128 tokens (float32 weights), at most seq_length; logits of the two rows and of the
    # piece's last token
    step = [{"name": "input_ids", "dtype": "int32", "shape": [2, 1]},
            {"name": "valid_length", "dtype": "int32", "shape": [2]}] + paged + [
        {"name": "slot_mapping", "dtype": "int32", "shape": [2]}]
    assert specs["chunk", 32][0][4]["shape"] == [1, 32]
    assert specs["chunk", 8] == (step + [{"name": "chunk_ids", "dtype": "int32", "shape": [1, 8]},
                                         {"name": "chunk_length", "dtype": "int32", "shape": [1]},
                                         {"name": "start", "dtype": "int32", "shape": [1]},
                                         {"name": "chunk_block_table", "dtype": "int32", "shape": [1, 4]},
                                         {"name": "chunk_slot_mapping", "dtype": "int32", "shape": [8]}],
                                 [{"name": "logits", "dtype": "float32", "shape": [3, 512]}])
    # the score graphs: the chunk graph's inputs and outputs of one step row (export/writers/graphs.py SCORE_STEP_ROWS: a
    # verify, perplexity and check's replay put a piece in alone), the logits of every piece position
    one = [{"name": "input_ids", "dtype": "int32", "shape": [1, 1]},
           {"name": "valid_length", "dtype": "int32", "shape": [1]},
           {"name": "block_tables", "dtype": "int32", "shape": [1, 4]},
           {"name": "slot_mapping", "dtype": "int32", "shape": [1]}]
    assert specs["score", 8] == (one + specs["chunk", 8][0][4:],
                                 [{"name": "logits", "dtype": "float32", "shape": [1 + 8, 512]}])
    assert specs["score", 32][1][0]["shape"] == [1 + 32, 512]
    assert [g.get("rows") for g in manifest["graphs"] if g["role"] == "score"] == [1, 1]
    assert specs["inc", 1] == (step, [{"name": "logits", "dtype": "float32", "shape": [2, 512]}])
    # and the inc graph of one row (export --step_rows, cpu's default 1 below batch 2): a step of one sequence
    # computes it alone
    inc = [g for g in manifest["graphs"] if g["role"] == "inc"]
    assert [(g["file"], g.get("rows"), g["inputs"][0]["shape"], g["outputs"][0]["shape"]) for g in inc] == [
        ("gqa_tied_inc_graph.mindir", None, [2, 1], [2, 512]), ("gqa_tied_inc_1rows_graph.mindir", 1, [1, 1], [1, 512])]
    # the cache is not in the weights file (a folder's size is its weights): the yaml says its layout
    with open(os.path.join(folder, "gqa_tied.yaml")) as fh:
        assert yaml.safe_load(fh)["infer"]["kv_cache"] == {
            "block_size": 8, "max_blocks": 4, "layout": "blocks_heads", "layers": 2, "kv_heads": 2, "head_dim": 16,
            "dtype": "float32"}


def test_yaml_carries_what_the_runtime_needs(exported):
    with open(os.path.join(exported["mha_untied"], "mha_untied.yaml")) as fh:
        doc = yaml.safe_load(fh)
    infer = doc["infer"]
    assert {k: infer[k] for k in ("model_name", "seq_length", "batch_size", "dtype", "device", "eos_token_id",
                                  "pad_token_id", "prefill_model_path", "increment_model_path",
                                  "ge_config_path")} == {
        "model_name": "qwen2", "seq_length": 32, "batch_size": 2, "dtype": "float32", "device": "cpu",
        "eos_token_id": [0], "pad_token_id": 0, "prefill_model_path": "mha_untied_prefill_graph.mindir",
        "increment_model_path": "mha_untied_inc_graph.mindir", "ge_config_path": "config.ini"}
    assert doc["model"]["config"]["num_key_value_heads"] == 4
    assert doc["model"]["config"]["tie_word_embeddings"] is False


def test_config_ini_is_the_profiles_file(exported):
    from export.devices import PROFILES

    with open(os.path.join(exported["gqa_tied"], "config.ini")) as a, open(PROFILES["cpu"].ini_path) as b:
        assert a.read() == b.read()


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_exported_graphs_match_hf(exported, checkpoints, name, tmp_path):
    """The MindIR files, each loaded on its own with GraphCell (reading the shared weights file), against HF.

    Two independently loaded GraphCells hold separate caches, so the cache is handed over by hand here;
    the runtime's ms backend shares one instead (see lite_runtime/backends/ms.py)."""
    prefill, inc = graph_cells(exported[name], str(tmp_path))
    rows = prompts(2, [4, 13], seed=11)
    logits = run(prefill, right_pad(rows, 32), [len(r) for r in rows], block_size=8)
    hand_off_cache(prefill, inc)
    for step in range(3):
        for b, row in enumerate(rows):
            assert rel_err(logits[b], hf_last_logits(checkpoints[name], row)) < TOL, (step, b)
        nxt = logits.argmax(-1)
        for b in range(2):
            rows[b].append(int(nxt[b]))
        logits = run(inc, nxt.reshape(2, 1), [len(r) for r in rows], block_size=8)


def test_sharded_bfloat16_checkpoint_written_by_hf(tmp_path, checkpoints, capsys):
    """A checkpoint saved by transformers itself: bf16 on disk, sharded with an index file."""
    import torch
    from transformers import Qwen2ForCausalLM

    src = checkpoints["gqa_tied"]
    model = Qwen2ForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ckpt = tmp_path / "bf16"
    model.save_pretrained(ckpt, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), ckpt / f)
    assert (ckpt / "model.safetensors.index.json").exists()
    out = tmp_path / "folder"
    code, printed, err = export_cli(capsys, "--checkpoint", str(ckpt), "--output", str(out), "--device", "cpu",
                                    "--seq_length", "16", "--batch_size", "1")
    assert code == 0, err
    with open(out / "golden.json", encoding="utf-8") as fh:  # a bfloat16 CPU folder: limits of its own, said
        limits = json.load(fh)["limits"]
    assert (f"check's limits, derived from this folder's own arithmetic: {limits['exact']['rel']:.1e} with x exact, "
            f"{limits['bf16']['rel']:.1e} as it serves (bfloat16 activations) (golden.json 'limits')") in printed
    prefill, _ = graph_cells(str(out), str(tmp_path / "local"))
    row = prompts(1, [6], seed=2)[0]
    from export.compare import kv_rounding_attention

    reference = model.float()  # the same bf16 weights, widened to fp32; keys and values as its bfloat16 KV cache holds
    reference.set_attn_implementation(kv_rounding_attention("bfloat16"))
    with torch.no_grad():
        ref = reference(torch.tensor([row])).logits[0, -1].numpy()
    with exact_activations():  # a 6-token prompt is a matmul of 6 rows: float32's form
        assert rel_err(run(prefill, right_pad([row], 16), [6], block_size=64)[0], ref) < TOL


def test_summary_line_and_overwrite(tmp_path, checkpoints, capsys):
    out = tmp_path / "m"
    args = ["--checkpoint", checkpoints["gqa_tied"], "--output", str(out), "--device", "cpu", "--seq_length", "8"]
    code, out_text, _ = export_cli(capsys, *args)
    line, stages, usage = out_text.splitlines()
    assert code == 0 and line.startswith(f"exported {out}: 13 files, ") and "peak anonymous memory" in line
    assert usage == (f"for the CPU (float32): python -m lite_runtime.check {out} checks it, "
                     f"python -m lite_runtime.serve --model_dir {out} serves it")
    assert re.fullmatch(r"time: check \S+ s, golden \S+ s, compile \S+ s, weights \S+ s \(read\+convert \S+ s, "
                        r"hash \S+ s, write \S+ s busy\), files \S+ s", stages), stages
    code, _, err = export_cli(capsys, *args)
    assert (code, err) == (2, f"error: {out} already exists. Delete it or pass --overwrite")
    (out / "stale.txt").write_text("from an older export")
    code, _, _ = export_cli(capsys, *args, "--overwrite")
    assert code == 0 and not (out / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no .partial or .old folders left


def test_piped_export_prints_its_stages_as_plain_lines_and_no_bars(tmp_path, checkpoints, capsys):
    """Without -q and with stderr not a terminal (here: captured), tqdm's bars are off (no `\r`) and each stage is
    one plain line; -q keeps stderr empty."""
    from export.pipeline import STAGES

    out = tmp_path / "piped"
    args = ["--checkpoint", checkpoints["gqa_tied"], "--output", str(out), "--device", "cpu", "--seq_length", "8"]
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 0 and err.splitlines() == list(STAGES.values()) == [
        "checking the checkpoint and the settings", "golden references (float32 numpy reference)",
        "compiling the graphs", "writing the weights", "writing the folder's files"]
    assert "\r" not in err
    code, _, err = export_cli(capsys, *args, "--overwrite")
    assert (code, err) == (0, "")


def test_atlas_export_says_what_the_folder_is_for_and_what_this_cpu_does_with_it(tmp_path, checkpoints):
    from export.config import ExportConfig
    from export.pipeline import run_export

    out = str(tmp_path / "atlas")
    summary = run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="atlas", seq_length=16,
                                      batch_size=1, dtype="float16", device="atlas_800i_a2", prefill_buckets=()))
    check = f"python -m lite_runtime.check {out}"
    assert summary.usage_lines(ascend_here=False) == (
        f"for Atlas 800I A2 (float16, fused graphs): run {check} on the device",
        f"no Ascend device here: on this CPU, {check} runs the fused ops as CPU stand-ins (slow, float16); or export "
        "with --device cpu for a folder to run here")
    assert summary.usage_lines(ascend_here=True) == (
        f"for Atlas 800I A2 (float16, fused graphs): run {check} on the device",)


def test_export_help_names_every_family():
    from export.__main__ import build_parser
    from export.families import FAMILIES

    help_text = build_parser().format_help().lower()
    assert set(FAMILIES) == {"qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe"}
    assert all(family in help_text for family in FAMILIES)
    assert ("Qwen2/Qwen2.5, Qwen3 or Llama checkpoint (or a Qwen3-MoE or Qwen2-MoE mixture of experts, qwen3_moe or "
            "qwen2_moe)") in build_parser().description


def test_default_prompt_buckets_follow_the_device_rule(tmp_path, checkpoints, capsys):
    from export.devices import default_buckets, get_profile

    cpu, atlas = get_profile("cpu"), get_profile("atlas_800i_a2")
    assert default_buckets(cpu, 2048) == (16, 32, 64, 128, 256, 512, 1024)
    assert default_buckets(cpu, 16) == ()
    assert default_buckets(atlas, 2048) == (128, 512)
    assert default_buckets(atlas, 4096) == (128, 512, 2048)
    assert default_buckets(atlas, 128) == ()
    base = ["--checkpoint", checkpoints["gqa_tied"], "--device", "cpu", "--seq_length", "40"]
    for extra, expected in (((), [16, 32, 40]), (("--prefill_buckets", "none"), [40]),
                            (("--prefill_buckets", "24"), [24, 40])):
        out = tmp_path / f"m{len(expected)}{expected[0]}"
        code, _, err = export_cli(capsys, *base, "--output", str(out), *extra)
        assert code == 0, err
        with open(out / f"{out.name}.yaml") as fh:
            infer = yaml.safe_load(fh)["infer"]
        assert infer["prefill_buckets"] == expected
        graphs = sorted(f for f in os.listdir(out) if f.endswith(".mindir"))
        assert len(graphs) == len(expected) + 5  # one per prompt length, the incremental graph, two chunk and two score
        assert infer["chunk_sizes"] == [8, 40] == infer["score_sizes"]  # cpu's 8 and 128, at most seq_length
        assert {f"{out.name}_chunk_8_graph.mindir", f"{out.name}_chunk_graph.mindir"} <= set(graphs)
        assert {f"{out.name}_score_8_graph.mindir", f"{out.name}_score_graph.mindir"} <= set(graphs)
    for chunks, files in (("8", ["m_chunk_8_chunk_8_graph.mindir"]), ("none", [])):  # --chunk_sizes: sizes, or none
        out = tmp_path / f"m_chunk_{chunks}"
        code, _, err = export_cli(capsys, *base, "--output", str(out), "--chunk_sizes", chunks)
        assert code == 0, err
        assert sorted(f for f in os.listdir(out) if "_chunk" in f[len(out.name):]) == files
    for scores, files in (("4", ["m_score_4_score_4_graph.mindir"]), ("none", [])):  # --score_sizes likewise
        out = tmp_path / f"m_score_{scores}"
        code, _, err = export_cli(capsys, *base, "--output", str(out), "--score_sizes", scores)
        assert code == 0, err
        assert sorted(f for f in os.listdir(out) if "_score" in f[len(out.name):]) == files
    code, _, err = export_cli(capsys, *base, "--output", str(tmp_path / "m_score_bad"), "--score_sizes", "0")
    assert code == 2 and err == ("error: --score_sizes: 0 must be between 1 and --seq_length 40 (or none: no score "
                                 "graph, a folder without speculative decoding and prompt logprobs)")
    code, _, err = export_cli(capsys, *base, "--output", str(tmp_path / "m_chunk_bad"), "--chunk_sizes", "8,41")
    assert code == 2 and err == ("error: --chunk_sizes: 41 must be between 1 and --seq_length 40 (or none: no chunk "
                                 "graph, a folder that cannot be served)")


def test_leftovers_of_killed_exports_are_removed(tmp_path, checkpoints, caplog):
    """An export killed with SIGKILL leaves its partial folder; the next export beside it removes it and says so."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process id that has just ended
    partial, old = tmp_path / f".m.partial-{dead}", tmp_path / f".other.old-{dead}"
    for folder in (partial, old):
        (folder / "m_variables").mkdir(parents=True)
        (folder / "m_variables" / "data_0").write_bytes(b"\0" * 2048)
    running = tmp_path / f".n.partial-{os.getppid()}"  # an export still running (its process exists)
    running.mkdir()
    caplog.set_level("WARNING")
    code = main(["-q", "--checkpoint", checkpoints["gqa_tied"], "--output", str(tmp_path / "m"), "--device", "cpu",
                 "--seq_length", "8"])
    assert code == 0
    assert sorted(os.listdir(tmp_path)) == sorted(["m", running.name])
    assert [r.getMessage() for r in caplog.records if "left by an export" in r.getMessage()] == [
        f"removed {tmp_path / partial.name} (2.0 KiB), left by an export (process {dead}) that did not finish",
        f"removed {tmp_path / old.name} (2.0 KiB), left by an export (process {dead}) that did not finish"]


# --- bad input: one line, no traceback, non-zero exit, nothing left behind ----------------------

@pytest.fixture
def ckpt_copy(tmp_path, checkpoints):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints["gqa_tied"], dst)
    return dst


def _edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_weights(ckpt, drop=(), reshape=None):
    from safetensors.numpy import load_file, save_file

    path = str(ckpt / "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    if reshape:
        name, shape = reshape
        tensors[name] = np.zeros(shape, tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


def test_bad_inputs(tmp_path, ckpt_copy, capsys):
    out = tmp_path / "out"
    base = ["--checkpoint", str(ckpt_copy), "--output", str(out), "--device", "cpu", "--seq_length", "16"]
    cfg_path = ckpt_copy / "config.json"

    def err(*extra):
        code, _, message = export_cli(capsys, *base, *extra)
        assert code == 2
        assert sorted(os.listdir(tmp_path)) == ["ckpt"], "nothing may be left behind"
        return message

    assert err("--seq_length", "2048") == (
        "error: --seq_length 2048 exceeds max_position_embeddings 1024 in config.json; pass a smaller --seq_length")
    assert err("--batch_size", "0") == "error: --batch_size must be at least 1, got 0"
    assert err("--prefill_buckets", "8,16") == ("error: --prefill_buckets: 16 must be between 1 and --seq_length - 1 "
                                                "(15); the full seq_length graph is always exported")
    assert err("--prefill_buckets", "8;12") == (
        "error: --prefill_buckets '8;12' must be auto, none or comma-separated integers, e.g. 128,512")
    assert err("--dtype", "bfloat16", "--device", "atlas_300i_duo") == (
        "error: --dtype bfloat16 has no kernels on device profile 'atlas_300i_duo'; use one of float16")
    assert err("--cpu_kernels", "on", "--device", "atlas_800") == (
        "error: --cpu_kernels on needs --device cpu (got --device atlas_800); graphs for Atlas use MindSpore's own ops")
    assert err("--cpu_kernels", "off", "--dtype", "bfloat16") == (
        "error: --cpu_kernels off: --device cpu --dtype bfloat16 stores 16-bit weights that only the CPU kernels "
        "read; drop --cpu_kernels off or export --dtype float32")
    assert err("--device", "atlas_9000") == (
        "error: --device 'atlas_9000' is not a known profile; known: atlas_800i_a2, atlas_800t_a2, atlas_800, "
        "atlas_300i_duo, cpu")

    _edit_config(ckpt_copy, model_type="glm")
    assert err() == (f"error: {cfg_path}: model_type 'glm' is not supported; supported: qwen2, qwen3, llama, "
                     "qwen3_moe, qwen2_moe")
    _edit_config(ckpt_copy, model_type="llama")  # Qwen2's q/k/v biases are not a Llama's: nothing is dropped quietly
    assert err() == ("error: checkpoint tensors do not match config.json (unexpected 6: model.layers.0.self_attn.k_proj"
                     ".bias, model.layers.0.self_attn.q_proj.bias, model.layers.0.self_attn.v_proj.bias, model.layers.1."
                     "self_attn.k_proj.bias, model.layers.1.self_attn.q_proj.bias, model.layers.1.self_attn.v_proj.bias)"
                     "; check that the weights belong to this config")
    _edit_config(ckpt_copy, model_type="qwen2", layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    assert err() == ("error: --seq_length 16: config.json has sliding-window attention (use_sliding_window, "
                     "sliding_window 8), which is not supported beyond the window; pass --seq_length 8 or less, "
                     "where sliding changes nothing")
    _edit_config(ckpt_copy, layer_types=["full_attention", "full_attention"], sliding_window=None)

    text = cfg_path.read_text()
    cfg_path.write_text(text[:40])
    assert err().startswith(f"error: {cfg_path}: not valid JSON (")
    cfg_path.unlink()
    assert err() == (f"error: {cfg_path}: not found; pass --checkpoint a Hugging Face model folder with config.json, "
                     "or a .gguf file")
    cfg_path.write_text(text)

    _edit_weights(ckpt_copy, drop=("model.norm.weight", "model.layers.1.mlp.up_proj.weight"))
    assert err() == ("error: checkpoint tensors do not match config.json (missing 2: "
                     "model.layers.1.mlp.up_proj.weight, model.norm.weight); "
                     "check that the weights belong to this config")


def test_misshaped_weight(tmp_path, ckpt_copy, capsys):
    _edit_weights(ckpt_copy, reshape=("model.layers.0.self_attn.k_proj.weight", (64, 64)))
    code, _, err = export_cli(capsys, "--checkpoint", str(ckpt_copy), "--output", str(tmp_path / "o"),
                              "--device", "cpu", "--seq_length", "8")
    assert (code, err) == (2, f"error: {ckpt_copy / 'model.safetensors'}: tensor "
                              "model.layers.0.self_attn.k_proj.weight has shape [64, 64], config.json implies "
                              "[32, 64]; check that the weights belong to this config")


def test_truncated_weights_file(tmp_path, ckpt_copy, capsys):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    code, _, err = export_cli(capsys, "--checkpoint", str(ckpt_copy), "--output", str(tmp_path / "o"),
                              "--device", "cpu", "--seq_length", "8")
    assert (code, err) == (2, f"error: {path}: truncated ({len(data) - 1000} of {len(data)} bytes); "
                              "re-download or re-copy it")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_failure_after_the_graphs_leaves_nothing(tmp_path, ckpt_copy, capsys):
    """No tokenizer is found only after both graphs are written: the partial folder must go."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt_copy / f).unlink()
    code, _, err = export_cli(capsys, "--checkpoint", str(ckpt_copy), "--output", str(tmp_path / "o"),
                              "--device", "cpu", "--seq_length", "8")
    assert (code, err) == (2, f"error: {ckpt_copy}: no tokenizer files (tokenizer.json, vocab.json + merges.txt "
                              "or tokenizer.model); copy the model's tokenizer into the checkpoint folder")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_cli_error_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "export", "--checkpoint", str(tmp_path / "nope"),
                           "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nope' / 'config.json'}: not found; pass --checkpoint a Hugging Face model folder "
        "with config.json, or a .gguf file"]
