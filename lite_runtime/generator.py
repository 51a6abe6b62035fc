"""TextGenerator: the `text_generation` task. Loads both graphs on a backend and generates token by token.

The KV cache lives in the graphs. This object records which tokens each cache row holds, so
`infer` (one step) and `generate` (a whole request) can be called in any order and any number
of times: a step that extends every cached row by one token runs the incremental graph, anything
else runs prefill. A lock serialises callers, so a streaming thread cannot interleave with another
request on the same cache.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from lite_runtime.backends import check_inputs, load_backend, resolve_backend
from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError
from lite_runtime.folder import graph_key, graph_role, graph_tokens
from lite_runtime.inputs import InputOfInfer
from lite_runtime.sampling import GenerationSettings, choose, process
from lite_runtime.tokenizer import FolderTokenizer, has_folder_tokenizer

log = logging.getLogger(__name__)

IDLE_SECONDS = 0.2  # how long no request must have run before the idle warm-up compiles a graph


@dataclass
class InferOutput:
    """One step: per row, the chosen next token, its probability under the processed scores, and the
    graph's raw float32 logits [rows, vocab_size] (before any repetition penalty or sampling warper)."""

    next_tokens: List[int]
    probs: List[float]
    logits: Optional[np.ndarray] = field(default=None, repr=False)


class GenerateOutput(list):
    """What generate returns: the rows of ids (each the prompt followed by the generated ids), as HF's generate
    returns a tensor of rows, so `out[0]`, `for row in out`, `len(out)` and `tokenizer.batch_decode(out)` work
    as they do on HF's output; `.sequences` (the rows) and the timing attributes are ours."""

    def __init__(self, sequences: List[List[int]], finish_reasons: Sequence[str] = (),
                 prompt_lengths: Sequence[int] = ()) -> None:
        super().__init__(sequences)
        self.finish_reasons: List[str] = list(finish_reasons)  # per row: "eos" or "length"
        self.prompt_lengths: List[int] = list(prompt_lengths)
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_steps = 0
        self.new_tokens = 0

    @property
    def sequences(self) -> List[List[int]]:
        return list(self)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens made by the incremental graph per second (the first token of each row comes from prefill)."""
        made = self.new_tokens - len(self)
        return made / self.decode_seconds if self.decode_seconds > 0 and made > 0 else 0.0

    def __repr__(self) -> str:
        return (f"GenerateOutput(sequences={list(self)!r}, finish_reasons={self.finish_reasons!r}, "
                f"prompt_lengths={self.prompt_lengths!r})")


def warm_up_keys(setting: str, backend: str, keys: List[str]) -> List[str]:
    """The graphs to run once at load, of `keys` (prefill graphs and `inc`), for a warm_up setting.

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
        smallest = min((k for k in keys if graph_role(k) == "prefill"), key=graph_tokens)
        return [smallest, "inc"]
    return []


class TextGenerator:
    def __init__(self, config: InferConfig, tokenizer=None) -> None:
        self.config = config
        self.backend_name = resolve_backend(config.backend, config.target)
        self.inputs = InputOfInfer.get(config.model_name)
        self.backend = load_backend(self.backend_name, config)
        self.config = config = getattr(self.backend, "config", config)  # the rank resolved; the caller's untouched
        self.batch_size, self.seq_length = int(config.batch_size), int(config.infer_seq_length)
        # prompt-length buckets: a batch prefills on the smallest full graph its longest prompt fits
        paths = config.graph_paths()
        self.prefill_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "prefill")
        # one prompt into one cache row (prefill_slot): the slot graphs, or at batch 1 the prefill graphs themselves
        self.slot_sizes = sorted(graph_tokens(k) for k in paths if graph_role(k) == "slot") or (
            self.prefill_sizes if self.batch_size == 1 else [])
        self._tokenizer = tokenizer
        self.defaults = GenerationSettings.from_generation_config(config.model_dir).updated(
            eos_token_id=config.eos_token_id or None, pad_token_id=config.pad_token_id)
        self.pad = int(self.defaults.pad_token_id or 0)  # what padding positions and free rows are given
        self._cache: Optional[List[List[int]]] = None  # tokens held by each cache row (padding rows too)
        self._cache_rows = 0  # how many of them are real rows
        self._checked = set()  # graphs whose engine specs were checked (and compiled, or about to be)
        self._inputs_checked = set()  # graphs whose first inputs were checked against their specs
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._requests = 0  # infer/generate calls under way or waiting (the idle warm-up gives way to them)
        self._last_request = time.monotonic()
        self._local = threading.local()  # last_output: per calling thread, so concurrent callers do not race
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
        start = time.perf_counter()
        for key in keys:
            self.warm(key)
        log.info("%s backend: %d graph(s) warmed up in %.2f s", self.backend_name, len(keys),
                 time.perf_counter() - start)

    def warm(self, key: str) -> None:
        """Compile graph `key` now (the server does this for what every request needs, before it listens)."""
        self._check_engine_specs(key)
        self._checked.add(key)
        if hasattr(self.backend, "prepare"):  # compiles without running: the KV cache is untouched
            self.backend.prepare(key)
        else:  # mslite: GE compiles on the first run, which writes the cache
            self.backend.run(key, {s.name: np.ones(s.shape, s.dtype) for s in self.backend.input_specs(key)})
            self._cache = None

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

    @property
    def tokenizer(self):
        """The tokenizer passed in, else the folder's tokenizer.json (lite_runtime.tokenizer), else AutoTokenizer."""
        if self._tokenizer is None:
            path = self.config.tokenizer_path or self.config.model_dir
            if not path:
                raise InferError("no tokenizer: pass tokenizer=... or tokenizer_path, or call generate with token ids")
            if has_folder_tokenizer(path):
                self._tokenizer = FolderTokenizer(path)
                return self._tokenizer
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise InferError(f"{path} has no tokenizer.json; loading its tokenizer needs transformers "
                                 "(pip install transformers), or pass tokenizer=...") from None
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    @contextlib.contextmanager
    def _request(self):
        """The lock, for a request: counted, so the idle warm-up does not start a compile while one waits."""
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
        return next(n for n in self.prefill_sizes if n >= longest)

    def _prefill(self, rows: List[List[int]]) -> np.ndarray:
        full = [list(r) for r in rows] + [[self.pad]] * (self.batch_size - len(rows))
        tokens = self.prefill_size(max(len(r) for r in rows))
        self._cache = None  # unknown until the graph call succeeds: a failed call leaves a prefill to do
        logits = self._run(graph_key("prefill", tokens), self.inputs.prefill(full, tokens, self.pad))
        self._cache, self._cache_rows = full, len(rows)
        return logits[:len(rows)]

    def _step(self, advance: Dict[int, int]) -> np.ndarray:
        """Append advance[row] to those rows; the other rows rewrite their last token (cache unchanged)."""
        rows = [row + [int(advance[i])] if i in advance else row for i, row in enumerate(self._cache)]
        self._cache = None  # as in _prefill: recorded only once the graph has run
        logits = self._run("inc", self.inputs.increment([r[-1] for r in rows], [len(r) for r in rows]))
        self._cache = rows
        return logits[:self._cache_rows]

    def _forward(self, rows: List[List[int]]) -> np.ndarray:
        """Logits after each row's last token, reusing the cache when every row extends it by one."""
        cache = self._cache
        if (cache is not None and len(rows) == self._cache_rows
                and all(len(r) == len(c) + 1 and r[:-1] == c for r, c in zip(rows, cache))):
            return self._step({i: r[-1] for i, r in enumerate(rows)})
        return self._prefill(rows)

    # --- slots: each cache row its own request (continuous batching, lite_runtime.batching) -----------------
    def slot_key(self, tokens: int) -> str:
        """The graph that prefills a prompt of `tokens` tokens into one cache row."""
        if not self.slot_sizes:
            if not self.config.slot_graphs:
                raise InferError("the slot graphs were not loaded: pass slot_graphs=True to pipeline()")
            raise InferError(f"{self.config.prefill_model_path}: this batch_size {self.batch_size} folder has no slot "
                             "graphs (exported before them); re-export it to serve requests one row at a time")
        if tokens > self.slot_sizes[-1]:
            raise InferError(f"a prompt of {tokens} tokens is longer than the graphs ({self.slot_sizes[-1]})")
        n = next(n for n in self.slot_sizes if n >= tokens)
        return graph_key("prefill" if self.batch_size == 1 else "slot", n)

    def prefill_slot(self, slot: int, row: Sequence[int]) -> np.ndarray:
        """Prefill one prompt into cache row `slot`, leaving the other rows as they are: float32 logits [V]."""
        key = self.slot_key(len(row))
        arrays = self.inputs.prefill([list(row)], graph_tokens(key), self.pad)
        if self.batch_size > 1:
            arrays = self.inputs.slot(arrays, slot)
        with self._request():
            self._cache = None  # the rows no longer hold what generate/infer recorded
            return self._run(key, arrays)[0]

    def step_slots(self, tokens: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        """One decode step of every row: tokens[i] at position lengths[i] - 1 of row i. float32 logits [B, V].
        A free row is given any token at length 1: it writes only position 0 of its own row. So a row that holds
        a request takes part in every step from its prefill on (as lite_runtime.batching does), or its position 0
        is overwritten."""
        with self._request():
            self._cache = None
            return self._run("inc", self.inputs.increment(tokens, lengths))

    # --- checks -----------------------------------------------------------------------------------
    def _check_rows(self, rows: Sequence[Sequence[int]]) -> List[List[int]]:
        if isinstance(rows, (str, bytes)):
            raise InferError("input_ids is a string; generate() and infer() take token ids: call the pipeline "
                             "itself for text, pipe(text), or tokenize it first")
        if hasattr(rows, "tolist"):  # numpy arrays and torch tensors, as HF callers pass them
            rows = rows.tolist()
        if not rows or isinstance(rows[0], (int, np.integer)):
            raise InferError("input_ids must be a list of token-id lists, one per row")
        if len(rows) > self.batch_size:
            raise InferError(f"{len(rows)} rows but the graphs were exported with batch_size {self.batch_size}; "
                             f"send at most {self.batch_size} or re-export with --batch_size {len(rows)}")
        out = []
        for i, row in enumerate(rows):
            if isinstance(row, (str, bytes)):
                raise InferError(f"row {i} is a string; input_ids are token ids: call pipe(text) for text")
            row = row.tolist() if hasattr(row, "tolist") else list(row)
            bad = next((t for t in row if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
            if bad is not None:
                raise InferError(f"row {i} has a token id {bad!r} that is not an integer; input_ids are integer "
                                 "token ids from the tokenizer")
            row = [int(t) for t in row]
            if not row:
                raise InferError(f"row {i} is empty; every prompt needs at least one token")
            if len(row) > self.seq_length:
                raise InferError(f"row {i} has {len(row)} tokens, more than the graphs' seq_length "
                                 f"{self.seq_length}; shorten the prompt or re-export with a larger --seq_length")
            vocab = self.config.vocab_size
            if vocab and not all(0 <= t < vocab for t in row):
                raise InferError(f"row {i} has a token id outside [0, {vocab}); was it made by another tokenizer?")
            out.append(row)
        return out

    def _limits(self, rows: List[List[int]], s: GenerationSettings) -> List[int]:
        """Tokens each row may generate: max_new_tokens, else max_length - prompt, else up to seq_length."""
        limits = []
        for i, row in enumerate(rows):
            if s.max_new_tokens is not None:
                total = len(row) + s.max_new_tokens
                what = f"{len(row)} prompt tokens + max_new_tokens {s.max_new_tokens} = {total}"
            elif s.max_length is not None:
                total = s.max_length
                what = f"max_length {total}"
                if total <= len(row):
                    raise InferError(f"row {i}: max_length {total} leaves no room after its {len(row)} prompt "
                                     "tokens; raise max_length or use max_new_tokens")
            else:
                total, what = self.seq_length, ""
            if total > self.seq_length:
                raise InferError(f"row {i}: {what} exceeds the graphs' seq_length {self.seq_length}; lower it or "
                                 f"re-export with --seq_length {total}")
            limits.append(total - len(row))
        return limits

    # --- public -----------------------------------------------------------------------------------
    def encode(self, text: str, apply_chat_template: bool = False, add_special_tokens: bool = False) -> List[int]:
        if apply_chat_template:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InferError("the tokenizer has no chat template; drop apply_chat_template / --chat")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def __call__(self, inputs, apply_chat_template: bool = False, add_special_tokens: bool = False,
                 return_full_text: bool = False, streamer=None, **kwargs):
        """Text in, generated text out (a str for a str, a list for a list)."""
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        ids = [self.encode(t, apply_chat_template, add_special_tokens) for t in texts]
        out = self.generate(ids, streamer=streamer, **kwargs)
        texts = [self.tokenizer.decode(seq if return_full_text else seq[n:], skip_special_tokens=True)
                 for seq, n in zip(out.sequences, out.prompt_lengths)]
        self.last_output = out
        return texts[0] if single else texts

    @property
    def last_output(self) -> Optional[GenerateOutput]:
        """The GenerateOutput (sequences, timing) of this thread's last text call, None before one."""
        return getattr(self._local, "last_output", None)

    @last_output.setter
    def last_output(self, out: Optional[GenerateOutput]) -> None:
        self._local.last_output = out

    def infer(self, input_ids: Sequence[Sequence[int]], **kwargs) -> InferOutput:
        """One step for callers that drive the loop: the next token of each row and its probability."""
        s = self.defaults.updated(**kwargs)
        rows = self._check_rows(input_ids)
        rng = np.random.default_rng(s.seed)
        with self._request():
            logits = self._forward(rows)
        picks = [choose(process(logits[i], rows[i], s), s.do_sample, rng) for i in range(len(rows))]
        return InferOutput([t for t, _ in picks], [p for _, p in picks], logits)

    def generate(self, input_ids: Sequence[Sequence[int]], streamer=None, **kwargs) -> GenerateOutput:
        """Per row, the prompt ids followed by the generated ids, stopping at eos or the limit."""
        s = self.defaults.updated(**kwargs)
        rows = self._check_rows(input_ids)
        limits = self._limits(rows, s)
        eos = set(s.eos_token_id or ())
        rng = np.random.default_rng(s.seed)
        seqs = [list(r) for r in rows]
        reasons: List[Optional[str]] = [None] * len(rows)
        out = GenerateOutput(seqs, [], [len(r) for r in rows])
        with self._request():
            if streamer is not None:
                streamer.put(np.array(rows) if len(rows) == 1 else [np.array(r) for r in rows])
            start = time.perf_counter()
            logits = self._prefill(rows)
            out.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            while True:
                new: Dict[int, int] = {}
                for i in range(len(rows)):
                    if reasons[i] is None:
                        token, _ = choose(process(logits[i], seqs[i], s), s.do_sample, rng)
                        seqs[i].append(token)
                        new[i] = token
                        if token in eos:
                            reasons[i] = "eos"
                        elif len(seqs[i]) - len(rows[i]) >= limits[i]:
                            reasons[i] = "length"
                out.new_tokens += len(new)
                if streamer is not None:
                    streamer.put(np.array([new.get(i, -1) for i in range(len(rows))]))
                if all(reasons):
                    break
                logits = self._step({i: t for i, t in new.items() if reasons[i] is None})
                out.decode_steps += 1
            out.decode_seconds = time.perf_counter() - start
            if streamer is not None:
                streamer.end()
        out.finish_reasons = [str(r) for r in reasons]
        return out
