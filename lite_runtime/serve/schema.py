"""What /openapi.json says: every status each operation can return, the responses' shapes, and this folder's limits.

FastAPI documents 200 and its own 422 for every body route; this server never answers 422 (every refusal is a 400 in
OpenAI's error shape: protocol.validation_error), and it answers more than 200: 400 (bad input, also what only the
model can judge: a prompt longer than the graphs, a token id past the vocabulary), 401 (with --api_key), 404 (an
unknown `model`), 413 (a body over --max_body_bytes), 500 (a failed graph call, or chat without jinja2), 503 (busy,
draining or shutting down; always with Retry-After) and 504 (past --request_timeout). `document` rewrites the
generated document once: the statuses per operation with the error object as their schema, 422 dropped, and the
limits of the served folder written into the request schemas where a schema can say them (`max_tokens` at most
seq_length, `n` at most the rows, token ids below the vocabulary's size, `model` one of the names served), so a
client generated from it, or a gateway validating against it, refuses what the server refuses.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from lite_runtime.serve.protocol import ErrorResponse


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- the 200 bodies (documentation: the handlers build plain dicts) ------------------------------------------------
class Usage(Loose):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(Loose):
    index: int
    text: str
    logprobs: Optional[Dict[str, Any]]
    finish_reason: Optional[str]


class CompletionResponse(Loose):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage


class ResponseMessage(Loose):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[List[Dict[str, Any]]] = None
    reasoning_content: Optional[str] = Field(None, description="a reasoning model's thinking (also as `reasoning`)")


class ChatChoice(Loose):
    index: int
    message: ResponseMessage
    logprobs: Optional[Dict[str, Any]]
    finish_reason: Optional[str]


class ChatCompletionResponse(Loose):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class TokenizeResponse(Loose):
    count: int
    max_model_len: int
    tokens: List[int]


class DetokenizeResponse(Loose):
    prompt: str


class ModelCard(Loose):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(Loose):
    object: Literal["list"]
    data: List[ModelCard]


class Health(Loose):
    status: Literal["ok", "draining"]
    model: str
    backend: str
    rows: int
    rows_busy: int
    waiting: int


# --- statuses per operation -----------------------------------------------------------------------------------------
_ERRORS = {
    400: "bad input, named by `param`: a field of the wrong type or out of range, or what only the model can judge "
         "(a prompt longer than the graphs, a token id past the vocabulary, a schema the grammar cannot compile)",
    401: "the server has an API key (--api_key) and the request does not carry it: `Authorization: Bearer KEY`",
    404: "`model` names a model this server does not serve (`code: model_not_found`)",
    413: "the body is over --max_body_bytes (`code: request_too_large`); it is not read",
    500: "the server failed: a graph call (`code: engine_error`), chat on a machine without jinja2, or a bug "
         "(`code: internal_error`)",
    503: "busy (every row serving and the queue full: `server_busy`), draining at shutdown (`server_draining`) or "
         "shut down mid-request (`server_shutdown`); retry after the seconds Retry-After says",
    504: "the request ran past --request_timeout (`code: timeout`); its row was freed",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                                "schema": {"type": "integer", "minimum": 0}}}
_GENERATE = (400, 401, 404, 413, 500, 503, 504)
_TOKENS = (400, 401, 404, 413, 500, 503)
STATUSES = {("post", "/v1/completions"): _GENERATE, ("post", "/v1/chat/completions"): _GENERATE,
            ("post", "/tokenize"): _TOKENS, ("post", "/detokenize"): (400, 401, 404, 413, 503),
            ("get", "/v1/models"): (401,), ("get", "/health"): ()}
OK = {("post", "/v1/completions"): CompletionResponse, ("post", "/v1/chat/completions"): ChatCompletionResponse,
      ("post", "/tokenize"): TokenizeResponse, ("post", "/detokenize"): DetokenizeResponse,
      ("get", "/v1/models"): ModelList, ("get", "/health"): Health}
STREAMED = {("post", "/v1/completions"), ("post", "/v1/chat/completions")}


def _ref(name: str) -> Dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def document(app, service) -> Dict[str, Any]:
    """The OpenAPI document of `app` as this server answers (module doc), built once and kept."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    models = [ErrorResponse, *OK.values()]
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template="#/components/schemas/{model}")
    schemas.update(defs.get("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for (method, path), statuses in STATUSES.items():
        op = doc["paths"].get(path, {}).get(method)
        if op is None:
            continue
        responses = op["responses"] = {k: v for k, v in op["responses"].items() if k != "422"}
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {"application/json": {"schema": _ref(OK[(method, path)].__name__)}}
        if (method, path) in STREAMED:
            ok["content"]["text/event-stream"] = {"schema": {  # one event (OpenAPI 3.1: `schema` is per event)
                "type": "object", "required": ["data"],
                "description": "with `stream: true`: server-sent events, each `data: {chunk}` (a chunk object as "
                               "JSON, or an error object), the last `data: [DONE]`",
                "properties": {"data": {"type": "string", "contentMediaType": "application/json"},
                               "event": {"type": "string"}}}}
        if path == "/health":
            responses["503"] = {"description": "draining at shutdown: a load balancer's cue", "headers": {},
                                "content": {"application/json": {"schema": _ref("Health")}}}
        for status in statuses:
            entry = {"description": _ERRORS[status],
                     "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
            if status == 503:
                entry["headers"] = _RETRY_AFTER
            responses[str(status)] = entry
    _limits(schemas, service)
    app.openapi_schema = doc
    return doc


def _limits(schemas: Dict[str, Any], service) -> None:
    """The served folder's limits in the request schemas: what its 400s and 404s enforce."""
    generator = service.generator
    vocab, seq, rows = generator.config.vocab_size, generator.seq_length, service.engine.rows
    names = [service.model_name, *service.aliases]

    def token_ids(node: Any) -> None:  # every {"type": "integer", "minimum": 0} under a token-id field
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0 and vocab:
                node["maximum"] = vocab - 1
            for value in node.values():
                token_ids(value)
        elif isinstance(node, list):
            for value in node:
                token_ids(value)

    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["anyOf"] = [{"type": "string", "enum": names}, {"type": "null"}]
        for key in ("prompt", "stop_token_ids", "tokens"):
            if key in props:
                token_ids(props[key])
        if "logit_bias" in props and vocab:  # keys: decimal token ids, no longer than the vocabulary's largest
            props["logit_bias"]["anyOf"][0]["propertyNames"]["maxLength"] = len(str(vocab - 1))
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key]["anyOf"][0]["maximum"] = seq
        if "n" in props:
            props["n"]["maximum"] = rows
