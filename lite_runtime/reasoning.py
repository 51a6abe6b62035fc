"""Reasoning output: the model's thinking (`<think> ... </think>`) told apart from its answer.

Qwen3 writes `<think>\\n...\\n</think>\\n\\n` before its answer when its chat template leaves thinking on (its
generation prompt ends `<|im_start|>assistant\\n`; `enable_thinking: false` renders an empty block in the prompt
instead). DeepSeek-R1-distilled models (qwen2 and llama families) are given the opening `<think>\\n` by their template
and write the reasoning, `</think>`, then the answer. One rule covers both, decided per request from the rendered
prompt, not from the family: if the template's generation prompt leaves a block open, the output starts in the
reasoning; otherwise a block counts only when the output starts with the opening marker. Output without a block is
untouched (the answer is all of it).

Three parts:
- `reasoning_format`: which parser a folder gets, from its chat template (the markers) and family (the name, as
  vLLM's --reasoning-parser names them: `qwen3`, `deepseek_r1`); a name given for a template without the markers is
  an InferError (the server's start-up error).
- `ReasoningParser`: the generated text, as it streams, into ("reasoning", text) and ("content", text) events; the
  same parser reads a whole answer, so streaming and non-streaming agree. Whitespace around the block is trimmed
  (the reasoning's ends, the answer's start), as the templates add it.
- `ThinkState`: the same boundary on token ids, for the engine: a thinking budget (the block is closed by forcing
  `\\n</think>\\n\\n` once that many reasoning tokens are out) and structured output, whose grammar applies to the
  answer only (the first token may still open a block). docs/serving.md, "Reasoning models".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from lite_runtime.errors import InferError
from lite_runtime.text_machine import TextMachine, partial

PARSERS = ("qwen3", "deepseek_r1")
Event = Tuple[str, str]  # ("reasoning" | "content", text)


@dataclass(frozen=True)
class ReasoningFormat:
    name: str  # "qwen3" | "deepseek_r1" (the same markers and rule: the module doc)
    start: str = "<think>"
    end: str = "</think>"


def reasoning_format(template: Optional[str], family: Optional[str], choice: str = "auto") -> Optional[ReasoningFormat]:
    """The folder's reasoning parser: `choice` "auto" (from the template's markers, named after the family), "none",
    or a name in PARSERS (an InferError when the template has no markers: nothing would ever be parsed)."""
    if choice == "none":
        return None
    if choice != "auto" and choice not in PARSERS:
        raise InferError(f"reasoning parser {choice!r} is not one of auto, none, {', '.join(PARSERS)}")
    fmt = ReasoningFormat("qwen3" if family == "qwen3" else "deepseek_r1")
    marked = bool(template) and fmt.start in template and fmt.end in template
    if not marked:
        if choice == "auto":
            return None
        raise InferError(f"--reasoning_parser {choice}: this folder's chat template has no reasoning markers "
                         f"({fmt.start} ... {fmt.end}), so its model does not write reasoning this parser could "
                         "separate; drop the flag (auto) or pass a folder of a reasoning model")
    return ReasoningFormat(choice) if choice != "auto" else fmt


def opens_block(generation_prompt: str, fmt: ReasoningFormat) -> bool:
    """Whether the text the template adds for the answer (its generation prompt) leaves a reasoning block open."""
    return generation_prompt.rfind(fmt.start) > generation_prompt.rfind(fmt.end)


@dataclass
class ReasoningParser(TextMachine):
    """Text in (feed, then finish), ("reasoning" | "content", text) events out (module doc)."""

    fmt: ReasoningFormat
    opened: bool  # the prompt left a block open: the output starts in the reasoning
    reasoning: str = ""
    content: str = ""
    seen: bool = False  # a reasoning block was in the output (or opened by the prompt)
    _state: str = field(default="", init=False)  # before | reasoning | after (the answer's leading space) | content
    _buffer: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self._state = "reasoning" if self.opened else "before"
        self.seen = self.opened

    def _before(self, out: List[Event], final: bool) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.fmt.start):
            self._buffer, self._state, self.seen = stripped[len(self.fmt.start):], "reasoning", True
        elif final or not self.fmt.start.startswith(stripped):  # not a block: the output is the answer, untouched
            self._state = "content"

    def _reasoning(self, out: List[Event], final: bool) -> None:
        if not self.reasoning:
            self._buffer = self._buffer.lstrip()
        at = self._buffer.find(self.fmt.end)
        if at >= 0:
            self._emit(out, "reasoning", self._buffer[:at].rstrip())
            self._buffer, self._state = self._buffer[at + len(self.fmt.end):], "after"
            return
        if final:  # the output ended inside the block (max_tokens): all of it is reasoning
            self._emit(out, "reasoning", self._buffer.rstrip())
            self._buffer = ""
            return
        body = self._buffer[:len(self._buffer) - partial(self._buffer, self.fmt.end)]
        sent = len(body.rstrip())  # trailing space waits: it may be the block's last
        self._emit(out, "reasoning", self._buffer[:sent])
        self._buffer = self._buffer[sent:]

    def _after(self, out: List[Event], final: bool) -> None:
        self._buffer = self._buffer.lstrip()
        if self._buffer or final:
            self._state = "content"

    def _content(self, out: List[Event], final: bool) -> None:
        self._emit(out, "content", self._buffer)
        self._buffer = ""

    def _emit(self, out: List[Event], kind: str, text: str) -> None:
        if text:
            setattr(self, kind, getattr(self, kind) + text)
            out.append((kind, text))


@dataclass(frozen=True)
class ThinkTokens:
    """A format's markers as the tokenizer writes them: read once per server, shared by every request's ThinkState."""

    start: Tuple[int, ...]  # the opening marker's ids
    end: Tuple[int, ...]  # the closing marker's ids
    close: Tuple[int, ...]  # forced at a budget: "\n" + end + "\n\n"

    @classmethod
    def of(cls, tokenizer, fmt: ReasoningFormat) -> "ThinkTokens":
        """The ids; an InferError when decoding drops a marker (a special token): the parser reads text."""
        for marker in (fmt.start, fmt.end):
            ids = tokenizer.encode(marker, add_special_tokens=False)
            if tokenizer.decode(ids, skip_special_tokens=True) != marker:
                raise InferError(f"reasoning parser {fmt.name}: the tokenizer drops {marker} from decoded text (a "
                                 "special token), so the reasoning cannot be told from the answer; pass "
                                 "--reasoning_parser none")
        start = tuple(tokenizer.encode(fmt.start, add_special_tokens=False))
        end = tuple(tokenizer.encode(fmt.end, add_special_tokens=False))
        close = tuple(tokenizer.encode("\n" + fmt.end + "\n\n", add_special_tokens=False))
        if not any(close[i:i + len(end)] == end for i in range(len(close))):
            close = tuple(tokenizer.encode("\n", add_special_tokens=False)) + end  # the ids the stop check sees
        return cls(start, end, close)


def _ends_with(ids: Sequence[int], tail: Sequence[int]) -> bool:
    return len(ids) >= len(tail) > 0 and list(ids[len(ids) - len(tail):]) == list(tail)


@dataclass
class ThinkState:
    """One request's reasoning block on token ids (engine side): whether the next token is reasoning, the budget."""

    start: Tuple[int, ...]  # the opening marker's ids
    end: Tuple[int, ...]  # the closing marker's ids
    close: Tuple[int, ...]  # forced at the budget: "\n" + end + "\n\n"
    state: str  # maybe (the first tokens may open a block) | reasoning | done
    budget: Optional[int] = None  # reasoning tokens at most; None: no limit
    count: int = 0  # reasoning tokens so far
    forced: List[int] = field(default_factory=list)  # the next tokens, chosen for the model (the close)

    @classmethod
    def for_request(cls, tokens: ThinkTokens, opened: bool, budget: Optional[int]) -> "ThinkState":
        state = cls(tokens.start, tokens.end, tokens.close, "reasoning" if opened else "maybe", budget)
        state._check_budget()
        return state

    @property
    def answering(self) -> bool:
        """The next token is the answer's, chosen by the model (a grammar applies to it)."""
        return self.state == "done" and not self.forced

    def may_open(self) -> Optional[int]:
        """The token that would open a block here (allowed beside a grammar's), else None."""
        return self.start[0] if self.state == "maybe" else None

    def next_forced(self) -> Optional[int]:
        return self.forced.pop(0) if self.forced else None

    def observe(self, generated: Sequence[int]) -> None:
        """After a token was appended to `generated`."""
        if self.state == "maybe":
            n = len(generated)
            if list(generated) == list(self.start[:n]):
                if n == len(self.start):
                    self.state = "reasoning"
                    self._check_budget()
            else:
                self.state = "done"
        elif self.state == "reasoning":
            if _ends_with(generated, self.end):
                self.state = "done"  # a forced close goes on with its "\n\n"
            else:
                self.count += 1
                self._check_budget()

    def _check_budget(self) -> None:
        if self.state == "reasoning" and self.budget is not None and self.count >= self.budget and not self.forced:
            self.forced = list(self.close)
            self.budget = None  # closed once
