"""Continuous batching over a folder's static graphs: each request holds one row ("slot") of the KV cache.

A request waits in a bounded queue until a row is free; then the slot graph prefills its prompt into
that row alone (TextGenerator.prefill_slot) and it joins the decode batch at the next step. Every step
runs the incremental graph once for all rows (step_slots); a request leaves as soon as it ends (eos,
a stop string, max_tokens) or its client has gone, and its row is free for the next one. The other rows
are never written by another request's calls, so a request cannot see another's tokens, and a row's
numbers do not depend on what the other rows hold.

One thread (the engine) makes every graph call; callers submit a `SlotRequest` (or several at once:
`submit_many`, all or none) and receive its events through the request's `emit` callback, called from the
engine thread: ("text", str, logprobs), then one ("end", finish_reason) or ("error", message, code): code
`timeout` (past its deadline), `server_shutdown` (abort() or stop()) or `engine_error`. Text is
decoded from the generated ids as a whole each step, so multi-byte characters and stop strings split across
tokens come out right: text that could still be the start of a stop string is held back until it cannot.
`logprobs` is None unless the request asked for them (`SlotRequest.logprobs` = how many alternatives): then
the `TokenLogprob`s of the tokens whose text this event completes, log-softmax of the raw float32 logits of
the graphs (before the repetition penalty, temperature, top-k/top-p and any grammar mask: what the model
gives, as OpenAI and vLLM's default report).

A request may carry a `constraint` (lite_runtime.serve.grammar: a grammar's token mask): its `mask(scores)`
is applied to the logits before the sampling transforms, `accept(token)` follows the chosen token, and
`finished()` ends the request (finish reason "stop") when the grammar can take nothing more. Greedy asks
`allows(token)` of the unmasked argmax first and masks only when it is refused (the masked argmax is the same
token whenever it is allowed; the mask costs ~0.1 ms at 152K tokens, the question 0.5 us).

No HTTP here (lite_runtime.serve) and no MindSpore or torch: the generator's backend does the work.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.sampling import GenerationSettings, choose, process

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every row is busy and the queue is at its bound."""


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: List[Tuple[int, float]]  # the `logprobs` most likely tokens, most likely first


@dataclass
class SlotRequest:
    prompt: List[int]
    max_tokens: int
    settings: GenerationSettings  # sampling (do_sample, temperature, top_k, top_p, repetition_penalty, seed)
    emit: Callable[[Tuple[Any, ...]], None]
    stop: Sequence[str] = ()
    eos: Sequence[int] = ()
    logprobs: Optional[int] = None  # None: none; k: each token's log-probability and the k most likely
    constraint: Any = None  # mask(scores) -> scores, accept(token), finished() -> bool
    cancelled: bool = False  # set by the caller (client gone); the engine frees the row at its next step
    deadline: Optional[float] = None  # time.monotonic() past which the engine ends it ("timeout" error)
    # filled in by the engine
    generated: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    text: str = ""  # sent so far
    submitted: float = field(default_factory=time.monotonic)
    started: Optional[float] = None  # when its row's prefill began
    token_times: List[float] = field(default_factory=list)  # when each generated token was chosen (monotonic)
    ended: Optional[float] = None
    slot: Optional[int] = None
    token_logprobs: List[TokenLogprob] = field(default_factory=list)
    _sent_logprobs: int = 0  # token_logprobs already sent with text

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.settings.seed)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` must wait: an incomplete character (U+FFFD from a split UTF-8
    sequence) or the longest tail that is the start of a stop string."""
    keep = 0
    while keep < len(text) and text[len(text) - 1 - keep] == "\ufffd":
        keep += 1
    body = text[:len(text) - keep]
    for stop in stops:
        for n in range(min(len(stop) - 1, len(body)), 0, -1):
            if body.endswith(stop[:n]):
                keep = max(keep, len(text) - len(body) + n)
                break
    return keep


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under softmax(logits) and the `top` most likely tokens (float64 sums)."""
    x = np.asarray(logits, np.float64)
    peak = x.max()
    lse = peak + np.log(np.exp(x - peak).sum())
    best: List[Tuple[int, float]] = []
    if top > 0:
        part = np.argpartition(-x, top - 1)[:top]
        part = part[np.lexsort((part, -x[part]))]  # most likely first; ties by id
        best = [(int(i), float(x[i] - lse)) for i in part]
    return TokenLogprob(int(token), float(x[token] - lse), best)


class BatchEngine:
    """The engine thread over a TextGenerator: `submit` requests; `stop()` ends the thread."""

    def __init__(self, generator, max_queue: int = 64) -> None:
        self.generator = generator
        self.rows = int(generator.batch_size)
        self.seq_length = int(generator.seq_length)
        self.max_queue = int(max_queue)
        self.slots: List[Optional[SlotRequest]] = [None] * self.rows
        self.waiting: Deque[SlotRequest] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._abort: Optional[Tuple[str, str]] = None  # (message, code): end everything at the next step
        self.steps = 0  # decode steps run
        self.inflight = 0  # requests submitted and not ended: at most rows + max_queue
        self.peak_busy = 0  # most rows busy at once
        self.completed = 0  # requests ended, by any reason
        self._thread = threading.Thread(target=self._loop, name="mslite-llm-engine", daemon=True)
        self._thread.start()

    # --- callers ------------------------------------------------------------------------------------
    def submit(self, request: SlotRequest) -> None:
        self.submit_many([request])

    def submit_many(self, requests: Sequence[SlotRequest]) -> None:
        """Queue every request or, past the bound, none (QueueFull)."""
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine has stopped")
            if self.inflight + len(requests) > self.rows + self.max_queue:
                raise QueueFull()
            self.inflight += len(requests)
            self.waiting.extend(requests)
            self._cond.notify()

    def load(self) -> Tuple[int, int]:
        """(rows busy, requests waiting for one)."""
        with self._cond:
            return sum(s is not None for s in self.slots), self.inflight - sum(s is not None for s in self.slots)

    def abort(self, message: str, code: str = "server_shutdown") -> None:
        """End every running and waiting request at the next step with ("error", message, code)."""
        with self._cond:
            self._abort = (message, code)
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return self.inflight == 0

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # --- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not self.waiting and all(s is None for s in self.slots):
                    self._cond.wait()
                if self._stopped:
                    break
                abort, self._abort = self._abort, None
                if abort:
                    waiting, self.waiting = list(self.waiting), collections.deque()
                admit = []
                for row in range(self.rows):
                    if self.slots[row] is None and self.waiting:
                        admit.append((row, self.waiting.popleft()))
            if abort:
                for row, request in enumerate(self.slots):
                    if request is not None:
                        self._end(row, request, error=abort[0], code=abort[1])
                for request in waiting:
                    self._finish(request, "error", ("error", abort[0], abort[1]))
                continue
            try:
                for row, request in admit:
                    self._start(row, request)
                self._step()
            except Exception as exc:  # noqa: BLE001  (a failed graph call ends the requests it served, not the server)
                log.exception("the engine's graph call failed")
                for row, request in enumerate(self.slots):
                    if request is not None:
                        self._end(row, request, error=f"inference failed: {exc}", code="engine_error")
        for row, request in enumerate(self.slots):
            if request is not None:
                self._end(row, request, error="the server is shutting down", code="server_shutdown")
        for request in self.waiting:
            request.emit(("error", "the server is shutting down", "server_shutdown"))

    def _start(self, row: int, request: SlotRequest) -> None:
        if request.cancelled:  # its client left while it waited
            self._finish(request, "cancelled", ("end", "cancelled"))
            return
        if request.deadline is not None and time.monotonic() > request.deadline:  # it waited past its deadline
            self._finish(request, "error", ("error", "the request waited past the server's --request_timeout",
                                            "timeout"))
            return
        request.slot, request.started = row, time.monotonic()
        self.slots[row] = request
        self.peak_busy = max(self.peak_busy, sum(s is not None for s in self.slots))
        self._advance(row, request, self.generator.prefill_slot(row, request.prompt))

    def _step(self) -> None:
        now = time.monotonic()
        for row, request in enumerate(self.slots):
            if request is not None and request.cancelled:
                self._end(row, request, reason="cancelled")
            elif request is not None and request.deadline is not None and now > request.deadline:
                self._end(row, request, error="the request ran past the server's --request_timeout", code="timeout")
        busy = [row for row, r in enumerate(self.slots) if r is not None]
        if not busy:
            return
        tokens, lengths = [self.generator.pad] * self.rows, [1] * self.rows  # a free row writes position 0 of its own row
        for row in busy:
            request = self.slots[row]
            tokens[row] = request.generated[-1]
            lengths[row] = len(request.prompt) + len(request.generated)
        logits = self.generator.step_slots(tokens, lengths)
        self.steps += 1
        for row in busy:
            self._advance(row, self.slots[row], logits[row])

    def _advance(self, row: int, request: SlotRequest, logits: np.ndarray) -> None:
        """Choose the request's next token from its logits, send the text it completes, end it if it is done."""
        seen = request.prompt + request.generated
        constraint = request.constraint
        if request.settings.do_sample:
            scores = process(logits if constraint is None else constraint.mask(logits), seen, request.settings)
            token, _ = choose(scores, True, request.rng)
        else:  # what choose() picks, without the softmax over the vocabulary it does for the probability
            token = int(np.argmax(process(logits, seen, request.settings)))
            if constraint is not None and not constraint.allows(token):  # else the masked argmax is the same token
                token = int(np.argmax(process(constraint.mask(logits), seen, request.settings)))
        request.generated.append(token)
        request.token_times.append(time.monotonic())
        if request.logprobs is not None and token not in request.eos:
            request.token_logprobs.append(token_logprob(logits, token, request.logprobs))
        if constraint is not None:
            constraint.accept(token)
        if token in request.eos or constraint is not None and constraint.finished():
            self._send_text(request, final=True)
            self._end(row, request, reason="stop")
            return
        if self._send_text(request, final=False):
            self._end(row, request, reason="stop")
        elif len(request.generated) >= request.max_tokens:
            self._send_text(request, final=True)
            self._end(row, request, reason="length")

    def _send_text(self, request: SlotRequest, final: bool) -> bool:
        """Send the text the new token completed; True when a stop string was reached (the text ends before it)."""
        ids = request.generated[:-1] if request.generated and request.generated[-1] in request.eos else request.generated
        text = self.generator.tokenizer.decode(ids, skip_special_tokens=True)
        hit = None
        if request.stop:
            since = max(0, len(request.text) - max(len(s) for s in request.stop))
            found = [i for i in (text.find(s, since) for s in request.stop) if i >= 0]
            hit = min(found) if found else None
        end = hit if hit is not None else len(text) if final else len(text) - held_back(text, request.stop)
        pending = request.logprobs is not None and (final or hit is not None) and \
            request._sent_logprobs < len(request.token_logprobs)
        if end > len(request.text) or pending:
            logprobs = None
            if request.logprobs is not None:
                logprobs = request.token_logprobs[request._sent_logprobs:]
                request._sent_logprobs = len(request.token_logprobs)
            request.emit(("text", text[len(request.text):end], logprobs))
            request.text = text[:max(end, len(request.text))]
        return hit is not None

    def _end(self, row: int, request: SlotRequest, reason: str = "", error: str = "", code: str = "") -> None:
        self.slots[row] = None
        self._finish(request, reason or "error", ("error", error, code or "engine_error") if error else ("end", reason))

    def _finish(self, request: SlotRequest, reason: str, event: Tuple[Any, ...]) -> None:
        """A request ends (from a row or from the queue): counted, stamped, its last event sent."""
        self._done()
        request.finish_reason, request.ended = reason, time.monotonic()
        request.emit(event)

    def _done(self) -> None:
        with self._cond:
            self.inflight -= 1
            self.completed += 1
