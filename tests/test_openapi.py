"""The server's OpenAPI document tells the truth: schemathesis over a served folder, and the statuses, limits and
405s it documents, each checked against what the server answers.

schemathesis (pinned in the test extra) runs every check but `positive_data_acceptance` (a schema cannot know what
only the model judges: a prompt and max_tokens past the graphs together, a schema the grammar cannot compile, a
chat template's own rules, all documented 400s): no server error, every status and header documented, every
response body (and stream event) valid for its schema, schema-invalid requests refused, 405 with Allow for methods
a route does not take. A fixed seed: the same cases on every run.
"""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from serving import _error, served

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(serve_folder):
    with served(serve_folder) as running:
        yield running


def test_schemathesis_finds_nothing(server):
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
                          "--max-examples", "40", "--seed", "1", "--exclude-checks", "positive_data_acceptance",
                          "--no-color"], capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", out)
    assert cases and int(cases.group(1)) == int(cases.group(2)) >= 500, out[-2000:]
    assert "No issues found" in out and "Warnings" not in out and "mostly rejected" not in out, out[-2000:]


def test_every_status_is_documented_and_422_is_gone(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    got = {(method, path): sorted(op["responses"]) for path, ops in doc["paths"].items() for method, op in ops.items()}
    generate = ["200", "400", "401", "404", "413", "500", "503", "504"]
    assert got == {("post", "/v1/completions"): generate, ("post", "/v1/chat/completions"): generate,
                   ("post", "/tokenize"): ["200", "400", "401", "404", "413", "500", "503"],
                   ("post", "/detokenize"): ["200", "400", "401", "404", "413", "503"],
                   ("get", "/v1/models"): ["200", "401"], ("get", "/health"): ["200", "503"]}
    op = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert op["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert op["503"]["headers"]["Retry-After"]["required"] is True
    assert {"application/json", "text/event-stream"} == set(op["200"]["content"])
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_the_folders_limits_are_in_the_schema(server):
    """max_tokens at most seq_length, n at most the rows, token ids below the vocabulary, model one of the names
    served: what the server refuses (with a 400 or a 404), the schema says."""
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    service = server.service
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == service.generator.seq_length == 64
    assert completion["n"]["maximum"] == service.engine.rows == 4
    assert completion["prompt"]["anyOf"][1]["items"] == {"type": "integer", "minimum": 0, "maximum": 511}
    assert completion["model"]["anyOf"][0]["enum"] == [service.model_name, *service.aliases]
    assert completion["prompt"]["anyOf"][0] == {"type": "string", "minLength": 1}
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 511
    assert schemas["TokenizeRequest"]["anyOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    roles = [v["properties"]["role"]["const"] for v in schemas["ChatMessage"]["oneOf"]]
    assert roles == ["system", "developer", "user", "assistant", "tool"]
    tool = schemas["ChatMessage"]["oneOf"][-1]
    assert tool["required"] == ["role", "content", "tool_call_id"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["tool_choice"]["anyOf"][0]["enum"] == ["none", "auto", "required"]
    for name, body, message, param in [
        ("tokenize", {}, "'prompt' (a string) or 'messages' is required", "prompt"),
        ("v1/completions", {"prompt": ""}, "the prompt is empty; send at least one token", "prompt"),
        ("v1/chat/completions", {"messages": [{"role": "tool"}]}, "'messages[0]' (role tool) needs 'content'",
         "messages"),
        ("v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
         "'messages[1]' (role tool) needs 'tool_call_id' (the id of the call it answers)", "messages"),
        ("v1/chat/completions", {"messages": [{"role": "assistant"}]},
         "'messages[0]' (role assistant) needs 'content' or 'tool_calls'", "messages"),
    ]:
        r = httpx.post(f"{server.url}/{name}", json=body)
        assert (r.status_code, r.json()) == (400, _error(message, param)), name


@pytest.mark.parametrize("method, path, allow", [
    ("TRACE", "/health", "GET"), ("DELETE", "/v1/models", "GET"), ("GET", "/v1/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"), ("OPTIONS", "/tokenize", "POST"),
])
def test_a_method_a_route_does_not_take_is_405_with_allow(server, method, path, allow):
    r = httpx.request(method, server.url + path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json() == _error("Method Not Allowed")
