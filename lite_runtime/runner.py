"""ModelRunner: a folder's graphs on one backend, and what each row of the KV cache holds.

Both callers go through it: TextGenerator (the HF-style API: a batch prefilled together, then stepped) and
BatchEngine (the server: each request in its own row, prefilled piece by piece by the chunk graph between the
decode steps of the others). Three graph calls, each returning the float32 logits and recording what it wrote:

    prefill(rows)                   the prefill graph of the smallest bucket that fits: rows 0..n-1 (padding rows after)
    step(tokens, lengths)           the inc graph: row i's token at position lengths[i] - 1
    chunk(slot, tokens, start, ...) the chunk graph: a step as `step`, and one row's tokens at [start, start + len)
    chunk(..., every=True)          the score graph: the same, returning the logits after every token of the piece

`held[row]` is the list of tokens whose keys and values sit at positions [0, len) of that row, or None when unknown.
Every call keeps it true (a write at position p keeps what lies before p), so the generator reuses the cache when a
request extends its rows by one token, and the engine reuses a row's prefix for a prompt that begins with it (the
next turn of a chat) whatever ran in between. A failed call leaves the rows it may have written unknown.

Graphs are checked against the manifest on first use and compiled at load or while idle (warm_up_keys). One
re-entrant lock serialises the calls; `request()` holds it for a caller's whole sequence of calls (generate) and
counts it, so the idle warm-up never starts a compile while a request waits. No timing is kept here: callers
measure their own calls.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.backends import check_inputs, load_backend, resolve_backend
from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError
from lite_runtime.folder import graph_key, graph_role, graph_tokens
from lite_runtime.inputs import InputOfInfer

log = logging.getLogger(__name__)

IDLE_SECONDS = 0.2  # how long no request must have run before the idle warm-up compiles a graph


def warm_up_keys(setting: str, backend: str, keys: List[str]) -> List[str]:
    """The graphs to run once at load, of `keys` (prefill graphs, `inc`, the chunk graph), for a warm_up setting.

    "auto" is "all" on mslite: GE compiles a graph for minutes on its first run, which must never
    happen inside a request (and GE's compile cache makes the next load fast). On ms it is
    "smallest": the inc graph, which every request needs, and the smallest prefill graph, which
    short prompts need. Longer buckets compile in seconds on the first prompt that needs them, so a
    server that only sees short prompts never pays their compile time nor their activations' memory.
    """
    if setting == "auto":
        setting = "all" if backend == "mslite" else "smallest"
    if setting == "all":
        return list(keys)
    if setting == "smallest":
        prefills = sorted((k for k in keys if graph_role(k) == "prefill"), key=graph_tokens)
        return prefills[:1] + ["inc"]
    return []


class ModelRunner:
    def __init__(self, config: InferConfig) -> None:
        self.backend_name = resolve_backend(config.backend, config.target)
        self.inputs = InputOfInfer.get(config.model_name)
        self.backend = load_backend(self.backend_name, config)
        self.config = config = getattr(self.backend, "config", config)  # the rank resolved; the caller's untouched
        self.batch_size, self.seq_length = int(config.batch_size), int(config.infer_seq_length)
        self.pad = int(config.pad_token_id or 0)  # what padding positions and free rows are given
        paths = config.graph_paths()
        # prompt-length buckets: a batch prefills on the smallest full graph its longest prompt fits
        self.prefill_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "prefill")
        self.chunk_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "chunk")
        self.score_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "score")
        self.held: List[Optional[List[int]]] = [None] * self.batch_size
        self._checked = set()  # graphs whose engine specs were checked (and compiled, or about to be)
        self._inputs_checked = set()  # graphs whose first inputs were checked against their specs
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._requests = 0  # callers under way or waiting (the idle warm-up gives way to them)
        self._last_request = time.monotonic()
        self._check_graph_specs()
        self._warm_up()

    # --- loading ----------------------------------------------------------------------------------
    def _check_graph_specs(self) -> None:
        """Graphs loaded without a folder: their shapes against the config, from the engine, before any call.

        A folder's manifest was checked against its yaml when it was read; what the engine reports is
        checked against the manifest when each graph is first used (_check_engine_specs), so loading
        reads no graph that no request needs.
        """
        if self.config.folder is not None:
            return
        for key, path in self.config.graph_paths().items():
            got = tuple(self.backend.input_specs(key))
            ids = next((s for s in got if s.name == "input_ids"), None)
            want = (self.batch_size, graph_tokens(key))
            if ids is None or tuple(ids.shape) != want:
                raise InferError(f"{path}: input_ids shape {list(ids.shape) if ids else None} does not match "
                                 f"batch_size {self.batch_size} and seq_length {self.seq_length}")

    def _check_engine_specs(self, key: str) -> None:
        folder = self.config.folder
        if folder is None:
            return
        got = tuple(self.backend.input_specs(key))
        if got != folder.graphs[key].inputs:
            raise InferError(f"{folder.graphs[key].path}: the graph's inputs "
                             f"{[(s.name, s.dtype, list(s.shape)) for s in got]} disagree with manifest.json "
                             f"{[(s.name, s.dtype, list(s.shape)) for s in folder.graphs[key].inputs]}; re-export")

    def _warm_up(self) -> None:
        """Compile graphs so a request does not pay for it (warm_up_keys): at load, or while idle (`auto` on ms)."""
        keys = warm_up_keys(self.config.warm_up, self.backend_name, list(self.config.graph_paths()))
        if self.config.warm_up == "auto" and hasattr(self.backend, "prepare"):
            # inc first: every request needs it, and a short prompt's prefill compiles as fast as it would wait
            order = [k for k in keys if k == "inc"] + [k for k in keys if k != "inc"]
            threading.Thread(target=self._warm_up_when_idle, args=(order,), name="mslite-llm-warm-up").start()
            return
        if not keys:  # "none": the caller warms what it needs (the server: lite_runtime/serve/cli.py), and says so
            return
        start = time.perf_counter()
        for key in keys:
            self.warm(key)
        log.info("%s backend: %d graph(s) warmed up in %.2f s", self.backend_name, len(keys),
                 time.perf_counter() - start)

    def warm(self, key: str) -> None:
        """Compile graph `key` now (the server does this for what every request needs, before it listens)."""
        with self._lock:
            self._check_engine_specs(key)
            self._checked.add(key)
            if hasattr(self.backend, "prepare"):  # compiles without running: the KV cache is untouched
                self.backend.prepare(key)
            else:  # mslite: GE compiles on the first run, which writes the cache
                self.held = [None] * self.batch_size
                self.backend.run(key, {s.name: np.ones(s.shape, s.dtype) for s in self.backend.input_specs(key)})

    def _warm_up_when_idle(self, keys: List[str]) -> None:
        """Compile `keys` one at a time, each only once no request has run for IDLE_SECONDS.

        A request that arrives during a compile waits for that one graph (under a second for the 0.5B
        shape). The thread is not a daemon (a compile must not be cut off at interpreter exit); it
        stops as soon as the main thread has ended.
        """
        main = threading.main_thread()
        for key in keys:
            while True:
                if not main.is_alive():
                    return
                idle = self._requests == 0 and time.monotonic() - self._last_request >= IDLE_SECONDS
                if idle and self._lock.acquire(timeout=0.05):
                    break
                time.sleep(0.05)
            try:
                if self._requests == 0 and key not in self._checked:
                    start = time.perf_counter()
                    self.warm(key)
                    log.info("%s backend: %s compiled while idle in %.2f s", self.backend_name, key,
                             time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001  (the request that needs the graph reports it properly)
                log.warning("warming up %s while idle failed: %s", key, exc)
                return
            finally:
                self._lock.release()

    @contextlib.contextmanager
    def request(self):
        """The lock, for a caller's sequence of calls: counted, so the idle warm-up does not start a compile while
        one waits."""
        with self._count_lock:
            self._requests += 1
        try:
            with self._lock:
                yield
        finally:
            with self._count_lock:
                self._requests -= 1
                self._last_request = time.monotonic()

    # --- graph calls ------------------------------------------------------------------------------
    def _run(self, key: str, arrays: Dict[str, np.ndarray]) -> np.ndarray:
        if key not in self._checked:
            self._check_engine_specs(key)
        if key not in self._inputs_checked:
            check_inputs(key, arrays, self.backend.input_specs(key))
            self._inputs_checked.add(key)
        self._checked.add(key)
        return self.backend.run(key, arrays)

    def prefill_size(self, longest: int) -> int:
        """The smallest prefill graph that holds a prompt of `longest` tokens."""
        if not self.prefill_sizes:
            raise InferError("the prefill graphs were not loaded (prefill_graphs=False: the server's set); load the "
                             "folder with pipeline() to generate outside the server")
        return next(n for n in self.prefill_sizes if n >= longest)

    def prefill(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Rows 0..n-1 prefilled with `rows` (every other row gets one padding token): float32 logits [n, V]."""
        full = [list(r) for r in rows] + [[self.pad]] * (self.batch_size - len(rows))
        tokens = self.prefill_size(max(len(r) for r in rows))
        with self.request():
            self.held = [None] * self.batch_size  # the graph writes every row: unknown until it has run
            logits = self._run(graph_key("prefill", tokens), self.inputs.prefill(full, tokens, self.pad))
            self.held = full
        return logits[:len(rows)]

    def step(self, tokens: Sequence[int], lengths: Sequence[int],
             record: Optional[Sequence[bool]] = None) -> np.ndarray:
        """One decode step of every row: tokens[i] at position lengths[i] - 1 of row i. float32 logits [B, V].

        `record[i]` False: row i's write is scratch (a free row must take part in the step): its held prefix keeps
        what lies before the write and is not extended by it."""
        with self.request():
            before, self.held = self.held, [None] * self.batch_size
            logits = self._run("inc", self.inputs.increment(tokens, lengths))
            self.held = self._stepped(before, tokens, lengths, record)
        return logits

    def chunk(self, slot: int, tokens: Sequence[int], start: int, step_tokens: Sequence[int],
              step_lengths: Sequence[int], record: Sequence[bool],
              every: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """A decode step of every row (as `step`; row `slot`'s part must be scratch) and `tokens` into row `slot` at
        positions [start, start + len), in one call of the smallest chunk graph that holds them; positions before
        `start` must hold the prompt's first tokens. Returns the step's float32 logits [B, V] and the piece's last
        token's [V]; with `every`, through the smallest score graph, the logits after each of the piece's tokens
        [len, V] instead (a view of the graph's output: copy what outlives the next call)."""
        role = "score" if every else "chunk"
        sizes = self.score_sizes if every else self.chunk_sizes
        if not sizes:
            raise InferError(self.missing(role))
        size = next((n for n in sizes if n >= len(tokens)), None)
        if not tokens or size is None or not 0 <= start <= self.seq_length - len(tokens):
            raise InferError(f"a piece of {len(tokens)} tokens at position {start} does not fit the {role} graphs "
                             f"({', '.join(map(str, sizes))} tokens) in rows of {self.seq_length}")
        if record[slot]:
            raise InferError(f"row {slot} takes a piece and a step token in one call; its step part must be scratch")
        arrays = self.inputs.chunk(step_tokens, step_lengths, tokens, size, start, slot, self.pad)
        with self.request():
            before, self.held = self.held, [None] * self.batch_size
            logits = self._run(graph_key(role, size), arrays)
            held = self._stepped(before, step_tokens, step_lengths, record)  # the step's writes come first
            held[slot] = _written(held[slot], start, list(tokens), True)
            self.held = held
        b = self.batch_size
        return logits[:b], (logits[b:b + len(tokens)] if every else logits[b])

    def missing(self, role: str) -> str:
        """Why a folder has no graph of `role` loaded, and what to do."""
        what = {"chunk": "which serving needs", "score": "which speculative decoding, prompt logprobs (echo) and "
                "perplexity need"}[role]
        if role == "chunk" and not self.config.chunk_graphs:
            return "the chunk graphs were not loaded: pass chunk_graphs=True to pipeline()"
        if role == "score" and not self.config.score_graphs:
            return "the score graphs were not loaded: pass score_graphs=True to pipeline()"
        return (f"{self.config.prefill_model_path}: this folder has no {role} graph (exported before them, or with "
                f"--{role}_sizes none), {what}; re-export it with python -m export")

    def scratch_step(self) -> Tuple[List[int], List[int], List[bool]]:
        """A step in which every row writes scratch (`scratch_length`): tokens, lengths and record for `chunk`."""
        b = self.batch_size
        return [self.pad] * b, [self.scratch_length(r) for r in range(b)], [False] * b

    def _stepped(self, before, tokens, lengths, record) -> List[Optional[List[int]]]:
        return [_written(h, int(p) - 1, [int(t)], record is None or record[i])
                for i, (h, t, p) in enumerate(zip(before, tokens, lengths))]

    def scratch_length(self, row: int) -> int:
        """The valid_length that makes a step's write to `row` scratch: just past what the row holds (at its last
        position when it is full, which it then no longer holds)."""
        return min(len(self.held[row] or ()), self.seq_length - 1) + 1

    def forget(self) -> None:
        """Every row unknown (something else wrote the cache)."""
        with self._lock:
            self.held = [None] * self.batch_size


def _written(held: Optional[List[int]], start: int, tokens: List[int], record: bool) -> Optional[List[int]]:
    """What a row holds after `tokens` were written at positions [start, start + len): the prefix before them and,
    when recorded, them; None when what lies before `start` is unknown."""
    if start == 0 and record:
        return list(tokens)
    if held is None or start > len(held):
        return None
    return held[:start] + tokens if record else held[:start]
