"""Chunked prefill and prefix reuse (lite_runtime/engine/scheduler.py over the chunk graph): the engine driven directly, and the
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
    from lite_runtime.engine.scheduler import SlotRequest
    from lite_runtime.engine.sampling import GenerationSettings

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
    from lite_runtime.engine.scheduler import BatchEngine, SlotRequest
    from lite_runtime.engine.sampling import GenerationSettings

    short, (long,) = prompts(3, [5, 6, 7], seed=41), prompts(1, [40], seed=42)
    want = [solo(pipe, p, 30) for p in short] + [solo(pipe, long, 4)]
    pipe.runner.pool.reset_cache()  # the solo runs' blocks are findable: the long prompt would find 32 of its tokens
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


def test_prefix_blocks_are_shared_across_requests(pipe, checkpoints):
    """Prefix caching in whole blocks of 8 (lite_runtime/engine/blocks.py): a request's full blocks stay findable after it
    ends; the next turn of a conversation finds the blocks its previous turn wrote, a repeated prompt all its full
    blocks but the one holding its last token (whose logits give the first token); another prompt finds none. Every
    answer equals the solo run's, and HF's."""
    from lite_runtime.engine.scheduler import BatchEngine

    pipe.runner.pool.reset_cache()
    engine = BatchEngine(pipe)
    queries, hits = engine.prefix_queries, engine.prefix_hits  # the pool's counters, since it was loaded
    try:
        a, b, c, d, e = prompts(5, [12, 14, 16, 18, 9], seed=50)
        first = [run(engine, p, 6) for p in (a, b, c, d)]
        assert all(r.cached == 0 for r in first)
        assert run(engine, e, 6).cached == 0  # no block holds any of it
        turn = b + first[1].generated + prompts(1, [7], seed=51)[0]  # b's conversation, one more message
        nxt = run(engine, turn, 8)
        # b's request wrote its prompt and its answer but the last token (never fed back): 19 tokens, 2 full blocks
        assert nxt.cached == 16
        assert nxt.generated == hf_generate(checkpoints["gqa_tied"], turn, max_new_tokens=8, min_new_tokens=8,
                                            do_sample=False)[len(turn):]
        again = run(engine, c, 6)
        assert again.cached == 8 and again.generated == first[2].generated  # 16 tokens: the 2nd block holds the last
        assert engine.prefix_hits - hits == nxt.cached + again.cached
        assert engine.prefix_queries - queries == sum(len(p) for p in (a, b, c, d, e, turn, c))
        assert nxt.generated == solo(pipe, turn, 8)
        assert engine.pool.num_used == 0  # every request ended: no block held, their contents kept for reuse
    finally:
        engine.stop()


def test_requests_that_arrive_together_compute_a_shared_prefix_once(pipe, checkpoints):
    """Four requests with one 24-token system prompt, submitted at once: the first computes it, the others find its
    three blocks as soon as they are written (prompts go in one after another) and share them while all four run
    (their blocks' reference counts are 4); every answer is its solo answer."""
    from lite_runtime.engine.scheduler import BatchEngine, SlotRequest
    from lite_runtime.engine.sampling import GenerationSettings

    system = prompts(1, [24], seed=60)[0]
    asks = [system + q for q in prompts(4, [3, 5, 6, 4], seed=61)]
    want = [solo(pipe, p, 10) for p in asks]
    pipe.runner.pool.reset_cache()  # the solo runs' blocks: not found
    engine = BatchEngine(pipe)
    hits = engine.prefix_hits
    shared = []
    try:
        done = threading.Event()
        ended = []

        def emit(event, i):
            if event[0] == "text" and len(shared) < 1 and all(r.seq is not None and len(r.seq.blocks) >= 3
                                                                 for r in requests):
                shared.append([engine.pool.refs[b] for b in requests[0].seq.blocks[:3]])
            if event[0] in ("end", "error"):
                ended.append(i)
                if len(ended) == 4:
                    done.set()

        requests = [SlotRequest(prompt=p, max_tokens=10, settings=GenerationSettings(),
                                emit=lambda ev, i=i: emit(ev, i)) for i, p in enumerate(asks)]
        engine.submit_many(requests)
        assert done.wait(60)
        assert [r.generated for r in requests] == want
        assert [r.cached for r in requests] == [0, 24, 24, 24]
        assert shared == [[4, 4, 4]]
        assert engine.prefix_hits - hits == 72
    finally:
        engine.stop()


def test_a_pool_too_small_for_the_load_preempts_and_recomputes_and_the_tokens_do_not_change(serve_folder, pipe,
                                                                                           checkpoints):
    """A pool of 10 blocks (80 tokens) for four requests that grow to 40 tokens each: the youngest give their blocks
    back and wait, and are recomputed (prompt and the tokens they had) when blocks free up; every answer equals its
    solo answer and HF's, preemptions are counted, and every block is free at the end."""
    from lite_runtime import pipeline
    from lite_runtime.engine.scheduler import BatchEngine, SlotRequest
    from lite_runtime.engine.sampling import GenerationSettings

    small = pipeline("text_generation", model=serve_folder, backend="ms", chunk_graphs=True, num_blocks=11)
    asks = prompts(4, [10, 13, 7, 16], seed=70)
    want = [solo(pipe, p, 40 - len(p)) for p in asks]
    engine = BatchEngine(small)
    try:
        done = threading.Event()
        ended = []
        requests = [SlotRequest(prompt=p, max_tokens=40 - len(p), settings=GenerationSettings(),
                                emit=lambda ev: ev[0] in ("end", "error") and (ended.append(ev), len(ended) == 4
                                                                                and done.set()))
                    for p in asks]
        engine.submit_many(requests)
        assert done.wait(120)
        assert all(ev[0] == "end" for ev in ended), ended
        assert [r.generated for r in requests] == want
        assert engine.preemptions >= 1 and any(r.preempted for r in requests)
        assert want[3] == hf_generate(checkpoints["gqa_tied"], asks[3], max_new_tokens=24, min_new_tokens=24,
                                      do_sample=False)[len(asks[3]):]
        assert small.runner.pool.num_used == 0
    finally:
        engine.stop()


def test_kv_memory_grows_a_block_at_a_time(pipe):
    """A request holds the blocks its tokens fill, no more: at each decode step, ceil(positions / 8) blocks for the
    positions it holds with the one the step writes; none once it ends."""
    from lite_runtime.engine.scheduler import BatchEngine, SlotRequest
    from lite_runtime.engine.sampling import GenerationSettings

    engine = BatchEngine(pipe)
    held = []
    step = pipe.runner.step

    def counted(rows):  # the runner's own step, with what the pool holds as it is called
        held.append((len(request.seq.tokens) + 1, engine.pool.num_used))
        return step(rows)

    try:
        pipe.runner.step = counted
        done = threading.Event()
        request = SlotRequest(prompt=prompts(1, [5], seed=80)[0], max_tokens=40, settings=GenerationSettings(), eos=(),
                              emit=lambda ev: ev[0] in ("end", "error") and done.set())
        engine.submit(request)
        assert done.wait(60)
        assert [t for t, _ in held] == list(range(6, 45))  # the prompt went in as a piece, then 39 steps
        assert all(used == -(-positions // 8) for positions, used in held), held
        assert engine.pool.num_used == 0
    finally:
        del pipe.runner.step
        engine.stop()


def test_a_chat_turn_reports_its_cached_tokens_and_answers_as_alone(serve_folder, pipe):
    """The second turn of a chat: usage's prompt_tokens_details.cached_tokens is the conversation's full blocks turn 1
    left, the answer is the solo answer, and /metrics counts the hit; with --prefix_reuse off nothing is reused."""
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
            held = ids1 + pipe.encode(answer)  # what turn 1 left in its blocks (at most)
            common = next(i for i, (x, y) in enumerate(zip(held + [-1], ids2)) if x != y)
            cached = r2.usage.prompt_tokens_details.cached_tokens
            assert r2.choices[0].message.content == expected(pipe, ids2, 4)[0]
            if reuse:  # whole blocks of 8 of the common prefix
                assert cached % 8 == 0 and 8 <= cached <= common, (cached, common)
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


def test_generate_with_more_prompts_than_rows_runs_through_the_engine(pipe, checkpoints):
    """pipeline().generate of several prompts goes through the engine (lite_runtime/generator.py _generate_engine):
    six prompts on four graph rows, two of them sharing a 16-token prefix; every row's tokens equal its solo run's and
    HF's, each stops at its own limit, and no block is held afterwards."""
    pool = pipe.runner.pool
    pool.reset_cache()
    base = prompts(6, [9, 12, 5, 14, 7, 10], seed=60)
    shared = prompts(1, [16], seed=61)[0]
    rows = [shared + base[0], shared + base[1]] + base[2:]
    hits = pool.hits
    out = pipe.generate(rows, max_new_tokens=6, eos_token_id=[])
    assert pool.hits - hits >= 16  # the second of the two found the first's prefix blocks (blocks of 8)
    assert [len(s) - len(r) for s, r in zip(out.sequences, rows)] == [6] * 6
    assert out.finish_reasons == ["length"] * 6 and out.new_tokens == 36
    for row, seq in zip(rows, out.sequences):
        assert seq[:len(row)] == row
        assert seq == hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert seq[len(row):] == solo(pipe, row, 6)
    assert pool.num_used == 0
