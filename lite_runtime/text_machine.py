"""Text that arrives in pieces (a stream's deltas), read by a state machine into events: the tool-call parser
(lite_runtime/serve/tools.py) and the reasoning parser (lite_runtime/reasoning.py). Feeding a whole text at once
and feeding it cut anywhere give the same events' text, which is how streamed and whole answers agree.
"""
from __future__ import annotations

from typing import List, Tuple


def partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (text that must wait)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)


class TextMachine:
    """`feed(text)` then `finish()`, each returning events; a subclass keeps `_state` and `_buffer` and has one
    method `_<state>(out, final)` per state, run until a pass changes neither; `_ended(out, final)` after."""

    _state: str
    _buffer: str

    def feed(self, text: str) -> List[Tuple]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> List[Tuple]:
        return self._run(final=True)

    def _run(self, final: bool) -> List[Tuple]:
        out: List[Tuple] = []
        while True:
            before = (self._state, len(self._buffer))
            getattr(self, f"_{self._state}")(out, final)
            if (self._state, len(self._buffer)) == before:
                break
        self._ended(out, final)
        return out

    def _ended(self, out: List[Tuple], final: bool) -> None:
        pass
