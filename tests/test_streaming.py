"""Streaming: the streamed text of every row equals the returned text, greedy and sampled."""
from __future__ import annotations

import threading

import pytest

from lite_runtime import BatchTextIteratorStreamer, InferError, TextIteratorStreamer
from reference import prompts

ROWS = prompts(2, [3, 8], seed=41)


def stream(pipe, streamer, rows, **kwargs):
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=pipe.generate(rows, streamer=streamer, **kwargs)))
    thread.start()
    pieces = list(streamer)
    thread.join()
    return pieces, result["out"]


@pytest.mark.parametrize("kwargs", [dict(), dict(do_sample=True, top_k=40, top_p=0.95, temperature=1.3, seed=5,
                                                repetition_penalty=1.1)])
def test_every_row_streams_its_text(pipes, tokenizer, kwargs):
    pipe = pipes["gqa_tied"]
    streamer = BatchTextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    pieces, out = stream(pipe, streamer, ROWS, max_new_tokens=12, **kwargs)
    for i, (seq, n) in enumerate(zip(out.sequences, out.prompt_lengths)):
        streamed = "".join(text for row, text in pieces if row == i)
        assert streamed == tokenizer.decode(seq[n:], skip_special_tokens=True)
    assert {row for row, _ in pieces} == {0, 1}


def test_single_row_stream_with_prompt(pipes, tokenizer):
    streamer = TextIteratorStreamer(tokenizer, skip_special_tokens=True)
    pieces, out = stream(pipes["mha_untied"], streamer, [ROWS[1]], max_new_tokens=9)
    assert "".join(pieces) == tokenizer.decode(out.sequences[0], skip_special_tokens=True)


def test_transformers_own_streamer_works_for_one_row(pipes, tokenizer):
    from transformers import TextIteratorStreamer as HFStreamer

    streamer = HFStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    pieces, out = stream(pipes["gqa_tied"], streamer, [ROWS[0]], max_new_tokens=10)
    assert "".join(pieces) == tokenizer.decode(out.sequences[0][3:], skip_special_tokens=True)


def test_single_row_streamer_refuses_a_batch(pipes, tokenizer):
    with pytest.raises(InferError) as err:
        pipes["gqa_tied"].generate(ROWS, streamer=TextIteratorStreamer(tokenizer), max_new_tokens=2)
    assert str(err.value) == ("TextIteratorStreamer streams one row, the batch has 2; "
                              "use BatchTextIteratorStreamer")
