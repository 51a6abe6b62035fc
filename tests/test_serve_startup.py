"""What the server says and answers about its own setup: chat without jinja2 (a 500, the machine's fault) or without a
chat template (a 400, as vLLM), the names a request may use for a renamed folder, a truthful warm-up line."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

import httpx
import pytest

from serving import served, server_process

JINJA2_MISSING = "rendering the chat template needs jinja2, which cannot be imported here: pip install jinja2"


def test_without_jinja2_chat_is_a_500_that_names_it_and_start_up_says_so(serve_folder):
    """The server where jinja2 cannot be imported: one warning line at start-up; chat and /tokenize with messages answer
    500 in OpenAI's shape naming jinja2 (not a 400 blaming the client's messages, not counted as an invalid request);
    completions still work. The warm-up line comes after the warm-up, with the graphs it compiled."""
    server, port = server_process(serve_folder, "--log_level", "info", hide=["jinja2"])
    url = f"http://127.0.0.1:{port}"
    try:
        want = {"error": {"message": f"this server cannot render chat messages: {JINJA2_MISSING}; /v1/completions "
                                     "works", "type": "server_error", "param": None, "code": "missing_dependency"}}
        messages = [{"role": "user", "content": "hi"}]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "serve4", "messages": messages})
        assert (r.status_code, r.json()) == (500, want)
        r = httpx.post(url + "/tokenize", json={"messages": messages})
        assert (r.status_code, r.json()) == (500, want)
        r = httpx.post(url + "/v1/completions", json={"model": "serve4", "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(url + "/metrics").text
        assert [line for line in metrics.splitlines() if line.startswith("mslite_llm:invalid_requests_total")] == []
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    lines = err.splitlines()
    startup = lines[:next(i for i, line in enumerate(lines) if "signal 15: draining" in line)]
    assert [line for line in startup if line.startswith("WARNING")] == [
        f"WARNING lite_runtime.serve: chat is off: {JINJA2_MISSING}; /v1/chat/completions and /tokenize with "
        "messages answer 500 until then"]
    warmed = [line for line in lines if "warmed up" in line]
    assert len(warmed) == 1 and re.fullmatch(
        r"INFO lite_runtime\.serve: ms backend: 5 graph\(s\) warmed up in \d+\.\d\d s \(chunk_8, chunk_64, inc, "
        r"inc_1, inc_2\)",
        warmed[0]), warmed


def _without_chat_template(src: str, dst: str) -> str:
    """A copy of `src` under another directory name whose tokenizer has no chat template (manifest updated)."""
    shutil.copytree(src, dst)
    os.unlink(os.path.join(dst, "chat_template.jinja"))
    config_path = os.path.join(dst, "tokenizer_config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    config.pop("chat_template", None)
    with open(config_path, "w") as fh:
        json.dump(config, fh)
    manifest_path = os.path.join(dst, "manifest.json")
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    del manifest["files"]["chat_template.jinja"]
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)
    from test_check import rehash

    rehash(dst, "tokenizer_config.json")
    return dst


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def renamed(serve_folder, tmp_path_factory):
    """serve4 (exported with --name serve4) moved to a directory named `renamed`, without its chat template, served;
    with the warnings its start-up logged."""
    folder = _without_chat_template(serve_folder, str(tmp_path_factory.mktemp("moved") / "renamed"))
    handler, log = Lines(), logging.getLogger("lite_runtime.serve")
    log.addHandler(handler)
    with served(folder) as running:
        log.removeHandler(handler)
        running.warnings = handler.lines
        yield running


def _model_of(url: str, model: str):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 1})
    return r.status_code, r.json().get("model") if r.status_code == 200 else r.json()


def test_a_renamed_folder_answers_to_its_exported_name_and_its_directory_name(renamed):
    assert [m.id for m in renamed.client.models.list().data] == ["serve4"]
    assert _model_of(renamed.url, "serve4") == (200, "serve4")
    assert _model_of(renamed.url, "renamed") == (200, "serve4")  # the alias; responses carry the primary name
    assert _model_of(renamed.url, "gpt-4") == (404, {"error": {
        "message": "the model 'gpt-4' does not exist; this server serves 'serve4' (also as 'renamed')",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})


def test_model_name_replaces_the_primary_name(renamed):
    with served(renamed.service.generator.config.model_dir, model_name="custom") as custom:
        assert [m.id for m in custom.client.models.list().data] == ["custom"]
        assert httpx.get(custom.url + "/health").json()["model"] == "custom"
        assert [_model_of(custom.url, name) for name in ("custom", "serve4", "renamed")] == [(200, "custom")] * 3


def test_without_a_chat_template_chat_is_a_400_as_vllm_and_start_up_says_so(renamed):
    folder = renamed.service.generator.config.model_dir
    assert renamed.warnings == [
        f"chat is off: {folder}: the tokenizer has no chat template (tokenizer_config.json chat_template or "
        "chat_template.jinja); chat requests answer 400: use /v1/completions"]
    before = httpx.get(renamed.url + "/metrics").text
    want = {"error": {"message": "this model's tokenizer has no chat template: use /v1/completions",
                      "type": "invalid_request_error", "param": None, "code": None}}
    r = httpx.post(renamed.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert (r.status_code, r.json()) == (400, want)
    r = httpx.post(renamed.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert (r.status_code, r.json()) == (400, want)
    after = httpx.get(renamed.url + "/metrics").text  # the client's request is refused: counted as invalid
    assert 'mslite_llm:invalid_requests_total{endpoint="/v1/chat/completions"} 1.0' in after
    assert 'endpoint="/v1/chat/completions"' not in before
