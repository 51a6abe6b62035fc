"""Continuous batching over a folder's static graphs and its paged KV cache (docs/architecture.md, "The KV cache: a
pool of blocks"): a request is a sequence of blocks of the runner's pool, and a graph row while it runs.

A request waits in a bounded queue until a graph row is free (the graph batch: sequences a step serves) and the pool
has the blocks its first piece needs (admission by rows and free blocks; a step's prompt tokens are the token budget,
`prefill_chunk`: by default the folder's largest chunk graph, as vLLM's max_num_batched_tokens and llama-server's
batch favour throughput; a smaller one keeps the running streams' gaps short while a prompt goes in). Its prompt
goes in piece by piece through the chunk graphs (ModelRunner.chunk): one piece of at most `prefill_chunk` tokens per
engine step, in the same call as the decode step of the rows already generating, so the weights are read once for
both and a long prompt costs the running streams a piece's arithmetic per token, not its whole prefill (chunked
prefill); with no row generating, pieces of the largest chunk graph run back to back. When its last piece is in, it
chooses its first token and joins the decode batch; a step without a piece runs the incremental graph
(ModelRunner.step). A request leaves as soon as it ends (eos, a stop string, max_tokens) or its client has gone, and
its row and blocks are free for the next one. A request's blocks are its own or shared read-only (below), so a
request cannot see another's tokens, and a row's numbers do not depend on what the other rows hold. Where a piece
ends depends on the load (small pieces while others decode); on the CPU kernels' path a token's numbers do not (each
row of a matmul is summed in the same order whatever the rows beside it), elsewhere they may differ in the last bits.

Blocks (lite_runtime/engine/blocks.py BlockPool, vLLM's design): a request takes blocks as its positions need them, a step
or a piece at a time. Prefix caching: when a request's prompt starts going in, the longest prefix of it held in full
blocks that some request computed (running, or finished and not yet reused: the free queue keeps a block's contents
until it is handed out again, least recently freed first) is shared instead of computed: the blocks' reference
counts go up, and the request prefills only the rest. At least the prompt's last token is always prefilled: its
logits give the first token. A request's full blocks become findable as soon as they are written, so requests that
share a system prompt compute it once even when they arrive together (their prompts go in one after another).
`SlotRequest.cached` says how many prompt tokens were found (usage's prompt_tokens_details.cached_tokens).
Preemption: when a step or a piece needs a block and none is free, the youngest other request (by admission) gives
its blocks back (kept findable) and waits again at the head of the queue; it is recomputed when it runs again (its
prompt and the tokens it had generated, as one prefill), and its tokens do not change. A row without a request
writes nowhere and reads the null block.

One thread (the engine) makes every graph call; callers submit a `SlotRequest` (or several at once: `submit_many`,
all or none) and receive its events through the request's `emit` callback, called from the engine thread:
("text", str, logprobs), then one ("end", finish_reason) or ("error", message, code): code `timeout` (past its
deadline), `server_shutdown` (abort() or stop()) or `engine_error`. What a request does at each token:
lite_runtime/engine/request.py. No HTTP here (lite_runtime.serve) and no MindSpore or torch.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Deque, List, Optional, Sequence, Tuple

from lite_runtime.engine.blocks import SequenceBlocks
from lite_runtime.errors import InferError
from lite_runtime.engine.runner import StepRow
from lite_runtime.engine.speculative import Pacer, SpecStats
from lite_runtime.engine.request import (SlotRequest, TokenLogprob, held_back, next_token, score_piece,  # noqa: F401
                                      send_echo, token_logprob)

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every row is busy and the queue is at its bound."""


class BatchEngine:
    """The engine thread over a TextGenerator's runner: `submit` requests; `stop()` ends the thread.

    `prefill_chunk`: prompt tokens per engine step while other rows decode (default: the folder's largest chunk
    graph, the step's token budget, which pieces take when no row decodes; a smaller one, down to the smallest chunk
    graph, trades prompt throughput for shorter gaps in the running streams). `prefix_reuse` False:
    no prompt takes another's blocks (each is prefilled whole): for an operator who does not want one user's prompt
    to shorten another's time to first token (a timing side channel), or to measure what caching buys."""

    def __init__(self, generator, max_queue: int = 64, prefill_chunk: Optional[int] = None,
                 prefix_reuse: bool = True, speculative_tokens: Optional[int] = None) -> None:
        self.generator = generator
        self.runner = runner = generator.runner
        self.pool = runner.pool
        self.rows, self.seq_length = runner.batch_size, runner.seq_length
        if not runner.chunk_sizes:
            raise InferError(runner.missing("chunk"))
        if prefill_chunk is not None and not 1 <= prefill_chunk <= runner.chunk_sizes[-1]:
            raise InferError(f"prefill_chunk {prefill_chunk} must be between 1 and the folder's largest chunk graph "
                             f"({runner.chunk_sizes[-1]} tokens)")
        self.prefill_chunk = prefill_chunk or runner.chunk_sizes[-1]
        self.prefix_reuse = prefix_reuse
        self.max_queue = int(max_queue)
        self.slots: List[Optional[SlotRequest]] = [None] * self.rows
        self.waiting: Deque[SlotRequest] = collections.deque()
        self._clock = 0  # admission order: the younger a request, the sooner it is preempted
        self._cond = threading.Condition()
        self._stopped = False
        self._abort: Optional[Tuple[str, str]] = None  # (message, code): end everything at the next step
        self.steps = 0  # decode steps run
        self.pieces = 0  # chunk graph calls run
        self.inflight = 0  # requests submitted and not ended: at most rows + max_queue
        self.peak_busy = 0  # most rows busy at once
        self.completed = 0  # requests ended, by any reason
        self.preemptions = 0  # requests that gave their blocks back to let an older one on
        # speculative decoding: draft tokens at most per verify (default: what the smallest score graph checks)
        self.speculative_tokens = speculative_tokens or max((runner.score_sizes or [2])[0] - 1, 1)
        self.spec = SpecStats()  # drafted and accepted tokens, every request (/metrics)
        generator.release()  # the pipeline's rows' blocks: the engine's from now on
        self._thread = threading.Thread(target=self._loop, name="mslite-llm-engine", daemon=True)
        self._thread.start()

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the pool (prefix caching), vLLM's prefix_cache_queries."""
        return self.pool.queries

    @property
    def prefix_hits(self) -> int:
        """Of them, found in blocks some request computed (not prefilled again)."""
        return self.pool.hits

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

    def blocks(self) -> Tuple[int, int]:
        """(free blocks, blocks a sequence may have): the pool as /health and /metrics say it."""
        return self.pool.num_free, self.pool.capacity

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
                with self.runner.request():  # one hold of the runner for the step's bookkeeping and its call
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
        """Waiting requests onto free rows, oldest first (under the lock), each while the pool has the free blocks
        its first piece needs (or nothing runs: then it goes in and takes what it finds); blocks are taken as it goes
        in. The first that does not fit waits at the head: first come, first served."""
        admit = []
        free_blocks = self.pool.num_free
        while self.waiting:
            free = [row for row in range(self.rows) if self.slots[row] is None]
            if not free:
                break
            head = self.waiting[0]
            need = self.pool.blocks_for(min(len(head.context()), self.runner.chunk_sizes[-1]))
            if need > free_blocks and any(s is not None for s in self.slots):
                break
            free_blocks -= need
            request = self.waiting.popleft()
            self.slots[free[0]] = request  # taken now; _start fills it in
            admit.append((free[0], request))
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
        request.slot, request.order = row, self._clock
        if request.started is None:
            request.started = time.monotonic()
        if request.seq is None:
            request.seq = SequenceBlocks(self.pool)
        self.peak_busy = max(self.peak_busy, sum(s is not None for s in self.slots))

    def _begin(self, request: SlotRequest) -> None:
        """Its prompt (or, after a preemption, its prompt and what it had generated) starts going in: the longest
        prefix found in the pool's blocks is shared (prefix caching), the rest is prefilled."""
        context = request.context()
        if request.prompt_logprobs is None and self.prefix_reuse:  # echo: every position scored, from 0
            found = request.seq.adopt(context, most=(len(context) - 1) // self.pool.block_size)
        else:
            found = 0
        if not request.recomputing:  # what a client asked (vLLM's counters: a recompute is not a query)
            self.pool.queries += len(request.prompt)
            self.pool.hits += found
            request.cached = found
        request.prefilled, request.begun = found, True

    def _expire(self) -> None:
        now = time.monotonic()
        for row, request in enumerate(self.slots):
            if request is not None and request.cancelled:
                self._end(row, request, reason="cancelled")
            elif request is not None and request.deadline is not None and now > request.deadline:
                self._end(row, request, error="the request ran past the server's --request_timeout", code="timeout")

    # --- blocks ------------------------------------------------------------------------------------
    def _ensure(self, request: SlotRequest, length: int) -> bool:
        """Blocks for positions [0, length) of `request`'s sequence, preempting younger requests while too few are
        free; False when even that does not make room (then it is the youngest: the caller preempts it)."""
        while not request.seq.fits(length):
            victims = [r for r in self.slots if r is not None and r is not request and r.order > request.order
                       and r.seq is not None and r.seq.blocks and r.prompt_logprobs is None]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.order))
        request.seq.reserve(length)
        return True

    def _preempt(self, request: SlotRequest) -> None:
        """Its blocks go back to the pool (kept findable: its recompute will likely find them) and it waits again,
        first in the queue, to be recomputed (module doc)."""
        self.preemptions += 1
        request.preempted += 1
        request.seq.release(commit=self.prefix_reuse)
        request.prefilled, request.begun = 0, False
        request.recomputing = bool(request.generated)
        self.slots[request.slot] = None
        request.slot = None
        with self._cond:
            self.waiting.appendleft(request)

    # --- a step ------------------------------------------------------------------------------------
    def _run_step(self) -> None:
        """One engine step: the decode step of the rows that have a token to feed and, while a prompt is being
        prefilled, the next piece of the oldest such one in the same call (the chunk graph: the weights are read once
        for both); every other row is idle (module doc)."""
        for request in sorted((r for r in self.slots if r is not None and r.decoding), key=lambda r: r.order):
            if request.slot is not None and not self._ensure(request, len(request.seq.tokens) + 1):
                self._preempt(request)  # the youngest, and the pool too small for all: it waits for room
        prefilling = [r for r in self.slots if r is not None and not r.decoding]
        decoding = [r for r in self.slots if r is not None and r.decoding]
        if not prefilling and not decoding:
            return
        rows = self.runner.idle()
        for request in decoding:
            rows[request.slot] = StepRow(request.generated[-1], len(request.seq.tokens) + 1, request.seq.blocks)
        piece = None
        if prefilling:
            piece = min(prefilling, key=lambda r: r.order)
            if not piece.begun:
                self._begin(piece)
            context = piece.context()
            start = piece.prefilled
            every = piece.prompt_logprobs is not None  # echo's logprobs: every position, through the score graphs
            if every:
                size = self.runner.score_sizes[0] if decoding else self.runner.score_sizes[-1]
            else:
                size = self.prefill_chunk if decoding else self.runner.chunk_sizes[-1]
            tokens_in = context[start:start + size]
            if not self._ensure(piece, start + len(tokens_in)):
                piece = None  # no room for it yet: the others decode, and it goes in as they end
        if piece is not None:
            logits, last = self.runner.chunk(tokens_in, start, piece.seq.blocks, rows, every=every)
            if every:
                score_piece(piece, start, last)
                last = last[-1]
            self.pieces += 1
            piece.prefilled += len(tokens_in)
            piece.seq.tokens.extend(tokens_in)
            if self.prefix_reuse:
                piece.seq.commit()
        elif decoding:
            if len(decoding) == 1 and decoding[0].proposer is not None and self.runner.score_sizes:
                if self._speculate(decoding[0]):
                    return
            tick = time.perf_counter()
            logits = self.runner.step(rows)
            if len(decoding) == 1 and decoding[0].pacer is not None:
                decoding[0].pacer.plain(time.perf_counter() - tick)
        else:
            return
        self.steps += bool(decoding)
        for request in decoding:
            request.seq.tokens.append(request.generated[-1])
            if self.prefix_reuse and len(request.seq.tokens) % self.pool.block_size == 0:
                request.seq.commit()
        for request in decoding:
            self._advance(request, logits[request.slot])
        if piece is not None and piece.prefilled == len(piece.context()):  # in: it decodes from the next step
            if piece.recomputing:  # its tokens were chosen before it was preempted: none is chosen again
                piece.recomputing = False
            else:
                if piece.echo is not None:
                    send_echo(piece)
                if piece.max_tokens == 0:  # echo alone: the prompt (and its logprobs) is the answer
                    self._end(piece.slot, piece, reason="length")
                else:
                    self._advance(piece, last)

    def _speculate(self, request: SlotRequest) -> bool:
        """One verify round for the only decoding request (lite_runtime/engine/speculative.py): its proposer's drafts and its
        last token through the score graph, then its tokens chosen position by position as a step would choose them
        (next_token: sampling, logprobs, grammar, stops), kept while they are the drafts. A token drawn from the
        target's own distribution at each position keeps the output the target's (greedy: token-identical; sampled:
        for a draft that is a point mass, prompt lookup's, this is the speculative-sampling rule). The verify writes
        every draft's position; the blocks only rejected ones used go back to the pool. False when it did not run (no
        draft, no blocks for them, or the pacer's loss budget says a plain step): the caller steps."""
        if request.pacer is None:
            request.pacer = Pacer(self.speculative_tokens)
        pacer = request.pacer
        seq = request.prompt + request.generated
        left = request.max_tokens - len(request.generated)
        k = min(pacer.plan(request.proposer.lacking(seq), left), request.max_tokens - len(request.generated),
                self.seq_length - len(seq), self.runner.score_sizes[-1] - 1)
        if k < 1:
            return False
        tick = time.perf_counter()
        drafts, _ = request.proposer.propose(seq, k, request.settings, request.rng)
        if not drafts or not request.seq.fits(len(seq) + len(drafts)):
            return False
        request.seq.reserve(len(seq) + len(drafts))
        checking = time.perf_counter()
        _, verify = self.runner.chunk([seq[-1]] + drafts, len(seq) - 1, request.seq.blocks, self.runner.idle(),
                                      every=True)
        verified = time.perf_counter() - checking
        self.steps += 1
        kept, reason = 0, None
        for i in range(len(drafts) + 1):
            reason = next_token(request, verify[i], self.generator.tokenizer)
            if reason is not None or i == len(drafts) or request.generated[-1] != drafts[i]:
                break
            kept += 1
        # the sequence's valid tokens: the last token and the kept drafts (rejected ones lie past them, their blocks
        # given back)
        request.seq.tokens = seq + drafts[:kept]
        request.seq.truncate(len(seq) + kept)
        if self.prefix_reuse:
            request.seq.commit()
        self.spec.rounds += 1
        self.spec.drafted += len(drafts)
        self.spec.accepted += kept
        request.spec_drafted += len(drafts)
        request.spec_accepted += kept
        pacer.round(time.perf_counter() - tick, verified, len(drafts), kept)
        if reason is not None:
            self._end(request.slot, request, reason=reason)
        return True

    def _advance(self, request: SlotRequest, logits) -> None:
        reason = next_token(request, logits, self.generator.tokenizer)
        if reason is not None:
            self._end(request.slot, request, reason=reason)

    def _end(self, row: int, request: SlotRequest, reason: str = "", error: str = "", code: str = "") -> None:
        self.slots[row] = None
        if request.seq is not None:
            request.seq.release(commit=self.prefix_reuse)
        self._finish(request, reason or "error", ("error", error, code or "engine_error") if error else ("end", reason))

    def _finish(self, request: SlotRequest, reason: str, event: Tuple[Any, ...]) -> None:
        """A request ends (from a row or from the queue): counted, stamped, its last event sent."""
        with self._cond:
            self.inflight -= 1
            self.completed += 1
        request.finish_reason, request.ended = reason, time.monotonic()
        request.emit(event)
