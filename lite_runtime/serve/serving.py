"""Serving: a validated request (protocol.py) becomes engine requests, one per choice; no HTTP here (app.py).

What needs the model is checked here: the prompt and max_tokens against the graphs' seq_length, token ids
against the vocabulary, `n` against the cache rows, tools against the chat template, schemas against the
grammar library. Each refusal is an APIError naming the field.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from lite_runtime.engine.scheduler import BatchEngine, QueueFull, SlotRequest
from lite_runtime.errors import InferError, MissingDependencyError
from lite_runtime.serve.metrics import Metrics
from lite_runtime.serve.protocol import (MAX_BIAS, APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                         DetokenizeRequest, NamedToolChoice, Sampling, TokenizeRequest)
from lite_runtime.reasoning import ReasoningFormat, ThinkState, ThinkTokens, opens_block
from lite_runtime.serve.tools import ToolFormat, tool_format
from lite_runtime.tokenizer import chat_problem

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
MAX_BODY_BYTES = 8 << 20  # a request body past this is a 413 before it is read (--max_body_bytes)


@dataclasses.dataclass
class Plan:
    """A validated request: what the engine runs for each choice and how to answer."""

    endpoint: str  # "completions" | "chat"
    prompt: List[int]
    max_tokens: int
    settings: List[Any]  # GenerationSettings, one per choice (seed + i)
    stop: List[str]
    stream: bool
    include_usage: bool
    logprobs: Optional[int] = None  # None: none; k: the chosen token's and k alternatives
    grammar: Any = None  # a compiled grammar (grammar.py): each choice gets its own matcher
    tools: Optional[ToolFormat] = None  # parse the answer's tool calls in this form
    echo: Optional[str] = None  # completions' echo: the prompt's text, sent before the completion
    prompt_logprobs: Optional[int] = None  # echo with logprobs: every prompt token's, and this many alternatives
    speculative: bool = False  # draft while it decodes alone (Service.proposer; lite_runtime/engine/speculative.py)
    eos: Tuple[int, ...] = ()  # the tokens that end an answer: the folder's eos (unless ignore_eos), stop_token_ids
    # chat with a reasoning parser (lite_runtime/reasoning.py): its format, whether the prompt opened a block, and the
    # thinking budget (None: no limit)
    reasoning: Optional[ReasoningFormat] = None
    opened: bool = False
    thinking_budget: Optional[int] = None

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


class Service:
    """Turns request bodies into engine requests; owns the generator, the engine and the metrics."""

    def __init__(self, generator, engine: BatchEngine, model_name: str, api_key: Optional[str] = None,
                 metrics_public: bool = False, max_body_bytes: int = MAX_BODY_BYTES,
                 request_timeout: Optional[float] = None, aliases: Sequence[str] = (),
                 speculative: Optional[str] = None, draft=None,
                 reasoning: Optional[Tuple[ReasoningFormat, ThinkTokens]] = None,
                 thinking_budget: Optional[int] = None) -> None:
        self.generator, self.engine, self.model_name, self.api_key = generator, engine, model_name, api_key
        # other names a request's "model" may use (the folder's directory name: cli.load_service); /v1/models and
        # every response give model_name
        self.aliases = tuple(a for a in dict.fromkeys(aliases) if a != model_name)
        self.metrics_public, self.max_body_bytes = metrics_public, max_body_bytes
        self.request_timeout = request_timeout  # seconds from submission; None: no limit
        self.draining = False  # set at SIGTERM / SIGINT: new requests get a 503 (cli.py)
        self.created = int(time.time())
        self.metrics = Metrics(engine)
        # speculative decoding: "prompt_lookup" (the default where the folder has score graphs: cli.load_service),
        # "draft" (`draft`: the draft folder's TextGenerator) or None (off; a request's `speculative: true` still asks
        # for it: prompt lookup where the server has no draft)
        self.speculative, self.draft = speculative, draft
        # the chat template's reasoning parser and its markers' ids (cli.reasoning_parser_of, lite_runtime/reasoning.py)
        # and the server's default thinking budget (--max_reasoning_tokens; a request's own wins)
        self.reasoning, self.think_tokens = reasoning or (None, None)
        self.thinking_budget = thinking_budget
        self._grammars = None
        self.chat_problem = chat_problem(generator.tokenizer)  # None: chat renders (checked once, at start-up)

    @property
    def grammars(self):
        """The grammar compiler over this model's vocabulary, built at the first structured request."""
        if self._grammars is None:
            from lite_runtime.serve.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.generator.tokenizer, self.generator.config.vocab_size,
                                             list(self.generator.defaults.eos_token_id or ()))
        return self._grammars

    # --- checks -------------------------------------------------------------------------------------------
    def check_key(self, authorization: Optional[str]) -> None:
        if not self.api_key:
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(authorization[len("Bearer "):].strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name and model not in self.aliases:
            also = f" (also as {', '.join(repr(a) for a in self.aliases)})" if self.aliases else ""
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'{also}",
                           param="model", code="model_not_found")

    def chat_warning(self) -> Optional[str]:
        """The start-up warning when chat cannot be rendered (what is missing and the fix), else None."""
        problem = self.chat_problem
        if isinstance(problem, MissingDependencyError):
            return f"chat is off: {problem}; /v1/chat/completions and /tokenize with messages answer 500 until then"
        if problem is not None:
            return (f"chat is off: {self.generator.config.model_dir or 'the model'}: {problem} (tokenizer_config.json "
                    "chat_template or chat_template.jinja); chat requests answer 400: use /v1/completions")
        return None

    def _check_chat(self) -> None:
        """A 500 when this server cannot render chat (its setup's fault: the client can do nothing about it, and it is
        not counted as an invalid request); a 400 when the model has no chat template (as vLLM: the model has no chat
        format, the client has to send a plain prompt)."""
        problem = self.chat_problem
        if isinstance(problem, MissingDependencyError):
            raise APIError(500, f"this server cannot render chat messages: {problem}; /v1/completions works",
                           kind="server_error", code="missing_dependency")
        if problem is not None:
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")

    def _in_vocabulary(self, ids: Sequence[int], field: str) -> List[int]:
        """`ids` if every one is a token of this model, else a 400 naming `field` and the first outsider."""
        vocab = self.generator.config.vocab_size
        bad = next((t for t in ids if vocab and not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"'{field}' has the token id {bad}, outside this model's vocabulary [0, {vocab})",
                           param=field)
        return list(ids)

    # --- plans --------------------------------------------------------------------------------------------
    def _common(self, req: Sampling, prompt: List[int], endpoint: str, max_tokens: Optional[int],
                max_name: str) -> Plan:
        self._check_model(req.model)
        field = "messages" if endpoint == "chat" else "prompt"
        if not prompt:
            raise APIError(400, "the prompt is empty; send at least one token", param=field)
        if req.n > self.engine.rows:
            raise APIError(400, f"'n' must be at most {self.engine.rows} (this folder's graph rows: each choice takes "
                                f"one), got {req.n}", param="n")
        seq, room = self.generator.seq_length, self.generator.seq_length - len(prompt)
        if room < 1:  # the largest graph holds seq_length tokens: the prompt leaves no room, or does not fit
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's graphs hold {seq} tokens per "
                                "request, prompt and completion together: shorten it", param=field,
                           code="context_length_exceeded")
        if max_tokens == 0:  # echo alone (protocol.py): the prompt, and its logprobs when asked
            pass
        elif max_tokens is None:
            max_tokens = room if endpoint == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > seq:
            raise APIError(400, f"'{max_name}' {max_tokens} is beyond this model's seq_length {seq}", param=max_name)
        elif max_tokens > room:
            raise APIError(400, f"the prompt's {len(prompt)} tokens + '{max_name}' {max_tokens} exceed this model's "
                                f"seq_length {seq}; lower '{max_name}' to at most {room}", param=max_name,
                           code="context_length_exceeded")
        sampling: Dict[str, Any] = {"top_p": req.top_p, "repetition_penalty": req.repetition_penalty,
                                    "top_k": None if req.top_k is None else max(req.top_k, 0), "min_p": req.min_p,
                                    "presence_penalty": req.presence_penalty,
                                    "frequency_penalty": req.frequency_penalty}
        if req.logit_bias:  # OpenAI's -100 bans the token (HF's suppress_tokens); another value is added (HF's
            bias, vocab = {}, self.generator.config.vocab_size  # sequence_bias of that one token)
            for key, value in req.logit_bias.items():
                if vocab and int(key) >= vocab:
                    raise APIError(400, f"'logit_bias' key '{key}' is not a token id of this model: its vocabulary is "
                                        f"[0, {vocab})", param="logit_bias")
                bias[int(key)] = value
            sampling["suppress_tokens"] = [t for t, v in bias.items() if v <= -MAX_BIAS] or None
            sampling["sequence_bias"] = {(t,): v for t, v in bias.items() if v > -MAX_BIAS} or None
        if req.temperature is not None:  # absent: the folder's generation_config.json decides, as pipeline() does
            sampling.update(do_sample=req.temperature > 0,
                            temperature=req.temperature if req.temperature > 0 else None)
        try:
            settings = [self.generator.defaults.updated(
                seed=None if req.seed is None else req.seed + i, **sampling) for i in range(req.n)]
        except InferError as exc:
            raise APIError(400, str(exc)) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        plan = Plan(endpoint, prompt, max_tokens, settings, req.stops(), req.stream, include_usage)
        eos = () if req.ignore_eos else tuple(self.generator.defaults.eos_token_id or ())
        extra = self._in_vocabulary(req.stop_token_ids or (), "stop_token_ids")
        plan.eos = eos + tuple(t for t in extra if t not in eos)
        plan.speculative = bool(self.speculative) if req.speculative is None else req.speculative
        if plan.speculative and not self.engine.runner.score_sizes:
            raise APIError(400, "'speculative' needs the folder's score graphs, which this folder was exported "
                                "without: re-export it with python -m export (--score_sizes auto)", param="speculative")
        if req.response_format is not None and req.response_format.type != "text":
            plan.grammar = self.grammars.response_format(req.response_format)
        return plan

    def completion_plan(self, req: CompletionRequest) -> Plan:
        prompt = req.prompt
        ids = self.generator.encode(prompt) if isinstance(prompt, str) else self._in_vocabulary(prompt, "prompt")
        plan = self._common(req, ids, "completions", req.max_tokens, "max_tokens")
        plan.logprobs = req.logprobs
        if req.echo:
            plan.echo = prompt if isinstance(prompt, str) else self.generator.tokenizer.decode(ids)
            if req.logprobs is not None:
                if not self.engine.runner.score_sizes:
                    raise APIError(400, "'echo' with 'logprobs' needs the folder's score graphs (every prompt "
                                        "position's logits), which this folder was exported without: re-export it "
                                        "with python -m export (--score_sizes auto)", param="echo")
                plan.prompt_logprobs = req.logprobs
        return plan

    def chat_plan(self, req: ChatCompletionRequest) -> Plan:
        self._check_model(req.model)
        self._check_chat()
        # tools are rendered whenever given (with "none" too, as vLLM: the model still knows them; a template
        # without tools then just leaves them out), and the answer is read for calls unless tool_choice is "none"
        none = req.tool_choice == "none"
        fmt = tool_format(getattr(self.generator.tokenizer, "chat_template", None)) if none else \
            self._tool_format(req.tools) if req.tools else None
        kwargs = req.chat_template_kwargs or {}
        text = self.chat_prompt(req.messages, req.tools if fmt else None, template_kwargs=kwargs)
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        plan = self._common(req, self.generator.encode(text), "chat", getattr(req, name), name)
        budget = req.thinking_budget()
        if self.reasoning is not None:
            plan.reasoning = self.reasoning
            plan.opened = opens_block(self._generation_prompt(req.messages, req.tools if fmt else None, kwargs, text),
                                      self.reasoning)
            plan.thinking_budget = budget if budget is not None or req.reasoning_budget == -1 else self.thinking_budget
        elif budget is not None:
            field = "max_reasoning_tokens" if req.max_reasoning_tokens is not None else "reasoning_budget"
            raise APIError(400, f"'{field}': this model does not reason (its chat template has no <think> block), "
                                "so there is no thinking to budget; send no budget", param=field)
        plan.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        plan.tools = None if none else fmt
        forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        if fmt and forced:
            if plan.grammar is not None:
                raise APIError(400, "'response_format' and a forced 'tool_choice' ask for two shapes of answer: "
                                    "send one", param="response_format")
            only = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
            plan.grammar = self.grammars.tool_call(fmt, [t for t in req.tools if only in (None, t.function.name)],
                                                   several=only is None and req.parallel_tool_calls)
        return plan

    def _tool_format(self, tools) -> ToolFormat:
        fmt = tool_format(getattr(self.generator.tokenizer, "chat_template", None))
        if fmt is None:
            raise APIError(400, "'tools': this model's chat template does not render tools (it has no tool-call "
                                "form: Qwen2.5/Qwen3's <tool_call> or Llama 3.1's JSON); send no tools",
                           param="tools")
        return fmt

    def _generation_prompt(self, messages: List[ChatMessage], tools, kwargs: Dict[str, Any], text: str) -> str:
        """What the template adds for the answer: `text` (rendered with add_generation_prompt) past the same render
        without it (the whole of `text` when the two do not share that start)."""
        try:
            bare = self.chat_prompt(messages, tools, add_generation_prompt=False, template_kwargs=kwargs)
        except APIError:  # a template that renders only with the generation prompt: judge by the whole text
            return text
        return text[len(bare):] if text.startswith(bare) else text

    def chat_prompt(self, messages: List[ChatMessage], tools=None, add_generation_prompt: bool = True,
                    template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        """The chat template applied to the messages (text parts joined), with `tools` when given and
        `template_kwargs` (chat_template_kwargs) as more variables."""
        clean = []
        for i, m in enumerate(messages):
            item: Dict[str, Any] = {"role": m.role, "content": m.text() or ""}
            if m.tool_calls:
                calls = []
                for j, call in enumerate(m.tool_calls):
                    try:
                        arguments = json.loads(call.function.arguments)
                    except ValueError:
                        raise APIError(400, f"'messages[{i}].tool_calls[{j}].function.arguments' is not JSON",
                                       param="messages") from None
                    calls.append({"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": arguments}})
                item["tool_calls"] = calls
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    item[key] = getattr(m, key)
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:  # Qwen3's template reads it (as vLLM passes it)
                item["reasoning_content"] = reasoning
            clean.append(item)
        self._check_chat()
        tokenizer = self.generator.tokenizer
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
        try:
            return tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **extra)
        except Exception as exc:  # noqa: BLE001  (a template's raise_exception, e.g. roles out of order)
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None

    def proposer(self):
        """A new request's drafter: the draft folder's (shared: the engine thread alone calls it) or prompt lookup."""
        from lite_runtime.engine.speculative import DraftFolder, PromptLookup

        if self.draft is not None:
            if not isinstance(self._draft_proposer, DraftFolder):
                self._draft_proposer = DraftFolder(self.draft)
            return self._draft_proposer
        return PromptLookup()

    _draft_proposer = None

    # --- /tokenize, /detokenize (vLLM's shape) ------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> Dict[str, Any]:
        """`prompt` (add_special_tokens default true) or `messages` through the chat template (add_generation_prompt
        default true, add_special_tokens default false). `max_model_len`: the tokens the graphs hold per request,
        prompt and completion together."""
        self._check_model(req.model)
        chat = req.messages is not None
        if chat:
            self._check_chat()
        text = self.chat_prompt(req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs) if chat \
            else req.prompt
        special = (not chat) if req.add_special_tokens is None else req.add_special_tokens
        tokens = self.generator.encode(text, add_special_tokens=special)
        return {"count": len(tokens), "max_model_len": self.generator.seq_length, "tokens": tokens}

    def detokenize(self, req: DetokenizeRequest) -> Dict[str, Any]:
        self._check_model(req.model)
        tokens = self._in_vocabulary(req.tokens, "tokens")
        return {"prompt": self.generator.tokenizer.decode(tokens, skip_special_tokens=False)}

    # --- shutting down --------------------------------------------------------------------------------------
    def drain(self, timeout: float) -> bool:
        """Stop taking requests (503 with Retry-After; /health says draining), let the running ones finish for up to
        `timeout` seconds, then end the rest with a server_shutdown error their clients see. True if none was cut."""
        self.draining = True
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.engine.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.engine.idle():
            return True
        self.engine.abort(f"the server is shutting down: this request ran past the drain timeout ({timeout:g} s)")
        while not self.engine.idle() and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        return False

    # --- running ------------------------------------------------------------------------------------------
    def submit(self, plan: Plan, emit: Callable[[int, tuple], None]) -> List[SlotRequest]:
        """Queue one engine request per choice (all or none); `emit(choice_index, event)` from the engine thread."""
        left = [len(plan.settings)]
        requests: List[SlotRequest] = []

        def for_choice(i: int):
            def choice_emit(event) -> None:
                if event[0] in ("end", "error"):
                    left[0] -= 1
                    if not left[0]:
                        self.metrics.ended(plan.endpoint, requests, requests[0].finish_reason or "error")
                emit(i, event)
            return choice_emit

        deadline = None if not self.request_timeout else time.monotonic() + self.request_timeout
        for i, settings in enumerate(plan.settings):
            think = None if plan.reasoning is None else ThinkState.for_request(self.think_tokens, plan.opened,
                                                                                plan.thinking_budget)
            requests.append(SlotRequest(prompt=plan.prompt, max_tokens=plan.max_tokens, settings=settings,
                                        deadline=deadline, emit=for_choice(i), stop=plan.stop, eos=plan.eos,
                                        think=think,
                                        logprobs=plan.logprobs, echo=plan.echo, prompt_logprobs=plan.prompt_logprobs,
                                        proposer=self.proposer() if plan.speculative else None,
                                        constraint=plan.grammar.matcher() if plan.grammar is not None else None))
        try:
            self.engine.submit_many(requests)
        except QueueFull:
            self.metrics.rejections.inc()
            raise APIError(503, f"the server is busy: its {self.engine.rows} rows are serving and its "
                                f"{self.engine.max_queue} queue places (--max_queue) are taken; retry later",
                           kind="server_error", code="server_busy", headers={"Retry-After": "1"}) from None
        return requests
