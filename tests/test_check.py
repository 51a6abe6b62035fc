"""python -m lite_runtime.check and python -m export.compare: verdicts on good, altered and half-precision folders."""
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

from lite_runtime.check import main as check_main
from lite_runtime.golden import TOLERANCES, ReferenceRow, RowResult
from hiding import hide

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folders with chunk and score graphs (all but tensor-parallel ones): the prompts run three times, through the
# prefill graphs, the chunk graphs (the server's) and the score graphs (every position's logits)
SLOTS = " (each through the prefill graphs and through the chunk graphs; one per bucket through the score graphs)"
PASS = re.compile(r"^PASS (\S+) on backend ms: (\d+) prompts" + re.escape(SLOTS) + r", (\d+) steps, greedy tokens "
                  r"identical, top-k logits within (\S+) relative \((\w+) limit (\S+)\)$")


def run_cli(main, capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err.strip().splitlines()


def rehash(folder, rel: str) -> None:
    """Make the manifest agree with an edited file, as a careless copy tool or a tamperer would."""
    path = os.path.join(folder, "manifest.json")
    with open(path) as fh:
        manifest = json.load(fh)
    with open(os.path.join(folder, rel), "rb") as fh:
        data = fh.read()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    with open(path, "w") as fh:
        json.dump(manifest, fh)


def alter_weight(folder, name: str, factor: float) -> None:
    """Multiply one parameter in the folder's weights file by `factor`, then re-hash it."""
    from mindspore.train import mind_ir_pb2

    with open(os.path.join(folder, "manifest.json")) as fh:
        stem = json.load(fh)["name"]
    model = mind_ir_pb2.ModelProto()
    with open(os.path.join(folder, f"{stem}_inc_graph.mindir"), "rb") as fh:
        model.ParseFromString(fh.read())
    ext = next(p.external_data for p in model.graph.parameter if p.name.rsplit(":", 1)[-1] == name)
    rel = f"{stem}_variables/data_0"
    data = np.fromfile(os.path.join(folder, rel), dtype=np.uint8)
    data[ext.offset:ext.offset + ext.length].view(np.float32)[:] *= factor
    data.tofile(os.path.join(folder, rel))
    rehash(folder, rel)


def copy_folder(src, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return str(dst)


def test_cpu_folder_passes_and_every_graph_runs(exported, capsys, tmp_path):
    folder = exported["gqa_tied_buckets"]
    report = tmp_path / "report.json"
    code, out, err = run_cli(check_main, capsys, folder, "--backend", "ms", "--json", str(report))
    assert code == 0, err
    assert out[0] == "reference: golden.json: export/writers/reference.py: float32 numpy on the checkpoint's weights"
    assert out[1].split() == ["prompt", "graph", "tokens", "steps", "diverges", "at", "top-1", "max", "abs", "err",
                              "max", "rel", "err", "result"]
    assert [line.split()[:6] for line in out[2:8]] == [
        [str(i), g, str(n), "16", "-", "16/16"] for i, (g, n) in enumerate(
            [("prefill_8", 6), ("prefill_8", 3), ("prefill_16", 12), ("prefill_16", 6), ("prefill_32", 17),
             ("prefill_32", 8)])]
    verdict = PASS.match(out[-1])
    assert verdict and verdict.group(1, 2, 3, 5, 6) == ("gqa_tied_buckets", "6", "240", "float32", "1e-04")
    assert float(verdict.group(4)) < 1e-5
    doc = json.loads(report.read_text())
    assert doc["passed"] is True and doc["verdict"] == out[-1]
    assert doc["tolerance"] == {"dtype": "float32", "rel": 1e-4, "derived": False}
    import mindspore

    assert doc["info"]["environment"]["mindspore"] == mindspore.__version__
    assert doc["info"]["exported_with"]["mindspore"] == mindspore.__version__
    assert doc["info"]["folder"]["prefill_buckets"] == [8, 16, 32] and "[" not in doc["info"]["ge_config"]


def test_progress_lines_only_where_they_apply(exported, capsys, tmp_path):
    """Piped (here: captured), check prints one loading line and its report: no per-step lines, no tqdm bar (off
    when stderr is not a terminal), no note about GE on a CPU folder; nothing about loading a folder that is not one."""
    folder = exported["gqa_tied"]
    code, out, err = run_cli(check_main, capsys, folder, "--backend", "ms")
    assert code == 0 and err == [f"loading {folder} (backend ms)"]
    assert PASS.match(out[-1])
    missing = str(tmp_path / "none")
    code, out, err = run_cli(check_main, capsys, missing, "--backend", "ms")
    assert (code, out, err) == (2, [], [f"error: {missing}: not a folder; pass a model folder written by python -m "
                                        "export"])
    code, _, err = run_cli(check_main, capsys, missing, "--backend", "mslite")
    assert (code, err) == (2, [f"error: {missing}: not a folder; pass a model folder written by python -m export"])


def test_float16_atlas_folder_passes_within_its_limits(atlas_exported, capsys):
    """The folder that ships to Atlas (float16), run here on MindSpore's CPU float16 kernels."""
    code, out, err = run_cli(check_main, capsys, atlas_exported["float16"], "--backend", "ms", "-q")
    assert code == 0, out + err
    verdict = PASS.match(out[-1])
    assert verdict and verdict.group(1, 2, 3, 5, 6) == ("atlas_float16", "4", "160", "float16", "1e-02")
    assert 1e-5 < float(verdict.group(4)) < TOLERANCES["float16"].rel  # really float16, and within its limit


def test_altered_weights_fail_and_name_the_divergence(exported, capsys, tmp_path):
    """Weights changed after export, checksums re-made so loading accepts them: only the check can tell."""
    folder = copy_folder(exported["gqa_tied"], tmp_path, "gqa_tied")
    alter_weight(folder, "model.norm.weight", -1.0)  # every logit changes sign: argmax becomes argmin
    code, out, err = run_cli(check_main, capsys, folder, "--backend", "ms", "-q")
    with open(os.path.join(folder, "golden.json")) as fh:
        first = json.load(fh)["batches"][0]["rows"][0]["tokens"][0]
    assert code == 1
    assert all(line.split()[4] == "0" and line.endswith("FAIL") for line in out[2:4]), out
    assert re.match(rf"^FAIL gqa_tied on backend ms: 5 of 5 runs of 2 prompts{re.escape(SLOTS)} fail; "
                    rf"greedy tokens diverge in prompt 0 "
                    rf"\(prefill_32\) at step 0: device token \d+, reference {first}; worst logit error \S+ relative "
                    rf"\(float32 limit 1e-04\)$", out[-1]), out[-1]
    assert err[-1] == ("check failed: rerun with --json report.json and send that file, with the folder's "
                       "manifest.json and yaml, to whoever exported the folder")
    subtle = copy_folder(exported["gqa_tied"], tmp_path, "subtle")
    alter_weight(subtle, "model.layers.1.mlp.down_proj.weight", 1.01)  # one matrix 1 % off
    code, out, _ = run_cli(check_main, capsys, subtle, "--backend", "ms", "-q")
    assert code == 1 and re.match(r"^FAIL .*logit error \S+ relative exceeds the float32 limit 1e-04", out[-1]), out[-1]


def row(tokens, top_ids, top_logits, scale):
    return ReferenceRow([1], tokens, top_ids, top_logits, scale)


def test_judging_near_ties_and_non_finite_logits():
    tol = TOLERANCES["float16"]  # rel 1e-2: a near tie is a top-2 margin <= 2 * 1e-2 * scale
    logits = np.zeros(10, np.float32)
    logits[[3, 4]] = [9.98, 9.96]  # the device prefers 3
    near = row([4], [[4, 3]], [[10.0, 9.9]], [10.0])  # the reference prefers 4 by 0.1 <= 0.2: a near tie
    r = RowResult(0, "prefill_8", 1)
    r.judge(0, logits, near, tol)
    r.close(tol)
    assert (r.first_divergence, r.near_ties, r.failures, r.passed) == (0, [0], [], True)
    assert r.divergence == {"step": 0, "device_token": 3, "reference_token": 4, "reference_margin": pytest.approx(0.1)}
    clear = row([4], [[4, 3]], [[10.0, 9.5]], [10.0])  # a margin of 0.5 is not a tie
    r = RowResult(0, "prefill_8", 1)
    r.judge(0, logits, clear, tol)
    r.close(tol)
    assert r.failures == ["greedy token differs at step 0: device 3, reference 4 (reference margin 0.5, not a near "
                          "tie)", "logit error 4.80e-02 relative exceeds the float16 limit 1e-02"]
    r = RowResult(0, "prefill_8", 1)
    r.judge(0, np.full(10, np.nan, np.float32), near, tol)
    assert r.failures == ["non-finite logits from step 0"] and not r.passed


def test_folders_that_cannot_be_checked(exported, capsys, tmp_path):
    folder = copy_folder(exported["gqa_tied"], tmp_path, "damaged")
    path = os.path.join(folder, "golden.json")
    with open(path) as fh:
        doc = json.load(fh)
    del doc["batches"][0]["rows"][1]["top_logits"]
    with open(path, "w") as fh:
        json.dump(doc, fh)
    rehash(folder, "golden.json")
    code, _, err = run_cli(check_main, capsys, folder, "--backend", "ms", "-q")
    assert (code, err) == (2, [f"error: {path}: malformed (KeyError: 'top_logits'); re-export the folder"])
    old = copy_folder(exported["gqa_tied"], tmp_path, "old")  # exported before golden references existed
    os.unlink(os.path.join(old, "golden.json"))
    with open(os.path.join(old, "manifest.json")) as fh:
        manifest = json.load(fh)
    del manifest["golden"], manifest["files"]["golden.json"]
    with open(os.path.join(old, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    code, _, err = run_cli(check_main, capsys, old, "--backend", "ms", "-q")
    assert (code, err) == (2, [f"error: {old}: no golden references (golden.json); the folder was exported before "
                               "mslite-llm wrote them: re-export it with python -m export to check it"])


HIDE = hide() + """
from lite_runtime.check import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] in HIDDEN for m in sys.modules), "imported a hidden module"
sys.exit(code)
"""


def test_check_runs_without_torch_or_transformers_and_imports_without_mindspore(exported):
    folder = exported["gqa_tied"]
    proc = subprocess.run([sys.executable, "-c", HIDE, "torch,transformers", folder, "--backend", "ms", "-q"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].startswith(f"PASS gqa_tied on backend ms: 2 prompts{SLOTS}, 80 steps")
    proc = subprocess.run([sys.executable, "-c", HIDE, "mindspore,torch,transformers", folder, "--backend", "ms", "-q"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: backend 'ms' needs MindSpore, which cannot be imported here: pip install mindspore==2.10.0 'numpy<2' "
        "(or use backend 'mslite' on Atlas)")


def test_check_on_an_atlas_box_needs_only_numpy_and_pyyaml_besides_lite(atlas_exported):
    """Everything the project installs but numpy and pyyaml hidden: the check reads the folder, its golden references
    and its ini, and stops only where mindspore_lite itself is needed (it cannot be installed here)."""
    hidden = "mindspore,torch,transformers,tokenizers,safetensors,tqdm,sentencepiece,mindspore_lite,cpu_kernels"
    proc = subprocess.run([sys.executable, "-c", HIDE, hidden, atlas_exported["float16"], "--backend", "mslite", "-q"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: backend 'mslite' needs mindspore_lite, which cannot be imported here: install the mindspore_lite wheel "
        "that matches your CANN from https://www.mindspore.cn/lite/docs/en/master/use/downloads.html and source "
        "CANN's set_env.sh, or pass backend 'ms' to run on the CPU with MindSpore")


def test_launcher_check(exported, capsys):
    from lite_runtime import launcher

    code, out, _ = run_cli(launcher.main, capsys, "--model_dir", exported["mha_untied"], "--backend", "ms",
                           "--check")
    assert code == 0 and out[-1].startswith(f"PASS mha_untied on backend ms: 2 prompts{SLOTS}, 80 steps")


@pytest.mark.filterwarnings("error::FutureWarning")  # transformers' deprecations (past_key_values, gone in 5.40)
@pytest.mark.parametrize("which", ["cpu", "float16"])
def test_compare_against_hf(exported, atlas_exported, checkpoints, capsys, which):
    from export.compare import main as compare_main

    folder = exported["gqa_tied"] if which == "cpu" else atlas_exported["float16"]
    quiet = ["-q"] if which == "float16" else []  # without -q, piped: HF's progress bar is off too
    code, out, err = run_cli(compare_main, capsys, "--checkpoint", checkpoints["gqa_tied"], "--model_dir", folder,
                             *quiet)
    assert code == 0, out + err
    assert err == []
    assert out[0] == "reference: HF transformers, float32, the checkpoint's weights"
    verdict = PASS.match(out[-2])
    assert verdict and verdict.group(5) == ("float32" if which == "cpu" else "float16")
    assert re.match(r"^stored golden references against HF: greedy tokens identical, top-k logits within (\S+) "
                    r"relative$", out[-1])
    assert float(out[-1].split()[-2]) < 1e-5


def test_compare_refuses_bfloat16(atlas_exported, checkpoints, capsys):
    from export.compare import main as compare_main

    folder = atlas_exported["bfloat16"]
    code, _, err = run_cli(compare_main, capsys, "--checkpoint", checkpoints["gqa_tied"], "--model_dir", folder)
    assert (code, err) == (2, [
        f"error: {os.path.join(folder, 'atlas_bfloat16.yaml')}: a bfloat16 folder cannot run on this CPU (MindSpore "
        "has no bfloat16 CPU kernels); run python -m lite_runtime.check on the Atlas A2 server it is for, or export "
        "a float16 or float32 folder from the same checkpoint and compare that"])
