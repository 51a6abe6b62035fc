"""The engine's events of one request's choices, in OpenAI's response and stream-chunk shapes.

Per choice: text deltas (through the reasoning parser when the folder's template thinks, lite_runtime/reasoning.py:
the reasoning as `reasoning_content` and `reasoning` (vLLM's older and newer names), the answer as `content`; and the
answer through the tool-call parser when the request has tools), the tokens' logprobs
(completions: `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`; chat: `content` of
{token, logprob, bytes, top_logprobs}), the finish reason (`tool_calls` when the answer is calls). A token's
text is its bytes (the byte-level BPE's own) decoded as UTF-8, a partial character as U+FFFD.
"""
from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

from lite_runtime.reasoning import ReasoningParser
from lite_runtime.serve.serving import Plan
from lite_runtime.serve.tools import ToolCallParser


@lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token spells each byte with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenPieces:
    """Token id -> (text, bytes), cached: what logprobs show for a token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: Dict[int, Tuple[str, List[int]]] = {}

    def __call__(self, token: int) -> Tuple[str, List[int]]:
        piece = self._cache.get(token)
        if piece is None:
            piece = self._cache[token] = self._piece(token)
        return piece

    def _piece(self, token: int) -> Tuple[str, List[int]]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # FolderTokenizer's or transformers' fast one
        raw = backend.id_to_token(int(token)) if backend is not None else None
        decoder = _byte_decoder()
        if raw is not None and all(c in decoder for c in raw):
            data = bytes(decoder[c] for c in raw)
        elif raw is not None and len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
            data = bytes([int(raw[3:5], 16)])  # sentencepiece byte fallback
        elif raw is not None and "\u2581" in raw:
            data = raw.replace("\u2581", " ").encode()  # sentencepiece's word boundary
        else:
            data = self.tokenizer.decode([token]).encode()
        return data.decode("utf-8", errors="replace"), list(data)


class Choice:
    def __init__(self, index: int, answer: "Answer") -> None:
        self.index, self.answer = index, answer
        self.text = ""
        self.logprobs: List[Any] = []  # TokenLogprob, every token sent
        self.offsets: List[int] = []  # completions' text_offset: characters of the tokens before
        self._chars = 0
        self.finish: Optional[str] = None
        self.parser = ToolCallParser(answer.plan.tools) if answer.plan.tools else None
        plan = answer.plan
        self.thinking = ReasoningParser(plan.reasoning, plan.opened) if plan.chat and plan.reasoning else None

    def add(self, text: str, logprobs) -> List[tuple]:
        """The events of the new text: ("reasoning", text), and the answer's through the tool parser or as
        ("content", text); the logprob entries are kept."""
        for entry in logprobs or ():
            self.offsets.append(self._chars)
            self._chars += len(self.answer.pieces(entry.token)[0])
            self.logprobs.append(entry)
        self.text += text
        return self._answer(self.thinking.feed(text) if self.thinking else [("content", text)] if text else [])

    def _answer(self, events: List[tuple], final: bool = False) -> List[tuple]:
        """Reasoning events as they are, content through the tool parser (finished when `final`)."""
        if self.parser is None:
            return events
        out: List[tuple] = []
        for event in events:
            out += self.parser.feed(event[1]) if event[0] == "content" else [event]
        return out + (self.parser.finish() if final else [])

    def end(self, reason: str) -> List[tuple]:
        events = self._answer(self.thinking.finish() if self.thinking else [], final=True)
        calls = self.parser.calls if self.parser else []
        self.finish = "tool_calls" if calls and reason == "stop" else reason
        return events


class Answer:
    """One request's response: `chunk(...)` for each streamed event, `response()` once every choice ended."""

    def __init__(self, plan: Plan, model: str, pieces: TokenPieces) -> None:
        self.plan, self.model, self.pieces = plan, model, pieces
        self.id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [Choice(i, self) for i in range(len(plan.settings))]
        self.requests: List[Any] = []  # the engine's SlotRequests, for usage

    # --- logprobs in the two shapes -----------------------------------------------------------------------
    def _chat_logprobs(self, entries) -> Optional[Dict[str, Any]]:
        if entries is None:
            return None

        def one(token: int, logprob: float) -> Dict[str, Any]:
            text, data = self.pieces(token)
            return {"token": text, "logprob": logprob, "bytes": data}

        return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                            for e in entries]}

    def _completion_logprobs(self, entries, offsets: List[int]) -> Optional[Dict[str, Any]]:
        if entries is None:
            return None
        top = []
        for e in entries:
            if e.top is None:  # echo's first prompt token: nothing predicts it
                top.append(None)
                continue
            alternatives: Dict[str, float] = {}
            for t, lp in e.top:
                alternatives.setdefault(self.pieces(t)[0], lp)
            top.append(alternatives)
        return {"tokens": [self.pieces(e.token)[0] for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def _logprobs(self, choice: Choice, entries, start: int) -> Optional[Dict[str, Any]]:
        if self.plan.logprobs is None:
            return None
        entries = entries or []
        if self.plan.chat:
            return self._chat_logprobs(entries)
        return self._completion_logprobs(entries, choice.offsets[start:start + len(entries)])

    # --- streaming ----------------------------------------------------------------------------------------
    def _chunk(self, choices: List[Dict[str, Any]], usage: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def opening(self) -> List[Dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice."""
        if not self.plan.chat:
            return []
        return [self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for c in self.choices]

    def text_chunks(self, index: int, text: str, entries) -> List[Dict[str, Any]]:
        choice = self.choices[index]
        start = len(choice.logprobs)
        events = choice.add(text, entries)
        logprobs = self._logprobs(choice, entries, start) if entries else None
        if not self.plan.chat:
            if not text and not entries:
                return []
            return [self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])]
        deltas = [self._delta(choice, e) for e in events]
        if not deltas and entries:
            deltas = [{}]
        return [self._chunk([{"index": index, "delta": d, "logprobs": logprobs if i == len(deltas) - 1 else None,
                              "finish_reason": None}]) for i, d in enumerate(deltas)]

    def _delta(self, choice: Choice, event: tuple) -> Dict[str, Any]:
        if event[0] == "content":
            return {"content": event[1]}
        if event[0] == "reasoning":
            return {"reasoning_content": event[1], "reasoning": event[1]}
        if event[0] == "call":
            _, i, call_id, name = event
            return {"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}

    def end_chunks(self, index: int, reason: str) -> List[Dict[str, Any]]:
        choice = self.choices[index]
        events = choice.end(reason)
        out = []
        if self.plan.chat:
            out += [self._chunk([{"index": index, "delta": self._delta(choice, e), "logprobs": None,
                                  "finish_reason": None}]) for e in events]
            last = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice.finish}
        else:
            text = "".join(e[1] for e in events if e[0] == "content")
            last = {"index": index, "text": text, "logprobs": None, "finish_reason": choice.finish}
        return out + [self._chunk([last])]

    def usage_chunk(self) -> Dict[str, Any]:
        return self._chunk([], self.usage())

    # --- whole ----------------------------------------------------------------------------------------------
    def usage(self) -> Dict[str, int]:
        generated = sum(len(r.generated) for r in self.requests)
        prompt = len(self.plan.prompt)
        # prompt tokens found in the cache row (prefix reuse: lite_runtime/engine/scheduler.py), as OpenAI reports its cache
        cached = self.requests[0].cached if self.requests else 0
        usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.plan.chat and self.plan.reasoning is not None:  # OpenAI's count of the thinking (markers not counted)
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(r.think.count for r in self.requests
                                                                          if r.think is not None)}
        return usage

    def response(self) -> Dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(c, c.logprobs, 0)
            if not self.plan.chat:
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish})
                continue
            message: Dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.thinking is not None:
                thought = c.thinking.reasoning or None  # an empty block (a budget of 0) is no reasoning
                message.update(content=c.thinking.content if c.thinking.content or not c.thinking.seen else None,
                               reasoning_content=thought, reasoning=thought)
            if c.parser is not None:
                message["content"] = c.parser.message_content()
                if c.parser.calls:
                    message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                             for i, n, a in c.parser.calls]
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish})
        return {"id": self.id, "object": "chat.completion" if self.plan.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
