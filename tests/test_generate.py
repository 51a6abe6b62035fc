"""pipeline(...).generate / infer / __call__ against HF generate on the same checkpoint (ms backend)."""
from __future__ import annotations

import numpy as np
import pytest

from reference import hf_generate, prompts

ROWS = prompts(2, [4, 13], seed=21)


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_greedy_batch_of_two_equals_hf(pipes, checkpoints, name):
    out = pipes[name].generate([list(r) for r in ROWS], max_new_tokens=12)
    for row, got in zip(ROWS, out.sequences):
        assert got == hf_generate(checkpoints[name], row, max_new_tokens=12, do_sample=False)
    assert out.prompt_lengths == [4, 13]
    assert all(r in ("eos", "length") for r in out.finish_reasons)


def test_second_request_equals_first_and_single_row_batch(pipes, checkpoints):
    pipe = pipes["gqa_tied"]
    first = pipe.generate(ROWS, max_new_tokens=8).sequences
    assert pipe.generate(ROWS, max_new_tokens=8).sequences == first
    assert pipe.generate([ROWS[1]], max_new_tokens=8).sequences == [first[1]]  # the padded batch row is dropped


def test_infer_then_generate_and_generate_then_infer(pipes):
    pipe = pipes["mha_untied"]
    want = pipe.generate(ROWS, max_new_tokens=6).sequences
    rows = [list(r) for r in ROWS]
    for _ in range(6):  # the caller drives the loop: one infer per token
        step = pipe.infer(rows)
        for r, t in zip(rows, step.next_tokens):
            r.append(t)
        assert all(0.0 < p <= 1.0 for p in step.probs)
        z = step.logits[:len(rows)].astype("float64")  # greedy, no penalty: the probability is softmax(logits)'s
        e = np.exp(z - z.max(1, keepdims=True))
        assert step.probs == pytest.approx([e[i, t] / e[i].sum() for i, t in enumerate(step.next_tokens)], rel=1e-9)
    assert rows == want
    assert pipe.generate(ROWS, max_new_tokens=6).sequences == want
    assert pipe.infer([want[0][:-1], want[1][:-1]]).next_tokens == [want[0][-1], want[1][-1]]


def test_max_length_and_eos_stop_each_row(pipes, checkpoints):
    pipe = pipes["gqa_tied"]
    out = pipe.generate(ROWS, max_length=16)
    assert [len(s) for s in out.sequences] == [16, 16] and out.finish_reasons == ["length", "length"]
    eos = out.sequences[1][14]  # the second token row 1 generates: make it the end of sequence
    stopped = pipe.generate(ROWS, max_length=16, eos_token_id=eos)
    assert stopped.sequences[1] == out.sequences[1][:15] and stopped.finish_reasons[1] == "eos"
    cut = out.sequences[0].index(eos) + 1 if eos in out.sequences[0][4:] else 16
    assert stopped.sequences[0] == out.sequences[0][:cut]


def test_text_call_equals_hf_greedy_text(pipes, checkpoints, tokenizer):
    pipe = pipes["gqa_tied"]
    text = "The quick brown fox"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ref = hf_generate(checkpoints["gqa_tied"], ids, max_new_tokens=10, do_sample=False)
    assert pipe(text, max_new_tokens=10) == tokenizer.decode(ref[len(ids):], skip_special_tokens=True)
    assert pipe([text, text], max_new_tokens=10) == [pipe(text, max_new_tokens=10)] * 2
    assert pipe(text, max_new_tokens=10, return_full_text=True) == tokenizer.decode(ref, skip_special_tokens=True)


def test_chat_template_is_the_tokenizers(pipes, checkpoints, tokenizer):
    pipe = pipes["gqa_tied"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    ref = hf_generate(checkpoints["gqa_tied"], ids, max_new_tokens=5, do_sample=False)
    assert pipe("hi", apply_chat_template=True, max_new_tokens=5) == tokenizer.decode(ref[len(ids):],
                                                                                       skip_special_tokens=True)


def test_prefill_buckets_give_the_same_tokens(pipes, exported, checkpoints):
    """A folder with full graphs of 8, 16 and 32 tokens: each prompt runs on the smallest that fits."""
    import json
    import os

    bucketed, single = pipes["gqa_tied_buckets"], pipes["gqa_tied"]
    with open(os.path.join(exported["gqa_tied_buckets"], "manifest.json")) as fh:
        manifest = json.load(fh)
    assert sorted((g["role"], g["tokens"]) for g in manifest["graphs"]) == [
        ("chunk", 8), ("chunk", 32), ("inc", 1), ("inc", 1), ("prefill", 8), ("prefill", 16), ("prefill", 32),
        ("score", 8), ("score", 32)]  # inc: of 2 rows, and of 1 (export --step_rows)
    assert len({g["variables"] for g in manifest["graphs"]}) == 1  # one weights file for all the graphs
    assert [bucketed.prefill_size(n) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    for lengths in ([3, 8], [5, 12], [16, 2], [20, 9]):
        rows = prompts(2, lengths, seed=sum(lengths))
        got = bucketed.generate(rows, max_new_tokens=8).sequences
        assert got == single.generate(rows, max_new_tokens=8).sequences
        assert got[0] == hf_generate(checkpoints["gqa_tied"], rows[0], max_new_tokens=8, do_sample=False)



def test_output_indexes_like_hf_generate(pipes, checkpoints, tokenizer):
    """Code written for HF (`out = generate(...); out[0]`, `batch_decode(out)`) works on GenerateOutput."""
    import torch

    out = pipes["gqa_tied"].generate(ROWS, max_new_tokens=5)
    hf = [hf_generate(checkpoints["gqa_tied"], r, max_new_tokens=5, do_sample=False) for r in ROWS]
    assert out[0] == hf[0] and out[-1] == hf[1] and out[:1] == [hf[0]]
    assert list(out) == hf and len(out) == 2 and out.sequences == hf
    assert tokenizer.batch_decode(out) == tokenizer.batch_decode(hf)
    # and HF-style input: a tensor of rows
    again = pipes["gqa_tied"].generate(torch.tensor([ROWS[1]]), max_new_tokens=5)
    assert again[0] == hf[1]


def test_graphs_load_on_first_use_and_compile_while_idle(exported, checkpoints):
    """Loading reads no graph; a request of one prompt loads the chunk graph its pieces take (the largest: runner
    prefill) and the inc graph of its rows (one: inc_1); idle time compiles the rest of the warm-up set (the inc
    graphs, then that chunk graph) without running them, so the next tokens are still HF's."""
    import threading
    import time

    from lite_runtime import pipeline

    folder, ckpt = exported["gqa_tied_buckets"], checkpoints["gqa_tied"]
    lazy = pipeline("text_generation", model=folder, backend="ms", warm_up="none")
    assert lazy.backend.cells == {}
    row = list(ROWS[1])  # 13 tokens: the 16-token bucket
    assert lazy.generate([row], max_new_tokens=5).sequences[0] == hf_generate(ckpt, row, max_new_tokens=5,
                                                                            do_sample=False)
    assert sorted(lazy.backend.cells) == ["chunk_32", "inc_1"]

    idle = pipeline("text_generation", model=folder, backend="ms")  # warm_up "auto": compile while idle
    deadline = time.monotonic() + 120
    while any(t.name == "mslite-llm-warm-up" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(idle.backend._compiled) == ["chunk_32", "inc", "inc_1"]
    assert idle.generate([row[:6]], max_new_tokens=5).sequences[0] == hf_generate(ckpt, row[:6], max_new_tokens=5,
                                                                                do_sample=False)


def test_an_export_beside_the_idle_warm_up_in_one_process(exported, checkpoints, tmp_path):
    """The idle warm-up compiles in a thread; an export (or another pipeline) in the same process compiles too.
    MindSpore's compiler is not thread-safe: both hold the ms backend's lock, so neither crashes."""

    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    ckpt = checkpoints["gqa_tied"]
    pipe = pipeline("text_generation", model=exported["gqa_tied_buckets"], backend="ms")  # warm_up "auto"
    row = list(ROWS[1])[:6]
    first = pipe.infer([row]).logits[0]  # the 8-token bucket only: inc is left to the warm-up thread
    # the warm-up thread starts compiling inc 0.2 s after the request, while the export below builds its graphs
    run_export(ExportConfig(checkpoint=ckpt, output=str(tmp_path / "again"), name="again", seq_length=16,
                            batch_size=1, dtype="float32", device="cpu", prefill_buckets=(8,)))
    again = pipeline("text_generation", model=str(tmp_path / "again"), backend="ms")
    expected = hf_generate(ckpt, row, max_new_tokens=3, do_sample=False)
    assert pipe.generate([row], max_new_tokens=3).sequences[0] == expected
    assert again.generate([row], max_new_tokens=3).sequences[0] == expected
    assert int(first.argmax()) == expected[len(row)]


def test_last_output_is_the_calling_threads_own(pipes):
    """Two threads calling the same pipeline each read the timing and sequences of their own call."""
    import threading

    pipe = pipes["gqa_tied"]
    got = {}

    def run(name, text, n):
        pipe(text, max_new_tokens=n)
        got[name] = len(pipe.last_output.sequences[0]) - pipe.last_output.prompt_lengths[0]

    threads = [threading.Thread(target=run, args=("a", "hello", 3)), threading.Thread(target=run, args=("b", "the", 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a": 3, "b": 7}


def test_graphs_run_through_the_executor_directly_with_the_cells_outputs(exported, monkeypatch):
    """After its first call a graph runs through MindSpore's graph executor with the phase its compile recorded
    (backends/ms.py _launcher, skipping GraphCell.__call__'s per-call Python): on this MindSpore every graph MindSpore
    runs has that path (here all of them: MSLITE_LLM_DIRECT_STEPS=0; by default the graphs of our kernels run without
    it, tests/test_arena_calls.py), and it returns what the cell's own call returns, bit for bit."""
    from lite_runtime import pipeline

    monkeypatch.setenv("MSLITE_LLM_DIRECT_STEPS", "0")
    pipe = pipeline("text_generation", model=exported["gqa_tied"], backend="ms", warm_up="none")
    pipe.generate(ROWS, max_new_tokens=3)
    backend = pipe.backend
    ran = sorted(backend._launchers)
    assert ran and all(backend._launchers[k] is not None for k in ran) and not backend.plans
    key = next(k for k in ran if k.startswith("inc"))
    inputs = {s.name: np.zeros(s.shape, s.dtype) for s in backend.input_specs(key)}
    inputs["input_ids"][:] = 7
    inputs["valid_length"][:] = 1
    inputs["slot_mapping"][:] = -1  # idle rows over the null block: no cache is written
    args = [backend._tensor(inputs[s.name]) for s in backend.input_specs(key)]
    direct = backend._launchers[key](args)
    assert np.array_equal(direct, backend.cells[key](*args).asnumpy())
    assert np.isfinite(direct).all()


def test_few_prompts_go_in_as_pieces_through_the_chunk_graphs(exported, checkpoints):
    """prefill of one prompt, or of prompts that fill at most a third of the prefill graph's rows x its bucket
    (runner.PIECES_FILL), runs them as pieces through the chunk graphs (the server's path: a batch-16 folder computed
    every row of its prefill graph for one prompt); more prompts than that run the prefill graph. Both give HF's last logits within float32's limit and HF's
    greedy tokens; with prefill_in_pieces off (check's replays) the prefill graph runs whatever the fill."""
    from lite_runtime import pipeline
    from lite_runtime.engine.runner import PIECES_FILL, SequenceBlocks
    from reference import TOL, hf_last_logits, rel_err

    pipe = pipeline("text_generation", model=exported["gqa_tied_buckets"], backend="ms", warm_up="none")
    runner, ckpt = pipe.runner, checkpoints["gqa_tied"]
    assert PIECES_FILL == 1 / 3 and runner.batch_size == 2 and runner.chunk_sizes == [8, 32]

    def prefill(rows, pieces):
        runner.prefill_in_pieces = pieces
        ran = set(runner._checked)
        seqs = [SequenceBlocks(runner.pool) for _ in rows]
        for seq, row in zip(seqs, rows):
            seq.reserve(len(row))
        try:
            logits = runner.prefill(rows, [seq.blocks for seq in seqs])
        finally:
            for seq in seqs:
                seq.release(False)
        return logits, set(runner._checked) - ran

    row = prompts(1, [20], seed=3)[0]  # 20 tokens of the 2 x 32 the prefill_32 graph computes: 0.31
    want = hf_last_logits(ckpt, row)
    first, graphs = prefill([row], True)
    assert graphs == {"chunk_32"}  # one piece of the largest chunk graph
    assert rel_err(first[0], want) < TOL
    again, graphs = prefill([row], True)
    assert not graphs and np.array_equal(again, first)
    whole, graphs = prefill([row], False)
    assert graphs == {"prefill_32"} and rel_err(whole[0], want) < TOL
    one = prompts(1, [30], seed=6)[0]  # 30 of 2 x 32: 0.47, but one prompt
    logits, graphs = prefill([one], True)
    assert graphs <= {"chunk_32"} and rel_err(logits[0], hf_last_logits(ckpt, one)) < TOL
    two = prompts(2, [12, 10], seed=4)  # 22 of 2 x 16: 0.69, the prefill graph
    logits, graphs = prefill(two, True)
    assert graphs == {"prefill_16"}
    for got, r in zip(logits, two):
        assert rel_err(got, hf_last_logits(ckpt, r)) < TOL
    runner.prefill_in_pieces = True
    assert pipe.generate([row], max_new_tokens=6).sequences[0] == hf_generate(ckpt, row, max_new_tokens=6,
                                                                                do_sample=False)


def test_a_prompt_longer_than_the_chunk_graphs_goes_in_several_pieces(tmp_path, checkpoints):
    """A batch-4 folder whose one chunk graph takes 8 tokens: a 20-token prompt prefills as pieces of 8, 8 and 4
    (each after the positions before it are in its blocks), HF's last logits within float32's limit and its greedy
    tokens."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline
    from reference import TOL, hf_last_logits, rel_err

    out = str(tmp_path / "pieces")
    run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="pieces", seq_length=32,
                            batch_size=4, dtype="float32", device="cpu", prefill_buckets=(), chunk_sizes=(8,),
                            score_sizes=(), block_size=8))
    pipe = pipeline("text_generation", model=out, backend="ms", warm_up="none")
    calls = []
    chunk = pipe.runner.chunk
    pipe.runner.chunk = lambda tokens, start, *a, **k: calls.append((len(tokens), start)) or chunk(tokens, start, *a,
                                                                                                        **k)
    row = prompts(1, [20], seed=5)[0]
    logits = pipe.infer([row]).logits
    assert calls == [(8, 0), (8, 8), (4, 16)]
    assert rel_err(logits[0], hf_last_logits(checkpoints["gqa_tied"], row)) < TOL
    assert pipe.generate([row], max_new_tokens=6).sequences[0] == hf_generate(checkpoints["gqa_tied"], row,
                                                                                max_new_tokens=6, do_sample=False)
