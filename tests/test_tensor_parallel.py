"""Tensor parallelism (python -m export --tp_size 2): per-rank graphs with AllReduce, run by two real processes under
MindSpore's launcher (msrun) on the CPU, against HF transformers on the whole model."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from reference import hf_last_logits, hf_model, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [[5, 17, 33, 2, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]

WORKER = """
import json, sys
sys.path.insert(0, {root!r})
from lite_runtime import pipeline
folder, out = sys.argv[1], sys.argv[2]
pipe = pipeline("text_generation", model=folder, backend="ms")
rows = {rows!r}
step = pipe.infer(rows)
short = pipe.infer({short!r})  # the 16-token prefill graph (the rows above take the 32 one)
gen = pipe.generate(rows, max_new_tokens=8)
json.dump({{"rank": pipe.config.rank_id, "logits": step.logits.tolist(), "short_logits": short.logits.tolist(),
           "tokens": [list(map(int, r)) for r in gen]}}, open(f"{{out}}/rank{{pipe.config.rank_id}}.json", "w"))
"""
SHORT = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]]


@pytest.fixture(scope="module")
def tp_folder(tmp_path_factory, checkpoints):
    """gqa_tied (4 heads, 2 kv heads) split over 2 ranks: 2 heads, 1 kv head and half the MLP columns each."""
    from export.config import ExportConfig
    from export.pipeline import run_export

    out = str(tmp_path_factory.mktemp("tp") / "tp2")
    run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="tp2", seq_length=32, batch_size=2,
                            dtype="float32", device="cpu", prefill_buckets=(16,), tp_size=2, block_size=16))
    return out


def _scheduler_port() -> int:
    """A free port BELOW the kernel's ephemeral range (32768-60999 by default) for msrun's scheduler.

    A port the kernel hands out for `bind(0)` is also one it hands out as the source port of any outgoing connection:
    between our closing it and the scheduler binding it, the other test worker's clients (the serving tests open
    thousands) can take it, and msrun's worker then waits out the whole cluster timeout. Ports below the range are
    never handed out that way."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000 for msrun's scheduler")


CLUSTER_TIME_OUT = 120  # msrun's default is 600 s, the whole test's budget: a cluster that never forms fails sooner


def msrun(tmp_path, *args, workers: int = 2):
    """`msrun --worker_num N ... args` with this Python first on PATH; (exit code, the workers' logs).

    When the cluster never formed (the scheduler's log never says so) the job is launched once more on another port:
    that is MindSpore's launcher failing to meet, before any of our code runs, and its logs go in the failure."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for attempt in (1, 2):
        log_dir = tmp_path / f"msrun-{attempt}"
        proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "msrun"), "--worker_num", str(workers),
                               "--local_worker_num", str(workers), "--master_port", str(_scheduler_port()),
                               "--cluster_time_out", str(CLUSTER_TIME_OUT), "--log_dir", str(log_dir), "--join",
                               "True", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=CLUSTER_TIME_OUT + 480)
        logs = {p.name: p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log"))}
        scheduler = log_dir / "scheduler.log"
        formed = scheduler.exists() and "Cluster is successfully initialized" in scheduler.read_text(errors="replace")
        if proc.returncode == 0 or formed:
            return proc.returncode, logs
    sched = scheduler.read_text(errors="replace")[-2000:] if scheduler.exists() else "(no scheduler.log)"
    raise AssertionError(f"msrun's cluster never formed, twice; scheduler log:\n{sched}\nmsrun:\n{proc.stdout[-2000:]}"
                         f"\n{proc.stderr[-2000:]}")


def check_under_msrun(tmp_path, folder: str, workers: int = 2):
    """The launcher's --check, unchanged, under msrun: it exits 0 and every worker logged. Returns the logs."""
    code, logs = msrun(tmp_path, os.path.join(ROOT, "scripts", "run_infer_main.py"), "--model_dir", folder,
                       "--backend", "ms", "--check", workers=workers)
    assert code == 0, "\n".join(logs.values())[-3000:]
    assert len(logs) == workers
    return logs


def test_the_folder_holds_each_ranks_graphs_and_weights(tp_folder):
    from lite_runtime.folder import load_folder

    folder = load_folder(tp_folder)
    assert folder.tp_size == 2 and folder.infer["tp_size"] == 2
    for rank in (0, 1):
        paths = folder.graph_paths(rank)
        assert sorted(paths) == ["inc", "prefill_16", "prefill_32"]  # no chunk graph: the server serves no TP folder
        assert all(os.path.basename(p).startswith(f"tp2_rank{rank}_") for p in paths.values())
    with open(os.path.join(tp_folder, "manifest.json")) as fh:
        manifest = json.load(fh)
    assert {g["variables"] for g in manifest["graphs"]} == {"tp2_rank0_variables/data_0", "tp2_rank1_variables/data_0"}
    # each rank's q_proj holds its 2 heads of 4 (head_dim 16 for the tiny model's hidden 64)
    inc = next(g for g in manifest["graphs"] if g["role"] == "inc" and g["rank"] == 1)
    assert inc["inputs"] == [{"name": "input_ids", "dtype": "int32", "shape": [2, 1]},
                             {"name": "valid_length", "dtype": "int32", "shape": [2]},
                             {"name": "block_tables", "dtype": "int32", "shape": [2, 2]},
                             {"name": "slot_mapping", "dtype": "int32", "shape": [2]}]
    # the same block tables on every rank, each rank's caches its heads: 1 kv head of 2 per rank
    assert folder.kv_cache.kv_heads == 1 and folder.kv_cache.max_blocks == 2


def test_two_ranks_under_msrun_equal_hf_and_the_single_card_folder(tp_folder, checkpoints, pipes, tmp_path):
    """Both ranks return the same logits and tokens: HF's greedy tokens on the whole model, and logits within 1e-4
    of HF's and of the single-card folder's (gqa_tied, the same checkpoint), on both prefill graphs."""
    import torch

    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=ROOT, rows=ROWS, short=SHORT))
    code, logs = msrun(tmp_path, script, tp_folder, tmp_path)
    assert code == 0, "\n".join(logs.values())[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["tokens"] == r1["tokens"] and r0["logits"] == r1["logits"]
    ckpt = checkpoints["gqa_tied"]
    single = pipes["gqa_tied"]
    assert rel_err(np.array(r0["logits"]), single.infer(ROWS).logits) < 1e-4
    assert rel_err(np.array(r0["short_logits"]), single.infer(SHORT).logits) < 1e-4
    for i, row in enumerate(SHORT):
        assert rel_err(np.array(r0["short_logits"][i]), hf_last_logits(ckpt, row)) < 1e-4
    for i, row in enumerate(ROWS):
        assert rel_err(np.array(r0["logits"][i]), hf_last_logits(ckpt, row)) < 1e-4
        with torch.no_grad():
            ref = hf_model(ckpt).generate(torch.tensor([row]), max_new_tokens=8, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0].tolist()
        assert r0["tokens"][i][:len(ref)] == ref[:len(r0["tokens"][i])]


def test_check_under_msrun_passes_on_every_rank(tp_folder, tmp_path):
    """The launcher, unchanged, under msrun: each rank replays the golden references."""
    for log in check_under_msrun(tmp_path, tp_folder).values():
        assert "PASS tp2 on backend ms: 4 prompts, " in log  # no chunk graph: the server serves no TP folder


def test_a_rank_count_other_than_the_folders_and_a_missing_rank_file(tp_folder, tmp_path):
    """One-line errors that say what to do: msrun with 1 process for a 2-rank folder; a copy without rank 1's weights."""
    script = tmp_path / "load.py"
    script.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom lite_runtime import InferError, pipeline\n"
                      f"try:\n    pipeline('text_generation', model={tp_folder!r}, backend='ms')\n"
                      "except InferError as exc:\n    print('ERROR', exc)\n")
    code, logs = msrun(tmp_path, script, workers=1)
    assert (f"ERROR {os.path.abspath(tp_folder)}: the folder is split over 2 ranks, but this job has 1 processes; "
            "launch it with msrun --worker_num 2") in "\n".join(logs.values())
    import shutil

    from lite_runtime import InferError
    from lite_runtime.folder import load_folder

    copy = tmp_path / "copy"
    shutil.copytree(tp_folder, copy)
    os.remove(copy / "tp2_rank1_variables" / "data_0")
    with pytest.raises(InferError) as err:
        load_folder(str(copy))
    assert str(err.value).startswith(f"{copy / 'tp2_rank1_variables' / 'data_0'}: ")


def test_without_msrun_the_error_says_how_to_launch(tp_folder):
    from lite_runtime import InferError, pipeline

    env_worker = os.environ.pop("MS_WORKER_NUM", None)
    try:
        with pytest.raises(InferError) as err:
            pipeline("text_generation", model=tp_folder, backend="ms")
    finally:
        if env_worker is not None:
            os.environ["MS_WORKER_NUM"] = env_worker
    assert str(err.value) == (f"{os.path.abspath(tp_folder)}: the folder is split over 2 ranks (--tp_size 2); run one "
                              "process per rank under MindSpore's launcher: msrun --worker_num 2 --local_worker_num 2 "
                              "<your script>")


@pytest.mark.parametrize("tp,numbers", [(3, "num_attention_heads 4, num_key_value_heads 2, intermediate_size 128"),
                                        (4, "num_key_value_heads 2")])
def test_a_tp_size_that_does_not_divide_is_refused_with_the_numbers(checkpoints, tmp_path, capsys, tp, numbers):
    from export.__main__ import main

    code = main(["-q", "--checkpoint", checkpoints["gqa_tied"], "--output", str(tmp_path / "x"), "--device", "cpu",
                 "--seq_length", "32", "--tp_size", str(tp)])
    assert code == 2 and not os.path.exists(tmp_path / "x")
    assert capsys.readouterr().err.strip() == (
        f"error: --tp_size {tp} does not divide config.json's {numbers}; each rank takes an equal share of the heads, "
        "kv heads and MLP columns: pick a divisor")


def test_mslite_plan_loads_the_ranks_graphs_with_the_rank_table(tp_folder, tmp_path, monkeypatch):
    """On Atlas (not run here) each rank is a process: its graphs, its card, and the rank table GE gives HCCL."""
    from lite_runtime import InferConfig, InferError
    from lite_runtime.backends.mslite import build_plan, context_plan
    from export.devices import GE_CONFIG_DIR

    ini = os.path.join(GE_CONFIG_DIR, "atlas_800i_a2.ini")
    table = tmp_path / "rank_table.json"
    table.write_text(json.dumps({"version": "1.0", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "127.0.0.1", "host_nic_ip": "reserve",
         "device": [{"device_id": "0", "rank_id": "0"}, {"device_id": "1", "rank_id": "1"}]}]}))
    for var in ("RANK_ID", "DEVICE_ID", "RANK_TABLE_FILE"):
        monkeypatch.delenv(var, raising=False)
    config = InferConfig.from_folder(tp_folder, target="Ascend", ge_config_path=ini)
    with pytest.raises(InferError) as err:
        build_plan(config)
    assert str(err.value) == (f"{os.path.abspath(tp_folder)}: the folder is split over 2 ranks, which HCCL connects "
                              "through a rank table: pass rank_table_file=... (run_infer_main.py --rank_table_file) "
                              "or set RANK_TABLE_FILE (README, \"Two cards\")")
    monkeypatch.setenv("RANK_ID", "1")
    monkeypatch.setenv("RANK_TABLE_FILE", str(table))
    config = InferConfig.from_folder(tp_folder, target="Ascend", ge_config_path=ini)
    assert context_plan(config) == {"ascend.device_id": 1, "ascend.rank_id": 1, "ascend.provider": "ge",
                                    "target": ["ascend"]}
    plan = build_plan(config)
    assert config.rank_id == 0  # the rank is resolved in the plan's own copy: the caller's config is not changed
    builds = [step for step in plan if step[0] == "build_from_file"]
    assert [os.path.basename(step[2]) for step in builds] == [
        "tp2_rank1_prefill_graph.mindir", "tp2_rank1_prefill_16_graph.mindir", "tp2_rank1_inc_graph.mindir"]
    assert all(step[5] == {"ascend_context": {"rank_table_file": str(table)}} for step in builds)
    monkeypatch.setenv("RANK_ID", "2")
    with pytest.raises(InferError) as err:
        context_plan(InferConfig.from_folder(tp_folder, target="Ascend", ge_config_path=ini))
    assert str(err.value) == (f"{os.path.abspath(tp_folder)}: rank 2, but the folder is split over 2 ranks (0..1); "
                              "pass rank_id or set RANK_ID per process")


def test_the_launcher_under_msrun_prints_the_answer_on_rank_0(tp_folder, pipes, tmp_path):
    """Rank 0 prints the single-card folder's answer; rank 1 only its timing line."""
    code, logs = msrun(tmp_path, os.path.join(ROOT, "scripts", "run_infer_main.py"), "--model_dir", tp_folder,
                       "--backend", "ms", "--prompt", "hello", "--max_output_length", "6")
    assert code == 0, "\n".join(logs.values())[-3000:]
    timing = {name: [line for line in log.splitlines() if line.startswith("[timing]")] for name, log in logs.items()}
    assert [len(t) for t in timing.values()] == [1, 1]
    assert timing["worker_0.log"][0].endswith("backend ms, rank 0 of 2)")
    assert timing["worker_1.log"][0].endswith("backend ms, rank 1 of 2)")
    want = pipes["gqa_tied"]("hello", max_new_tokens=6)
    assert want.strip() and want in logs["worker_0.log"].splitlines()
    assert want not in logs["worker_1.log"].splitlines()


FAMILY_WORKER = """
import json, sys
sys.path.insert(0, {root!r})
from lite_runtime import pipeline
out = {{}}
for name, folder in {folders!r}.items():
    pipe = pipeline("text_generation", model=folder, backend="ms")
    out[name] = {{"logits": pipe.infer({rows!r}).logits.tolist(),
                 "tokens": [list(map(int, r)) for r in pipe.generate({rows!r}, max_new_tokens=6)]}}
    rank = pipe.config.rank_id
json.dump(out, open({out!r} + f"/families_rank{{rank}}.json", "w"))
"""


def test_qwen3_and_llama_with_biases_split_over_two_ranks_equal_hf(tokenizer, tmp_path):
    """The parts only some families have, under TP: Qwen3's per-head q/k norms (head_dim 32 != hidden / heads) and
    Llama's o_proj and MLP biases (added once, after the AllReduce), with untied heads."""
    import torch

    from export.checkpoints import random_checkpoint
    from export.config import ExportConfig
    from export.pipeline import run_export
    from test_families import FAMILY_CHECKPOINTS

    folders, checkpoints = {}, {}
    for name in ("qwen3_gqa_untied", "llama_mha_untied_linear_bias"):
        kw = FAMILY_CHECKPOINTS[name]
        tok = random_checkpoint.build_tokenizer(bos=True) if kw["family"] == "llama" else tokenizer
        checkpoints[name] = random_checkpoint.make_checkpoint(str(tmp_path / f"ckpt_{name}"), tokenizer=tok, **kw)
        folders[name] = str(tmp_path / name)
        run_export(ExportConfig(checkpoint=checkpoints[name], output=folders[name], name=name, seq_length=32,
                                batch_size=1, dtype="float32", device="cpu", prefill_buckets=(), tp_size=2))
    row = [7, 3, 99, 140, 2, 11, 5, 61, 8]
    script = tmp_path / "families.py"
    script.write_text(FAMILY_WORKER.format(root=ROOT, folders=folders, rows=[row], out=str(tmp_path)))
    code, logs = msrun(tmp_path, script)
    assert code == 0, "\n".join(logs.values())[-3000:]
    r0, r1 = (json.loads((tmp_path / f"families_rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1
    for name, ckpt in checkpoints.items():
        assert rel_err(np.array(r0[name]["logits"][0]), hf_last_logits(ckpt, row)) < 1e-4, name
        with torch.no_grad():
            ref = hf_model(ckpt).generate(torch.tensor([row]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0].tolist()
        got = r0[name]["tokens"][0]
        assert got == ref[:len(got)], name


def test_the_server_refuses_a_tensor_parallel_folder_before_loading(tp_folder):
    pytest.importorskip("fastapi")
    from lite_runtime.errors import InferError
    from lite_runtime.serve import load_service

    with pytest.raises(InferError) as err:
        load_service(tp_folder, backend="ms")
    assert str(err.value) == (f"{tp_folder}: a tensor-parallel folder (2 ranks) cannot be served yet: every rank has "
                              "to take every step, and the server drives one process; run it with pipeline() or "
                              "scripts/run_infer_main.py under msrun (README, \"Two cards\")")
