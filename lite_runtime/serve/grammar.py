"""Structured output: a grammar's token mask over the logits, through llguidance, for every backend.

Why llguidance (measured at Qwen2.5's 152K vocabulary on this 2-core x86 machine, 2026-11-24,
docs/performance-log.md, "Structured output and the server's new API: what a token costs"): computing the
next-token mask took a median 5 us (xgrammar 0.2.8: 28 us; outlines-core 0.2.14: 220 us), compiling a JSON schema
1.2 ms (xgrammar 19 ms; outlines-core 0.7 s, 13 s for an open JSON object), reading the vocabulary once 1.0 s; it
needs neither torch nor a GPU (xgrammar's package declares torch), refuses what it cannot enforce by name
("Unimplemented keys: [\"uniqueItems\"]"), and takes a Lark grammar with `%json` rules, which tool calls need.
Putting the mask on float32 logits in numpy 1.26 costs ~130 us (a copy, the bits unpacked into a boolean
"disallowed" vector, one masked copy; a sparse path when few words are set), so greedy asks the grammar about its
own argmax first (`allows`, ~5 us) and masks only when it is refused.

The mask is applied to the raw logits before the repetition penalty and the sampling warpers (as vLLM
does), so top-k/top-p choose among allowed tokens only; logprobs stay those of the raw logits. JSON is
written with ", " and ": " and no other whitespace (a random or weak model cannot loop on blank space).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import numpy as np

from lite_runtime.serve.protocol import APIError
from lite_runtime.serve.tools import ToolFormat

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NEG_INF = np.float32(-np.inf)


def _tokenizer_json(tokenizer) -> str:
    """The tokenizers library's JSON of the folder's tokenizer (FolderTokenizer, or a transformers fast one)."""
    raw = getattr(tokenizer, "backend_tokenizer", None)
    if raw is None:
        raise APIError(400, "structured output needs the folder's tokenizer.json (a fast tokenizer)",
                       param="response_format")
    return raw.to_str()


class GrammarCompiler:
    """The vocabulary read once (llguidance.LLTokenizer); grammars compiled per request."""

    def __init__(self, tokenizer, vocab_size: int, eos: List[int]) -> None:
        try:
            import llguidance
        except ImportError:
            raise APIError(400, "structured output and forced tool calls need llguidance on the server: "
                                'pip install -e ".[serve]"', param="response_format") from None
        self.llg = llguidance
        self.version = getattr(llguidance, "__version__", "?")
        self.text_tokenizer = tokenizer
        self.tokenizer = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                                eos_token=list(eos) or None)
        self.vocab_size = vocab_size

    def compile(self, grammar: str, param: str) -> "Grammar":
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise APIError(400, f"'{param}' cannot be enforced by this server's grammar engine (llguidance "
                                f"{self.version}): {matcher.get_error()}", param=param.split(".")[0])
        return Grammar(matcher, self.vocab_size)

    def response_format(self, fmt) -> "Grammar":
        """{"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema": {"schema": ...}}."""
        if fmt.type == "json_object":
            schema: Dict[str, Any] = {"type": "object"}
            param = "response_format"
        else:
            schema = fmt.json_schema.schema_ or {}
            param = "response_format.json_schema.schema"
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        except ValueError as exc:
            raise APIError(400, f"'{param}' is not a JSON schema: {exc}", param="response_format") from None
        return self.compile(grammar, param)

    def tool_call(self, fmt: ToolFormat, tools, several: bool) -> "Grammar":
        """A call of one of these tools in the model's form (`tool_choice` "required" or one function); with
        `several` (required, parallel_tool_calls) one or more, in the forms that allow more than one."""
        rules = []
        for i, tool in enumerate(tools):
            schema = {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                       fmt.arguments_key: tool.function.parameters or {}},
                      "required": ["name", fmt.arguments_key], "additionalProperties": False,
                      "x-guidance": JSON_STYLE}
            rules.append(f"call{i}: %json {json.dumps(schema)}")
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        if fmt.start is None:  # the whole answer is one call (llama3_json)
            lark = f"start: {calls}\n" + "\n".join(rules)
        else:
            opening, closing = self._literal(fmt.start), self._literal(fmt.end)
            more = ' ("\\n" tool_call)*' if several else ""
            lark = (f"start: tool_call{more}\ntool_call: {opening} \"\\n\" ({calls}) \"\\n\" {closing}\n"
                    + "\n".join(rules))
        return self.compile(self.llg.LLMatcher.grammar_from_lark(lark), "tools")

    def _literal(self, text: str) -> str:
        """A marker as the grammar must name it: its own token when the vocabulary has one (llguidance treats added
        tokens as special: `<[id]>`), else the text."""
        token = self.text_tokenizer.encode(text, add_special_tokens=False)
        if len(token) == 1 and token[0] < self.vocab_size and self.tokenizer.is_special_token(token[0]):
            return f"<[{token[0]}]>"
        return json.dumps(text)


class Grammar:
    """A compiled grammar; each choice gets a copy of its fresh matcher (llguidance builds lexer states lazily, and
    copies share what one has built: a new matcher per choice paid that again, 0.2-1.5 ms a token at first)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._fresh, self.vocab_size = matcher, vocab_size

    def matcher(self) -> "Matcher":
        return Matcher(self._fresh.deep_copy(), self.vocab_size)


class Matcher:
    """One choice's grammar state: the engine's `constraint` (lite_runtime.engine.scheduler)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.numpy as llnp

        self.m, self.llnp = matcher, llnp
        self.bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        self.error: Optional[str] = None

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of float32 logits [V] with every token the grammar does not allow next at -inf."""
        self.m.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)  # 6 us; numpy's wrapper 50
        out = np.array(logits, np.float32)
        return apply_bitmask(out, self.bitmask[0])

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (0.5 us: no mask computed)."""
        return self.m.validate_tokens([int(token)]) == 1

    def accept(self, token: int) -> None:
        if not self.m.consume_token(int(token)) and self.error is None:
            self.error = self.m.get_error()

    def finished(self) -> bool:
        return self.m.is_stopped() or self.error is not None


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """In place on float32 logits [V]; bitmask int32 [ceil(V / 32)], bit j of word i = token 32 i + j allowed."""
    size = logits.shape[0]
    if np.count_nonzero(bitmask) <= 64:  # a structural position: few tokens allowed
        words = np.flatnonzero(bitmask)
        rows, cols = np.nonzero(np.unpackbits(bitmask[words].view(np.uint8), bitorder="little").reshape(-1, 32))
        ids = words[rows] * 32 + cols
        ids = ids[ids < size]
        keep = logits[ids]
        logits.fill(_NEG_INF)
        logits[ids] = keep
        return logits
    disallowed = np.unpackbits(np.invert(bitmask).view(np.uint8), count=size, bitorder="little").view(bool)
    np.copyto(logits, _NEG_INF, where=disallowed)
    return logits
