"""Golden references written into every model folder: fixed prompts, the checkpoint's greedy tokens and top-k logits.

`python -m lite_runtime.check` replays them on the device the folder runs on, with only
mindspore_lite, numpy and pyyaml there, and says whether the device computes what the checkpoint
means. They are computed at export by export/writers/reference.py (float32 numpy on the checkpoint's own
weights, whatever the export dtype), never by the exported graphs.

The prompts (documented in model_dirs/README.md, "golden.json"):
- one batch per prefill graph, smallest first, so every graph GE compiles runs at least once: its
  longest row has `lead` tokens, more than the next smaller graph holds, so the runtime must pick
  this graph: lead = max(previous graph + 1, min(3/4 of this graph, seq_length - 15, 256));
- the folder's batch size in rows, of different lengths (lead, then lead·(B-r)/B), so padding and
  per-row lengths are exercised;
- NEW_TOKENS greedy steps per batch (fewer when the cache has no room), the first from the prefill
  graph, the rest from the incremental one;
- token ids from fixed texts (English, code, Chinese) through the checkpoint's tokenizer.json, or
  seeded random ids when there is none: the check itself needs no tokenizer.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from export.config import ModelConfig
from export.errors import ExportError
from lite_runtime.folder import graph_key
from lite_runtime.golden import ReferenceBatch, ReferenceRow, derived_limits, golden_document

log = logging.getLogger(__name__)

NEW_TOKENS = 16
TOP_K = 8
LEAD_CAP = 256  # bounds the reference's cost: no prompt is longer, unless a graph needs it to be used at all

TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable type made books cheap "
    "enough for merchants and students. Within fifty years, presses were running in more than two hundred "
    "cities across Europe, and the number of books in circulation grew from thousands to millions. ",
    "def fibonacci(n: int) -> list:\n    values = [0, 1]\n    while len(values) < n:\n"
    "        values.append(values[-1] + values[-2])\n    return values[:n]\n\n"
    "for i, value in enumerate(fibonacci(12)):\n    print(i, value)\n",
    "大型语言模型根据前面的词预测下一个词。推理分为两个阶段：预填充阶段一次读取整个提示并写入键值缓存，"
    "解码阶段每一步只生成一个新词。昇腾服务器通过图引擎运行导出的模型。",
)


def plan_batches(prefill_sizes: Sequence[int], seq_length: int, batch_size: int) -> List[Tuple[int, List[int], int]]:
    """(graph tokens, the batch's prompt lengths, steps) per prefill graph, smallest graph first."""
    plan = []
    previous = 0
    for n in sorted(prefill_sizes):
        lead = max(previous + 1, min(3 * n // 4, seq_length - NEW_TOKENS + 1, LEAD_CAP))
        lengths = [lead] + [max(1, lead * (batch_size - r) // batch_size) for r in range(1, batch_size)]
        plan.append((n, lengths, min(NEW_TOKENS, seq_length - lead + 1)))
        previous = n
    return plan


def _text_ids(checkpoint: str, vocab_size: int) -> Optional[List[List[int]]]:
    """Each of TEXTS as token ids of the checkpoint's tokenizer.json (a GGUF's: built from its metadata), or None
    when that cannot be used."""
    from export.checkpoints.gguf import build_tokenizer, is_gguf
    from export.checkpoints.gguf_file import open_gguf_file

    gguf = is_gguf(checkpoint)
    path = checkpoint if gguf else os.path.join(checkpoint, "tokenizer.json")
    if not gguf and not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer

        tokenizer = build_tokenizer(open_gguf_file(path), path) if gguf else Tokenizer.from_file(path)
        ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]
    except Exception as exc:  # any failure of a third-party tokenizer file: fall back to random ids
        log.warning("golden references: %s could not encode the fixed texts (%s); using random token ids", path, exc)
        return None
    if not all(ids) or max(max(row) for row in ids) >= vocab_size:
        return None
    return ids


def prompts_for(plan: List[Tuple[int, List[int], int]], checkpoint: str, vocab_size: int) -> Tuple[List[List[List[int]]], str]:
    """Token ids per batch and row, and where they came from ("tokenizer.json" or "random")."""
    texts = _text_ids(checkpoint, vocab_size)
    rng = np.random.default_rng(20261122)
    batches = []
    for b, (_, lengths, _) in enumerate(plan):
        rows = []
        for r, n in enumerate(lengths):
            if texts is None:
                rows.append([int(t) for t in rng.integers(0, vocab_size, n)])
            else:
                text = texts[(b + r) % len(texts)]
                rows.append((text * (n // len(text) + 1))[:n])
        batches.append(rows)
    return batches, "tokenizer.json" if texts is not None else "random"


def compute(model_cfg: ModelConfig, checkpoint: str, prefill_sizes: Sequence[int], seq_length: int,
            batch_size: int, progress: Optional[Callable[[int], None]] = None,
            matrices_in: str = "float32", quant: Optional[Tuple[Any, Any]] = None,
            lanes: Sequence[str] = (), early: Optional["AgreementPrefill"] = None,
            kv_in: str = "float32") -> Dict[str, Any]:
    """Run the plan through the float32 reference; returns golden.json's content (lite_runtime.golden).

    Every row of every batch runs together, so each forward is one pass over the weights: the first
    prefills every prompt, each later one decodes one token of every row still going.
    matrices_in: for a CPU folder that stores its matrices in 16 bits and computes in float32, the
    reference uses the same rounded matrices (NumpyDecoder), and the folder is held to float32's limits.
    kv_in: the dtype a CPU folder keeps its KV cache in as it serves (bfloat16: the fast form's lane rounds each key
    and value as that cache stores them, NumpyDecoder; the rows keep float32's, as check's x-exact replays run the
    folder with float32 caches), else float32.
    quant: (the folder's `quantization` record, export/network/quantize.py FolderMeaning) of a quantized folder, once its weights
    are written: the reference runs on the weights the folder holds, dequantized, so `check` holds a device to the
    usual limits. Then a second reference on the checkpoint's own weights is fed the same tokens, all steps of every
    row in one prefill pass (the folder's greedy tokens are known by then), and how far the two are apart is recorded
    as `agreement` (_Agreement), over agreement_rows. That costs one pass more than a float folder's golden, not a
    second decode; its prompts' part runs before, beside the export's compile stage, when `early` (AgreementPrefill,
    started by the caller) is given.
    lanes: the fast form's lane and "reorder" (lanes_for): every decode step also runs in those lanes beside each row
    (ArithmeticLanes), whose distance from the row sets the check's limits for this folder (`limits`,
    lite_runtime/golden.py derived_limits).
    """
    from export.writers.reference import NumpyDecoder
    from export.checkpoints import open_checkpoint, plan_weights

    start = time.perf_counter()
    plan = plan_batches(prefill_sizes, seq_length, batch_size)
    batches, source = prompts_for(plan, checkpoint, model_cfg.vocab_size)
    where = open_checkpoint(checkpoint)
    if quant is not None:
        meaning = quant[1]
        where = {**where, **{name: meaning for name in meaning.layers}}
    net = NumpyDecoder(model_cfg, where, seq_length, matrices_in=matrices_in, kv_in=kv_in)
    rows = [(b, list(ids)) for b, batch in enumerate(batches) for ids in batch]
    # the folder's logits at each step of each row, for the agreement
    history: Optional[List[List[np.ndarray]]] = [[] for _ in rows] if quant is not None else None
    try:
        plan_weights(net.weight_shapes(), where, tied=bool(model_cfg.tie_word_embeddings))  # names and shapes
        steps = [plan[b][2] for b, _ in rows]
        caches = [net.new_cache() for _ in rows]
        records = [ReferenceRow(prompt=ids) for _, ids in rows]
        feed = [ids for _, ids in rows]
        active = list(range(len(rows)))
        probe = ArithmeticLanes(net, tuple(lanes)) if lanes else None
        clock = _Clock()
        while active:
            if probe is not None and probe.started:
                logits = probe.forward([feed[i] for i in active], [caches[i] for i in active], active)
            else:
                logits = net.forward([feed[i] for i in active], [caches[i] for i in active])
                if probe is not None:
                    probe.start(caches)
            if not np.isfinite(logits).all():
                raise ExportError(f"{checkpoint}: the float32 reference produced non-finite logits; the weights are "
                                  "damaged or not this config's")
            margins = net.routing_margins  # a mixture of experts': each new token's (the rows' first, lanes after)
            if margins is not None:
                ends = np.cumsum([len(feed[i]) for i in active])
                for i, end, n in zip(active, ends, [len(feed[i]) for i in active]):
                    records[i].routing_margin.append(float(f"{margins[end - n:end].min():.6g}"))
            for i, row_logits in zip(active, logits):
                feed[i] = [records[i].record(row_logits, TOP_K)]
                if history is not None:
                    history[i].append(row_logits)
            active = [i for i in active if len(records[i].tokens) < steps[i]]
            clock.lap("steps" if clock.laps else "prefill")
            if progress is not None:
                progress(1)
    finally:
        net.close()
    del caches
    agreement = None
    if quant is not None:
        early = early or AgreementPrefill(model_cfg, checkpoint, prefill_sizes, seq_length, batch_size)
        agreement = early.result(records, history)
        clock.lap("agreement")
        clock.laps["its prompts before"] = [early.seconds]
        if progress is not None:
            progress(1)
    log.info("golden references: %d prompts (%d tokens) %s", len(rows), sum(len(ids) for _, ids in rows),
             clock.text())
    out = [ReferenceBatch(graph_key("prefill", tokens), [records[i] for i, (rb, _) in enumerate(rows) if rb == b])
           for b, (tokens, _, _) in enumerate(plan)]
    return golden_document(
        out, computed_by="export/writers/reference.py: float32 numpy on the checkpoint's weights" + (
            f", matrices rounded to {matrices_in} as the folder stores them" if matrices_in != "float32" else "") + (
            ", dequantized from the folder's weights files" if quant is not None else ""),
        matrices_in=matrices_in, **({"kv_cache_in": kv_in} if kv_in != "float32" else {}), prompt_source=source,
        top_k=TOP_K, seq_length=seq_length, batch_size=batch_size, seconds=round(time.perf_counter() - start, 3),
        **({} if agreement is None else {"quantization": quant[0], "agreement": agreement}),
        **({} if probe is None or not probe.steps else {"limits": derived_limits(probe.measured, kv_in)}))


class _Clock:
    """Seconds of the golden's parts (the prompts' prefill, the decode steps, the agreement), for the -v log."""

    def __init__(self) -> None:
        self.laps: Dict[str, List[float]] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.setdefault(name, []).append(now - self.last)
        self.last = now

    def text(self) -> str:
        return ", ".join(f"{name} {sum(t):.1f} s" + (f" ({len(t)})" if len(t) > 1 else "")
                         for name, t in self.laps.items())


def lanes_for(bits: Optional[int], matrices_in: str, cpu_kernels: bool) -> Tuple[str, ...]:
    """The lanes of a folder's golden steps (`bits`: a quantized folder's, else None): a CPU-kernel folder whose
    matmuls have a fast form that rounds x gets that form's lane and "reorder" ("int8": int4 and int8 weights, whose
    decode form takes x in int8 (int8 weights since 2026-11-29: their bands, on AVX-512 VNNI); "bf16": matrices stored
    in bfloat16, the AVX512-BF16 form); any other folder none (its limits are its dtype's constants). ("int16", an
    int8 folder's lane before, is what such a folder's golden.json still holds.)"""
    if not cpu_kernels:
        return ()
    if bits is not None:
        return ("int8", "reorder")
    if matrices_in == "bfloat16":
        return ("bf16", "reorder")
    return ()


class ArithmeticLanes:
    """Each decode step of the golden references again in two lanes beside every row, from the same history (each
    lane its own cache from the prompt on, fed the row's tokens), in the same matmul calls (export/writers/reference.py
    BlockedMatmul `lanes`, the widened weights shared): the fast form's, x rounded as the CPU kernels round it ("int16"
    at every quantized matmul, "int8" at a quantized folder's (int8 where the kernels may take it so, else int16), or
    "bf16" at every matmul of bfloat16 matrices); "reorder", every product in another float32 order
    (export/writers/reference.py BlockedMatmul: row by row, each in two halves). How far each lane's top-k logits land
    from the row's, over every step, is what this folder's arithmetic does to its logits (`measured`): the check's
    limits follow from it (lite_runtime/golden.py derived_limits). Only the steps: the prompt's prefill is shared
    (measured, the step's own products carry the lanes' distance: 1.4e-6 / 6.5e-5 for steps only against 1.4e-6 / 8.0e-5
    with the prompt too, at hidden 1024)."""

    def __init__(self, net, kinds: Tuple[str, ...] = ("int16", "reorder")) -> None:
        self.net = net
        self.kinds = kinds
        self.started = False
        self.caches: Dict[str, list] = {}
        self.measured = {kind: 0.0 for kind in self.kinds}
        self.steps = 0  # decode steps the lanes ran (none: a folder whose golden rows end at the prefill)

    def start(self, caches) -> None:
        """After the prompts' prefill: each lane's caches begin as copies of the rows' (keys and values are replaced,
        never written in place, by the reference's attention: a shallow copy is a copy)."""
        from export.checkpoints.safetensors import rounded_to
        from export.writers.reference import RowCache

        kv_in = self.net.kv_in
        for kind in self.kinds:
            self.caches[kind] = []
            for cache in caches:
                lane = RowCache(len(cache.keys))
                lane.keys, lane.values, lane.length = list(cache.keys), list(cache.values), cache.length
                if kind != "reorder" and kv_in != "float32":  # the fast lane's prompt too, as its cache holds it
                    lane.keys = [None if t is None else rounded_to(t, kv_in) for t in lane.keys]
                    lane.values = [None if t is None else rounded_to(t, kv_in) for t in lane.values]
                self.caches[kind].append(lane)
        self.started = True

    def forward(self, feed, caches, active):
        """The rows' step, each lane's beside it; returns the rows' logits, records the lanes' distances."""
        n = len(active)
        lane_caches = [self.caches[kind][i] for kind in self.kinds for i in active]
        self.net.matmul.lanes = {kind: slice((k + 1) * n, (k + 2) * n) for k, kind in enumerate(self.kinds)}
        try:
            logits = self.net.forward(list(feed) * (1 + len(self.kinds)), list(caches) + lane_caches)
        finally:
            self.net.matmul.lanes = {}
        self.steps += 1
        rows = logits[:n]
        ids = np.argpartition(-rows, TOP_K - 1, axis=1)[:, :TOP_K]
        scale = np.abs(rows).max(axis=1)
        want = np.take_along_axis(rows, ids, 1).astype(np.float64)
        for k, kind in enumerate(self.kinds):
            lane = np.take_along_axis(logits[(k + 1) * n:(k + 2) * n], ids, 1).astype(np.float64)
            worst = float((np.abs(lane - want).max(axis=1) / np.maximum(scale, 1e-30)).max())
            self.measured[kind] = max(self.measured[kind], worst)
        return rows


def agreement_rows(prompts: Sequence[Sequence[int]]) -> List[int]:
    """The golden rows the agreement is computed on: those whose prompts have at most LEAD_CAP tokens (at least the
    smallest graph's batch, whose prompts never have more). A longer prompt exists only so that a larger prefill graph
    is run at all; the agreement measures the folder's weights, and a second float32 prefill of those prompts was the
    largest part of a quantized export's extra time (Qwen2-7B: 83 s of a 216 s golden stage, docs/export.md)."""
    return [i for i, ids in enumerate(prompts) if len(ids) <= LEAD_CAP]


class AgreementPrefill:
    """The agreement's float32 prefill on the checkpoint's own weights: the prompts of its rows (agreement_rows) but
    each one's last token, in a thread of its own from construction on. A quantized export starts it when it starts
    compiling (export/pipeline.py): MindSpore's compile keeps one core busy, the weights stage mostly waits on reading
    the checkpoint, and this prefill needs neither the graphs nor the folder. `result` then feeds each row's last
    prompt token and the folder's greedy tokens after it, and compares. `cancel` stops it between two layers (an export
    that fails meanwhile)."""

    def __init__(self, model_cfg: ModelConfig, checkpoint: str, prefill_sizes: Sequence[int], seq_length: int,
                 batch_size: int) -> None:
        import threading

        from export.writers.reference import NumpyDecoder
        from export.checkpoints import open_checkpoint

        batches, _ = prompts_for(plan_batches(prefill_sizes, seq_length, batch_size), checkpoint, model_cfg.vocab_size)
        prompts = [list(ids) for batch in batches for ids in batch]
        self.rows = agreement_rows(prompts)
        self.prompts = [prompts[i] for i in self.rows]
        self.net = NumpyDecoder(model_cfg, open_checkpoint(checkpoint), seq_length)
        self.caches = [self.net.new_cache() for _ in self.rows]
        self.error: Optional[BaseException] = None
        self.seconds = 0.0  # the prompts' prefill, in its thread
        self._thread = threading.Thread(target=self._prefill, name="golden-agreement", daemon=True)
        self._thread.start()

    def _prefill(self) -> None:
        longer = [i for i, ids in enumerate(self.prompts) if len(ids) > 1]  # a one-token prompt has nothing before
        start = time.perf_counter()
        try:
            if longer:
                self.net.forward([self.prompts[i][:-1] for i in longer], [self.caches[i] for i in longer])
        except BaseException as exc:  # raised by result(), in the export's thread
            self.error = exc
        self.seconds = time.perf_counter() - start

    def cancel(self) -> None:
        self.net.stopped.set()
        self._thread.join()
        self.net.close()

    def result(self, records: List[ReferenceRow], history: List[List[np.ndarray]]) -> Dict[str, Any]:
        """The agreement of every golden row's `records` (the folder's greedy tokens) and `history` (the folder's
        logits at each step), over this prefill's rows."""
        self._thread.join()
        try:
            if self.error is not None:
                raise self.error
            records, history = [records[i] for i in self.rows], [history[i] for i in self.rows]
            if [r.prompt for r in records] != self.prompts:
                raise ExportError("the agreement's prompts are not the golden rows'; this is a bug in export, please "
                                  "report it")
            tails = [len(r.tokens) for r in records]
            logits = self.net.forward([[ids[-1]] + r.tokens[:-1] for ids, r in zip(self.prompts, records)],
                                      self.caches, tail=tails)
        finally:
            self.net.close()
        starts = np.concatenate([[0], np.cumsum(tails)])
        agree = _Agreement()
        for step in range(max(tails)):
            rows = [i for i, n in enumerate(tails) if n > step]
            agree.add(rows, np.stack([history[i][step] for i in rows]), logits[[starts[i] + step for i in rows]])
        return agree.result()


class _Agreement:
    """A quantized folder's reference against its checkpoint's, both fed the folder's greedy tokens."""

    def __init__(self) -> None:
        self.steps = self.same = self.before_first = 0
        self.diverged: set = set()
        self.max_error = 0.0

    def add(self, rows: List[int], folder: np.ndarray, checkpoint: np.ndarray) -> None:
        self.max_error = max(self.max_error, float(np.abs(folder - checkpoint).max()))
        for i, a, b in zip(rows, folder.argmax(axis=1), checkpoint.argmax(axis=1)):
            self.steps += 1
            if a == b:
                self.same += 1
                if i not in self.diverged:
                    self.before_first += 1
            else:
                self.diverged.add(i)

    def result(self) -> Dict[str, Any]:
        return {"tokens": self.steps, "greedy_agreement": round(self.before_first / max(self.steps, 1), 6),
                "top1_match": round(self.same / max(self.steps, 1), 6),
                "max_logit_error": float(f"{self.max_error:.6g}"),
                "computed_by": "export/writers/reference.py on the checkpoint's own weights, fed the folder's greedy tokens "
                               f"(one prefill of each prompt and its tokens, over the rows whose prompts have at most "
                               f"{LEAD_CAP} tokens)"}


def max_steps(prefill_sizes: Sequence[int], seq_length: int, batch_size: int, quantized: bool = False) -> int:
    """How many reference forwards `compute` runs (for a progress bar); a quantized folder's has the agreement's."""
    return max(s for _, _, s in plan_batches(prefill_sizes, seq_length, batch_size)) + (1 if quantized else 0)
