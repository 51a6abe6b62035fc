"""Chunked prefill and prefix reuse (lite_runtime/batching.py over the chunk graph): the engine driven directly, and the
server through the openai client, against pipeline().generate on the same folder (the solo run) and HF transformers.
Same folder as test_serve (gqa_tied, batch 4, seq_length 64, chunk graphs of 8 and 64 tokens, float32)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from reference import hf_generate, prompts
from serving import complete, expected, served


@pytest.fixture(scope="module")
def pipe(serve_folder):
    from lite_runtime import pipeline

    return pipeline("text_generation", model=serve_folder, backend="ms", chunk_graphs=True)


def run(engine, prompt, max_tokens, eos=()):
    """Submit one greedy request and wait for its end; the SlotRequest."""
    from lite_runtime.batching import SlotRequest
    from lite_runtime.sampling import GenerationSettings

    done = threading.Event()
    request = SlotRequest(prompt=list(prompt), max_tokens=max_tokens, settings=GenerationSettings(), eos=eos,
                          emit=lambda event: event[0] in ("end", "error") and done.set())
    engine.submit(request)
    assert done.wait(60)
    return request


def solo(pipe, prompt, max_tokens):
    """pipeline().generate's greedy tokens for one prompt, past eos as the engine's requests here (eos=())."""
    return pipe.generate([prompt], max_new_tokens=max_tokens, eos_token_id=[])[0][len(prompt):]


def test_a_long_prompt_is_prefilled_between_the_running_rows_steps(pipe):
    """Three rows decode while a 40-token prompt arrives, prefilled 4 tokens per step: each of its 10 pieces is
    followed by a decode step of the others, so they keep getting tokens; every answer is its solo answer."""
    from lite_runtime.batching import BatchEngine, SlotRequest
    from lite_runtime.sampling import GenerationSettings

    short, (long,) = prompts(3, [5, 6, 7], seed=41), prompts(1, [40], seed=42)
    want = [solo(pipe, p, 30) for p in short] + [solo(pipe, long, 4)]
    engine = BatchEngine(pipe, prefill_chunk=4)
    try:
        events = [[] for _ in range(4)]
        requests = [SlotRequest(prompt=p, max_tokens=30, settings=GenerationSettings(), emit=e.append)
                    for p, e in zip(short, events)]
        for request in requests:
            engine.submit(request)
        deadline = time.time() + 60
        while min(len(r.generated) for r in requests) < 3:  # all three decoding
            assert time.time() < deadline
            time.sleep(0.001)
        pieces = engine.pieces
        late = SlotRequest(prompt=long, max_tokens=4, settings=GenerationSettings(), emit=events[3].append)
        engine.submit(late)
        while not all(e and e[-1][0] == "end" for e in events):
            assert time.time() < deadline
            time.sleep(0.005)
        assert [r.generated for r in requests + [late]] == want
        assert engine.pieces - pieces == 10 and late.cached == 0
        # between its admission and its first token, every running row got a token after each of its pieces but
        # the last (whose step already carries its first token)
        for r in requests:
            during = [t for t in r.token_times if late.started <= t <= late.token_times[0]]
            assert len(during) >= 9, (len(during), r.generated)
    finally:
        engine.stop()


def test_prefix_reuse_and_least_recently_used_rows(pipe, checkpoints):
    """Four requests take the four rows (least recently used first); a new prompt takes the row used longest ago;
    the next turn of a conversation takes its row and prefills only what is new; a repeated prompt reuses all but
    its last token. Every answer equals the solo run's, and HF's."""
    from lite_runtime.batching import BatchEngine

    pipe.runner.forget()  # what earlier tests left in the rows
    engine = BatchEngine(pipe)
    try:
        a, b, c, d, e = prompts(5, [12, 14, 16, 18, 9], seed=50)
        first = [run(engine, p, 6) for p in (a, b, c, d)]
        assert [r.slot for r in first] == [0, 1, 2, 3] and all(r.cached == 0 for r in first)
        assert run(engine, e, 6).slot == 0  # no row holds any of it: the least recently used one
        turn = b + first[1].generated + prompts(1, [7], seed=51)[0]  # b's conversation, one more message
        nxt = run(engine, turn, 8)
        assert nxt.slot == 1 and nxt.cached == len(b) + 6 - 1  # the answer's last token was never fed back
        assert nxt.generated == hf_generate(checkpoints["gqa_tied"], turn, max_new_tokens=8, min_new_tokens=8,
                                            do_sample=False)[len(turn):]
        again = run(engine, c, 6)
        assert again.slot == 2 and again.cached == len(c) - 1 and again.generated == first[2].generated
        assert engine.prefix_hits == nxt.cached + again.cached
        assert nxt.generated == solo(pipe, turn, 8)  # last: pipeline() prefills every row of the shared cache
    finally:
        engine.stop()


def test_a_chat_turn_reports_its_cached_tokens_and_answers_as_alone(serve_folder, pipe):
    """The second turn of a chat: usage's prompt_tokens_details.cached_tokens is the conversation its row kept, the
    answer is the solo answer, and /metrics counts the hit; with --prefix_reuse off nothing is reused."""
    turn1 = [{"role": "user", "content": "hi"}]
    ids1 = pipe.encode(pipe.tokenizer.apply_chat_template(turn1, tokenize=False, add_generation_prompt=True))
    for reuse in (True, False):
        with served(serve_folder, prefix_reuse=reuse) as server:
            r1 = server.client.chat.completions.create(model="serve4", messages=turn1, max_tokens=4, temperature=0)
            answer = r1.choices[0].message.content
            turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "ok"}]
            ids2 = pipe.encode(pipe.tokenizer.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True))
            before = httpx.get(server.url + "/metrics").text
            r2 = server.client.chat.completions.create(model="serve4", messages=turn2, max_tokens=4, temperature=0)
            after = httpx.get(server.url + "/metrics").text
            held = ids1 + pipe.encode(answer)  # what turn 1 left in its row (at most)
            common = next(i for i, (x, y) in enumerate(zip(held + [-1], ids2)) if x != y)
            cached = r2.usage.prompt_tokens_details.cached_tokens
            assert r2.choices[0].message.content == expected(pipe, ids2, 4)[0]
            if reuse:
                assert len(ids1) <= cached <= common
                assert _counter(after, "prefix_cache_hits") - _counter(before, "prefix_cache_hits") == cached
            else:
                assert cached == 0
            assert _counter(after, "prefix_cache_queries") - _counter(before, "prefix_cache_queries") == len(ids2)
            # a completion reports its cached tokens too (none: a prompt no row holds)
            _, _, usage = complete(server, prompts(1, [9], seed=52)[0], max_tokens=2)
            assert usage.prompt_tokens_details.cached_tokens == 0


def _counter(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"mslite_llm:{name}_total "))
    return float(line.split()[1])
