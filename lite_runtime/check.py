"""python -m lite_runtime.check <folder>: does this machine's engine compute what the checkpoint means?

Replays the folder's golden references (golden.json, computed in float32 from the checkpoint at
export) through the chosen backend and compares greedy tokens and top-k logits, with limits set by
the folder's dtype (lite_runtime/golden.py). Needs only what the folder needs to run: on an Atlas
server mindspore_lite, numpy and pyyaml; no torch, transformers or MindSpore.

Exit code 0 when every prompt passes, 1 when one fails, 2 when the folder cannot be checked.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from lite_runtime.backends import CHOICES, mslite_importable
from lite_runtime.backends.standins import describe
from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError
from lite_runtime.folder import graph_rows
from lite_runtime.golden import (ACTIVATION_LABELS, TOLERANCES, Reference, RowResult, Tolerance, fast_mode,
                                 folder_limits, load_golden, replay, replay_chunks, replay_scores, tolerance_for)
from lite_runtime.versions import environment

SEND_BACK = ("rerun with --json report.json and send that file, with the folder's manifest.json and yaml, "
             "to whoever exported the folder")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lite_runtime.check",
        description="Replay a model folder's golden references (fixed prompts with the checkpoint's float32 greedy "
                    "tokens and top-k logits, stored at export) on this machine and report, per prompt, the first "
                    "step where the greedy tokens diverge, the logit error and top-1 agreement. Exit code 0: pass, "
                    "1: fail, 2: the folder cannot be checked.")
    p.add_argument("model_dir", help="model folder written by python -m export")
    p.add_argument("--backend", choices=CHOICES, default="auto",
                   help="mslite (Atlas, GE), ms (MindSpore, CPU) or auto: mslite when importable and the folder "
                        "targets Ascend (default)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the full report as JSON to FILE")
    p.add_argument("--device_id", type=int, default=None, help="Ascend device to run on (default 0)")
    p.add_argument("--rank_id", type=int, default=None,
                   help="mslite, tensor-parallel folders: this process's rank (default: $RANK_ID, else 0)")
    p.add_argument("--rank_table_file", default=None,
                   help="mslite, tensor-parallel folders: the HCCL rank table (default: $RANK_TABLE_FILE)")
    p.add_argument("--ge_cache_dir", default=None,
                   help="mslite: root of GE's compile cache (default ~/.cache/mslite-llm/ge; 'none' turns it off)")
    from lite_runtime.engine.kv_pool import add_pool_arguments

    add_pool_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("-v", "--verbose", action="store_true", help="log which backend was chosen and why")
    return p


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@dataclass
class Report:
    name: str
    backend: str
    dtype: str
    tolerance: Tolerance
    reference: str
    rows: List[RowResult]
    info: Dict[str, Any] = field(default_factory=dict)  # environment, versions, the folder's settings
    graph: str = "plain"  # the folder's graph form
    standins: Dict[str, int] = field(default_factory=dict)  # fused op -> nodes the backend ran as CPU stand-ins
    # a quantized or bfloat16 CPU folder: the limit of its replay through the fast path (int16 or bfloat16
    # activations), whose rows' graph ends with FAST_SUFFIX; `tolerance` then holds the other replays, run with x
    # exact (lite_runtime/golden.py folder_limits)
    fast: Optional[Tolerance] = None
    fast_mode: str = "int16"  # the fast path's activations (lite_runtime/golden.py FAST_MODES)
    # a bfloat16 CPU folder exported before its bf16 limit, on a machine whose kernels serve it in the AVX512-BF16
    # form, or an int4 one exported before its int8 limit: what check could not replay, said in a line of its own
    unreplayed: Optional[str] = None

    def _split(self):
        """(the rows held to `tolerance`, the fast path's rows)."""
        return ([r for r in self.rows if not r.graph.endswith(FAST_SUFFIX[self.fast_mode])],
                [r for r in self.rows if r.graph.endswith(FAST_SUFFIX[self.fast_mode])])

    def activations_line(self) -> Optional[str]:
        """For a quantized or bfloat16 CPU folder: how its matmuls ran in each replay, and where each limit comes
        from."""
        if self.fast is None:
            return self.unreplayed
        what, served = FAST_WORDS[self.fast_mode]
        line = (f"activations: the {what} ran with x exact (float32's arithmetic; limit "
                f"{self.tolerance.rel:.1e}), then as they serve, {served} (limit "
                f"{self.fast.rel:.1e}, the rows marked {FAST_SUFFIX[self.fast_mode]}); both limits derived for this "
                "folder at export from its own arithmetic (golden.json 'limits')")
        return line if self.unreplayed is None else f"{line}\n{self.unreplayed}"

    def form_line(self) -> str:
        """Which graph form ran, and what was substituted: the stand-ins prove the wiring, not Ascend's kernels; on
        the CPU, which code path of the kernels ran (ISA, and the quantized matmuls' decode form)."""
        ops = describe(self.standins)
        path = self.info.get("cpu_kernels_path")
        kernels = f"; CPU kernels: {path}" if path else ""
        if self.info.get("direct_steps"):
            kernels += f"; run directly, not by MindSpore's executor: {', '.join(self.info['direct_steps'])}"
        if ops is None:
            return f"graph form: {self.graph}{kernels}"
        return (f"graph form: {self.graph}; Ascend's fused operators ran as CPU stand-ins ({ops}): this proves the "
                f"graphs' wiring, not Ascend's kernels; run check on the device for those{kernels}")

    def step_graphs_line(self) -> str:
        """How many decode calls each inc graph ran: the replays take them in turn, so each is proved."""
        steps = self.info.get("step_graphs") or {}
        batch = self.info.get("folder", {}).get("batch_size")
        return "decode calls by inc graph (rows): " + ", ".join(f"{k} ({graph_rows(k, batch)}): {n}"
                                                               for k, n in steps.items())

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def verdict(self) -> str:
        steps = sum(r.steps for r in self.rows)
        main, fast = self._split()
        worst = max((r.max_rel for r in main), default=0.0)
        limit = self.tolerance.limit_text()
        ties = sum(len(r.near_ties) for r in self.rows)
        tie_note = f"; {ties} near-tie step(s) reported, not failed" if ties else ""
        routed = [r for r in self.rows if r.routing_tie is not None]
        if routed:  # a mixture of experts' near-tied routing (lite_runtime/golden.py RowResult.judge)
            tie_note += (f"; {len(routed)} run(s) judged up to a token whose expert routing is a near tie, reported "
                         f"after it (worst {max(r.routing_max_rel for r in routed):.1e} relative)")
        prompts = _count(len({r.prompt for r in self.rows}), "prompt")
        chunks = any(r.graph.startswith("chunk_") for r in self.rows)  # replay_chunks ran every prompt a second way
        scores = any(r.graph.startswith("score_") for r in self.rows)  # replay_scores: one prompt per batch
        slots = chunks or scores or bool(fast)
        paths = (" (each through the prefill graphs" + (" and through the chunk graphs" if chunks else "")
                 + ("; one per bucket through the score graphs" if scores else "")
                 + (f"; again through the {_fast_graphs(fast)} with {ACTIVATION_LABELS[self.fast_mode]}"
                    if fast else "")
                 + ")") if slots else ""
        fast_note = ""
        if fast:
            fast_note = (f"; with {ACTIVATION_LABELS[self.fast_mode]} within {max(r.max_rel for r in fast):.1e} (limit "
                         f"{self.fast.rel:.1e}, derived for this folder)")
        if self.passed:
            return (f"PASS {self.name} on backend {self.backend}: {prompts}{paths}, {steps} steps, greedy "
                    f"tokens identical, top-k logits within {worst:.1e} relative {limit}{fast_note}{tie_note}")
        bad = [r for r in self.rows if not r.passed]
        runs = f"{len(bad)} of {len(self.rows)} runs of {prompts}{paths}" if slots else \
            f"{len(bad)} of {len(self.rows)} prompts"
        diverged = [r for r in bad if any("greedy token" in f for f in r.failures)]
        if diverged:
            r, d = diverged[0], diverged[0].divergence or {}
            what = (f"greedy tokens diverge in prompt {r.prompt} ({r.graph}) at step {r.first_divergence}: device "
                    f"token {d.get('device_token')}, reference {d.get('reference_token')}")
        else:
            what = f"prompt {bad[0].prompt} ({bad[0].graph}): {bad[0].failures[0]}"
        return (f"FAIL {self.name} on backend {self.backend}: {runs} fail; {what}; "
                f"worst logit error {worst:.1e} relative {limit}{fast_note}")

    def table(self) -> str:
        head = ("prompt", "graph", "tokens", "steps", "diverges at", "top-1", "max abs err", "max rel err", "result")
        lines = [head]
        for r in self.rows:
            where = "-" if r.first_divergence is None else str(r.first_divergence)
            result = "ok" if r.passed else "FAIL"
            if r.near_ties:
                result += f" (near tie at {', '.join(map(str, r.near_ties))})"
            if r.routing_tie is not None:
                result += f" (routing near tie from step {r.routing_tie})"
            lines.append((str(r.prompt), r.graph, str(r.prompt_tokens), str(r.steps), where,
                          f"{r.top1_agree}/{r.steps}", f"{r.max_abs:.2e}", f"{r.max_rel:.2e}", result))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)

    def to_dict(self) -> Dict[str, Any]:
        return {"verdict": self.verdict(), "passed": self.passed, "name": self.name, "backend": self.backend,
                "graph": self.graph, "standins": dict(self.standins),
                "dtype": self.dtype, "tolerance": asdict(self.tolerance),
                **({} if self.fast is None else {"fast_tolerance": asdict(self.fast)}), "reference": self.reference,
                "rows": [{**asdict(r), "passed": r.passed} for r in self.rows], "info": self.info}


def run_check(model_dir: str, backend: str = "auto", reference: Optional[Reference] = None, progress=None,
              **overrides) -> Report:
    """Load `model_dir` (every file hashed again), replay `reference` (default: the folder's golden.json)."""
    overrides.setdefault("verify_checksums", "always")
    return check_config(InferConfig.from_folder(model_dir, backend=backend, **overrides), reference, progress)


def check_config(config: InferConfig, reference: Optional[Reference] = None, progress=None,
                 tolerance: Optional[Tolerance] = None) -> Report:
    """run_check for a folder already read into `config` (its checksums verified then). `reference`: another
    reference than the folder's golden.json (export.compare's HF), held to `tolerance` (default: the folder's).

    A quantized or bfloat16 CPU folder whose golden.json carries derived limits (lite_runtime/golden.py
    folder_limits) replays with its matmuls' x exact (cpu_kernels ACTIVATIONS_EXACT: float32's arithmetic) against
    the tight limit, then once through the prefill graphs as it serves (x rounded to int16, or to bfloat16 in the
    AVX512-BF16 form) against that path's limit. A bfloat16 CPU folder exported before its limit replays with x
    exact against float32's, and the report says when this machine serves it in a form it did not replay."""
    from lite_runtime.task import pipeline

    backend = config.backend
    folder = config.folder
    golden = reference is None
    if reference is None:
        reference = load_golden(folder)
    if reference is None:
        raise InferError(f"{folder.path}: no golden references (golden.json); the folder was exported before "
                         "mslite-llm wrote them: re-export it with python -m export to check it")
    cpu_kernels = folder.infer.get("device") == "cpu" and bool(folder.infer.get("cpu_kernels"))
    quantized_cpu = folder.quantization is not None and cpu_kernels
    # bfloat16 matrices on the CPU kernels: their matmuls of several rows round x to bfloat16 where the CPU has
    # AVX512-BF16 (cpu_kernels.bf16_form)
    bf16_cpu = folder.quantization is None and cpu_kernels and folder.infer.get("dtype") == "bfloat16"
    limits = folder_limits(reference) if (quantized_cpu or bf16_cpu) and golden else None
    mode = fast_mode(limits)
    if tolerance is None:
        # a CPU folder with 16-bit weights: float32's, on rounded weights; a quantized CPU folder: its derived limits
        # (one exported before them: the int16 activations' constant); against HF (export.compare), with x exact,
        # float32's
        if limits:
            tolerance = limits["exact"]
        elif quantized_cpu and not golden:
            tolerance = TOLERANCES["float32"]
        else:
            tolerance = tolerance_for(config.compute_dtype, folder.quantization is not None, cpu_kernels)
    if tolerance is None:
        raise InferError(f"{folder.yaml_path}: dtype {config.compute_dtype!r} has no check limits; known: "
                         f"{', '.join(TOLERANCES)}")
    start = time.perf_counter()
    slots = any(g.role == "chunk" for g in config.folder.graphs.values())  # every folder but tensor-parallel ones
    if slots:  # the server's path too: its chunk graph, each prompt in pieces into its own row, joining a running batch
        config = dataclasses.replace(config, chunk_graphs=True)
    # a folder whose KV cache is bfloat16 as it serves (a CPU folder of a bfloat16 dtype, cpu_kernels/paged.h): its
    # replays with x exact run it with float32 caches, float32's arithmetic end to end, against the reference's rows
    # (which keep float32 keys and values); the fast replay runs it as it serves, bfloat16 caches, against the fast
    # lane's limit (which rounds them as the cache does: export/writers/golden.py)
    kv16 = cpu_kernels and folder.kv_cache.dtype == "bfloat16"
    counts: Dict[str, int] = {}  # inc graph -> decode steps it ran, over every replay

    generator = pipeline("text_generation", model=dataclasses.replace(config, kv_cache_dtype="float32") if kv16 else
                         config, backend=backend)
    generator.runner.cycle_step_graphs, generator.runner.step_counts = True, counts  # every inc graph takes its turn
    generator.runner.prefill_in_pieces = False  # its prefill replays prove the prefill graphs themselves
    loaded = time.perf_counter() - start
    # against golden's tight limit, or HF's float32, or (a bfloat16 folder before its limit) float32's constant
    exact = (quantized_cpu and (limits is not None or not golden)) or bf16_cpu
    runner = generator.runner

    def replay_every_graph(limit) -> List[RowResult]:
        """The prefill graphs, the chunk graphs (the server's pieces), the score graphs (every position of a piece:
        speculation, echo, perplexity)."""
        out = replay(generator, reference, limit, progress=progress)
        if slots:
            out += replay_chunks(runner, reference, limit, progress=progress)
        if runner.score_sizes:
            out += replay_scores(runner, reference, limit, progress=progress)
        return out

    with _activations("exact" if exact else None):
        rows = replay_every_graph(tolerance)
    if mode is not None:  # the path that serves: the kernels' default (int8 for int4 weights, int16 for int8 ones,
        # and the AVX512-BF16 form), or int16 for a folder whose limit is int16's (an int4 one exported before int8's);
        # every graph: the forms some row counts take (a verify's 9 rows, a piece's) are replayed at those counts
        if kv16:  # as it serves: its bfloat16 caches, the graphs rebuilt over the same weights
            standins = dict(generator.backend.standins)
            generator.release()
            runner.use_cache_dtype(None)
            for op, n in standins.items():
                generator.backend.standins[op] = max(n, generator.backend.standins.get(op, 0))
        with _activations(FAST_KERNEL_MODE[mode]):
            fast = replay_every_graph(limits[mode])
        for r in fast:
            r.graph += FAST_SUFFIX[mode]
        rows += fast
    runner.cycle_step_graphs = False
    unproved = [k for k in runner.step_graphs.values() if not counts.get(k)]
    if unproved and rows:  # no step fitted them (more rows than any replay steps): say so in a row of its own
        gap = RowResult(len(rows), "+".join(unproved), 0)
        gap.failures.append(f"no decode step of the replays ran the inc graph(s) {', '.join(unproved)}")
        rows.append(gap)
    info = {"environment": environment(generator.backend_name), "exported_with": folder.exported_with,
            "folder": {k: folder.infer.get(k) for k in ("device", "soc", "dtype", "seq_length", "batch_size",
                                                        "prefill_buckets", "chunk_sizes", "score_sizes", "cpu_kernels", "tp_size",
                                                        "graph")},
            "load_seconds": round(loaded, 2), "replay_seconds": round(time.perf_counter() - start - loaded, 2)}
    try:
        with open(folder.ge_config_path, encoding="utf-8", errors="replace") as fh:
            info["ge_config"] = fh.read()
    except OSError:
        pass
    path = kernels_path(generator.backend_name, folder) if folder.infer.get("cpu_kernels") or \
        generator.backend.standins else None
    if path:
        info["cpu_kernels_path"] = path
    plans = sorted(getattr(generator.backend, "plans", {}))
    if plans:  # the graphs that ran as direct steps (lite_runtime/backends/direct.py), the rest through MindSpore
        info["direct_steps"] = plans
    standins = dict(generator.backend.standins)
    info["standins"] = standins
    info["kv_cache"] = generator.runner.pool_plan.line() + "; every replay's block tables shuffled (not contiguous)" + (
        "; bfloat16 as the folder serves it in the replays" + (" with its fast path's activations, float32 in those "
                                                               "with x exact" if mode else "") if kv16 else "")
    info["step_graphs"] = dict(sorted(counts.items(), key=lambda kv: graph_rows(kv[0], runner.batch_size)))
    if exact:
        info["quant_activations"] = {"replays": "exact", **({"fast replay": mode} if mode else {})}
    if kv16:
        info["kv_cache_dtype"] = {"replays with x exact": "float32" if mode else "bfloat16",
                                  **({"fast replay": "bfloat16"} if mode else {})}
    unreplayed = None
    if bf16_cpu and mode is None and golden and _bf16_form(generator.backend_name) == "avx512_bf16":
        unreplayed = ("activations: replayed with x exact only; this machine serves the folder's steps of several "
                      "rows in the AVX512-BF16 form (x rounded to bfloat16), which was not replayed: golden.json "
                      "predates its limit; re-export the folder with python -m export to check that form")
    elif mode == "int16" and _serves_int8(folder, generator.backend_name):
        bits = folder.quantization["bits"]
        unreplayed = (f"activations: the fast replay ran x in int16 (matrices this installation bands, in float32), "
                      f"what golden.json's limit covers; this installation serves the int{bits} matmuls with x in int8 "
                      "(MSLITE_LLM_QUANT_ACTIVATIONS=int16 serves them as replayed): golden.json predates the int8 "
                      "form's limit; re-export the folder with python -m export to check that form")
    return Report(name=folder.name, backend=generator.backend_name, dtype=config.compute_dtype, tolerance=tolerance,
                  reference=reference.source, rows=rows, info=info, graph=folder.graph_form, standins=standins,
                  fast=None if mode is None else limits[mode], fast_mode=mode or "int16", unreplayed=unreplayed)


def _fast_graphs(rows) -> str:
    """The graphs the fast replay's rows ran: 'prefill graphs', '..., chunk graphs and score graphs'."""
    roles = [name for prefix, name in (("prefill", "prefill"), ("chunk_", "chunk"), ("score_", "score"))
             if any(r.graph.startswith(prefix) for r in rows)] or ["prefill"]
    return (", ".join(roles[:-1]) + " and " + roles[-1] if len(roles) > 1 else roles[0]) + " graphs"


def _serves_int8(folder, backend: str) -> bool:
    """Whether this installation serves the folder's quantized matmuls with x in int8 in the default activations
    mode: int4 on every form, int8 on AVX-512 VNNI (its bands)."""
    kernels = _kernels(backend)
    bits = (folder.quantization or {}).get("bits")
    return kernels is not None and (bits == 4 or (bits == 8 and kernels.quant_form() == "avx512_vnni"))


def _kernels(backend: str):
    """The cpu_kernels module where `backend` runs them (ms), else None (mslite, or not installed)."""
    if backend != "ms":
        return None
    try:
        import cpu_kernels
    except ImportError:
        return None
    return cpu_kernels


def _bf16_form(backend: str) -> Optional[str]:
    """The CPU kernels' form for bfloat16 weights (cpu_kernels.bf16_form) where they ran, else None."""
    cpu_kernels = _kernels(backend)
    return None if cpu_kernels is None else cpu_kernels.bf16_form()


def kernels_path(backend: str, folder) -> Optional[str]:
    """The CPU kernels' code path that ran ("avx512, quantized decode avx512_vnni", and ", rows by amx" where banded
    int8 or int4 weights take AMX tiles for several rows: a verify, sequences in a step, a prompt; "avx512, bfloat16
    rows avx512_bf16 and amx" likewise for bfloat16 weights), None when none of them did (the mslite backend, a folder
    without them)."""
    cpu_kernels = _kernels(backend)
    if cpu_kernels is None:
        return None
    isa = cpu_kernels.isa()
    if isa is None:
        return None
    if folder.quantization is not None:
        bits = folder.quantization.get("bits")
        tiles = bits in (4, 8) and cpu_kernels.bands_here(bits) and cpu_kernels.tiles() == "amx"
        return f"{isa}, quantized decode {cpu_kernels.quant_form()}" + (", rows by amx" if tiles else "")
    if folder.infer.get("dtype") == "bfloat16":
        return f"{isa}, bfloat16 rows {cpu_kernels.bf16_form()}" + (" and amx" if cpu_kernels.tiles() == "amx" else "")
    return isa


FAST_SUFFIX = {"int16": "@int16", "int8": "@int8", "bf16": "@bf16"}  # the graph label's end of the fast path's replay
# rows, by mode
# the kernels' activation mode (cpu_kernels.set_quant_activations) of the fast path's replay, by the folder's mode
FAST_KERNEL_MODE = {"int16": "int16", "int8": "int8", "bf16": "int8"}
# per fast mode: (what ran with x exact, how x is rounded as the folder serves)
FAST_WORDS = {"int16": ("quantized matmuls", "x rounded to int16 per block of 32"),
              "int8": ("quantized matmuls", "x rounded to int8 per block of 32 where the form takes it so (int4 "
                                            "weights; int8 ones in bands, on AVX-512 VNNI; a prompt's rows too where "
                                            "the weights are in bands; int16 at others)"),
              "bf16": ("bfloat16 matmuls", "x rounded to bfloat16 in the matmuls of several rows (AVX512-BF16: from "
                                           "5 rows, a prompt's too; float32's form where the CPU lacks it)")}


@contextlib.contextmanager
def _activations(mode: Optional[str]):
    """The CPU kernels' quantized matmuls with x `mode` (cpu_kernels.set_quant_activations) inside, the default after;
    None: as they are."""
    if mode is None:
        yield
        return
    import cpu_kernels

    cpu_kernels.set_quant_activations(mode)
    try:
        yield
    finally:
        cpu_kernels.set_quant_activations(None)


def print_report(report: Report, out=None) -> None:
    out = out or sys.stdout
    print(f"reference: {report.reference}", file=out)
    print(report.table(), file=out)
    print(report.form_line(), file=out)
    if report.activations_line():
        print(report.activations_line(), file=out)
    if report.info.get("kv_cache"):
        print(report.info["kv_cache"], file=out)
    if len(report.info.get("step_graphs") or ()) > 1:
        print(report.step_graphs_line(), file=out)
    print(report.verdict(), file=out)


@contextlib.contextmanager
def _progress_bar(quiet: bool):
    """The replay's steps as a tqdm bar on a terminal (none when stderr is not one, or with -q, or without tqdm: an
    Atlas box needs only Lite, numpy and pyyaml); yields the progress callback, or None."""
    if quiet:
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    with tqdm(desc="replay", unit="step", disable=None, leave=False) as bar:
        yield bar.update


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("device_id", args.device_id), ("ge_cache_dir", args.ge_cache_dir),
                                   ("rank_id", args.rank_id), ("rank_table_file", args.rank_table_file),
                                   ("num_blocks", args.num_blocks), ("kv_cache_memory", args.kv_cache_memory))
                 if v is not None}
    try:
        # the folder read and hashed first: nothing is said about loading a folder that is not one
        config = InferConfig.from_folder(args.model_dir, backend=args.backend, verify_checksums="always",
                                         **overrides)
        if not args.quiet:
            ge = args.backend == "mslite" or (args.backend == "auto" and config.target == "Ascend"
                                              and mslite_importable())  # where GE will compile
            print(f"loading {args.model_dir} (backend {args.backend}"
                  f"{'; GE compiles each graph on first use, minutes per graph' if ge else ''})",
                  file=sys.stderr, flush=True)
        with _progress_bar(args.quiet) as bar:
            report = check_config(config, progress=bar)
    except InferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print_report(report)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh, indent=2)
            fh.write("\n")
        print(f"report written to {args.json_path}", file=sys.stderr)
    if not report.passed:
        print(f"check failed: {SEND_BACK}" if not args.json_path else
              f"check failed: send {args.json_path}, with the folder's manifest.json and yaml, to whoever exported "
              "the folder", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
