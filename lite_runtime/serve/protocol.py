"""The OpenAI API's request bodies as pydantic models, and its error shape: what /docs shows is what is checked.

Types are strict (a string is not an integer, `true` is not a number) and numbers finite (`NaN` and `Infinity`,
which Python's json reads, are refused). Fields this server implements only at their no-op value (`best_of`,
`suffix`) are accepted at it and refused otherwise, naming the field; other unknown fields are ignored, as
OpenAI's own server does. Every refusal becomes one OpenAI-shaped 400 through `validation_error` (the app's one
handler), in the words of the field: "'top_p' must be in (0, 1], got 0". Checks that need the model (the prompt
against seq_length, token ids against the vocabulary) are the serving layer's (serving.py).
"""
# no `from __future__ import annotations`: pydantic reads the annotations at class creation
import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictInt, WithJsonSchema, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API
MAX_BIAS = 100  # logit_bias values lie in [-100, 100]; -100 bans the token (OpenAI's "ban or exclusive selection")
# chat_template_kwargs may not set what the server renders the template with (HF's apply_chat_template arguments)
RESERVED_TEMPLATE_KEYS = ("messages", "tools", "add_generation_prompt", "tokenize", "documents",
                          "continue_final_message")


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[Dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def said(**schema) -> Any:
    """A constraint the schema states and a validator (here or in serving.py) enforces with its own words."""
    return Field(json_schema_extra=schema)


TokenId = Annotated[StrictInt, said(minimum=0)]  # and below the vocabulary's size: schema.py writes it in
NonEmpty = Annotated[str, said(minLength=1)]


# --- responses (what /openapi.json documents; the handlers build plain dicts) -------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx)")
    param: Optional[str] = Field(description="the request field at fault, when one is")
    code: Optional[str] = Field(description="e.g. context_length_exceeded, model_not_found, invalid_api_key, "
                                            "request_too_large, server_busy, server_draining, timeout")


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every status but 200 has it."""
    error: ErrorDetail


def refuse(param: str, message: str) -> PydanticCustomError:
    """A refusal raised inside a validator: validation_error turns it into a 400 naming `param`."""
    return PydanticCustomError("api_error", "{message}", {"param": param, "message": message})


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


def _surrogate(value: Any, path: str):
    """(field path, index) of the first string in `value` holding a lone UTF-16 surrogate (JSON's "\\ud800"
    decodes to one; no tokenizer can take it), else None."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return path, exc.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class Request(Body):
    """A top-level body: every string in it must be valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        found = _surrogate(data, "")
        if found:
            path, at = found
            message = f"'{path}' has a lone surrogate at character {at} (a \\ud800-\\udfff escape without its pair): " \
                      "send valid Unicode"
            raise refuse(path.split("[")[0].split(".")[0], message)
        return data


# --- parts ------------------------------------------------------------------------------------------------------
class StreamOptions(Body):
    include_usage: bool = False


class JSONSchemaFormat(Body):
    name: str = "response"
    description: Optional[str] = None
    schema_: Dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise refuse("response_format", "'response_format' of type json_schema needs 'json_schema': "
                                            "{\"name\", \"schema\", \"strict\"}")
        return self


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # an assistant turn's reasoning, as this server returns it (vLLM's two names): Qwen3's template renders it for
    # the turns after the last user message
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in value):
            return value
        raise PydanticCustomError("content", "must be a string or a list of text parts")

    def text(self) -> Optional[str]:
        return "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content

    def problem(self) -> Optional[str]:
        """What this message lacks for its role (OpenAI's rules), else None."""
        if self.role == "assistant":
            return None if self.content is not None or self.tool_calls else "needs 'content' or 'tool_calls'"
        if self.content is None:
            return "needs 'content'"
        if self.role == "tool" and self.tool_call_id is None:
            return "needs 'tool_call_id' (the id of the call it answers)"
        return None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """One object per role (oneOf, told apart by `role`), each with the fields it takes and needs: the rules
        `problem` enforces."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        props = target["properties"]
        content = {k: v for k, v in props["content"].items() if k not in ("default", "anyOf")}
        content["anyOf"] = [s for s in props["content"]["anyOf"] if s.get("type") != "null"]
        text_role = {"content": content, "name": props["name"]}
        variants = [{"type": "object", "title": f"{role.capitalize()}Message", "required": ["role", "content"],
                     "properties": {"role": {"const": role}, **text_role}}
                    for role in ("system", "developer", "user")]
        variants.append({"type": "object", "title": "AssistantMessage", "required": ["role"],
                         "properties": {"role": {"const": "assistant"},
                                        **{k: props[k] for k in ("content", "name", "tool_calls",
                                                                 "reasoning_content", "reasoning")}},
                         "anyOf": [{"required": ["content"], "properties": {"content": content}},
                                   {"required": ["tool_calls"],
                                    "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})
        variants.append({"type": "object", "title": "ToolMessage", "required": ["role", "content", "tool_call_id"],
                         "properties": {"role": {"const": "tool"}, "content": content,
                                        "tool_call_id": {"type": "string"}, "name": props["name"]}})
        for key in list(target):
            if key not in ("title", "description"):
                del target[key]
        target["oneOf"] = variants
        return schema


def _check_messages(messages: Optional[List[ChatMessage]]) -> None:
    for i, m in enumerate(messages or ()):
        problem = m.problem()
        if problem:
            raise refuse("messages", f"'messages[{i}]' (role {m.role}) {problem}")


def _template_kwargs(value):
    """chat_template_kwargs, refused when a key is one the server renders the template with."""
    for key in value or {}:
        if key in RESERVED_TEMPLATE_KEYS:
            raise refuse("chat_template_kwargs", f"'chat_template_kwargs' may not set {key!r}: the server renders the "
                                                 f"template with its own (send them as the request's fields)")
    return value


TemplateKwargs = Annotated[Optional[Dict[str, Any]], AfterValidator(_template_kwargs)]


# --- the requests -------------------------------------------------------------------------------------------
class Sampling(Request):
    """What completions and chat share."""

    model: Optional[str] = Field(None, description="the served model's id (GET /v1/models); any other is a 404")
    max_tokens: Optional[int] = Field(None, ge=0, description="0 only with echo (the prompt's logprobs alone)")
    n: int = Field(1, ge=1, description="choices, each its own graph row; at most the folder's batch size")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[NonEmpty, Annotated[List[NonEmpty], said(maxItems=MAX_STOP)], None] = Field(
        None, description=f"up to {MAX_STOP} non-empty strings")
    temperature: Optional[float] = Field(None, ge=0, le=2, description="0: greedy; absent: generation_config.json")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="extension (vLLM's): -1 or 0 disables it")
    repetition_penalty: Optional[float] = Field(None, gt=0, description="extension (vLLM's, HF's meaning)")
    seed: Optional[int] = Field(None, description="choice i samples with seed + i")
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    speculative: Optional[bool] = Field(None, description="extension: speculative decoding for this request (the "
                                        "server's --speculative draft, else prompt lookup); absent: the server's "
                                        "default")
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, description="OpenAI's: minus this from the logit of "
                                              "every token already generated")
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, description="OpenAI's: minus this times how often "
                                               "the token was generated so far")
    logit_bias: Optional[Annotated[Dict[str, float], WithJsonSchema({
        "type": "object", "propertyNames": {"pattern": r"^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}})]] = Field(
        None, description=f"token id (a decimal string) -> a bias in [-{MAX_BIAS}, {MAX_BIAS}] added to its logit; "
                          f"-{MAX_BIAS} bans it")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="extension (vLLM's, HF's meaning): drop tokens "
                                   "less likely than min_p times the most likely one; 0 disables it")
    stop_token_ids: Optional[List[TokenId]] = Field(None, description="extension (vLLM's): these tokens end the "
                                                      "answer as eos does (not in its text)")
    ignore_eos: Optional[bool] = Field(None, description="extension (vLLM's): eos does not end the answer; "
                                       "max_tokens, a stop or stop_token_ids do")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None or isinstance(value, str) and value:
            return value
        if isinstance(value, list) and len(value) <= MAX_STOP and all(isinstance(s, str) and s for s in value):
            return value
        raise refuse("stop", f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise refuse("logit_bias", f"'logit_bias' key {_shown(key)} is not a token id: keys are token ids "
                                           "written as decimal strings, e.g. {\"50256\": -100}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise refuse("logit_bias", f"'logit_bias' value for key {_shown(key)} must be in [-{MAX_BIAS}, "
                                           f"{MAX_BIAS}], got {_shown(bias)}")
        return value

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    prompt: Union[NonEmpty, Annotated[List[TokenId], said(minItems=1)],
                  Annotated[List[NonEmpty], said(minItems=1, maxItems=1)],
                  Annotated[List[Annotated[List[TokenId], said(minItems=1)]], said(minItems=1, maxItems=1)]] \
        = Field(description="one prompt: a non-empty string or list of token ids (a list of one of those is that one)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS,
                                    description="each token's log-probability and this many alternatives")
    echo: Optional[bool] = Field(None, description="the prompt before the completion; with logprobs, every prompt "
                                                    "token's (the first's null), as lm-evaluation-harness scores")
    best_of: Optional[int] = Field(None, description="1 only", json_schema_extra={"enum": [1, None]})
    suffix: Optional[str] = Field(None, description="empty only", json_schema_extra={"enum": ["", None]})

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]  # a batch of one
        if isinstance(value, str) or isinstance(value, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if isinstance(value, list):
            raise refuse("prompt", "'prompt' must be one string or one list of token ids: send one prompt per request")
        raise refuse("prompt", "'prompt' is required: a string or a list of token ids")

    @model_validator(mode="after")
    def _completion_noops(self):
        if self.max_tokens == 0 and not self.echo:
            raise refuse("max_tokens", "'max_tokens' 0 needs 'echo': true (the prompt's logprobs alone)")
        for name, noop in (("best_of", (1,)), ("suffix", ("",))):
            value = getattr(self, name)
            if value is not None and value not in noop:
                raise refuse(name, f"'{name}' is not supported by this server")
        return self


class ChatCompletionRequest(Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="the same as max_tokens; wins over it")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    tools: Optional[List[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: TemplateKwargs = Field(None, description="extension (vLLM's): more variables for the chat "
                                                 "template, e.g. {\"enable_thinking\": false} (Qwen3)")
    max_reasoning_tokens: Optional[int] = Field(None, ge=0, description="extension: a thinking budget; at this many "
                                                "reasoning tokens the block is closed and the answer follows")
    reasoning_budget: Optional[int] = Field(None, ge=-1, description="extension (llama.cpp's name): the same; -1 "
                                            "means no limit")

    def thinking_budget(self) -> Optional[int]:
        """The thinking budget asked (either name), None for no limit."""
        if self.max_reasoning_tokens is not None:
            return self.max_reasoning_tokens
        return None if self.reasoning_budget in (None, -1) else self.reasoning_budget

    @model_validator(mode="after")
    def _chat_rules(self):
        _check_messages(self.messages)
        if self.max_tokens == 0:
            raise refuse("max_tokens", "'max_tokens' must be at least 1 in chat (0 is for completions with 'echo')")
        if self.max_reasoning_tokens is not None and self.reasoning_budget not in (None, -1, self.max_reasoning_tokens):
            raise refuse("reasoning_budget", "'reasoning_budget' and 'max_reasoning_tokens' are two names of the "
                                             "thinking budget and disagree: send one")
        if self.top_logprobs and not self.logprobs:
            raise refuse("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = [t.function.name for t in self.tools or []]
            if not names:
                raise refuse("tool_choice", "'tool_choice' asks for a tool call but 'tools' is empty")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise refuse("tool_choice", f"'tool_choice' names the function '{self.tool_choice.function.name}', "
                                            f"which is not in 'tools' ({', '.join(names)})")
        return self


class TokenizeRequest(Request):
    """vLLM's /tokenize: `prompt`, or `messages` through the chat template."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = True
    tools: Optional[List[Tool]] = None
    chat_template_kwargs: TemplateKwargs = None

    @model_validator(mode="after")
    def _one_of(self):
        if self.prompt is None and self.messages is None:
            raise refuse("prompt", "'prompt' (a string) or 'messages' is required")
        _check_messages(self.messages)
        return self


class DetokenizeRequest(Request):
    model: Optional[str] = None
    tokens: List[TokenId]


# --- one handler for every refusal ------------------------------------------------------------------------------
_KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
          "list_type": "an array", "dict_type": "an object", "model_type": "an object", "int_from_float": "an integer",
          "model_attributes_type": "an object"}


_UNION_TAGS = ("str", "int", "bool", "float", "none", "NamedToolChoice", "dict")


def _field(loc) -> str:
    """("body", "messages", 0, "content") -> messages[0].content"""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and part not in _UNION_TAGS and not any(c in str(part) for c in "[-"):
            out += ("." if out else "") + str(part)  # union members' tags ('str', 'list[int]', ...) are not fields
    return out


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return str(value)[:40]


def _bounds(model, name: str) -> Optional[str]:
    """'[0, 2]' / '(0, 1]' / '[1, inf]' from a top-level field's ge/gt/le constraints."""
    info = getattr(model, "model_fields", {}).get(name) if model is not None else None
    if info is None:
        return None
    low = high = None
    low_open = False
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            low = m.ge
        if getattr(m, "gt", None) is not None:
            low, low_open = m.gt, True
        if getattr(m, "le", None) is not None:
            high = m.le
    if low is None and high is None:
        return None
    return f"{'(' if low_open else '['}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"


def validation_error(errors: List[Dict[str, Any]], model=None) -> APIError:
    """The first of pydantic's (or FastAPI's) errors as OpenAI's 400, naming the field."""
    e = errors[0]
    kind, loc, ctx = e.get("type"), tuple(e.get("loc", ())), e.get("ctx") or {}
    if kind == "json_invalid":
        where = f" (char {loc[1]})" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return APIError(400, f"the body is not valid JSON: {ctx.get('error', 'JSON decode error')}{where}")
    if kind == "api_error":
        return APIError(400, ctx["message"], param=ctx["param"])
    name = _field(loc)
    param = next((p for p in loc if p != "body"), None)
    param = param if isinstance(param, str) else None
    if not name:
        return APIError(400, "the body must be a JSON object")
    value = e.get("input")
    if kind == "missing":
        return APIError(400, f"'{name}' is required", param=param)
    if kind in _KINDS:
        return APIError(400, f"'{name}' must be {_KINDS[kind]}, got {_shown(value)}", param=param)
    if kind == "finite_number":
        return APIError(400, f"'{name}' must be a finite number", param=param)
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bounds = _bounds(model, name) or e.get("msg", "")
        return APIError(400, f"'{name}' must be in {bounds}, got {_shown(value)}", param=param)
    if kind == "literal_error":
        return APIError(400, f"'{name}' must be {ctx.get('expected')}, got {_shown(value)}", param=param)
    if kind == "too_short":
        return APIError(400, f"'{name}' must not be empty", param=param)
    return APIError(400, f"'{name}' {e.get('msg', 'is invalid')}", param=param)
