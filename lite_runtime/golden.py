"""Replaying reference prompts on a loaded folder and judging the logits: the core of `check` and `export.compare`.

The reference is a folder's golden.json (float32 numpy at export, export/writers/golden.py) or, for
`python -m export.compare`, HF transformers on the checkpoint. Either way each prompt is replayed
teacher-forced through `TextGenerator.infer`: the prompt prefills, then each reference token is
fed through the incremental graph, so every step compares logits on the same context even after
the device would have chosen differently. "First diverging step" is where the device's argmax
differs from the reference token, which is exactly where free-running greedy generation would
part ways. Only numpy is needed here: this runs where the folder runs.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from lite_runtime.errors import ModelFolderError
from lite_runtime.folder import GOLDEN, ModelFolder, graph_key

GOLDEN_FORMAT = "mslite-llm-golden"
GOLDEN_VERSION = 1  # what export writes
GOLDEN_VERSIONS = (1,)


@dataclass(frozen=True)
class Tolerance:
    """How far a folder of this dtype may be from the float32 reference (model_dirs/README.md, "check").

    rel: max |device - reference| over the reference's top-k logits, relative to the step's largest
    |logit|. A step whose reference top-2 margin is below 2 * rel * that scale is a near tie: the
    device may pick either token there, and a different pick is reported, not failed.
    """

    dtype: str
    rel: float
    derived: bool = False  # derived for this folder at export (folder_limits), not the dtype's

    def limit_text(self) -> str:
        """`(<what> limit <rel>[, derived for this folder])`, as the verdict says it."""
        if self.derived:
            return f"({self.dtype} limit {self.rel:.1e}, derived for this folder)"
        return f"({self.dtype} limit {self.rel:.0e})"


# About 3x the worst error measured against the float32 reference on random checkpoints of five shapes
# (benchmarks/measure_check_limits.py; figures in model_dirs/README.md, "golden.json and check"): float16
# 3.4e-3 (MindSpore's CPU kernels and HF's alike), bfloat16 1.7e-2 (HF on the CPU), float32 1.4e-6.
TOLERANCES: Dict[str, Tolerance] = {
    "float32": Tolerance("float32", 1e-4),
    "float16": Tolerance("float16", 1e-2),
    "bfloat16": Tolerance("bfloat16", 5e-2),
}

# A quantized CPU folder exported before its golden.json carried limits derived from its own arithmetic (below:
# derived_limits, which every quantized CPU folder now has): the constant it was checked against then, "float32 with
# int16 activations", kept so such a folder still checks as it did (its verdict names this limit). A constant cannot
# be right for every shape: a correct folder can exceed it, a tampered one pass under it (issue 43); re-export for
# limits of its own.
INT16_ACTIVATIONS = Tolerance("float32 with int16 activations", 1e-3)


# Limits derived for one folder from its own arithmetic (a quantized folder for the CPU kernels; docs/checking.md,
# "Limits derived for a quantized CPU folder"). At export the golden references' decode steps run again in two lanes
# (export/writers/golden.py ArithmeticLanes): x rounded to int16 per block of 32 as the kernels' fast decode form rounds it,
# and every product in another float32 order (row by row, each in two halves). The largest distance of each lane
# from the references, over every step's top-k logits relative to the step's largest |logit| (as RowResult.judge
# measures a device), is what that arithmetic does to this folder's logits; the limit is LIMIT_FACTOR times it. A
# device doing the same arithmetic is another draw of the same rounding: measured over twelve shapes (hidden 64 to
# 1024; benchmarks/measure_check_limits.py --quantized), a device with x exact lands 1.2-2.8x the reorder lane's
# distance (the golden steps' own float32 rounding is in both), with x in int16 0.7-1.4x the int16 lane's; 10x keeps
# every correct folder at least 3x inside (tests/test_check_limits.py), while one group's scale 1 % off or one
# nibble inverted moved the logits 13x the reorder lane's distance or more there. Never below LIMIT_FLOOR (2^-20: a few
# float32 units of the largest logit; no float32 computation promises less). `exact` holds the replays that run the
# quantized matmuls with x exact (cpu_kernels ACTIVATIONS_EXACT: float32's arithmetic), `int16` the replay through
# the fast path as it serves.
#
# A bfloat16 CPU folder likewise (since 2026-11-28): the kernels' AVX512-BF16 form rounds x to bfloat16 at every
# matmul of several rows (cpu_kernels/matmul16.cc), so its golden steps run a "bf16" lane (x rounded to bfloat16 at
# every matmul) beside "reorder", and its limits are `exact` and `bf16`. A bfloat16 folder exported before them is
# checked as it was (float32's constant, its replays with x exact) and told that the fast form was not replayed.
#
# An int4 CPU folder likewise (since 2026-11-29): the kernels' default decode form takes x in int8 per block of 32 for
# int4 weights (cpu_kernels/matmul_quant.cc ACTIVATIONS_INT8), so its golden steps run an "int8" lane (x rounded to
# int8 at the int4 matmuls the kernels take so, to int16 at the other quantized ones) and its limits are `exact` and
# `int8`. An int4 folder exported before them (limits `exact` and `int16`) replays its fast path in int16
# (cpu_kernels' ACTIVATIONS_INT16), as it was checked, and is told that the int8 form was not replayed.
#
# An int8 CPU folder likewise (since 2026-11-29): on AVX-512 VNNI the runtime repacks its int8 matrices into bands of
# 16 rows whose form takes x in int8 (cpu_kernels/matmul_quant.cc qbands_r16_vnni), so its golden steps run the "int8"
# lane too (x rounded to int8 at every quantized matmul whose inputs are whole 64s and group 32 or whole 64s: the
# bands' rule; a matmul the kernels keep in int16, as a tied embedding the Gather reads or any on another CPU, rounds
# x more finely than that) and its limits are `exact` and `int8`. One exported before (limits `exact` and `int16`) is
# checked as an int4 one exported before is.
LIMIT_FACTOR = 10.0
LIMIT_FLOOR = 2.0 ** -20
ACTIVATION_LABELS = {"exact": "float32 arithmetic (x exact)", "int16": "int16 activations",
                     "int8": "int8 activations", "bf16": "bfloat16 activations"}
FAST_MODES = ("int16", "int8", "bf16")  # the fast forms' activations, one per folder (the lane export/writers/golden.py ran)
_FAST_WHAT = {"int16": "with x rounded to int16 per block of 32 at every quantized matmul, as the CPU kernels' "
                       "decode form rounds it",
              "int8": "with x rounded to int8 per block of 32 at every quantized matmul whose inputs and group are "
                      "whole 64s, and groups of 32 (to int16 at the other quantized ones), as the CPU kernels' "
                      "decode form rounds it",
              "bf16": "with x rounded to bfloat16 at every matmul, as the CPU kernels' AVX512-BF16 form rounds it"}


def derived_limits(measured: Dict[str, float], kv_in: str = "float32") -> Dict[str, Any]:
    """golden.json's `limits` from the lanes' distances (`measured`: reorder and one fast mode, FAST_MODES): per
    activation mode, the limit and what it came from (`kv_in`: the KV cache's dtype as the folder serves, which the
    fast lane rounds keys and values to)."""
    exact = max(LIMIT_FACTOR * measured["reorder"], LIMIT_FLOOR)
    how = ("{factor} x the largest distance of the golden steps computed again {what}, over every step's top-k "
           "logits relative to its largest |logit|")
    out = {"exact": {"rel": float(f"{exact:.4g}"), "measured": float(f"{measured['reorder']:.4g}"),
                     "factor": LIMIT_FACTOR, "floor": LIMIT_FLOOR,
                     "from": how.format(factor=LIMIT_FACTOR, what="with every matmul summed in another float32 "
                                                                 "order")}}
    for mode in FAST_MODES:
        if mode in measured:
            out[mode] = {"rel": float(f"{max(LIMIT_FACTOR * measured[mode], exact):.4g}"),
                         "measured": float(f"{measured[mode]:.4g}"), "factor": LIMIT_FACTOR,
                         "from": how.format(factor=LIMIT_FACTOR, what=_FAST_WHAT[mode] + (
                             f", and each key and value rounded to {kv_in} as its KV cache holds them"
                             if kv_in != "float32" else ""))}
    return out


def folder_limits(reference: "Reference") -> Optional[Dict[str, Tolerance]]:
    """The derived limits a folder's golden.json carries ({"exact": ..., and one of FAST_MODES: ...} Tolerances), or
    None."""
    if not reference.limits:
        return None
    return {mode: Tolerance(ACTIVATION_LABELS[mode], float(reference.limits[mode]["rel"]), derived=True)
            for mode in ACTIVATION_LABELS if mode in reference.limits}


def fast_mode(limits: Optional[Dict[str, Any]]) -> Optional[str]:
    """The fast mode whose limit a folder's limits hold ("int16", "int8" or "bf16"), or None."""
    return next((m for m in FAST_MODES if limits and m in limits), None)


def tolerance_for(compute_dtype: str, quantized: bool, cpu_kernels: bool) -> Optional[Tolerance]:
    """The check's limits for a folder: its compute dtype's, or INT16_ACTIVATIONS for a quantized folder on the
    CPU kernels (float32 compute). None: a dtype without limits."""
    if quantized and cpu_kernels and compute_dtype == "float32":
        return INT16_ACTIVATIONS
    return TOLERANCES.get(compute_dtype)


def largest_logits(logits: np.ndarray, k: int) -> Tuple[List[int], List[float]]:
    """The k largest logits, largest first, ties by smaller id (np.argmax's choice)."""
    idx = np.argpartition(-logits, k - 1)[:k]
    idx = idx[np.lexsort((idx, -logits[idx]))]
    return [int(i) for i in idx], [float(f"{logits[i]:.9g}") for i in idx]  # 9 digits round-trip float32


@dataclass
class ReferenceRow:
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)  # the reference's greedy token at each step
    top_ids: List[List[int]] = field(default_factory=list)  # per step, the top-k token ids, largest logit first
    top_logits: List[List[float]] = field(default_factory=list)
    scale: List[float] = field(default_factory=list)  # per step, the largest |logit| over the whole vocabulary
    # a mixture of experts' (empty for a dense model): per step, the smallest routing margin of the tokens it feeds
    # (step 0 the prompt's, then each step's one): the router logits' gap between the last chosen expert and the
    # first not chosen, relative to their largest magnitude, over every sparse layer (export/writers/reference.py
    # routing). Below twice the check's limit a device may route that token otherwise: RowResult.judge
    routing_margin: List[float] = field(default_factory=list)

    def record(self, logits: np.ndarray, k: int) -> int:
        """Append one step computed by a reference (its logits [V]); returns the greedy token."""
        ids, values = largest_logits(logits, k)
        self.tokens.append(ids[0])
        self.top_ids.append(ids)
        self.top_logits.append(values)
        self.scale.append(float(f"{np.abs(logits).max():.9g}"))
        return ids[0]


@dataclass
class ReferenceBatch:
    graph: str  # the prefill graph the batch was planned for
    rows: List[ReferenceRow]


@dataclass
class Reference:
    source: str  # what computed it, for the report
    batches: List[ReferenceBatch]
    limits: Optional[Dict[str, Any]] = None  # golden.json's derived limits (a quantized or bf16 CPU folder's), if any

    @classmethod
    def from_dict(cls, doc: Dict[str, Any], where: str, vocab_size: int, source: str) -> "Reference":
        """Checked as it is read: a damaged file fails here with its name, never half-way through a replay."""
        def bad(what: str) -> ModelFolderError:
            return ModelFolderError(f"{where}: {what}; re-export the folder")

        if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
            raise bad(f"not a golden reference file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        if doc.get("format_version") not in GOLDEN_VERSIONS:
            raise bad(f"golden format version {doc.get('format_version')!r} is not supported by this runtime")
        batches = []
        try:
            for b, raw in enumerate(doc["batches"]):
                rows = [ReferenceRow(prompt=[int(t) for t in r["prompt"]], tokens=[int(t) for t in r["tokens"]],
                                     top_ids=[[int(i) for i in s] for s in r["top_ids"]],
                                     top_logits=[[float(v) for v in s] for s in r["top_logits"]],
                                     scale=[float(v) for v in r["scale"]],
                                     routing_margin=[float(v) for v in r.get("routing_margin", [])])
                        for r in raw["rows"]]
                steps = {len(r.tokens) for r in rows}
                if not rows or len(steps) != 1 or 0 in steps:
                    raise bad(f"batch {b} has no rows or rows with different numbers of steps")
                for r in rows:
                    n = len(r.tokens)
                    ids = [t for s in r.top_ids for t in s] + r.prompt + r.tokens
                    if (len(r.top_ids), len(r.top_logits), len(r.scale)) != (n, n, n) or not r.prompt or (
                            r.routing_margin and len(r.routing_margin) != n):
                        raise bad(f"batch {b} has a row whose per-step lists disagree in length")
                    if any(len(s) < 2 or s[0] != t for s, t in zip(r.top_ids, r.tokens)):
                        raise bad(f"batch {b} has a step whose top-k does not start with its token")
                    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
                        raise bad(f"batch {b} has token ids outside the vocabulary of {vocab_size}")
                batches.append(ReferenceBatch(str(raw.get("graph", "")), rows))
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"malformed ({type(exc).__name__}: {exc})") from None
        if not batches:
            raise bad("no batches")
        limits = doc.get("limits")
        if limits is not None:
            try:
                modes = ["exact", fast_mode(limits)]  # exact and one fast mode's, both there
                if modes[1] is None:
                    raise KeyError(" or ".join(FAST_MODES))
                if not all(float(limits[mode]["rel"]) > 0 for mode in modes):
                    raise ValueError("a limit is not positive")
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"malformed limits ({type(exc).__name__}: {exc})") from None
        return cls(source=source, batches=batches, limits=limits)


def _row_dict(row: ReferenceRow) -> Dict[str, Any]:
    """A row as golden.json holds it: a dense model's without routing margins."""
    out = asdict(row)
    if not row.routing_margin:
        del out["routing_margin"]
    return out


def golden_document(batches: List[ReferenceBatch], **fields: Any) -> Dict[str, Any]:
    """golden.json's content: the batches (each with its prefill graph's key and its rows) and the fields that say
    how they were made (computed_by, prompt_source, top_k, seq_length, batch_size, ...; model_dirs/README.md)."""
    out = [{"graph": b.graph, "steps": len(b.rows[0].tokens), "rows": [_row_dict(r) for r in b.rows]}
           for b in batches]
    return {"format": GOLDEN_FORMAT, "format_version": GOLDEN_VERSION, **fields, "batches": out}


def write_golden(folder: str, doc: Dict[str, Any]) -> str:
    path = os.path.join(folder, GOLDEN)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, separators=(",", ":"))
        fh.write("\n")
    return path


def load_golden(folder: ModelFolder) -> Optional[Reference]:
    """The folder's golden references, or None for a folder exported before they existed."""
    name = folder.manifest.get("golden")
    if not name:
        return None
    path = os.path.join(folder.path, name)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path}: unreadable ({exc}); re-copy the folder") from None
    return Reference.from_dict(doc, path, int(folder.infer["vocab_size"]),
                               source=f"{name}: {doc.get('computed_by', 'float32 reference at export')}")


@dataclass
class RowResult:
    prompt: int  # index over all rows of all batches
    graph: str  # the prefill graph the runtime ran it on
    prompt_tokens: int
    steps: int = 0
    top1_agree: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    first_divergence: Optional[int] = None  # step where the device's argmax left the reference token
    divergence: Optional[Dict[str, Any]] = None  # device and reference token there, and the reference margin
    near_ties: List[int] = field(default_factory=list)  # steps that disagree where the reference is a near tie
    # a mixture of experts: the first step whose tokens' routing is a near tie (ReferenceRow.routing_margin), from
    # which on the row is reported, not failed; and the largest relative logit error from there
    routing_tie: Optional[int] = None
    routing_max_rel: float = 0.0
    failures: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def judge(self, step: int, logits: np.ndarray, ref: ReferenceRow, tol: Tolerance) -> None:
        """Compare one step's device logits [V] with the reference's top-k at that step."""
        self.steps += 1
        if not np.all(np.isfinite(logits)):
            if not any("non-finite" in f for f in self.failures):
                self.failures.append(f"non-finite logits from step {step}")
            return
        ids, values, scale = np.asarray(ref.top_ids[step]), np.asarray(ref.top_logits[step], np.float64), ref.scale[step]
        err = float(np.abs(logits[ids].astype(np.float64) - values).max())
        # a token fed up to this step routed on a near tie (a mixture of experts): the device may have chosen another
        # expert for it, and every later step attends to that token: from here on reported, not failed
        routed = self.routing_tie is not None or any(m <= 2 * tol.rel for m in ref.routing_margin[:step + 1])
        if routed and self.routing_tie is None:
            self.routing_tie = step
        if routed:
            self.routing_max_rel = max(self.routing_max_rel, err / max(scale, 1e-30))
        else:
            self.max_abs = max(self.max_abs, err)
            self.max_rel = max(self.max_rel, err / max(scale, 1e-30))
        device, want = int(np.argmax(logits)), ref.tokens[step]
        if device == want:
            self.top1_agree += 1
            return
        margin = float(values[0] - values[1])
        if self.first_divergence is None:
            self.first_divergence = step
            self.divergence = {"step": step, "device_token": device, "reference_token": want,
                               "reference_margin": margin}
        if margin <= 2 * tol.rel * scale or routed:
            self.near_ties.append(step)
        elif not any("greedy token" in f for f in self.failures):
            self.failures.append(f"greedy token differs at step {step}: device {device}, reference {want} "
                                 f"(reference margin {margin:.3g}, not a near tie)")

    def close(self, tol: Tolerance) -> None:
        if self.max_rel > tol.rel:
            limit = f"{tol.rel:.1e}, derived for this folder" if tol.derived else f"{tol.rel:.0e}"
            self.failures.append(f"logit error {self.max_rel:.2e} relative exceeds the {tol.dtype} limit {limit}")


def replay(generator, reference: Reference, tol: Tolerance, progress=None) -> List[RowResult]:
    """Run every reference batch teacher-forced through `generator.infer`; one RowResult per row. The rows' blocks go
    back to the pool after."""
    try:
        return _replay(generator, reference, tol, progress)
    finally:
        if hasattr(generator, "release"):
            generator.release()


def _replay(generator, reference: Reference, tol: Tolerance, progress=None) -> List[RowResult]:
    results: List[RowResult] = []
    for batch in reference.batches:
        _scatter(getattr(generator, "runner", None))
        rows = [list(r.prompt) for r in batch.rows]
        graph = graph_key("prefill", generator.prefill_size(max(len(r) for r in rows)))
        mine = [RowResult(len(results) + i, graph, len(r.prompt)) for i, r in enumerate(batch.rows)]
        for step in range(len(batch.rows[0].tokens)):
            logits = generator.infer(rows).logits
            for i, ref in enumerate(batch.rows):
                mine[i].judge(step, logits[i], ref, tol)
                rows[i].append(ref.tokens[step])
            if progress is not None:
                progress(1)
        for r in mine:
            r.close(tol)
        results.extend(mine)
    return results


def _scatter(runner) -> None:
    """Every replay hands out the pool's blocks out of order (BlockPool.scatter): its sequences' block tables skip and
    run backwards, so only graphs that read and write through their tables pass."""
    pool = getattr(runner, "pool", None)
    if pool is not None:
        pool.scatter()


def halves(n: int, sizes: List[int]) -> List[Tuple[int, int]]:
    """[start, end) of the pieces of n tokens as the replays write them: the first half in pieces of the largest size
    (a prompt going in alone), the rest in pieces of the smallest (a chat's next turn, a verify)."""
    half = max(1, n // 2)
    return [(start, min(start + size, end)) for begin, end, size in ((0, half, sizes[-1]), (half, n, sizes[0]))
            for start in range(begin, end, size)]


def replay_chunks(runner, reference: Reference, tol: Tolerance, progress=None) -> List[RowResult]:
    """The reference rows again, the way the server runs them (lite_runtime.engine.scheduler), teacher-forced: row i, a
    sequence of its own blocks, goes in piece by piece through the chunk graphs, each piece in the same call as a
    decode step of the rows already in (graph row B-1-i; the others idle, as the engine's are); once its last piece is
    in, it is stepped with them, and the next row starts. Each prompt goes in as two parts: its first half from
    position 0 in pieces of the largest chunk graph (as a prompt goes in while nothing else runs), then the rest from
    the middle in pieces of the smallest (as the next turn of a chat goes in after the prefix it kept, while others
    decode), whatever the sizes. One RowResult per row; graph `chunk_<C>[+<C>]`."""
    from lite_runtime.engine.runner import SequenceBlocks, StepRow

    results: List[RowResult] = []
    b, sizes = runner.batch_size, runner.chunk_sizes
    graph = "+".join(graph_key("chunk", n) if i == 0 else str(n) for i, n in enumerate(sizes))
    for batch in reference.batches:
        _scatter(runner)
        refs = batch.rows
        slots = [b - 1 - i for i in range(len(refs))]
        rows = [list(r.prompt) for r in refs]
        seqs = [SequenceBlocks(runner.pool) for _ in refs]
        done = [0] * len(refs)  # steps judged per row
        mine = [RowResult(len(results) + i, graph, len(r.prompt)) for i, r in enumerate(refs)]

        def judge(i: int, logits) -> None:
            mine[i].judge(done[i], logits, refs[i], tol)
            rows[i].append(refs[i].tokens[done[i]])
            done[i] += 1
            if progress is not None:
                progress(1)

        def pieces(prompt: List[int]) -> List[tuple]:
            return [(start, prompt[start:end]) for start, end in halves(len(prompt), sizes)]

        try:
            joining, queue = 0, pieces(rows[0])
            while joining < len(refs) or any(0 < d < len(r.tokens) for d, r in zip(done, refs)):
                live = {slots[i]: i for i in range(joining) if done[i] < len(refs[i].tokens)}
                step = runner.idle()
                for row, i in live.items():
                    seqs[i].reserve(len(rows[i]))
                    step[row] = StepRow(rows[i][-1], len(rows[i]), seqs[i].blocks)
                if joining < len(refs):
                    start, piece = queue.pop(0)
                    seqs[joining].reserve(start + len(piece))
                    logits, last = runner.chunk(piece, start, seqs[joining].blocks, step)
                else:
                    logits = runner.step(step)
                for row, i in live.items():
                    judge(i, logits[row])
                if joining < len(refs) and not queue:  # its last piece: its first step is judged, it decodes from now
                    judge(joining, last)
                    joining += 1
                    queue = pieces(rows[joining]) if joining < len(refs) else []
        finally:
            for seq in seqs:
                seq.release(commit=False)
        for r in mine:
            r.close(tol)
        results.extend(mine)
    return results


def replay_scores(runner, reference: Reference, tol: Tolerance, progress=None) -> List[RowResult]:
    """The reference rows once more through the score graphs (every position's logits: speculative decoding's verify,
    prompt logprobs, perplexity), teacher-forced: the first row of each reference batch (one prompt per prefill
    bucket: short and long prompts both, at a third of the time of every row; the graphs' arithmetic is the chunk
    graphs', which replay_chunks holds on every row); its prompt and reference tokens go into a sequence of its own
    as pieces, the first half of the sequence in pieces of the largest score graph, the rest in pieces of the smallest
    (as a verify of draft tokens goes in), and the logits at every position from the prompt's last on are judged
    against that step of the reference: a whole continuation per piece. One RowResult per row; graph
    `score_<C>[+<C>]`."""
    from lite_runtime.engine.runner import SequenceBlocks

    results: List[RowResult] = []
    sizes = runner.score_sizes
    graph = "+".join(graph_key("score", n) if i == 0 else str(n) for i, n in enumerate(sizes))
    row_index = 0
    for batch in reference.batches:
        for i, ref in enumerate(batch.rows):
            row_index += 1
            if i:
                continue
            mine = RowResult(row_index - 1, graph, len(ref.prompt))
            seq = list(ref.prompt) + list(ref.tokens[:-1])
            first = len(ref.prompt) - 1  # the position whose logits give step 0
            _scatter(runner)
            cache = SequenceBlocks(runner.pool)
            try:
                cache.reserve(len(seq))
                for start, end in halves(len(seq), sizes):
                    _, logits = runner.chunk(seq[start:end], start, cache.blocks, runner.idle(), every=True)
                    for pos in range(max(start, first), end):
                        mine.judge(pos - first, logits[pos - start], ref, tol)
                        if progress is not None:
                            progress(1)
            finally:
                cache.release(commit=False)
            mine.close(tol)
            results.append(mine)
    return results
