"""Tool calls: which form a folder's chat template asks the model for, and the answer's text parsed into calls.

Two forms cover the families we export, told apart by the chat template itself (nothing to configure):
- `hermes` (Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after
  optional text;
- `llama3_json` (Llama 3.1+ with custom tools): the whole answer is `{"name": ..., "parameters": {...}}`.
`ToolCallParser` reads the generated text as it streams and says what OpenAI's stream says: content deltas,
a call's start (id, name) and deltas of its `function.arguments` text, held back only where the text could
be the close of the call. The same parser reads a whole answer (non-streaming), so both give one result.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from lite_runtime.text_machine import TextMachine, partial

Event = Tuple  # ("content", text) | ("call", index, id, name) | ("arguments", index, text)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: Optional[str]  # the text that opens a call; None: the answer's first character ('{')
    end: Optional[str]  # the text that closes it; None: the end of the answer
    arguments_key: str  # the key the model writes the arguments under

    def call_text(self, name: str, arguments: str) -> str:
        """A call as the model writes it (grammars force this shape)."""
        body = f'{{"name": "{name}", "{self.arguments_key}": {arguments}}}'
        return f"{self.start}\n{body}\n{self.end}" if self.start else body


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", None, None, "parameters")


def tool_format(template: Optional[str]) -> Optional[ToolFormat]:
    """The form the chat template teaches, or None when it does not render `tools`."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template or "parameters" in template and "<|eot_id|>" in template:
        return LLAMA3_JSON
    return None


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser(TextMachine):
    fmt: ToolFormat
    calls: List[List[str]] = field(default_factory=list)  # [id, name, arguments]
    content: str = ""
    _buffer: str = ""
    _state: str = "text"  # text | header | arguments
    _started: bool = False  # any non-space text seen (llama3_json decides on the first character)

    def message_content(self) -> Optional[str]:
        """The answer's content as OpenAI gives it: the text, or with calls the text around them (None if blank)."""
        return (self.content.strip() or None) if self.calls else self.content

    # --- the state machine (lite_runtime/text_machine.py) ------------------------------------------------------
    def _ended(self, out: List[Event], final: bool) -> None:
        if final and self._buffer:  # an unclosed call, or text that only looked like one
            if self._state == "arguments":
                self._arguments_delta(out, self._buffer.rstrip().removesuffix("}") if self.fmt.end is None
                                      else self._buffer)
            else:
                self._content(out, (self.fmt.start or "") + self._buffer if self._state == "header" else self._buffer)
            self._buffer = ""

    def _text(self, out: List[Event], final: bool) -> None:
        if self.fmt.start is None:  # llama3_json: a call is the whole answer, or there is none
            stripped = self._buffer.lstrip()
            if not self._started and stripped:
                self._started = True
                if stripped.startswith("{"):
                    self._state = "header"
                    return
            if self._started or final:
                self._content(out, self._buffer)
                self._buffer = ""
            return
        at = self._buffer.find(self.fmt.start)
        if at >= 0:
            if not self.calls or self._buffer[:at].strip():  # space between calls is not content
                self._content(out, self._buffer[:at])
            self._buffer, self._state = self._buffer[at + len(self.fmt.start):], "header"
            return
        keep = partial(self._buffer, self.fmt.start)
        if self.calls and not self._buffer[:len(self._buffer) - keep].strip():  # space between calls: not content
            if final:
                self._buffer = ""
            return
        self._content(out, self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _header(self, out: List[Event], final: bool) -> None:
        match = _HEADER.match(self._buffer)
        if match:
            self.calls.append([new_call_id(), json.loads(f'"{match.group(1)}"'), ""])
            out.append(("call", len(self.calls) - 1, self.calls[-1][0], self.calls[-1][1]))
            self._buffer, self._state = self._buffer[match.end():], "arguments"
            return
        end = self._buffer.find(self.fmt.end) if self.fmt.end else (len(self._buffer) if final else -1)
        if end < 0:
            return
        body, rest = self._buffer[:end], self._buffer[end + len(self.fmt.end or ""):]
        try:  # keys in another order: one whole call, or not a call at all
            value = json.loads(body)
            name, arguments = value["name"], value.get("arguments", value.get("parameters", {}))
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            self._content(out, (self.fmt.start or "") + body + (self.fmt.end or ""))
        else:
            self.calls.append([new_call_id(), name, ""])
            out.append(("call", len(self.calls) - 1, self.calls[-1][0], name))
            self._arguments_delta(out, json.dumps(arguments, ensure_ascii=False))
        self._buffer, self._state = rest.lstrip("\n") if self.fmt.end else rest, "text"

    def _arguments(self, out: List[Event], final: bool) -> None:
        end = self._buffer.find(self.fmt.end) if self.fmt.end else -1
        if end >= 0:
            body = self._buffer[:end].rstrip()
            self._arguments_delta(out, body[:-1].rstrip() if body.endswith("}") else body)
            self._buffer, self._state = self._buffer[end + len(self.fmt.end):].lstrip("\n"), "text"
            return
        # hold back from the last '}' when what follows it could still be the call's close
        close = self._buffer.rfind("}")
        tail = self._buffer[close + 1:] if close >= 0 else ""
        closing = close >= 0 and (not tail.strip() or self.fmt.end is not None and
                                  self.fmt.end.startswith(tail.strip()))
        safe = self._buffer[:close] if closing else self._buffer
        self._arguments_delta(out, safe)
        self._buffer = self._buffer[len(safe):]

    def _arguments_delta(self, out: List[Event], text: str) -> None:
        if text:
            self.calls[-1][2] += text
            out.append(("arguments", len(self.calls) - 1, text))

    def _content(self, out: List[Event], text: str) -> None:
        if text:
            self.content += text
            out.append(("content", text))
