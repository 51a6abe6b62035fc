"""Step graphs of fewer rows (export --step_rows): a decode step of n live sequences runs the inc graph of the fewest
rows that holds them, packed, and gives what the batch_size graph gives (HF's greedy tokens). Score graphs have one
step row (export/writers/graphs.py SCORE_STEP_ROWS): a live row is packed into it, more step first."""
from __future__ import annotations

import json
import os

import pytest

from reference import hf_generate, prompts, rel_err

ROWS = prompts(3, [5, 11, 7], seed=33)


def test_a_cpu_folder_has_inc_graphs_of_1_2_rows_below_batch_4(serve_folder):
    with open(os.path.join(serve_folder, "manifest.json")) as fh:
        graphs = [g for g in json.load(fh)["graphs"] if g["role"] == "inc"]
    assert [(g["file"], g.get("rows"), g["inputs"][0]["shape"], g["outputs"][0]["shape"]) for g in graphs] == [
        ("serve4_inc_graph.mindir", None, [4, 1], [4, 512]),
        ("serve4_inc_1rows_graph.mindir", 1, [1, 1], [1, 512]),
        ("serve4_inc_2rows_graph.mindir", 2, [2, 1], [2, 512])]


def test_few_sequences_run_the_fewest_rows_and_equal_hf(serve_pipe, checkpoints):
    from lite_runtime.folder import graph_rows

    runner = serve_pipe.runner
    assert runner.step_graphs == {1: "inc_1", 2: "inc_2", 4: "inc"}
    for n, graph in ((1, "inc_1"), (2, "inc_2"), (3, "inc")):
        runner.step_counts = {}
        out = serve_pipe.generate([list(r) for r in ROWS[:n]], max_new_tokens=10)
        for row, got in zip(ROWS, out.sequences):
            assert got == hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=10, do_sample=False)
        # the engine's steps: n rows once all are in (a row that is still going in, or done, is not a live row)
        assert max(runner.step_counts, key=lambda k: runner.step_counts[k]) == graph, (n, runner.step_counts)
        assert all(graph_rows(k, 4) <= graph_rows(graph, 4) for k in runner.step_counts), (n, runner.step_counts)


def test_a_live_row_anywhere_is_packed_and_its_logits_are_the_full_graphs(serve_pipe):
    """Rows 3 and 1 live (the others idle): one call of inc_2, the logits at rows 3 and 1 those of the batch_size
    graph for the same step, idle rows zeros."""
    from lite_runtime.engine.blocks import SequenceBlocks
    from lite_runtime.engine.runner import StepRow

    runner = serve_pipe.runner
    seqs = [SequenceBlocks(runner.pool) for _ in range(2)]
    try:
        for s, r in zip(seqs, ROWS):
            s.reserve(len(r))
        runner.prefill([ROWS[0], ROWS[1]], [s.blocks for s in seqs])
        rows = [None, StepRow(7, len(ROWS[1]), seqs[1].blocks), None, StepRow(9, len(ROWS[0]), seqs[0].blocks)]
        runner.step_counts = {}
        packed = runner.step(rows)
        assert runner.step_counts == {"inc_2": 1}
        sizes, runner.step_sizes = runner.step_sizes, [4]
        try:
            full = runner.step(rows)  # the same positions again: the same keys and values rewritten
        finally:
            runner.step_sizes = sizes
        assert runner.step_counts == {"inc_2": 1, "inc": 1}
        assert rel_err(packed[[1, 3]], full[[1, 3]]) < 1e-5
        assert not packed[[0, 2]].any()
    finally:
        for s in seqs:
            s.release(commit=False)


def test_score_graphs_have_one_step_row(serve_folder):
    with open(os.path.join(serve_folder, "manifest.json")) as fh:
        graphs = [g for g in json.load(fh)["graphs"] if g["role"] == "score"]
    assert [(g["file"], g.get("rows"), g["inputs"][0]["shape"], g["outputs"][0]["shape"]) for g in graphs] == [
        ("serve4_score_8_graph.mindir", 1, [1, 1], [1 + 8, 512]), ("serve4_score_graph.mindir", 1, [1, 1], [1 + 64, 512])]


@pytest.mark.parametrize("live", [[3], [1, 3]])
def test_a_score_call_beside_live_rows_gives_the_steps_and_the_pieces_logits(serve_pipe, live):
    """A piece through the score graph (one step row) beside live rows: one live row is packed into the graph's row
    (one call), two step first through their inc graph and the piece goes in alone; either way each live row's logits
    are its step's, the piece's those of the piece alone, and idle rows' zeros."""
    from lite_runtime.engine.blocks import SequenceBlocks
    from lite_runtime.engine.runner import StepRow

    runner = serve_pipe.runner
    seqs = [SequenceBlocks(runner.pool) for _ in range(3)]
    try:
        for s, r in zip(seqs, ROWS):
            s.reserve(len(r) + 8)
        runner.prefill([ROWS[0], ROWS[1]], [s.blocks for s in seqs[:2]])
        runner.prefill([ROWS[2][:3]], [seqs[2].blocks])
        rows = runner.idle()
        for row, i in zip(live, (0, 1)):
            rows[row] = StepRow(7 + i, len(ROWS[i]), seqs[i].blocks)
        piece = list(ROWS[2][3:])
        runner.step_counts = {}
        got_step, got_piece = runner.chunk(piece, 3, seqs[2].blocks, rows, every=True)
        got_piece = got_piece.copy()
        assert runner.step_counts == ({} if len(live) == 1 else {"inc_2": 1})
        want_step = runner.step(rows)  # the same positions again: the same keys and values rewritten
        want_piece = runner.chunk(piece, 3, seqs[2].blocks, runner.idle(), every=True)[1]
        assert rel_err(got_step[live], want_step[live]) < 1e-5
        assert not got_step[[i for i in range(4) if i not in live]].any()
        assert rel_err(got_piece, want_piece) < 1e-5
    finally:
        for s in seqs:
            s.release(commit=False)


def test_check_takes_every_inc_graph_in_turn(serve_folder, capsys):
    from lite_runtime.check import main

    assert main([serve_folder, "--backend", "ms", "-q"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("decode calls by inc graph"))
    counts = dict(part.rsplit(": ", 1) for part in line.split(": ", 1)[1].split(", "))
    assert set(counts) == {"inc_1 (1)", "inc_2 (2)", "inc (4)"} and all(int(v) > 0 for v in counts.values())


def test_step_rows_option(tmp_path, checkpoints, capsys):
    from export.__main__ import main

    base = ["--checkpoint", checkpoints["gqa_tied"], "--device", "cpu", "--seq_length", "16", "--batch_size", "4",
            "--prefill_buckets", "none", "--chunk_sizes", "none", "--score_sizes", "none"]
    for rows, files in (("none", []), ("3", ["s3_inc_3rows_graph.mindir"])):
        out = tmp_path / f"s{rows[0]}"
        assert main([*base, "--output", str(out), "--step_rows", rows]) == 0, capsys.readouterr().err
        assert sorted(f for f in os.listdir(out) if "rows_graph" in f) == files
    assert main([*base, "--output", str(tmp_path / "bad"), "--step_rows", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --step_rows: 4 must be between 1 and --batch_size - 1 (3); the inc graph of batch_size rows is always "
        "exported")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("role, rows", [("prefill", 1), ("inc", 8)])
def test_a_manifest_with_rows_where_none_can_be_is_refused(tmp_path, serve_folder, role, rows):
    import shutil

    from lite_runtime import InferConfig, InferError

    folder = tmp_path / "m"
    shutil.copytree(serve_folder, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    graph = next(g for g in manifest["graphs"] if g["role"] == role and (role == "prefill" or g.get("rows") == 2))
    graph["rows"] = rows
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InferError) as err:
        InferConfig.from_folder(str(folder))
    if role == "prefill":
        assert str(err.value) == (f"{folder / 'manifest.json'}: graph {graph['file']!r} has rows 1; only an inc or "
                                  "score graph has rows (a positive count); re-export the folder")
    else:
        assert str(err.value) == (f"{folder / 'serve4.yaml'}: the inc graph serve4_inc_2rows_graph.mindir has 8 rows, "
                                  "more than batch_size 4; re-export the folder")
