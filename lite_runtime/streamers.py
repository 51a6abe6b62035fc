"""Streamers: text as tokens arrive. `TextIteratorStreamer` is a drop-in for transformers' (one row);
`BatchTextIteratorStreamer` streams every row of a batch as (row, text) pairs.

The generator calls `put(prompt_ids [n, L])` once, then `put(new_ids [n])` per step, then `end()`.
With more than one row, a row that has finished is sent as -1 (no token) while the others go on.
"""
from __future__ import annotations

from queue import Queue
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from lite_runtime.errors import InferError

_STOP = object()


class _RowDecoder:
    """Decodes one row's tokens so far and releases the text that has become stable."""

    def __init__(self, tokenizer, decode_kwargs) -> None:
        self.tokenizer, self.decode_kwargs = tokenizer, decode_kwargs
        self.tokens: List[int] = []
        self.sent = 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, **self.decode_kwargs)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return ""
        return self._release(text)

    def flush(self) -> str:
        return self._release(self.tokenizer.decode(self.tokens, **self.decode_kwargs)) if self.tokens else ""

    def _release(self, text: str) -> str:
        piece, self.sent = text[self.sent:], max(self.sent, len(text))
        return piece


class _Base:
    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: Optional[float] = None,
                 **decode_kwargs: Any) -> None:
        self.tokenizer, self.skip_prompt, self.timeout = tokenizer, skip_prompt, timeout
        self.decode_kwargs = decode_kwargs
        self.queue: Queue = Queue()
        self.rows: List[_RowDecoder] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        """The prompt ([n, L] array, or a list of n arrays when lengths differ) first, then [n] new ids."""
        if not self._prompt_seen:
            self._prompt_seen = True
            if isinstance(value, list):
                prompts = [np.asarray(r).reshape(-1) for r in value]
            else:
                arr = np.asarray(value)
                prompts = list(arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1))
            self._check_rows(len(prompts))
            self.rows = [_RowDecoder(self.tokenizer, self.decode_kwargs) for _ in prompts]
            if not self.skip_prompt:  # else rows decode only what is generated, as the final text does
                for i, row in enumerate(prompts):
                    self.rows[i].tokens = [int(t) for t in row]
                    self._emit(i, self.rows[i].flush())
            return
        for i, token in enumerate(np.asarray(value).reshape(-1)):
            if int(token) >= 0:
                self._emit(i, self.rows[i].add(int(token)))

    def end(self) -> None:
        for i, row in enumerate(self.rows):
            self._emit(i, row.flush())
        self.queue.put(_STOP)

    def _next(self):
        item = self.queue.get(timeout=self.timeout)
        if item is _STOP:
            raise StopIteration
        return item

    def _check_rows(self, n: int) -> None:  # pragma: no cover - overridden
        pass

    def _emit(self, row: int, text: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class TextIteratorStreamer(_Base):
    """Iterating yields the new text of the single row, as transformers.TextIteratorStreamer does."""

    def _check_rows(self, n: int) -> None:
        if n != 1:
            raise InferError(f"TextIteratorStreamer streams one row, the batch has {n}; "
                             "use BatchTextIteratorStreamer")

    def _emit(self, row: int, text: str) -> None:
        if text:
            self.queue.put(text)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return self._next()


class BatchTextIteratorStreamer(_Base):
    """Iterating yields (row, new text) pairs for every row of the batch."""

    def _emit(self, row: int, text: str) -> None:
        if text:
            self.queue.put((row, text))

    def __iter__(self) -> Iterator[Tuple[int, str]]:
        return self

    def __next__(self) -> Tuple[int, str]:
        return self._next()
