"""The server's 2026 OpenAI API: /metrics, logprobs against HF's log_softmax, n choices, /openapi.json.
Same folder as test_serve (gqa_tied, batch 4, seq_length 64, float32), its own server."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from reference import hf_model, prompts
from serving import SEQ, Running, _error, complete, expected, served


@pytest.fixture(scope="module")
def server(serve_folder):
    with served(serve_folder) as running:
        yield running


def hf_log_softmax(checkpoint: str, prompt, generated) -> np.ndarray:
    """log_softmax (float64) of HF's float32 logits at each generated position: [len(generated), V]."""
    import torch

    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor([list(prompt) + list(generated)])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(generated)].numpy()


# --- logprobs -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_hf_log_softmax(server, serve_pipe, checkpoints, stream):
    """logprobs: 5 -> each token's log-probability and the 5 most likely, log-softmax of the raw logits (no sampling
    transform: temperature, top-k/p and the repetition penalty do not change them, as in OpenAI's API), within 1e-4
    of HF's on the same weights; the alternatives are HF's top 5 in order."""
    ids = prompts(1, [7], seed=21)[0]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 5, "repetition_penalty": 1.3}
    if not stream:
        choice = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        lp = choice["logprobs"]
    else:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    c = json.loads(line[6:])["choices"][0]
                    for key in lp:
                        lp[key] += (c["logprobs"] or {}).get(key, [])
    text, _, n = expected(serve_pipe, ids, 12, repetition_penalty=1.3)
    generated = serve_pipe.generate([ids], max_new_tokens=12, repetition_penalty=1.3)[0][len(ids):]
    ref = hf_log_softmax(checkpoints["gqa_tied"], ids, generated)
    from lite_runtime.serve.responses import TokenPieces

    pieces = TokenPieces(server.service.generator.tokenizer)
    assert len(lp["token_logprobs"]) == n == len(generated)
    np.testing.assert_allclose(lp["token_logprobs"], ref[np.arange(n), generated], atol=1e-4, rtol=0)
    for i, top in enumerate(lp["top_logprobs"]):
        want = {}
        for t in np.argsort(-ref[i], kind="stable")[:5]:  # OpenAI's shape keys by text: two tokens may share one
            want.setdefault(pieces(int(t))[0], ref[i][t])
        assert list(top) == list(want)
        np.testing.assert_allclose(list(top.values()), list(want.values()), atol=1e-4, rtol=0)
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(n)]


def test_chat_logprobs_with_top_logprobs_through_the_client(server, serve_pipe, checkpoints):
    messages = [{"role": "user", "content": "hello there"}]
    r = server.client.chat.completions.create(model="serve4", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=3)
    ids = serve_pipe.encode(serve_pipe.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True))
    generated = serve_pipe.generate([ids], max_new_tokens=8)[0][len(ids):]
    eos = set(serve_pipe.defaults.eos_token_id or ())
    generated = [t for t in generated if t not in eos]
    ref = hf_log_softmax(checkpoints["gqa_tied"], ids, generated)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(list(ref[np.arange(len(generated)), generated]), abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[2].logprob for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace") == r.choices[0].message.content


def test_logprobs_refusals(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                              "top_logprobs": 2})
    assert (r.status_code, r.json()) == (400, _error("'top_logprobs' needs 'logprobs': true", "top_logprobs"))
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                              "logprobs": True, "top_logprobs": 21})
    assert (r.status_code, r.json()) == (400, _error("'top_logprobs' must be in [0, 20], got 21", "top_logprobs"))


# --- the sampling fields ---------------------------------------------------------------------------------------
def test_sampling_fields_are_pipelines_through_the_client(server, serve_pipe):
    """presence_penalty, frequency_penalty, logit_bias (OpenAI's fields), min_p, stop_token_ids and ignore_eos
    (vLLM's, through extra_body): each answer is pipeline().generate's with the same settings under HF's names
    (tests/test_sampling.py holds those to transformers' processors and to OpenAI's formula)."""
    ids = prompts(1, [6], seed=8)[0]
    plain = serve_pipe.generate([ids], max_new_tokens=10)[0][len(ids):]
    first = plain[0]
    cases = [  # (the request's fields, pipeline's)
        (dict(presence_penalty=1.5, frequency_penalty=0.8), dict(presence_penalty=1.5, frequency_penalty=0.8)),
        (dict(logit_bias={str(first): -100}), dict(suppress_tokens=[first])),
        (dict(logit_bias={str(first): -3.5, str(plain[1]): 2}), dict(sequence_bias={(first,): -3.5,
                                                                                    (plain[1],): 2.0})),
        (dict(temperature=1.3, seed=11, extra_body={"min_p": 0.2}),
         dict(do_sample=True, temperature=1.3, seed=11, min_p=0.2)),
    ]
    for fields, kwargs in cases:
        text, finish, usage = complete(server, ids, max_tokens=10, **fields)
        want = expected(serve_pipe, ids, 10, **kwargs)
        assert (text, finish, usage.completion_tokens) == want, fields
    assert complete(server, ids, max_tokens=10, logit_bias={str(first): -100})[0] != \
        serve_pipe.tokenizer.decode(plain, skip_special_tokens=True)  # the ban did change the answer
    at = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    for stream in (False, True):  # a stop token ends the answer before it, as eos does
        text, finish, usage = complete(server, ids, stream=stream, max_tokens=10,
                                       extra_body={"stop_token_ids": [plain[at]]})
        assert (text, finish, usage.completion_tokens) == (
            serve_pipe.tokenizer.decode(plain[:at], skip_special_tokens=True), "stop", at + 1)
    eos = serve_pipe.defaults.eos_token_id[0]
    _, finish, usage = complete(server, ids, max_tokens=5, logit_bias={str(eos): 100})
    assert (finish, usage.completion_tokens) == ("stop", 1)
    _, finish, usage = complete(server, ids, max_tokens=5, logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert (finish, usage.completion_tokens) == ("length", 5)


@pytest.mark.parametrize("body, message, param", [
    ({"logit_bias": {"512": 1}}, "'logit_bias' key '512' is not a token id of this model: its vocabulary is [0, 512)",
     "logit_bias"),
    ({"logit_bias": {"a1": 1}}, "'logit_bias' key \"a1\" is not a token id: keys are token ids written as decimal "
                                "strings, e.g. {\"50256\": -100}", "logit_bias"),
    ({"logit_bias": {"5": -101}}, "'logit_bias' value for key \"5\" must be in [-100, 100], got -101.0", "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "'logit_bias.5' must be a number, got \"x\"", "logit_bias"),
    ({"presence_penalty": 2.5}, "'presence_penalty' must be in [-2, 2], got 2.5", "presence_penalty"),
    ({"frequency_penalty": -3}, "'frequency_penalty' must be in [-2, 2], got -3", "frequency_penalty"),
    ({"min_p": 1.5}, "'min_p' must be in [0, 1], got 1.5", "min_p"),
    ({"stop_token_ids": [3, 600]}, "'stop_token_ids' has the token id 600, outside this model's vocabulary [0, 512)",
     "stop_token_ids"),
])
def test_sampling_field_refusals(server, body, message, param):
    r = httpx.post(server.url + "/v1/completions", json=dict(prompt="a", **body))
    assert (r.status_code, r.json()) == (400, _error(message, param))


# --- n ----------------------------------------------------------------------------------------------------------
def test_n_choices_are_rows_seeded_seed_plus_i(server, serve_pipe):
    """n=3 sampled with seed 5: choice i is pipeline().generate with seed 5 + i; usage counts every choice."""
    ids = prompts(1, [6], seed=4)[0]
    r = server.client.completions.create(model="serve4", prompt=ids, max_tokens=10, n=3, temperature=1.0, seed=5,
                                         top_p=0.95)
    want = [expected(serve_pipe, ids, 10, do_sample=True, temperature=1.0, top_p=0.95, seed=5 + i) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.text, c.finish_reason) for c in r.choices] == [(t, f) for t, f, _ in want]
    assert len({c.text for c in r.choices}) > 1  # different seeds, different samples
    assert r.usage.completion_tokens == sum(n for _, _, n in want) and r.usage.prompt_tokens == len(ids)


def test_n_choices_stream_by_index(server, serve_pipe):
    messages = [{"role": "user", "content": "count me"}]
    chunks = list(server.client.chat.completions.create(model="serve4", messages=messages, max_tokens=6, n=2,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    texts, finish = {0: "", 1: ""}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    plain = server.client.chat.completions.create(model="serve4", messages=messages, max_tokens=6, temperature=0)
    assert texts[0] == texts[1] == plain.choices[0].message.content
    assert finish == {0: plain.choices[0].finish_reason, 1: plain.choices[0].finish_reason}
    assert chunks[-1].usage.completion_tokens == 2 * plain.usage.completion_tokens


# --- /metrics -------------------------------------------------------------------------------------------------
def _samples(text: str):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_what_was_served(server):
    before = _samples(httpx.get(server.url + "/metrics").text)
    ids = prompts(1, [5], seed=30)[0]
    text, reason, usage = complete(server, ids, max_tokens=7)
    assert reason == "length"
    httpx.post(server.url + "/v1/completions", json={"prompt": "a", "top_p": 0})  # a 400
    page = httpx.get(server.url + "/metrics").text
    after = _samples(page)
    # no `_created` series (prometheus-client adds one per counter and histogram, under the metric's help text)
    assert [line for line in page.splitlines() if "_created" in line] == []
    assert {name for name, _ in after if name.endswith("_created")} == set()

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("mslite_llm:requests_total", endpoint="completions", finish_reason="length") == 1
    assert grew("mslite_llm:prompt_tokens_total") == len(ids)
    assert grew("mslite_llm:generation_tokens_total") == 7
    assert grew("mslite_llm:time_to_first_token_seconds_count") == 1
    assert grew("mslite_llm:inter_token_latency_seconds_count") == 6
    assert grew("mslite_llm:e2e_request_latency_seconds_count") == 1
    assert grew("mslite_llm:invalid_requests_total", endpoint="/v1/completions") == 1
    assert after[("mslite_llm:rows", ())] == 4
    assert after[("mslite_llm:num_requests_running", ())] == 0


def test_metrics_need_the_key_unless_public(server):
    from lite_runtime.serve import Service

    s = server.service
    for public, status in ((False, 401), (True, 200)):
        keyed = Running(Service(s.generator, s.engine, s.model_name, api_key="k", metrics_public=public))
        try:
            assert httpx.get(keyed.url + "/metrics").status_code == status
            assert httpx.get(keyed.url + "/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        finally:
            keyed.stop()


# --- the schema -------------------------------------------------------------------------------------------------
def test_openapi_shows_the_real_request_models(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    body = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "n"} <= set(body)
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0] == {
        "maximum": 20, "minimum": 0, "type": "integer"}
    assert SEQ == server.service.generator.seq_length
