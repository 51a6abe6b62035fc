"""The server's test helpers: a real uvicorn server in a thread, the openai client, pipeline().generate as reference."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

import httpx

import pytest
from hiding import hide

openai = pytest.importorskip("openai")  # the `serve` extra; the test extra installs it
uvicorn = pytest.importorskip("uvicorn")

SEQ = 64  # the serve folder's seq_length (conftest.serve_folder)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(message, param=None, code=None):
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


class Running:
    def __init__(self, service) -> None:
        from lite_runtime.serve import create_app

        self.service = service
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def served(folder: str, **kwargs):
    """A Running server over load_service(folder, backend="ms", **kwargs); stopped, engine too, on leaving."""
    from lite_runtime.serve import load_service

    running = Running(load_service(folder, backend="ms", **kwargs))
    try:
        yield running
    finally:
        running.stop()
        running.service.engine.stop()


# python -c HIDDEN <modules> <serve arguments>: the server with `modules` (comma-separated) unimportable, as on a
# machine where they are not installed
HIDDEN = hide() + """
from lite_runtime.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def server_process(folder: str, *args: str, env=None, hide: Sequence[str] = ()):
    """(process, port) of `python -m lite_runtime.serve` on `folder` (ms backend, log level warning, stderr piped),
    once its /health answers 200; with `hide`, those modules cannot be imported in it."""
    port = _free_port()
    start = ["-c", HIDDEN, ",".join(hide)] if hide else ["-m", "lite_runtime.serve"]
    proc = subprocess.Popen([sys.executable, *start, "--model_dir", folder, "--port", str(port),
                             "--backend", "ms", "--log_level", "warning", *args], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError("the server did not come up")
        time.sleep(0.2)


def complete(server, prompt, stream=False, **kwargs):
    """(text, finish_reason, usage) of one /v1/completions request through the openai client."""
    kwargs.setdefault("temperature", 0)
    if not stream:
        r = server.client.completions.create(model="serve4", prompt=prompt, **kwargs)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    chunks = list(server.client.completions.create(model="serve4", prompt=prompt, stream=True,
                                                   stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].usage is not None
    return text, finish[0], chunks[-1].usage


def expected(pipe, ids, max_tokens, **kwargs):
    """pipeline().generate's text, finish reason (OpenAI's name) and token count for one prompt of ids."""
    out = pipe.generate([ids], max_new_tokens=max_tokens, **kwargs)
    new = out[0][len(ids):]
    text = pipe.tokenizer.decode(new, skip_special_tokens=True)
    return text, "stop" if out.finish_reasons[0] == "eos" else "length", len(new)
