"""TextGenerator: the `text_generation` task. Generates token by token through a ModelRunner (lite_runtime/engine/runner.py).

Each graph row's sequence keeps its blocks of the runner's KV pool and the tokens they hold (SequenceBlocks) between
calls, so `infer` (one step) and `generate` (a whole request) can be called in any order and any number of times: a
step that extends every row's sequence by one token runs the incremental graph, anything else runs prefill (the
rows' old blocks given back, findable by their tokens for prefix caching). The runner's lock serialises callers, so a
streaming thread cannot interleave with another request on the same cache.
"""
from __future__ import annotations

import contextlib

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError, MissingDependencyError
from lite_runtime.engine.blocks import PoolExhausted
from lite_runtime.engine.runner import ModelRunner, SequenceBlocks, StepRow
from lite_runtime.engine.sampling import (GenerationSettings, check_vocabulary, pick, probability, process, seeded,
                                   softmax)
from lite_runtime.engine.speculative import DraftFolder, Pacer, PromptLookup, SpecStats, accept, same_vocabulary
from lite_runtime.tokenizer import FolderTokenizer, chat_problem, has_folder_tokenizer

log = logging.getLogger(__name__)


@dataclass
class InferOutput:
    """One step: per row, the chosen next token, the graph's raw float32 logits [rows, vocab_size] (before any
    repetition penalty or sampling warper), and `probs`: each token's probability under the scores it was chosen
    from, computed when read (a softmax over the vocabulary per row: paid only by who asks for it)."""

    next_tokens: List[int]
    logits: Optional[np.ndarray] = field(default=None, repr=False)
    scores: List[np.ndarray] = field(default_factory=list, repr=False)  # per row, what the token was chosen from

    @property
    def probs(self) -> List[float]:
        return [probability(s, t) for s, t in zip(self.scores, self.next_tokens)]


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
        self.speculative: Optional[SpecStats] = None  # drafted and accepted tokens, when speculation was asked

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


class TextGenerator:
    """The `text_generation` task over a ModelRunner (lite_runtime/engine/runner.py), which it shares with the server's
    engine: the HF-style API (text in and out, generate, infer), the generation settings and input checks."""

    def __init__(self, config: InferConfig, tokenizer=None) -> None:
        self.runner = runner = ModelRunner(config)
        self.config, self.backend, self.backend_name = runner.config, runner.backend, runner.backend_name
        self.batch_size, self.seq_length, self.prefill_sizes = runner.batch_size, runner.seq_length, runner.prefill_sizes
        self._tokenizer = tokenizer
        self.defaults = GenerationSettings.from_generation_config(self.config.model_dir).updated(
            eos_token_id=self.config.eos_token_id or None, pad_token_id=self.config.pad_token_id)
        self.pad = runner.pad
        self.seqs = [SequenceBlocks(runner.pool) for _ in range(self.batch_size)]  # each graph row's sequence
        self._local = threading.local()  # last_output: per calling thread, so concurrent callers do not race

    def warm(self, key: str) -> None:
        """Compile graph `key` now (ModelRunner.warm)."""
        self.runner.warm(key)

    def prefill_size(self, longest: int) -> int:
        return self.runner.prefill_size(longest)

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

    # --- the cache: rows 0..n-1 of a batch, each its sequence's blocks ------------------------------------------
    @property
    def held(self) -> List[List[int]]:
        """What each graph row's sequence holds (its tokens' keys and values are in its blocks)."""
        return [list(seq.tokens) for seq in self.seqs]

    def release(self) -> None:
        """Give every row's blocks back to the pool (their full blocks stay findable: prefix caching)."""
        with self.runner.request():
            for seq in self.seqs:
                seq.release()

    @contextlib.contextmanager
    def _releasing(self):
        """generate()'s blocks go back to the pool when it returns or fails (infer(), a caller's own loop, keeps its
        rows' blocks between calls)."""
        try:
            yield
        finally:
            for seq in self.seqs:
                seq.release()

    def _reserve(self, seq: SequenceBlocks, length: int) -> None:
        try:
            seq.reserve(length)
        except PoolExhausted:
            pool = self.runner.pool
            raise InferError(f"the KV cache pool has {pool.num_free} free blocks of {pool.capacity} ({pool.block_size} "
                             f"tokens each) and a sequence of {length} tokens needs {pool.blocks_for(length)}; load "
                             "the folder with more (num_blocks / kv_cache_memory, --num_blocks / --kv_cache_memory), "
                             "or generate fewer rows at once") from None

    def _step(self, advance: Dict[int, int]) -> np.ndarray:
        """Append advance[row] to those rows' sequences; the other rows are idle (they write nowhere)."""
        rows: List[Optional[StepRow]] = [None] * self.batch_size
        for i, token in advance.items():
            seq = self.seqs[i]
            self._reserve(seq, len(seq.tokens) + 1)
            rows[i] = StepRow(int(token), len(seq.tokens) + 1, seq.blocks)
        logits = self.runner.step(rows)
        for i, token in advance.items():
            self.seqs[i].tokens.append(int(token))
        return logits

    def _prefill(self, rows: List[List[int]]) -> np.ndarray:
        """Rows 0..n-1 prefilled from position 0, each into fresh blocks (the old ones given back first)."""
        for seq in self.seqs:
            seq.release()
        for seq, row in zip(self.seqs, rows):
            self._reserve(seq, len(row))
        logits = self.runner.prefill(rows, [seq.blocks for seq in self.seqs[:len(rows)]])
        for seq, row in zip(self.seqs, rows):
            seq.tokens = list(row)
        return logits

    def _forward(self, rows: List[List[int]]) -> np.ndarray:
        """Logits after each row's last token, reusing the cache when every row extends what its sequence holds by one
        token."""
        if all(self.seqs[i].tokens and r[:-1] == self.seqs[i].tokens for i, r in enumerate(rows)):
            return self._step({i: r[-1] for i, r in enumerate(rows)})[:len(rows)]
        return self._prefill(rows)

    # --- checks -----------------------------------------------------------------------------------
    @staticmethod
    def _extends(row, held: List[int]) -> bool:
        """Whether row is held plus one more entry (compared in C: no per-token Python)."""
        if isinstance(row, (str, bytes)) or len(row) != len(held) + 1:
            return False
        if hasattr(row, "tolist"):
            row = row.tolist()
        try:
            return list(row[:-1]) == held
        except TypeError:
            return False

    def _check_rows(self, rows: Sequence[Sequence[int]], held: Sequence[Optional[List[int]]] = (),
                    queued: bool = False) -> List[List[int]]:
        """rows as lists of ints, each checked. `held`: what the graph rows' sequences hold (checked when they were
        sent), so a row that extends its sequence by one token (infer() driving a decode loop) has only that token
        checked, not its whole sequence on every step. `queued`: the rows go through the engine, which queues what
        the graph rows cannot take at once (any number of rows)."""
        if isinstance(rows, (str, bytes)):
            raise InferError("input_ids is a string; generate() and infer() take token ids: call the pipeline "
                             "itself for text, pipe(text), or tokenize it first")
        if hasattr(rows, "tolist"):  # numpy arrays and torch tensors, as HF callers pass them
            rows = rows.tolist()
        if not rows or isinstance(rows[0], (int, np.integer)):
            raise InferError("input_ids must be a list of token-id lists, one per row")
        if len(rows) > self.batch_size and not queued:
            raise InferError(f"{len(rows)} rows but the graphs were exported with batch_size {self.batch_size}; "
                             f"send at most {self.batch_size} or re-export with --batch_size {len(rows)}")
        out = []
        for i, row in enumerate(rows):
            if i < len(held) and held[i] is not None and len(held[i]) < self.seq_length and \
                    self._extends(row, held[i]):
                out.append(held[i] + self._check_row(i, row[-1:]))
            else:
                out.append(self._check_row(i, row))
        return out

    def _check_row(self, i: int, row) -> List[int]:
        """Row i of input_ids as a list of ints, or an InferError naming what is wrong with it."""
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
        return row

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
            problem = chat_problem(self.tokenizer)
            if isinstance(problem, MissingDependencyError):
                raise problem
            if problem is not None:
                raise InferError(f"{problem}; drop apply_chat_template / --chat")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def __call__(self, inputs, apply_chat_template: bool = False, add_special_tokens: bool = False,
                 return_full_text: bool = False, streamer=None, **kwargs):
        """Text in, generated text out (a str for a str, a list for a list)."""
        single = isinstance(inputs, str)
        texts = [inputs] if single else list(inputs)
        ids = [self.encode(t, apply_chat_template, add_special_tokens) for t in texts]
        speculative = kwargs.get("prompt_lookup_num_tokens") is not None or kwargs.get("assistant_model") is not None
        if speculative and len(ids) > 1:  # speculation runs one row at a time: the texts one after another
            outs = [self.generate([row], streamer=streamer, **kwargs) for row in ids]
            out = GenerateOutput([o[0] for o in outs], [o.finish_reasons[0] for o in outs],
                                 [o.prompt_lengths[0] for o in outs])
        else:
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

    def _settings(self, kwargs) -> GenerationSettings:
        """The folder's defaults updated by a call's arguments (HF's names), token ids checked against the
        vocabulary."""
        s = self.defaults.updated(**kwargs) if kwargs else self.defaults
        if self.config.vocab_size:
            check_vocabulary(s, self.config.vocab_size)
        return s

    def infer(self, input_ids: Sequence[Sequence[int]], **kwargs) -> InferOutput:
        """One step for callers that drive the loop: the next token of each row and its probability."""
        s = self._settings(kwargs)
        rows = self._check_rows(input_ids, self.held)
        rng = seeded(s.seed) if s.do_sample else None
        with self.runner.request():
            logits = self._forward(rows)
        scores = [process(logits[i], rows[i], s, len(rows[i])) for i in range(len(rows))]
        return InferOutput([pick(scores[i], s.do_sample, rng) for i in range(len(rows))], logits, scores)

    def generate(self, input_ids: Sequence[Sequence[int]], streamer=None,
                 prompt_lookup_num_tokens: Optional[int] = None, assistant_model=None, **kwargs) -> GenerateOutput:
        """Per row, the prompt ids followed by the generated ids, stopping at eos or the limit.

        Speculative decoding (HF's names; lite_runtime/engine/speculative.py), one row at a time: `prompt_lookup_num_tokens`
        K drafts up to K tokens from the sequence itself, `assistant_model` (a folder, or a pipeline of one, with the
        same tokenizer) drafts with that model; the tokens are what decoding without them gives (greedy) or
        distributed as it (sampling)."""
        s = self._settings(kwargs)
        speculative = prompt_lookup_num_tokens is not None or assistant_model is not None
        # several prompts go through the serving engine (lite_runtime/engine/scheduler.py): continuous batching over
        # the graph rows (more prompts than rows wait their turn), chunked prefill, shared prefix blocks; one prompt,
        # a streamer (HF's streamers take one sequence's tokens step by step), speculation or a folder without chunk
        # graphs (tensor parallel) run the rows here, prefilled together and stepped
        engine = not speculative and streamer is None and bool(self.runner.chunk_sizes) and \
            not isinstance(input_ids, (str, bytes)) and len(input_ids) > 1
        rows = self._check_rows(input_ids, queued=engine)
        limits = self._limits(rows, s)
        eos = set() if s.ignore_eos else set(s.eos_token_id or ())
        if engine:
            return self._generate_engine(rows, s, limits, eos)
        rng = seeded(s.seed) if s.do_sample else None
        seqs = [list(r) for r in rows]
        reasons: List[Optional[str]] = [None] * len(rows)
        out = GenerateOutput(seqs, [], [len(r) for r in rows])
        proposer = self._proposer(prompt_lookup_num_tokens, assistant_model, len(rows))
        if proposer is not None:
            return self._generate_speculative(rows[0], s, limits[0], eos, rng, out, streamer, *proposer)
        with self.runner.request(), self._releasing():
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
                        token = pick(process(logits[i], seqs[i], s, len(rows[i])), s.do_sample, rng)
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
                logits = self._step({i: t for i, t in new.items() if reasons[i] is None})[:len(rows)]
                out.decode_steps += 1
            out.decode_seconds = time.perf_counter() - start
            if streamer is not None:
                streamer.end()
        out.finish_reasons = [str(r) for r in reasons]
        return out

    def _generate_engine(self, rows: List[List[int]], s: GenerationSettings, limits: List[int],
                         eos) -> GenerateOutput:
        """Every row a request of the engine (BatchEngine over this generator's runner and pool), run to its end;
        sampling seeds each row with seed + i when a seed is given (the server's `n`)."""
        from lite_runtime.engine.request import SlotRequest
        from lite_runtime.engine.scheduler import BatchEngine

        left, done, errors = [len(rows)], threading.Event(), {}
        lock = threading.Lock()

        def ended(i: int):
            def emit(event) -> None:
                if event[0] not in ("end", "error"):
                    return
                if event[0] == "error":
                    errors[i] = event[1]
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return emit

        requests = [SlotRequest(prompt=list(row), max_tokens=limits[i], emit=ended(i), eos=tuple(eos),
                                settings=s.updated(seed=s.seed + i) if s.do_sample and s.seed is not None else s)
                    for i, row in enumerate(rows)]
        start = time.monotonic()  # the engine stamps tokens with time.monotonic()
        engine = BatchEngine(self, max_queue=len(rows))
        try:
            engine.submit_many(requests)
            done.wait()
        finally:
            engine.stop()
        end = time.monotonic()
        if errors:
            i = min(errors)
            raise InferError(f"row {i}: {errors[i]}")
        out = GenerateOutput([list(r.prompt) + r.generated for r in requests],
                             ["eos" if r.generated and r.generated[-1] in eos else "length" for r in requests],
                             [len(r) for r in rows])
        first = min((r.token_times[0] for r in requests if r.token_times), default=end)
        out.prefill_seconds = first - start  # to the first token of any row
        out.decode_seconds = max(end - first, 1e-9)
        out.new_tokens = sum(len(r.generated) for r in requests)
        out.decode_steps = engine.steps + engine.pieces
        return out

    # --- speculative decoding (lite_runtime/engine/speculative.py) --------------------------------------------
    def draft_generator(self, assistant_model) -> "TextGenerator":
        """The draft's TextGenerator: a pipeline or TextGenerator as given, a folder loaded once (on this one's
        backend) and kept; refused when its tokenizer or vocabulary is not this folder's."""
        if isinstance(assistant_model, TextGenerator):
            draft = assistant_model
        elif isinstance(getattr(assistant_model, "generator", None), TextGenerator):
            draft = assistant_model.generator
        else:
            import os

            path = os.fspath(assistant_model)
            cache = self.__dict__.setdefault("_drafts", {})
            draft = cache.get(path)
            if draft is None:
                from lite_runtime.config import InferConfig

                if not os.path.isdir(path):
                    raise InferError(f"assistant_model {path!r} is not a model folder; pass a folder written by "
                                     "python -m export (the same tokenizer), or a pipeline of one")
                draft = TextGenerator(InferConfig.from_folder(path, backend=self.backend_name))
                same_vocabulary(self, draft)
                cache[path] = draft
                return draft
        same_vocabulary(self, draft)
        return draft

    def _proposer(self, lookup_tokens, assistant_model, rows: int):
        """(proposer, K) for a generate call that asked for speculation, else None."""
        if lookup_tokens is None and assistant_model is None:
            return None
        if lookup_tokens is not None and assistant_model is not None:
            raise InferError("pass prompt_lookup_num_tokens or assistant_model, not both")
        if rows != 1:
            raise InferError(f"speculative decoding runs one row at a time, and {rows} were given; generate them "
                             "one by one")
        if not self.runner.score_sizes:
            raise InferError(self.runner.missing("score"))
        k = int(lookup_tokens) if lookup_tokens is not None else self.runner.score_sizes[0] - 1
        if lookup_tokens is not None and not 1 <= k <= self.runner.score_sizes[-1] - 1:
            raise InferError(f"prompt_lookup_num_tokens {lookup_tokens} must be between 1 and "
                             f"{self.runner.score_sizes[-1] - 1} (the folder's largest score graph, "
                             f"{self.runner.score_sizes[-1]} tokens, checks that many and the last token)")
        # a draft model: K from HF's num_assistant_tokens default (5) up to what the smallest score graph checks (a
        # verify costs its piece's arithmetic); prompt lookup: up to the K asked
        if assistant_model is not None:
            return DraftFolder(self.draft_generator(assistant_model)), max(k, 1), min(5, max(k, 1))
        return PromptLookup(), k, k

    def _generate_speculative(self, row: List[int], s: GenerationSettings, limit: int, eos, rng, out: GenerateOutput,
                              streamer, proposer, k_max: int, k_start: int) -> GenerateOutput:
        """generate() of one row with speculation (lite_runtime/engine/speculative.py, module doc)."""
        runner = self.runner
        seq = out[0]
        stats = out.speculative = SpecStats()
        pacer = Pacer(k_max, k_start)
        reason: Optional[str] = None
        forced: Optional[int] = None
        with runner.request(), self._releasing():
            if streamer is not None:
                streamer.put(np.array([row]))
            start = time.perf_counter()
            logits = self._prefill([row])[0]
            cache = self.seqs[0]
            out.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()

            def add(token: int) -> Optional[str]:
                seq.append(token)
                out.new_tokens += 1
                if streamer is not None:
                    streamer.put(np.array([token]))
                if token in eos:
                    return "eos"
                return "length" if len(seq) - len(row) >= limit else None

            while reason is None:
                token = forced if forced is not None else pick(process(logits, seq, s, len(row)), s.do_sample, rng)
                forced = None
                reason = add(token)
                if reason is not None:
                    break
                tick = time.perf_counter()
                left = limit - (len(seq) - len(row))
                k = min(pacer.plan(proposer.lacking(seq), left), limit - (len(seq) - len(row)) - 1, self.seq_length - len(seq),
                        runner.score_sizes[-1] - 1)
                drafts, qs = proposer.propose(seq, k, s, rng) if k >= 1 else ([], [])
                out.decode_steps += 1
                if not drafts:
                    logits = self._step({0: token})[0]
                    pacer.plain(time.perf_counter() - tick)
                    continue
                checking = time.perf_counter()
                self._reserve(cache, len(seq) + len(drafts))  # the token and the drafts' positions
                _, verify = runner.chunk([token] + drafts, len(seq) - 1, cache.blocks, runner.idle(), every=True)
                verified = time.perf_counter() - checking
                kept = 0
                for i, d in enumerate(drafts):
                    scores = process(verify[i], seq, s, len(row))
                    if s.do_sample:
                        forced = accept(softmax(scores), qs[i], d, rng)
                    else:
                        best = int(np.argmax(scores))
                        forced = None if best == d else best
                    if forced is not None:
                        break
                    kept += 1
                    reason = add(d)
                    if reason is not None:
                        break
                if forced is None and reason is None:
                    logits = np.array(verify[kept])  # a copy: the graph's output buffer is reused by the next call
                # what the sequence holds: the kept tokens; the rejected drafts' positions lie past them, and the
                # blocks only they used go back to the pool
                cache.tokens = list(seq)
                cache.truncate(len(seq))
                stats.rounds += 1
                stats.drafted += len(drafts)
                stats.accepted += kept
                pacer.round(time.perf_counter() - tick, verified, len(drafts), kept)
            out.decode_seconds = time.perf_counter() - start
            if streamer is not None:
                streamer.end()
        out.finish_reasons = [reason]
        return out
