"""The HTTP router: FastAPI routes over a Service, server-sent events, the API key, one error shape.

Request bodies are the protocol's pydantic models (so /openapi.json and /docs show the real API: schema.py adds
every status an operation can return and the folder's limits); every refusal, FastAPI's own included, leaves
through one handler as OpenAI's {"error": {...}}, with its headers (a 405's Allow, a 503's Retry-After). Plans
(tokenizing, templates, grammar compiles) are made off the event loop, so running streams keep flowing meanwhile.
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations
import asyncio
import json
from typing import Any, Dict

from lite_runtime.serve.metrics import CONTENT_TYPE
from lite_runtime.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         TokenizeRequest, validation_error)
from lite_runtime.serve.responses import Answer, TokenPieces
from lite_runtime.serve.schema import document
from lite_runtime.serve.serving import Plan, Service

_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
_OPEN = ("/health", "/docs", "/openapi.json", "/docs/oauth2-redirect")  # no API key needed


def create_app(service: Service):
    """The FastAPI application over a Service."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="mslite-llm", summary="An OpenAI-compatible server for an exported model folder",
                  redoc_url=None)
    pieces = TokenPieces(service.generator.tokenizer)
    open_paths = _OPEN + (("/metrics",) if service.metrics_public else ())

    def refused(path: str, exc: APIError) -> JSONResponse:
        if 400 <= exc.status < 500 and exc.status != 401:
            service.metrics.invalid.labels(path if path in _MODELS else "other").inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    class Gate:
        """Plain ASGI (not BaseHTTPMiddleware, which relays every streamed chunk through another task): the API key,
        and every POST body read as JSON whatever its content type (what `curl -d` sends as a form, as OpenAI's
        server does)."""

        def __init__(self, inner) -> None:
            self.inner = inner

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http":
                headers = scope["headers"]
                if scope["method"] == "POST":
                    receive = await self.bounded(scope, receive, send, headers)
                    if receive is None:
                        return
                if scope["method"] == "POST" and not any(k == b"content-type" and b"json" in v for k, v in headers):
                    headers = [(k, v) for k, v in headers if k != b"content-type"] + [
                        (b"content-type", b"application/json")]
                    scope = dict(scope, headers=headers)
                if service.draining and scope["method"] == "POST":
                    await refused(scope["path"], APIError(
                        503, "the server is shutting down: it finishes the requests it has and takes no new ones; "
                             "retry on another replica", kind="server_error", code="server_draining",
                        headers={"Retry-After": "5"}))(scope, receive, send)
                    return
                if scope["path"] not in open_paths:
                    try:
                        service.check_key(next((v.decode("latin-1") for k, v in headers if k == b"authorization"),
                                               None))
                    except APIError as exc:
                        await refused(scope["path"], exc)(scope, receive, send)
                        return
            await self.inner(scope, receive, send)

        async def bounded(self, scope, receive, send, headers):
            """`receive` when the body is within --max_body_bytes (a body without Content-Length is read here, up to
            the limit, and replayed); else None, after a 413 (the bytes past the limit are never read or parsed)."""
            limit = service.max_body_bytes

            async def too_large(size: str) -> None:
                await refused(scope["path"], APIError(
                    413, f"the request body is {size} bytes, past this server's limit of {limit} (--max_body_bytes)",
                    code="request_too_large"))(scope, receive, send)

            length = next((v for k, v in headers if k == b"content-length"), None)
            if length is not None:
                if length.isdigit() and int(length) > limit:
                    await too_large(length.decode())
                    return None
                return receive
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None  # the client went away
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    await too_large(f"over {limit}")
                    return None
                if not message.get("more_body"):
                    break
            body, sent = b"".join(chunks), [False]

            async def replay():
                if not sent[0]:
                    sent[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()
            return replay

    app.add_middleware(Gate)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return refused(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return refused(request.url.path, validation_error(list(exc.errors()), _MODELS.get(request.url.path)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404 (path), 405 (method: with Allow)
        return refused(request.url.path, APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a bug: still OpenAI's shape, and logged (Starlette's own)
        return refused(request.url.path, APIError(500, f"the server failed on this request: {type(exc).__name__}: "
                                                       f"{exc}"[:500], kind="server_error", code="internal_error"))

    app.openapi = lambda: document(app, service)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    @app.get("/health")
    async def health():
        busy, waiting = service.engine.load()
        free, blocks = service.engine.blocks()
        body = {"status": "draining" if service.draining else "ok", "model": service.model_name,
                "backend": service.generator.backend_name, "rows": service.engine.rows, "rows_busy": busy,
                "waiting": waiting, "kv_blocks": blocks, "kv_blocks_free": free,
                "kv_block_size": service.engine.pool.block_size}
        return JSONResponse(body, status_code=503 if service.draining else 200)

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "mslite-llm", "max_model_len": service.generator.seq_length}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await off_loop(service.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await off_loop(service.detokenize, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, await off_loop(service.completion_plan, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(request, await off_loop(service.chat_plan, body))

    def engine_error(event) -> APIError:
        """("error", message, code) from the engine: 504 past --request_timeout, 503 shutting down, else 500."""
        code = event[2] if len(event) > 2 else "engine_error"
        status = {"timeout": 504, "server_shutdown": 503}.get(code, 500)
        return APIError(status, str(event[1]), kind="server_error", code=code,
                        headers={"Retry-After": "5"} if status == 503 else None)

    async def answer(request: Request, plan: Plan):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(index: int, event) -> None:  # called from the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            except RuntimeError:  # the event loop has closed (shutdown)
                pass

        result = Answer(plan, service.model_name, pieces)
        result.requests = service.submit(plan, emit)

        def cancel() -> None:
            for job in result.requests:
                job.cancelled = True  # a no-op once it has ended; frees the row if the client has gone

        if not plan.stream:
            left = len(result.choices)
            try:
                while left:
                    try:
                        index, event = await asyncio.wait_for(events.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return JSONResponse({})  # nobody reads it
                        continue
                    if event[0] == "text":
                        result.choices[index].add(event[1], event[2])
                    elif event[0] == "error":
                        raise engine_error(event)
                    else:
                        result.choices[index].end(event[1])
                        left -= 1
                return result.response()
            finally:
                cancel()

        def data(payload: Dict[str, Any]) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def sse():
            try:
                for chunk in result.opening():
                    yield data(chunk)
                left = len(result.choices)
                while left:
                    index, event = await events.get()
                    if event[0] == "text":
                        chunks = result.text_chunks(index, event[1], event[2])
                    elif event[0] == "error":
                        yield data(engine_error(event).body())
                        break
                    else:
                        chunks, left = result.end_chunks(index, event[1]), left - 1
                    for chunk in chunks:
                        yield data(chunk)
                else:
                    if plan.include_usage:
                        yield data(result.usage_chunk())
                yield "data: [DONE]\n\n"
            finally:
                cancel()  # the client went away mid-stream: the engine frees the rows at its next step

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
