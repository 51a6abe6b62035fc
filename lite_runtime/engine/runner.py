"""ModelRunner: a folder's graphs on one backend, the paged KV cache's pool of blocks, and the graph calls in terms of
sequences (docs/architecture.md, "The KV cache: a pool of blocks").

Both callers go through it: TextGenerator (the HF-style API: a batch prefilled together, then stepped) and
BatchEngine (the server: each request a sequence of its own, prefilled piece by piece by the chunk graph between the
decode steps of the others). The runner owns the pool (lite_runtime/engine/blocks.py BlockPool, sized at load:
lite_runtime/engine/kv_pool.py); its callers take and give back blocks, and hand each call the block table of each sequence
it touches. Three graph calls, each returning the float32 logits:

    prefill(rows, tables)                  the prefill graph of the smallest bucket that fits: rows 0..n-1
    step(rows)                             the inc graph: each graph row a (token, length, table) or None (idle)
    chunk(tokens, start, table, rows)      the chunk graph: a step as `step`, and one sequence's tokens at
                                           [start, start + len)
    chunk(..., every=True)                 the score graph: the same, the logits after every token of the piece

A row's token goes to position length - 1 of its sequence (slot: the block its table lists for it, and the position
in that block); an idle row writes nowhere (slot -1) and reads the null block. The graphs never see the pool's size.

Graphs are checked against the manifest on first use and compiled at load or while idle (warm_up_keys). One
re-entrant lock serialises the calls; `request()` holds it for a caller's whole sequence of calls (generate) and
counts it, so the idle warm-up never starts a compile while a request waits. No timing is kept here: callers
measure their own calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.backends import check_inputs, load_backend, resolve_backend
from lite_runtime.engine.blocks import NULL_BLOCK, BlockPool, PoolExhausted, SequenceBlocks  # noqa: F401
from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError
from lite_runtime.folder import graph_key, graph_role, graph_rows, graph_tokens
from lite_runtime.inputs import InputOfInfer

log = logging.getLogger(__name__)

IDLE_SECONDS = 0.2  # how long no request must have run before the idle warm-up compiles a graph
# prefill goes in pieces through the chunk graphs for one prompt, or where its prompts fill at most this share of the
# prefill graph's rows x bucket (SmolLM2 bfloat16, a batch-16 folder, 32-300-token prompts on the Zen 5: pieces 1.4-6.4x
# faster at a quarter or less, 0.68-0.96x at a half or more; one prompt on a batch-1 folder 0.99-1.96x, bf16, int8
# and int4; docs/performance-log.md 60)
PIECES_FILL = 1 / 3


def warm_up_keys(setting: str, backend: str, keys: List[str], pieces: bool = False) -> List[str]:
    """The graphs to run once at load, of `keys` (prefill graphs, `inc`, the chunk graph), for a warm_up setting.

    "auto" is "all" on mslite: GE compiles a graph for minutes on its first run, which must never
    happen inside a request (and GE's compile cache makes the next load fast). On ms it is
    "smallest": the inc graphs, one of which every step needs, and the smallest prefill graph, which
    short prompts need, or with `pieces` (a prompt alone goes in pieces: ModelRunner.prefill) the largest chunk
    graph, which takes them. Longer buckets compile in seconds on the first prompt that needs them, so a
    server that only sees short prompts never pays their compile time nor their activations' memory.
    """
    if setting == "auto":
        setting = "all" if backend == "mslite" else "smallest"
    if setting == "all":
        return list(keys)
    if setting == "smallest":
        prefills = sorted((k for k in keys if graph_role(k) == "prefill"), key=graph_tokens)
        chunks = sorted((k for k in keys if graph_role(k) == "chunk"), key=graph_tokens)
        first = chunks[-1:] if pieces and chunks else prefills[:1]
        return first + [k for k in keys if graph_role(k) == "inc"]  # every step runs one of them
    return []


class StepRow(NamedTuple):
    """A graph row's part of a step: its sequence's newest `token`, at position `length` - 1, in `table`'s blocks."""

    token: int
    length: int
    table: Sequence[int]


class ModelRunner:
    def __init__(self, config: InferConfig) -> None:
        from lite_runtime.engine.kv_pool import plan_pool

        self.backend_name = resolve_backend(config.backend, config.target)
        self.inputs = InputOfInfer.get(config.model_name)
        if config.folder is None:
            raise InferError(f"{config.prefill_model_path}: graph files without their model folder cannot run: the "
                             "paged KV cache's block size and layout are the folder's (its yaml's infer.kv_cache); "
                             "load the folder (pipeline(model=<folder>), run_infer_main.py --model_dir)")
        self.cache = spec = config.folder.kv_cache
        if config.kv_cache_dtype is not None and spec.dtype != config.kv_cache_dtype:  # (check's float32 caches)
            if self.backend_name != "ms" or not config.folder.infer.get("cpu_kernels"):
                raise InferError(f"{config.folder.yaml_path}: kv_cache_dtype {config.kv_cache_dtype} runs only on the "
                                 "ms backend, for a folder whose graphs use the CPU kernels")
            self.cache = spec = dataclasses.replace(spec, dtype=config.kv_cache_dtype)
        self.batch_size, self.seq_length = int(config.batch_size), int(config.infer_seq_length)
        # the pool: the deployer's size, else from free memory (lite_runtime/engine/kv_pool.py); the backend allocates it
        self.pool_plan = plan_pool(spec, self.seq_length, self.batch_size, config.folder.path, config.num_blocks,
                                   config.kv_cache_memory, _free_after_weights(config))
        # chunk graphs: the engine's (the server, pipeline().generate of several prompts); by default loaded on ms,
        # which compiles a graph on first use, and not on mslite, where GE compiles every loaded graph for minutes
        chunk = config.chunk_graphs if config.chunk_graphs is not None else self.backend_name == "ms"
        config = dataclasses.replace(config, num_blocks=self.pool_plan.num_blocks, kv_cache_memory=None,
                                     chunk_graphs=bool(chunk))
        self.backend = load_backend(self.backend_name, config)
        self.config = config = getattr(self.backend, "config", config)  # the rank resolved; the caller's untouched
        self.pool = BlockPool(self.pool_plan.num_blocks, spec.block_size, _identity(config.folder))
        self.block_size, self.max_blocks = spec.block_size, spec.max_blocks
        self.pad = int(config.pad_token_id or 0)  # what padding positions and idle rows are given
        paths = config.graph_paths()
        # prompt-length buckets: a batch prefills on the smallest full graph its longest prompt fits
        self.prefill_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "prefill")
        self.chunk_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "chunk")
        self.score_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "score")
        # the inc graphs by rows: a step runs the one of the fewest rows that holds its live sequences
        self.step_graphs = {graph_rows(k, self.batch_size): k for k in paths if graph_role(k) == "inc"}
        self.step_sizes = sorted(self.step_graphs)
        # step rows of the chunk and score graphs that have fewer than batch_size (a score graph's one)
        self.piece_rows = {k: config.folder.graphs[k].rows for k in paths
                           if graph_role(k) in ("chunk", "score") and config.folder.graphs[k].rows is not None}
        self.cycle_step_graphs = False  # check: each step through the next graph that holds its rows (every one proved)
        # few prompts for the prefill graph's rows go in as pieces through the chunk graphs (prefill; check turns it
        # off: each graph is proved by a replay of its own)
        self.prefill_in_pieces = True
        self._cycle = 0
        self.step_counts: Dict[str, int] = {}  # steps run by each inc graph (check reports them)
        self._checked = set()  # graphs whose engine specs were checked (and compiled, or about to be)
        self._inputs_checked = set()  # graphs whose first inputs were checked against their specs
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._requests = 0  # callers under way or waiting (the idle warm-up gives way to them)
        self._last_request = time.monotonic()
        self._warm_up()

    # --- loading ----------------------------------------------------------------------------------
    def _check_engine_specs(self, key: str) -> None:
        """What the engine reports against the manifest (checked against the yaml when the folder was read), when
        each graph is first used: loading reads no graph that no request needs."""
        folder = self.config.folder
        got = tuple(self.backend.input_specs(key))
        if got != folder.graphs[key].inputs:
            raise InferError(f"{folder.graphs[key].path}: the graph's inputs "
                             f"{[(s.name, s.dtype, list(s.shape)) for s in got]} disagree with manifest.json "
                             f"{[(s.name, s.dtype, list(s.shape)) for s in folder.graphs[key].inputs]}; re-export")

    def _warm_up(self) -> None:
        """Compile graphs so a request does not pay for it (warm_up_keys): at load, or while idle (`auto` on ms)."""
        keys = warm_up_keys(self.config.warm_up, self.backend_name, list(self.config.graph_paths()),
                            pieces=self._pieces_here())
        if self.config.warm_up == "auto" and hasattr(self.backend, "prepare"):
            # inc first: every request needs it, and a short prompt's prefill compiles as fast as it would wait
            order = [k for k in keys if graph_role(k) == "inc"] + [k for k in keys if graph_role(k) != "inc"]
            threading.Thread(target=self._warm_up_when_idle, args=(order,), name="mslite-llm-warm-up").start()
            return
        if not keys:  # "none": the caller warms what it needs (the server: lite_runtime/serve/cli.py), and says so
            return
        start = time.perf_counter()
        for key in keys:
            self.warm(key)
        log.info("%s backend: %d graph(s) warmed up in %.2f s", self.backend_name, len(keys),
                 time.perf_counter() - start)

    def use_cache_dtype(self, dtype: Optional[str]) -> None:
        """Run on KV caches of `dtype` from now on ("float32", or None: the folder's own; InferConfig.kv_cache_dtype),
        the weights kept: the ms backend rebuilds its graphs, the pool forgets what its blocks held. Only while no
        sequence holds a block (check switches between its replays)."""
        if dtype is not None and dtype != "float32":
            raise InferError(f"kv_cache_dtype {dtype!r}: only float32 (or None, the folder's) is known")
        if not hasattr(self.backend, "use_cache_dtype") or not self.config.folder.infer.get("cpu_kernels"):
            raise InferError(f"{self.config.folder.yaml_path}: the KV cache's dtype can be changed only on the ms "
                             "backend, for a folder whose graphs use the CPU kernels")
        with self._lock:
            self.pool.forget_contents()
            self.backend.use_cache_dtype(dtype)
            self._checked.clear()
            spec = self.config.folder.kv_cache
            self.cache = dataclasses.replace(spec, dtype=dtype) if dtype is not None else spec

    def warm(self, key: str) -> None:
        """Compile graph `key` now (the server does this for what every request needs, before it listens)."""
        with self._lock:
            self._check_engine_specs(key)
            self._checked.add(key)
            if hasattr(self.backend, "prepare"):  # compiles without running: the KV cache is untouched
                self.backend.prepare(key)
            else:  # mslite: GE compiles on the first run: idle rows, which write nowhere and read the null block
                self.backend.run(key, self._warm_inputs(key))

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

    # --- block tables and slots -------------------------------------------------------------------------
    def tables(self, tables: Sequence[Optional[Sequence[int]]]) -> np.ndarray:
        """[rows, M] int32: each sequence's blocks in order, the rest the null block (None: an idle row)."""
        out = np.full((len(tables), self.max_blocks), NULL_BLOCK, np.int32)
        for i, table in enumerate(tables):
            if table:
                if len(table) > self.max_blocks:
                    raise InferError(f"a block table of {len(table)} blocks is longer than the folder's "
                                     f"{self.max_blocks} ({self.seq_length} tokens in blocks of {self.block_size})")
                out[i, :len(table)] = table
        return out

    def slots(self, table: Sequence[int], start: int, count: int) -> List[int]:
        """Where positions [start, start + count) of a sequence with blocks `table` go; InferError when the table does
        not reach that far (a caller's bug: blocks are taken before the call that writes them)."""
        bs = self.block_size
        if count and (start + count - 1) // bs >= len(table):
            raise InferError(f"positions up to {start + count - 1} need {(start + count - 1) // bs + 1} blocks; the "
                             f"sequence has {len(table)}")
        return [int(table[p // bs]) * bs + p % bs for p in range(start, start + count)]

    def _warm_inputs(self, key: str) -> Dict[str, np.ndarray]:
        """A call in which every row is idle (its writes skipped, its reads the null block)."""
        arrays = {}
        for spec in self.backend.input_specs(key):
            if spec.name.endswith("slot_mapping"):
                arrays[spec.name] = np.full(spec.shape, -1, spec.dtype)
            elif spec.name.endswith(("block_tables", "block_table", "start")):
                arrays[spec.name] = np.zeros(spec.shape, spec.dtype)
            else:
                arrays[spec.name] = np.ones(spec.shape, spec.dtype)
        return arrays

    def _step_arrays(self, rows: Sequence[Optional[StepRow]], graph_rows_: Optional[int] = None
                     ) -> Tuple[List[int], List[int], np.ndarray, List[int]]:
        """tokens, lengths, tables, slots of a step's graph rows (B of them, or `graph_rows_`; an idle row: pad,
        length 1, nowhere)."""
        want = self.batch_size if graph_rows_ is None else graph_rows_
        if len(rows) != want:
            raise InferError(f"a step has {len(rows)} rows; the graph takes {want}")
        tokens, lengths, slots = [], [], []
        for row in rows:
            if row is None:
                tokens.append(self.pad), lengths.append(1), slots.append(-1)
            else:
                if not 1 <= row.length <= self.seq_length:
                    raise InferError(f"a step at position {row.length - 1} is outside the graphs' {self.seq_length}")
                tokens.append(int(row.token)), lengths.append(int(row.length))
                slots += self.slots(row.table, row.length - 1, 1)
        return tokens, lengths, self.tables([None if r is None else r.table for r in rows]), slots

    # --- graph calls --------------------------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """Rows 0..n-1 prefilled with `rows`, each into its blocks `tables[i]` from position 0 (the other rows idle):
        float32 logits [n, V].

        For one prompt, or prompts that fill at most a third of the prefill graph's rows x its bucket (`PIECES_FILL`),
        where the chunk graphs are loaded, on a folder of our CPU kernels, each prompt goes in as pieces through them
        (`prefill_in_pieces`): a prefill graph computes every one of its rows' positions in parts of each layer (norms,
        MindSpore's elementwise ops, zeroing the padding), so one 128-token prompt on a batch-16 folder cost 4.8x its
        pieces (docs/performance-log.md 60). The same arithmetic as the server's prompts; check proves both."""
        tokens = self.prefill_size(max(len(r) for r in rows))
        if self._pieces_pay(rows, tokens):
            return self._prefill_in_pieces(rows, tables)
        full = [list(r) for r in rows] + [[self.pad]] * (self.batch_size - len(rows))
        slots = np.full((self.batch_size, tokens), -1, np.int32)
        for i, (row, table) in enumerate(zip(rows, tables)):
            slots[i, :len(row)] = self.slots(table, 0, len(row))
        arrays = self.inputs.prefill(full, tokens, self.pad, self.tables(list(tables) + [None] * (
            self.batch_size - len(rows))), slots.reshape(-1))
        with self.request():
            logits = self._run(graph_key("prefill", tokens), arrays)
        return logits[:len(rows)]

    def _pieces_here(self) -> bool:
        """Whether prefill may go in pieces here (prefill): on, chunk graphs loaded, a folder of our CPU kernels."""
        return self.prefill_in_pieces and bool(self.chunk_sizes) and bool(self.config.folder.infer.get("cpu_kernels"))

    def _pieces_pay(self, rows: Sequence[Sequence[int]], bucket: int) -> bool:
        return (self._pieces_here() and all(len(r) for r in rows)
                and (len(rows) == 1 or sum(len(r) for r in rows) <= PIECES_FILL * self.batch_size * bucket))

    def _prefill_in_pieces(self, rows: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> np.ndarray:
        """prefill's logits, each prompt in pieces of the largest chunk graph (the last one in the smallest that holds
        it), every step row idle."""
        big = self.chunk_sizes[-1]
        out = []
        with self.request():
            for row, table in zip(rows, tables):
                for start in range(0, len(row), big):
                    _, last = self.chunk(list(row[start:start + big]), start, table, self.idle())
                out.append(np.array(last, copy=True))
        return np.stack(out)

    def step(self, rows: Sequence[Optional[StepRow]]) -> np.ndarray:
        """One decode step: each graph row's token at position length - 1 of its sequence. float32 logits [B, V]
        (an idle row's are zeros).

        The live rows run packed, in the inc graph of the fewest rows that holds them (the folder's --step_rows
        graphs, and the batch_size one): the kernels compute only those rows (docs/architecture.md, "Step graphs of
        fewer rows"). A row is not tied to memory (its sequence's blocks are in its table), so any row can run in
        any graph row. With `cycle_step_graphs` (check) each step takes the next inc graph in turn, in as many
        calls as its rows need, so every one of them is proved on every replay."""
        if len(rows) != self.batch_size:
            raise InferError(f"a step has {len(rows)} rows; the graphs take {self.batch_size}")
        live = [i for i, r in enumerate(rows) if r is not None]
        if self.cycle_step_graphs:
            n = self.step_sizes[self._cycle % len(self.step_sizes)]
            self._cycle += 1
        else:
            n = next(k for k in self.step_sizes if k >= len(live))
        if n == self.batch_size:  # the full graph takes the rows where they are
            return self._step_call(self.step_graphs[n], rows)
        out = None
        for j in range(0, max(len(live), 1), n):
            part = live[j:j + n]
            logits = self._step_call(self.step_graphs[n], [rows[i] for i in part] + [None] * (n - len(part)))
            if out is None:
                out = np.zeros((self.batch_size,) + logits.shape[1:], logits.dtype)
            out[part] = logits[:len(part)]
        return out

    def _step_call(self, key: str, rows: Sequence[Optional[StepRow]]) -> np.ndarray:
        tokens, lengths, tables, slots = self._step_arrays(rows, graph_rows(key, self.batch_size))
        with self.request():
            logits = self._run(key, self.inputs.increment(tokens, lengths, tables, slots))
        self.step_counts[key] = self.step_counts.get(key, 0) + 1
        return logits

    def chunk(self, tokens: Sequence[int], start: int, table: Sequence[int], rows: Sequence[Optional[StepRow]],
              every: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """A decode step of the graph rows (as `step`) and `tokens` of one more sequence (blocks `table`) at positions
        [start, start + len), in one call of the smallest chunk graph that holds them; positions before `start` must
        be in its blocks already. Returns the step's float32 logits [B, V] and the piece's last token's [V]; with
        `every`, through the smallest score graph, the logits after each of the piece's tokens [len, V] instead (a
        view of the graph's output: copy what outlives the next call).

        A graph of fewer step rows than B (a score graph's one, export/writers/graphs.py SCORE_STEP_ROWS) takes the live rows
        packed when they fit; when they do not, they step first (`step`) and the piece goes in alone: two calls, the
        same logits (docs/architecture.md, "Score graphs of one step row")."""
        role = "score" if every else "chunk"
        sizes = self.score_sizes if every else self.chunk_sizes
        if not sizes:
            raise InferError(self.missing(role))
        size = next((n for n in sizes if n >= len(tokens)), None)
        if not tokens or size is None or not 0 <= start <= self.seq_length - len(tokens):
            raise InferError(f"a piece of {len(tokens)} tokens at position {start} does not fit the {role} graphs "
                             f"({', '.join(map(str, sizes))} tokens) in sequences of {self.seq_length}")
        if len(rows) != self.batch_size:
            raise InferError(f"a step has {len(rows)} rows; the graphs take {self.batch_size}")
        key = graph_key(role, size)
        b = self.piece_rows.get(key, self.batch_size)
        live = [i for i, r in enumerate(rows) if r is not None]
        if len(live) > b:  # more rows decode than the graph steps: they step, then the piece goes in alone
            with self.request():
                step_logits = self.step(rows)
                return step_logits, self.chunk(tokens, start, table, self.idle(), every)[1]
        # the live rows last, against the piece: the layer kernels leave out idle rows at either end of the rows they
        # compute (cpu_kernels/decode_ops.cc decode_layer), so a verify's idle step row, or the idle rows of a chunk
        # call of fewer sequences than the graph's rows, cost nothing
        packed = [None] * (b - len(live)) + [rows[i] for i in live]
        step_tokens, lengths, tables, slots = self._step_arrays(packed, b)
        piece_slots = self.slots(table, start, len(tokens)) + [-1] * (size - len(tokens))
        arrays = self.inputs.chunk(step_tokens, lengths, tables, slots, tokens, size, start, self.tables([table]),
                                   piece_slots, self.pad)
        with self.request():
            logits = self._run(key, arrays)
        # the live rows back where the caller has them; an idle row's logits are zeros, as step's
        step_logits = np.zeros((self.batch_size,) + logits.shape[1:], logits.dtype)
        step_logits[live] = logits[b - len(live):b]
        return step_logits, (logits[b:b + len(tokens)] if every else logits[b])

    def idle(self) -> List[Optional[StepRow]]:
        """A step in which every row is idle (a piece alone: `chunk(..., runner.idle())`)."""
        return [None] * self.batch_size

    def missing(self, role: str) -> str:
        """Why a folder has no graph of `role` loaded, and what to do."""
        what = {"chunk": "which serving needs", "score": "which speculative decoding, prompt logprobs (echo) and "
                "perplexity need"}[role]
        if role == "chunk" and not self.config.chunk_graphs:
            return "the chunk graphs were not loaded: pass chunk_graphs=True to pipeline() (off by default on mslite)"
        if role == "score" and not self.config.score_graphs:
            return "the score graphs were not loaded: pass score_graphs=True to pipeline()"
        return (f"{self.config.prefill_model_path}: this folder has no {role} graph (exported before them, or with "
                f"--{role}_sizes none), {what}; re-export it with python -m export")


def _identity(folder) -> bytes:
    """The folder's identity, which salts every block hash (lite_runtime/engine/blocks.py): the manifest's bytes (every file's
    sha256), so blocks are shared only between sequences of the very same folder."""
    import os

    try:
        with open(os.path.join(folder.path, "manifest.json"), "rb") as fh:
            return hashlib.sha256(fh.read()).digest()
    except OSError:
        return hashlib.sha256(folder.path.encode()).digest()


def _free_after_weights(config) -> Optional[int]:
    """Memory free for the KV pool (lite_runtime/engine/kv_pool.py): on Atlas (the mslite backend) the device's, less this
    rank's weights (pyACL); on the CPU what is available, less what the ms backend still needs for the weights (a
    float16 folder's float32 copies; the CPU kernels' weights copied into huge pages; mapped weights are page cache).
    None where unknown, and for a tensor-parallel folder: every rank must run the very same pool (the same block
    tables on every rank), which free memory measured per process would not give; its default is then fixed
    (--num_blocks sizes it)."""
    from lite_runtime.backends import mslite_importable
    from lite_runtime.memory import available_bytes, ms_backend_needs, weights_copy_bytes

    if config.folder.tp_size > 1:
        return None
    if config.target == "Ascend" and config.backend != "ms" and mslite_importable():
        from lite_runtime.backends.mslite import pool_free_bytes

        return pool_free_bytes(config)
    from lite_runtime.memory import refuse_if_too_big

    refuse_if_too_big(config.folder)  # the weights first: a folder that cannot load is told so, not about its pool
    have = available_bytes()
    if have is None:
        return None
    return max(0, have - ms_backend_needs(config.folder, 0) - weights_copy_bytes(config.folder, 0))
