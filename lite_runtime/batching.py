"""Continuous batching over a folder's static graphs: each request holds one row ("slot") of the KV cache.

A request waits in a bounded queue until a row is free. Its prompt goes into that row piece by piece through the
chunk graphs (ModelRunner.chunk): one piece of at most `prefill_chunk` tokens per engine step, in the same call as
the decode step of the rows already generating, so the weights are read once for both and a long prompt costs
the running streams a piece's arithmetic per token, not its whole prefill (chunked prefill); with no row
generating, pieces of the largest chunk graph run back to back. When its last piece is in, it chooses its first
token and joins the decode batch; a step without a piece runs the incremental graph (ModelRunner.step). A request leaves as
soon as it ends (eos, a stop string, max_tokens) or its client has gone, and its row is free for the next one. The
other rows are never written by another request's calls, so a request cannot see another's tokens, and a row's
numbers do not depend on what the other rows hold. Where a piece ends depends on the load (small pieces while
others decode); on the CPU kernels' path a token's numbers do not (each row of a matmul is summed in the same
order whatever the rows beside it), elsewhere they may differ in the last bits.

Prefix reuse: a free row keeps what its last request left (its prompt and answer, but the answer's last token,
which no step fed back). A new request takes the free row whose held tokens share the longest prefix with its
prompt (ties, and no match: the least recently used row), keeps that prefix and prefills only the rest: the next
turn of a chat pays for its new messages, not for the conversation again. `SlotRequest.cached` says how many
prompt tokens were reused (usage's prompt_tokens_details.cached_tokens). At least the prompt's last token is always
prefilled: its logits give the first token.

A row that takes part in a step without a token of its own (free, or between pieces) writes a padding token just
past what it holds, a scratch position that nothing reads before it is written again (ModelRunner.step `record`).

One thread (the engine) makes every graph call; callers submit a `SlotRequest` (or several at once: `submit_many`,
all or none) and receive its events through the request's `emit` callback, called from the engine thread:
("text", str, logprobs), then one ("end", finish_reason) or ("error", message, code): code `timeout` (past its
deadline), `server_shutdown` (abort() or stop()) or `engine_error`. What a request does at each token:
lite_runtime/slot_request.py. No HTTP here (lite_runtime.serve) and no MindSpore or torch.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Deque, List, Optional, Sequence, Tuple

from lite_runtime.errors import InferError
from lite_runtime.speculative import Pacer, SpecStats, common_prefix
from lite_runtime.slot_request import (SlotRequest, TokenLogprob, held_back, next_token, score_piece,  # noqa: F401
                                      send_echo, token_logprob)

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every row is busy and the queue is at its bound."""


class BatchEngine:
    """The engine thread over a TextGenerator's runner: `submit` requests; `stop()` ends the thread.

    `prefill_chunk`: prompt tokens per engine step while other rows decode (default: the folder's smallest chunk
    graph, lite_runtime/runner.py; at most its largest, which pieces take when no row decodes). `prefix_reuse` False: every prompt is prefilled whole (rows are still handed
    out least recently used first): for an operator who does not want one user's prompt to shorten another's time
    to first token (a timing side channel), or to measure what reuse buys."""

    def __init__(self, generator, max_queue: int = 64, prefill_chunk: Optional[int] = None,
                 prefix_reuse: bool = True, speculative_tokens: Optional[int] = None) -> None:
        self.generator = generator
        self.runner = runner = generator.runner
        self.rows, self.seq_length = runner.batch_size, runner.seq_length
        if not runner.chunk_sizes:
            runner.chunk(0, [runner.pad], 0, [], [], [False])  # raises the error that says why and what to do
        if prefill_chunk is not None and not 1 <= prefill_chunk <= runner.chunk_sizes[-1]:
            raise InferError(f"prefill_chunk {prefill_chunk} must be between 1 and the folder's largest chunk graph "
                             f"({runner.chunk_sizes[-1]} tokens)")
        self.prefill_chunk = prefill_chunk or runner.chunk_sizes[0]
        self.prefix_reuse = prefix_reuse
        self.max_queue = int(max_queue)
        self.slots: List[Optional[SlotRequest]] = [None] * self.rows
        self.waiting: Deque[SlotRequest] = collections.deque()
        self.last_used = [0] * self.rows  # when each row was last handed out (the LRU order of free rows)
        self._clock = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._abort: Optional[Tuple[str, str]] = None  # (message, code): end everything at the next step
        self.steps = 0  # decode steps run
        self.pieces = 0  # chunk graph calls run
        self.inflight = 0  # requests submitted and not ended: at most rows + max_queue
        self.peak_busy = 0  # most rows busy at once
        self.completed = 0  # requests ended, by any reason
        self.prefix_queries = 0  # prompt tokens of requests that took a row
        self.prefix_hits = 0  # of them, tokens found in the row (not prefilled again)
        # speculative decoding: draft tokens at most per verify (default: what the smallest score graph checks)
        self.speculative_tokens = speculative_tokens or max((runner.score_sizes or [2])[0] - 1, 1)
        self.spec = SpecStats()  # drafted and accepted tokens, every request (/metrics)
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
            busy = sum(s is not None for s in self.slots)
            return busy, self.inflight - busy

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
                else:
                    admit = self._admit()
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
                self._expire()
                self._run_step()
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

    def _admit(self) -> List[Tuple[int, SlotRequest]]:
        """Waiting requests onto free rows, oldest first (under the lock): each the row with the longest prefix of
        its prompt, else the least recently used one."""
        admit = []
        while self.waiting:
            free = [row for row in range(self.rows) if self.slots[row] is None]
            if not free:
                break
            request = self.waiting.popleft()
            row = max(free, key=lambda r: (self._reusable(r, request.prompt), -self.last_used[r]))
            self.slots[row] = request  # taken now; _start fills it in
            admit.append((row, request))
        return admit

    def _start(self, row: int, request: SlotRequest) -> None:
        if request.cancelled:  # its client left while it waited
            self.slots[row] = None
            self._finish(request, "cancelled", ("end", "cancelled"))
            return
        if request.deadline is not None and time.monotonic() > request.deadline:  # it waited past its deadline
            self.slots[row] = None
            self._finish(request, "error", ("error", "the request waited past the server's --request_timeout",
                                            "timeout"))
            return
        self._clock += 1
        self.last_used[row] = self._clock
        request.slot, request.started = row, time.monotonic()
        reuse = 0 if request.prompt_logprobs is not None else self._reusable(row, request.prompt)  # echo: all scored
        request.cached = request.prefilled = min(reuse, len(request.prompt) - 1)
        self.prefix_queries += len(request.prompt)
        self.prefix_hits += request.cached
        self.peak_busy = max(self.peak_busy, sum(s is not None for s in self.slots))

    def _reusable(self, row: int, prompt: Sequence[int]) -> int:
        """Tokens at the start of `prompt` that row `row` holds already."""
        return common_prefix(self.runner.held[row], prompt) if self.prefix_reuse else 0

    def _expire(self) -> None:
        now = time.monotonic()
        for row, request in enumerate(self.slots):
            if request is not None and request.cancelled:
                self._end(row, request, reason="cancelled")
            elif request is not None and request.deadline is not None and now > request.deadline:
                self._end(row, request, error="the request ran past the server's --request_timeout", code="timeout")

    def _run_step(self) -> None:
        """One engine step: the decode step of the rows that have a token to feed and, while a prompt is being
        prefilled, the next piece of the oldest such one in the same call (the chunk graph: the weights are read once
        for both); every other row writes scratch (module doc)."""
        waiting = [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]
        decoding = any(r is not None and r.decoding for r in self.slots)
        if not waiting and not decoding:
            return
        tokens, lengths, record = [self.runner.pad] * self.rows, [1] * self.rows, [False] * self.rows
        for row, request in enumerate(self.slots):
            if request is not None and request.decoding:
                tokens[row], lengths[row] = request.generated[-1], len(request.prompt) + len(request.generated)
                record[row] = True
            else:
                lengths[row] = self.runner.scratch_length(row)
        piece = None
        if waiting:
            piece = min(waiting, key=lambda r: r.started)
            start = piece.prefilled
            every = piece.prompt_logprobs is not None  # echo's logprobs: every position, through the score graphs
            if every:
                size = self.runner.score_sizes[0] if decoding else self.runner.score_sizes[-1]
            else:
                size = self.prefill_chunk if decoding else self.runner.chunk_sizes[-1]
            tokens_in = piece.prompt[start:start + size]
            logits, last = self.runner.chunk(piece.slot, tokens_in, start, tokens, lengths, record, every=every)
            if every:
                score_piece(piece, start, last)
                last = last[-1]
            self.pieces += 1
            piece.prefilled += len(tokens_in)
        else:
            alone = [r for r in range(self.rows) if record[r]]
            if len(alone) == 1 and self.slots[alone[0]].proposer is not None and self.runner.score_sizes:
                if self._speculate(alone[0], self.slots[alone[0]]):
                    return
            tick = time.perf_counter()
            logits = self.runner.step(tokens, lengths, record)
            if len(alone) == 1 and self.slots[alone[0]].pacer is not None:
                self.slots[alone[0]].pacer.plain(time.perf_counter() - tick)
        self.steps += decoding
        for row, request in enumerate(self.slots):
            if request is not None and record[row]:
                self._advance(row, request, logits[row])
        if piece is not None and piece.prefilled == len(piece.prompt):  # its first token: it decodes from the next
            if piece.echo is not None:
                send_echo(piece)
            if piece.max_tokens == 0:  # echo alone: the prompt (and its logprobs) is the answer
                self._end(piece.slot, piece, reason="length")
            else:
                self._advance(piece.slot, piece, last)

    def _speculate(self, row: int, request: SlotRequest) -> bool:
        """One verify round for the only decoding request (lite_runtime/speculative.py): its proposer's drafts and its
        last token through the score graph, then its tokens chosen position by position as a step would choose them
        (next_token: sampling, logprobs, grammar, stops), kept while they are the drafts. A token drawn from the
        target's own distribution at each position keeps the output the target's (greedy: token-identical; sampled:
        for a draft that is a point mass, prompt lookup's, this is the speculative-sampling rule). False when it did
        not run (no draft, or the pacer's loss budget says a plain step): the caller steps."""
        if request.pacer is None:
            request.pacer = Pacer(self.speculative_tokens)
        pacer = request.pacer
        seq = request.prompt + request.generated
        left = request.max_tokens - len(request.generated)
        k = min(pacer.plan(request.proposer.lacking(seq), left), request.max_tokens - len(request.generated), self.seq_length - len(seq),
                self.runner.score_sizes[-1] - 1)
        if k < 1:
            return False
        tick = time.perf_counter()
        drafts, _ = request.proposer.propose(seq, k, request.settings, request.rng)
        if not drafts:
            return False
        checking = time.perf_counter()
        _, verify = self.runner.chunk(row, [seq[-1]] + drafts, len(seq) - 1, *self.runner.scratch_step(), every=True)
        verified = time.perf_counter() - checking
        self.steps += 1
        kept, reason = 0, None
        for i in range(len(drafts) + 1):
            reason = next_token(request, verify[i], self.generator.tokenizer)
            if reason is not None or i == len(drafts) or request.generated[-1] != drafts[i]:
                break
            kept += 1
        self.runner.held[row] = seq + drafts[:kept]  # the row's valid tokens: rejected drafts lie past them
        self.spec.rounds += 1
        self.spec.drafted += len(drafts)
        self.spec.accepted += kept
        request.spec_drafted += len(drafts)
        request.spec_accepted += kept
        pacer.round(time.perf_counter() - tick, verified, len(drafts), kept)
        if reason is not None:
            self._end(row, request, reason=reason)
        return True

    def _advance(self, row: int, request: SlotRequest, logits) -> None:
        reason = next_token(request, logits, self.generator.tokenizer)
        if reason is not None:
            self._end(row, request, reason=reason)

    def _end(self, row: int, request: SlotRequest, reason: str = "", error: str = "", code: str = "") -> None:
        self.slots[row] = None
        self._finish(request, reason or "error", ("error", error, code or "engine_error") if error else ("end", reason))

    def _finish(self, request: SlotRequest, reason: str, event: Tuple[Any, ...]) -> None:
        """A request ends (from a row or from the queue): counted, stamped, its last event sent."""
        with self._cond:
            self.inflight -= 1
            self.completed += 1
        request.finish_reason, request.ended = reason, time.monotonic()
        request.emit(event)
