"""An OpenAI-compatible HTTP server for a model folder, with continuous batching over its static graphs.

    python -m lite_runtime.serve --model_dir model_dirs/qwen2-tiny [--host 127.0.0.1] [--port 8000]
                                 [--backend auto|mslite|ms] [--api_key KEY] [--max_queue N]

Endpoints: GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions (the chat
template of the folder's tokenizer), each with `stream: true` (server-sent events ending `data: [DONE]`).
Every row of the exported batch serves one request (lite_runtime.batching): a request starts as soon as a
row is free, while the others keep decoding. Past `--max_queue` waiting requests: 503 with Retry-After.

Needs the `serve` extra (FastAPI, uvicorn): pip install -e ".[serve]". This module imports them only in
create_app/main, so lite_runtime stays importable without them.
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request is imported in create_app)

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lite_runtime.batching import BatchEngine, QueueFull, SlotRequest
from lite_runtime.errors import InferError
from lite_runtime.folder import graph_key

log = logging.getLogger("lite_runtime.serve")

API_KEY_ENV = "MSLITE_LLM_API_KEY"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
MAX_STOP = 4  # stop strings per request, as OpenAI


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# --- reading a request body --------------------------------------------------------------------------------
_TYPES = {"integer": (int,), "number": (int, float), "boolean": (bool,), "string": (str,), "array": (list,),
          "object": (dict,)}


def _get(body: Dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] if it is of `kind` (null counts as absent), else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, _TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
    if not ok:
        raise APIError(400, f"'{name}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got "
                            f"{json.dumps(value)[:40]}", param=name)
    return value


def _in_range(name: str, value, low=None, high=None, low_open: bool = False) -> None:
    if value is None:
        return
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise APIError(400, f"'{name}' must be in {bounds}, got {value}", param=name)


def _refuse_unsupported(body: Dict[str, Any]) -> None:
    """Fields we do not implement are refused when they ask for something, accepted at their no-op value."""
    noop = {"echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,), "best_of": (1,), "suffix": ("",),
            "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],),
            "tool_choice": ("none",)}
    for name, values in noop.items():
        value = body.get(name)
        if value is not None and value not in values:
            hint = " (use repetition_penalty)" if name.endswith("_penalty") else ""
            raise APIError(400, f"'{name}' is not supported by this server{hint}", param=name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported", param="response_format")


@dataclass
class Plan:
    """A validated request: what the engine runs and how to answer."""

    prompt: List[int]
    max_tokens: int
    settings: Any
    stop: List[str]
    stream: bool
    include_usage: bool


class Service:
    """Turns request bodies into engine requests; owns the generator and the engine."""

    def __init__(self, generator, engine: BatchEngine, model_name: str, api_key: Optional[str] = None) -> None:
        self.generator, self.engine, self.model_name, self.api_key = generator, engine, model_name, api_key
        self.created = int(time.time())

    # --- validation ---------------------------------------------------------------------------------
    def check_key(self, authorization: Optional[str]) -> None:
        if not self.api_key:
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(authorization[len("Bearer "):].strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def _common(self, body: Dict[str, Any], prompt: List[int], chat: bool) -> Plan:
        _refuse_unsupported(body)
        self._check_model(body)
        n = _get(body, "n", "integer", 1)
        if n != 1:
            raise APIError(400, f"'n' must be 1 (one completion per request), got {n}", param="n")
        stream = _get(body, "stream", "boolean", False)
        options = _get(body, "stream_options", "object", {})
        include_usage = _get(options, "include_usage", "boolean", False)
        if not prompt:
            raise APIError(400, "the prompt is empty; send at least one token", param="messages" if chat else "prompt")
        seq, room = self.generator.seq_length, self.generator.seq_length - len(prompt)
        if room < 1:  # the largest graph holds seq_length tokens: the prompt leaves no room, or does not fit
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's graphs hold {seq} tokens per "
                                "request, prompt and completion together: shorten it", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get(body, name, "integer")
        _in_range(name, max_tokens, 1)
        if max_tokens is None:
            max_tokens = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > seq:
            raise APIError(400, f"'{name}' {max_tokens} is beyond this model's seq_length {seq}", param=name)
        elif max_tokens > room:
            raise APIError(400, f"the prompt's {len(prompt)} tokens + '{name}' {max_tokens} exceed this model's "
                                f"seq_length {seq}; lower '{name}' to at most {room}", param=name,
                           code="context_length_exceeded")
        stop = _get(body, "stop", "string" if isinstance(body.get("stop"), str) else "array", [])
        stop = [stop] if isinstance(stop, str) else stop
        if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings",
                           param="stop")
        temperature = _get(body, "temperature", "number")
        _in_range("temperature", temperature, 0, 2)
        top_p = _get(body, "top_p", "number")
        _in_range("top_p", top_p, 0, 1, low_open=True)
        top_k = _get(body, "top_k", "integer")
        _in_range("top_k", top_k, -1)
        penalty = _get(body, "repetition_penalty", "number")
        _in_range("repetition_penalty", penalty, 0, low_open=True)
        seed = _get(body, "seed", "integer")
        sampling: Dict[str, Any] = {"top_p": top_p, "repetition_penalty": penalty, "seed": seed,
                                    "top_k": None if top_k is None else max(top_k, 0)}
        if temperature is not None:  # absent: the folder's generation_config.json decides, as pipeline() does
            sampling.update(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None)
        try:
            settings = self.generator.defaults.updated(**sampling)
        except InferError as exc:
            raise APIError(400, str(exc)) from None
        return Plan(prompt, max_tokens, settings, stop, stream, include_usage)

    def completion_plan(self, body: Dict[str, Any]) -> Plan:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.generator.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = self._in_vocabulary(prompt, "prompt")
        elif isinstance(prompt, list):
            raise APIError(400, "'prompt' must be one string or one list of token ids: send one prompt per request",
                           param="prompt")
        else:
            raise APIError(400, "'prompt' is required: a string or a list of token ids", param="prompt")
        return self._common(body, ids, chat=False)

    def chat_prompt(self, body: Dict[str, Any], add_generation_prompt: bool = True) -> str:
        """The chat template applied to the body's `messages` (text parts only)."""
        messages = _get(body, "messages", "array")
        if not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content}", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"'messages[{i}]' must be an object with a 'role' string", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, f"'messages[{i}].content' parts must be text parts", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise APIError(400, f"'messages[{i}].content' must be a string", param="messages")
            clean.append({"role": m["role"], "content": content})
        tokenizer = self.generator.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        try:
            return tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001  (a template's raise_exception, e.g. roles out of order)
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None

    def chat_plan(self, body: Dict[str, Any]) -> Plan:
        return self._common(body, self.generator.encode(self.chat_prompt(body)), chat=True)

    def _in_vocabulary(self, ids: List[int], field: str) -> List[int]:
        """`ids` (ints) if every one is a token of this model, else a 400 naming `field` and the first outsider."""
        vocab = self.generator.config.vocab_size
        bad = next((t for t in ids if vocab and not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"'{field}' has the token id {bad}, outside this model's vocabulary [0, {vocab})",
                           param=field)
        return list(ids)

    def _check_model(self, body: Dict[str, Any]) -> None:
        model = _get(body, "model", "string")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def tokenize(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """vLLM's /tokenize: `prompt` (add_special_tokens default true) or `messages` through the chat template
        (add_generation_prompt default true, add_special_tokens default false). `max_model_len` is the tokens the
        graphs hold per request, prompt and completion together."""
        self._check_model(body)
        chat = "messages" in body
        if chat:
            text = self.chat_prompt(body, _get(body, "add_generation_prompt", "boolean", True))
        else:
            text = _get(body, "prompt", "string")
            if text is None:
                raise APIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
        special = _get(body, "add_special_tokens", "boolean", not chat)
        tokens = self.generator.encode(text, add_special_tokens=special)
        return {"count": len(tokens), "max_model_len": self.generator.seq_length, "tokens": tokens}

    def detokenize(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """vLLM's /detokenize: `tokens` -> {"prompt": text}, special tokens kept."""
        self._check_model(body)
        tokens = _get(body, "tokens", "array")
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise APIError(400, "'tokens' is required: a list of token ids", param="tokens")
        tokens = self._in_vocabulary(tokens, "tokens")
        return {"prompt": self.generator.tokenizer.decode(tokens, skip_special_tokens=False)}

    def submit(self, plan: Plan, emit) -> SlotRequest:
        eos = tuple(self.generator.defaults.eos_token_id or ())
        request = SlotRequest(prompt=plan.prompt, max_tokens=plan.max_tokens, settings=plan.settings, emit=emit,
                              stop=plan.stop, eos=eos)
        try:
            self.engine.submit(request)
        except QueueFull:
            raise APIError(503, f"the server is busy: its {self.engine.rows} rows are serving and its "
                                f"{self.engine.max_queue} queue places (--max_queue) are taken; retry later",
                           kind="server_error", code="server_busy", headers={"Retry-After": "1"}) from None
        return request


def create_app(service: Service):
    """The FastAPI application over a Service."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="mslite-llm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        busy, waiting = service.engine.load()
        return {"status": "ok", "model": service.model_name, "backend": service.generator.backend_name,
                "rows": service.engine.rows, "rows_busy": busy, "waiting": waiting}

    @app.get("/v1/models")
    async def models(request: Request):
        service.check_key(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "mslite-llm", "max_model_len": service.generator.seq_length}]}

    async def read_body(request: Request) -> Dict[str, Any]:
        service.check_key(request.headers.get("authorization"))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    async def answer(request: Request, plan: Plan, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # called from the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown)
                pass

        job = service.submit(plan, emit)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage() -> Dict[str, int]:
            n = len(job.generated)
            return {"prompt_tokens": len(plan.prompt), "completion_tokens": n, "total_tokens": len(plan.prompt) + n}

        def choice(text: Optional[str], finish: Optional[str], first: bool = False) -> Dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            if plan.stream:
                delta = {"role": "assistant", "content": text or ""} if first else (
                    {"content": text} if text else {})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}

        if not plan.stream:
            parts: List[str] = []
            try:
                while True:
                    try:
                        kind_, value = await asyncio.wait_for(events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return JSONResponse({})  # nobody reads it
                        continue
                    if kind_ == "text":
                        parts.append(value)
                    elif kind_ == "error":
                        raise APIError(500, str(value), kind="server_error")
                    else:
                        return {"id": rid, "object": kind, "created": created, "model": service.model_name,
                                "choices": [choice("".join(parts), value)], "usage": usage()}
            finally:
                job.cancelled = True  # a no-op once it has ended; frees the row if the client has gone

        async def sse():
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"

            def data(choices, extra=None) -> str:
                payload = {"id": rid, "object": chunk_kind, "created": created, "model": service.model_name,
                           "choices": choices, **(extra or {})}
                return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

            try:
                if chat:
                    yield data([choice("", None, first=True)])
                while True:
                    kind_, value = await events.get()
                    if kind_ == "text":
                        yield data([choice(value, None)])
                    elif kind_ == "error":
                        yield f"data: {json.dumps(APIError(500, str(value), kind='server_error').body())}\n\n"
                        break
                    else:
                        yield data([choice(None, value)])
                        if plan.include_usage:
                            yield data([], {"usage": usage()})
                        break
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled = True  # the client went away mid-stream: the engine frees the row at its next step

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)  # templates and tokenizers run off the event loop: streams keep flowing
        return await asyncio.get_running_loop().run_in_executor(None, service.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        return await asyncio.get_running_loop().run_in_executor(None, service.detokenize, body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, service.completion_plan(await read_body(request)), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, service.chat_plan(await read_body(request)), chat=True)

    return app


# --- loading and the command line ------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_service(model_dir: str, backend: str = "auto", api_key: Optional[str] = None, max_queue: int = 64,
                 model_name: Optional[str] = None, **config: Any) -> Service:
    """Load the folder, compile what the first request needs, start the engine."""
    from lite_runtime import pipeline
    from lite_runtime.folder import load_folder

    tp = load_folder(model_dir, verify=False).tp_size
    if tp > 1:
        raise InferError(f"{model_dir}: a tensor-parallel folder ({tp} ranks) cannot be served yet: every rank has to "
                         "take every step, and the server drives one process; run it with pipeline() or "
                         "scripts/run_infer_main.py under msrun (README, \"Two cards\")")
    generator = pipeline("text_generation", model=model_dir, backend=backend, warm_up="none", slot_graphs=True,
                         **config)
    if not generator.slot_sizes:
        generator.slot_key(1)  # raises the "re-export" error
    # what every request needs: the smallest slot graph and inc; on mslite every graph (GE compiles for
    # minutes on a graph's first run, which must not happen inside a request)
    slot_role = "prefill" if generator.batch_size == 1 else "slot"
    keys = [graph_key(slot_role, n) for n in generator.slot_sizes]
    for key in (keys if generator.backend_name == "mslite" else keys[:1]) + ["inc"]:
        generator._warm(key)
    generator.tokenizer  # noqa: B018  (load it now, not in the first request)
    name = model_name or (generator.config.folder.name if generator.config.folder else os.path.basename(model_dir))
    return Service(generator, BatchEngine(generator, max_queue=max_queue), name, api_key)


def build_parser() -> argparse.ArgumentParser:
    from lite_runtime.backends import CHOICES

    p = argparse.ArgumentParser(prog="python -m lite_runtime.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model_dir", required=True, help="model folder written by python -m export")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=CHOICES, default="auto",
                   help="mslite (Atlas, GE), ms (MindSpore, CPU) or auto: mslite when importable (default)")
    p.add_argument("--api_key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or set {API_KEY_ENV})")
    p.add_argument("--max_queue", type=int, default=64,
                   help="requests that may wait for a free row; past it, 503 with Retry-After (default: 64)")
    p.add_argument("--model_name", default=None, help="the model id clients send (default: the folder's name)")
    p.add_argument("--device_id", type=int, default=0)
    p.add_argument("--log_level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn
    except ImportError:
        print('error: the server needs FastAPI and uvicorn: pip install -e ".[serve]"', file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and not api_key:
        print(f"warning: listening on {args.host} without an API key: anyone who can reach this port can use the "
              f"model. Pass --api_key or set {API_KEY_ENV}.", file=sys.stderr, flush=True)
    if args.max_queue < 0:
        print("error: --max_queue must be >= 0", file=sys.stderr)
        return 2
    try:
        service = load_service(args.model_dir, backend=args.backend, api_key=api_key, max_queue=args.max_queue,
                               model_name=args.model_name, device_id=args.device_id)
    except InferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    g = service.generator
    print(f"serving {service.model_name} on http://{args.host}:{args.port}/v1 (backend {g.backend_name}, "
          f"{g.batch_size} row(s) of {g.seq_length} tokens{', API key required' if api_key else ''})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        service.engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
