"""The OpenAI-compatible server (lite_runtime.serve): a real uvicorn server on 127.0.0.1, the `openai` client from
PyPI and httpx, against pipeline().generate on the same folder (batch 4, so four requests share the decode batch)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from reference import prompts
from serving import SEQ, Running, _error, complete, expected, openai, served, server_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def folder(serve_folder):
    return serve_folder


@pytest.fixture(scope="module")
def pipe(serve_pipe):
    return serve_pipe


@pytest.fixture(scope="module")
def server(folder):
    with served(folder) as running:
        yield running


# --- correctness against pipeline().generate -----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_pipeline(server, pipe, stream):
    text = "the quick brown fox jumps"
    ids = pipe.encode(text)
    want, reason, n = expected(pipe, ids, 20)
    got, got_reason, usage = complete(server, text, stream=stream, max_tokens=20)
    assert (got, got_reason) == (want, reason)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), n, len(ids) + n)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_pipeline(server, pipe, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = pipe.encode(pipe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    want, reason, _ = expected(pipe, ids, 16)
    r = server.client.chat.completions.create(model="serve4", messages=messages, max_tokens=16, temperature=0,
                                              stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks)
        got_reason = chunks[-1].choices[0].finish_reason
    else:
        got, got_reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)
    assert (got, got_reason) == (want, reason)


def test_sampling_with_a_seed_equals_pipeline(server, pipe):
    """temperature, top_p, top_k, repetition_penalty and seed mean what they mean in pipeline().generate."""
    ids = prompts(1, [7], seed=3)[0]
    want, _, _ = expected(pipe, ids, 24, do_sample=True, temperature=1.3, top_p=0.9, top_k=40,
                          repetition_penalty=1.1, seed=11)
    got, _, _ = complete(server, ids, max_tokens=24, temperature=1.3, top_p=0.9, seed=11,
                         extra_body={"top_k": 40, "repetition_penalty": 1.1})
    assert got == want


def test_four_staggered_requests_each_equal_their_solo_output(server, pipe):
    """Four greedy requests of different lengths, each started while the others decode (8 engine steps apart):
    each joins a running decode batch, and each returns what it returns alone. The tiny model decodes a token in
    about a millisecond, so the engine is held (MindSpore's lock) while a request is submitted."""
    from lite_runtime.mindspore_lock import MINDSPORE_LOCK

    rows = prompts(4, [3, 12, 25, 40], seed=7)
    limits = [60, 50, 38, 24]
    solo = [expected(pipe, ids, n) for ids, n in zip(rows, limits)]
    assert [reason for _, reason, _ in solo] == ["length"] * 4  # nobody leaves early: all four overlap
    engine = server.service.engine
    results = {}

    def run(i):
        # speculative off: a token a step, so 8 steps apart leaves every earlier request decoding (prompt lookup, on
        # while a request decodes alone, may emit several tokens a step and end request 0 before request 2 comes)
        chunks = server.client.completions.create(model="serve4", prompt=rows[i], max_tokens=limits[i],
                                                  temperature=0, stream=True, extra_body={"speculative": False})
        results[i] = "".join(chunk.choices[0].text for chunk in chunks)

    engine.peak_busy = 0
    threads = []
    first_step = engine.steps
    submitted = engine.inflight + engine.completed  # every request submitted so far, ended or not
    for i in range(4):
        deadline = time.time() + 30
        # MindSpore's lock is taken to read the step count: the engine's next graph call waits while it is held, so
        # the engine runs at most a step past the mark (a loaded machine's scheduling cannot let it run ahead; with
        # prompt lookup the lone first request may emit several tokens a step)
        while True:
            MINDSPORE_LOCK.acquire()
            if engine.steps >= first_step + 8 * i:
                break
            MINDSPORE_LOCK.release()
            assert time.time() < deadline, (i, engine.steps - first_step)
            time.sleep(0.0005)
        try:  # held: the request is in the engine's queue before its next graph call
            threads.append(threading.Thread(target=run, args=(i,)))
            threads[-1].start()
            while engine.inflight + engine.completed < submitted + i + 1:
                assert time.time() < deadline, (i, engine.inflight, engine.completed - submitted)
                time.sleep(0.002)
        finally:
            MINDSPORE_LOCK.release()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(4)] == [text for text, _, _ in solo]
    assert engine.peak_busy == 4  # they really shared the decode batch


def test_stop_strings_are_found_across_token_boundaries(server, pipe):
    ids = prompts(1, [9], seed=5)[0]
    tokenizer = pipe.tokenizer
    new = pipe.generate([ids], max_new_tokens=30)[0][len(ids):]
    text = tokenizer.decode(new, skip_special_tokens=True)
    # a boundary between two generated tokens, with a plain character on each side: a stop of those two
    # characters is split across the tokens
    cuts = [len(tokenizer.decode(new[:j], skip_special_tokens=True)) for j in range(1, len(new))]
    cut = next(c for c in cuts if 0 < c < len(text) and "\ufffd" not in text[c - 1:c + 1]
               and text.find(text[c - 1:c + 1]) == c - 1)
    stop = text[cut - 1:cut + 1]
    for stream in (False, True):
        got, reason, _ = complete(server, ids, stream=stream, max_tokens=30, stop=[stop, "never-there"])
        assert (got, reason) == (text[:cut - 1], "stop")


# --- the slots: disconnects, the queue bound ---------------------------------------------------------------------
def _wait_idle(server, timeout=20.0):
    deadline = time.time() + timeout
    while True:
        health = httpx.get(server.url + "/health").json()
        if health["rows_busy"] == 0 and health["waiting"] == 0:
            return
        assert time.time() < deadline, health
        time.sleep(0.05)


def test_a_disconnected_client_frees_its_row(server, pipe):
    ids = prompts(1, [6], seed=9)[0]
    body = {"model": "serve4", "prompt": ids, "max_tokens": SEQ - 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # closed after the first event, with ~50 tokens to go: the engine frees the row at its next step
    _wait_idle(server)
    assert server.service.engine.slots == [None] * 4
    for ids in prompts(2, [4, 11], seed=10):
        assert complete(server, ids, max_tokens=12)[0] == expected(pipe, ids, 12)[0]


def test_past_the_queue_bound_503_with_retry_after(server, pipe):
    """4 rows + max_queue 1: a sixth request is refused while the engine is held; the five finish correctly."""
    from lite_runtime.mindspore_lock import MINDSPORE_LOCK

    engine = server.service.engine
    rows = prompts(5, [3, 5, 7, 9, 11], seed=12)
    results = {}
    engine.max_queue = 1
    try:
        with MINDSPORE_LOCK:  # the engine's next graph call waits: nothing finishes meanwhile
            threads = [threading.Thread(target=lambda i=i: results.update({i: complete(server, rows[i],
                                                                                       max_tokens=8)[0]}))
                       for i in range(5)]
            for t in threads:
                t.start()
            deadline = time.time() + 20
            while engine.inflight < 5:
                assert time.time() < deadline
                time.sleep(0.02)
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json() == {"error": {
                "message": "the server is busy: its 4 rows are serving and its 1 queue places (--max_queue) are "
                           "taken; retry later", "type": "server_error", "param": None, "code": "server_busy"}}
        for t in threads:
            t.join(timeout=60)
    finally:
        engine.max_queue = 64
    assert [results[i] for i in range(5)] == [expected(pipe, ids, 8)[0] for ids in rows]


# --- bad input: 400 with the reason, and nothing else disturbed -------------------------------------------------
BAD = [
    ("not json", b'{"prompt": "a",', _error(
        "the body is not valid JSON: Expecting property name enclosed in double quotes (char 15)")),
    ("not an object", b'[1]', _error("the body must be a JSON object")),
    ("not finite", b'{"prompt": "a", "temperature": NaN}', _error("'temperature' must be a finite number",
                                                                  "temperature")),
    ("wrong type", {"prompt": "a", "max_tokens": "8"}, _error("'max_tokens' must be an integer, got \"8\"",
                                                              "max_tokens")),
    ("bool for a number", {"prompt": "a", "temperature": True}, _error("'temperature' must be a number, got true",
                                                                       "temperature")),
    ("n > rows", {"prompt": "a", "n": 5}, _error(
        "'n' must be at most 4 (this folder's graph rows: each choice takes one), got 5", "n")),
    ("prompt too long", {"prompt": [5] * (SEQ + 1)}, _error(
        f"the prompt has {SEQ + 1} tokens; this model's graphs hold {SEQ} tokens per request, prompt and completion "
        "together: shorten it", "prompt", "context_length_exceeded")),
    ("max_tokens beyond seq_length", {"prompt": "a", "max_tokens": SEQ + 1}, _error(
        f"'max_tokens' {SEQ + 1} is beyond this model's seq_length {SEQ}", "max_tokens")),
    ("prompt + max_tokens", {"prompt": [5] * 10, "max_tokens": SEQ - 5}, _error(
        f"the prompt's 10 tokens + 'max_tokens' {SEQ - 5} exceed this model's seq_length {SEQ}; lower 'max_tokens' "
        f"to at most {SEQ - 10}", "max_tokens", "context_length_exceeded")),
    ("two prompts", {"prompt": ["a", "b"]}, _error(
        "'prompt' must be one string or one list of token ids: send one prompt per request", "prompt")),
    ("unsupported", {"prompt": "a", "best_of": 2}, _error("'best_of' is not supported by this server", "best_of")),
    ("logprobs > 20", {"prompt": "a", "logprobs": 21}, _error("'logprobs' must be in [0, 20], got 21", "logprobs")),
    ("out of range", {"prompt": "a", "top_p": 0}, _error("'top_p' must be in (0, 1], got 0", "top_p")),
]


@pytest.mark.parametrize("body,want", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_with_the_reason(server, body, want):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", **kwargs)
    assert (r.status_code, r.json()) == (400, want)


def test_bad_chat_messages_and_unknown_model(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]})
    assert (r.status_code, r.json()) == (400, _error(
        "'messages[0].content' must be a string or a list of text parts", "messages"))
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key(folder, server):
    """With a key every endpoint but /health needs `Authorization: Bearer KEY`; 401 in OpenAI's shape."""
    from lite_runtime.serve import Service

    s = server.service
    keyed = Running(Service(s.generator, s.engine, s.model_name, api_key="sesame"))
    try:
        assert httpx.get(keyed.url + "/health").status_code == 200
        missing = httpx.get(keyed.url + "/v1/models")
        assert (missing.status_code, missing.json()) == (401, {"error": {
            "message": "missing API key: send the header 'Authorization: Bearer <key>'",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="open", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="serve4", prompt="a", max_tokens=2)
        right = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sesame", max_retries=0)
        assert right.models.list().data[0].id == "serve4"
        assert right.completions.create(model="serve4", prompt="a", max_tokens=2).usage.completion_tokens >= 1
    finally:
        keyed.stop()


# --- the command ----------------------------------------------------------------------------------------------
def test_the_command_serves_and_warns_off_loopback_without_a_key(folder, tmp_path):
    # off loopback without a key: the warning comes first (this run then fails on the folder, before binding)
    proc = subprocess.run([sys.executable, "-m", "lite_runtime.serve", "--model_dir", str(tmp_path / "none"),
                           "--host", "0.0.0.0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == (
        "warning: listening on 0.0.0.0 without an API key: anyone who can reach this port can use the model. "
        "Pass --api_key or set MSLITE_LLM_API_KEY.")
    server, port = server_process(folder, env=dict(os.environ, MSLITE_LLM_API_KEY="k1"))
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0)
        r = client.completions.create(model="serve4", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
    assert f"serving serve4 on http://127.0.0.1:{port}/v1 (backend ms, 4 sequence(s) a step, up to {SEQ} tokens " \
           "each, API key required)" in err
    # the pool: blocks of 8, sized from free memory up to four longest sequences per graph row (4 x 4 x 8 blocks)
    assert re.search(r"^KV cache: 128 blocks of 8 tokens \(1024 tokens, \d+\.\d MiB\), sized from free memory \(50% "
                     r"of the \d+\.\d GiB free after the weights and 1 GiB for activations, at most 4 longest requests "
                     r"per row\)$", err, re.M), err


# --- /tokenize and /detokenize (vLLM's shape) -------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_with_the_models_tokenizer(server, pipe):
    tok = pipe.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": "serve4", "prompt": "hello world"})
    ids = tok("hello world", add_special_tokens=True)["input_ids"]
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": SEQ, "tokens": ids}
    messages = [{"role": "user", "content": "hi there"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids})
    assert (r.status_code, r.json()) == (200, {"prompt": tok.decode(ids, skip_special_tokens=False)})


def test_tokenize_counts_what_the_chat_endpoint_prefills(server):
    """The count /tokenize gives for messages is the prompt_tokens the chat endpoint then reports."""
    messages = [{"role": "user", "content": "count me"}]
    count = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    r = server.client.chat.completions.create(model="serve4", messages=messages, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == count


def test_tokenize_and_detokenize_refuse_bad_input_by_field(server):
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, 99999]})
    assert (r.status_code, r.json()) == (400, _error(
        "'tokens' has the token id 99999, outside this model's vocabulary [0, 512)", "tokens"))
    r = httpx.post(server.url + "/tokenize", json={})
    assert (r.status_code, r.json()) == (400, _error("'prompt' (a string) or 'messages' is required", "prompt"))
    r = httpx.post(server.url + "/tokenize", json={"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
