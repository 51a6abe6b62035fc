"""run_export: checkpoint -> model folder, written into a temporary folder and renamed at the end.

The stages, in order (each reported in the summary with its time):
1. check: config.json, settings, the checkpoint's tensor names and shapes (headers only), the free space;
2. golden: the golden references from the float32 numpy reference (export/writers/golden.py), before any weight
   is written, so damaged weights fail early; a quantized folder's after stage 4, from the integers written;
3. compile: the network, built without weights (the same for every rank), each graph compiled into a proto
   without data (export/writers/graphs.py);
4. weights: every rank's weights file written once, streamed from the checkpoint (export/writers/weights_file.py);
5. files: the graph files pointing into it, tokenizer, config.ini, yaml and manifest (lite_runtime's contract);
   the weights files flushed to the disk and dropped from the page cache (weights_file.release_cache).
Memory is set by the largest chunk in flight and MindSpore's own footprint, not by the model; the disk holds
the folder and nothing else.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from tqdm import tqdm

from export.config import ExportConfig, ModelConfig
from export.devices import (default_buckets, default_chunks, default_scores, default_step_rows, get_profile, graph_form,
                            usage_lines)
from export.errors import ExportError
from export.writers import checkpoint_files
from export.writers.weights_file import release_cache
from lite_runtime.memory import anon_bytes

log = logging.getLogger(__name__)

GRAPH_BYTES_ESTIMATE = 16 << 20  # per graph, for the free-space check before the graphs exist (a 7B's: ~1 MB)


@dataclass
class ExportSummary:
    output: str
    files: int
    total_bytes: int
    weight_bytes: int
    seconds: float
    peak_anon_bytes: int  # peak anonymous memory (RssAnon) of the export: what it holds, not the page cache
    golden_prompts: int = 0
    golden_seconds: float = 0.0
    stages: Dict[str, float] = field(default_factory=dict)  # wall seconds per stage, in order
    weights: Dict[str, float] = field(default_factory=dict)  # busy seconds inside the weights stage
    device: str = "cpu"  # the device profile's name, and the folder's dtypes and graph form (usage_lines)
    dtype: str = "float32"
    compute_dtype: str = "float32"
    graph: str = "plain"
    quantization: Optional[str] = None  # the linear layers' method (QuantMethod.label), None: float weights
    notes: Tuple[str, ...] = ()  # what the export chose for the user (a group size that had to change, ...)
    agreement: Optional[Dict[str, Any]] = None  # a quantized folder against its checkpoint (golden.json)
    tables: str = ""  # a quantized folder's embedding and head, in words
    limits: Optional[Dict[str, Any]] = None  # check's limits derived for a quantized or bf16 CPU folder (golden.json)

    def line(self) -> str:
        return (f"exported {self.output}: {self.files} files, {_size(self.total_bytes)} "
                f"(weights {_size(self.weight_bytes)}), {self.seconds:.1f} s, peak anonymous memory "
                f"{_size(self.peak_anon_bytes)}; golden references: {self.golden_prompts} "
                f"prompt{'s' if self.golden_prompts != 1 else ''} in {self.golden_seconds:.2f} s")

    def quantization_lines(self) -> Tuple[str, ...]:
        """The linear layers' method, what was chosen, and how far the folder is from its checkpoint."""
        if self.quantization is None:
            return ()
        lines = [f"weights: linear layers {self.quantization}; {self.tables}"] + [
            f"note: {n}" for n in self.notes if "quantized:" not in n and "kept as" not in n]
        a = self.agreement
        if a:
            lines.append(f"against the checkpoint's float weights, over the golden prompts: greedy agreement "
                         f"{a['greedy_agreement']:.1%} of {a['tokens']} tokens, top-1 match {a['top1_match']:.1%}, "
                         f"largest logit error {a['max_logit_error']:.3g} (golden.json 'agreement')")
        return tuple(lines) + self.limits_lines()

    def limits_lines(self) -> Tuple[str, ...]:
        """check's limits derived for this folder (a quantized or bfloat16 CPU folder's), in a line; else none."""
        from lite_runtime.golden import ACTIVATION_LABELS, fast_mode

        mode = fast_mode(self.limits)
        if mode is None:
            return ()
        return (f"check's limits, derived from this folder's own arithmetic: {self.limits['exact']['rel']:.1e} "
                f"with x exact, {self.limits[mode]['rel']:.1e} as it serves ({ACTIVATION_LABELS[mode]}) "
                "(golden.json 'limits')",)

    def usage_lines(self, ascend_here: bool) -> Tuple[str, ...]:
        """What the folder is for, and how to check it (here too, when this machine has no Ascend device)."""
        return usage_lines(get_profile(self.device), self.dtype, self.compute_dtype, self.graph, self.output,
                           ascend_here)

    def stage_line(self) -> str:
        """Where the time went; the weights stage's work overlaps in threads, so its parts are busy times."""
        parts = [f"{name} {seconds:.1f} s" for name, seconds in self.stages.items()]
        w = self.weights
        if w:
            parts = [p + (f" (read+convert {w['convert']:.1f} s, hash {w['hash']:.1f} s, write {w['write']:.1f} s "
                          "busy)" if p.startswith("weights ") else "") for p in parts]
        return "time: " + ", ".join(parts)


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


class PeakAnon:
    """Samples this process's anonymous memory (RssAnon) while it runs: the memory the export itself holds. (The
    peak RSS also counts the checkpoint's pages the memory maps touched, which the kernel reclaims at will.)"""

    def __init__(self, interval: float = 0.05) -> None:
        self.peak = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), name="peak-anon", daemon=True)

    @staticmethod
    def _now() -> int:
        return anon_bytes()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, self._now())

    def __enter__(self) -> "PeakAnon":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())


def prepare(cfg: ExportConfig) -> tuple:
    """Every check that needs no weights: config.json, settings, device, the target folder."""
    model_cfg = ModelConfig.from_checkpoint(cfg.checkpoint)
    _moe_supported(cfg, model_cfg)
    profile = get_profile(cfg.device)
    cfg.validate(model_cfg, profile.dtypes)
    if os.path.exists(cfg.output) and not cfg.overwrite:
        raise ExportError(f"{cfg.output} already exists. Delete it or pass --overwrite")
    return model_cfg, profile


def _moe_supported(cfg: ExportConfig, model_cfg: ModelConfig, quant=None) -> None:
    """A mixture of experts exports for every device, of one rank or tensor parallel (every rank each expert's share
    of its columns): float experts in every form (export/network/moe.py: the CPU kernels' op, Ascend's fused MoE ops,
    or the plain ops); quantized experts in the CPU kernels' form, and in the fused form per channel, as
    GroupedMatmulV4's antiquant takes int8 (docs/architecture.md, "Mixture of experts"). `quant`: the folder's
    QuantMethod once resolved (--quantize, or a GPTQ/GGUF checkpoint's layers kept as they are); before, what
    --quantize asks. Anything else is refused by the option to change, before anything is written."""
    if not model_cfg.num_experts or (quant is None and cfg.quantize in (None, "none")):
        return
    what = (f"{cfg.checkpoint}: model_type {model_cfg.model_type!r} is a mixture-of-experts model, whose quantized "
            "experts")
    if cfg.device == "cpu":
        if not cfg.use_cpu_kernels():
            raise ExportError(f"{what} run only in the CPU kernels, which this export does not use; export with them "
                              "(the default where the library is built) or with --quantize none")
    elif cfg.graph == "plain":
        raise ExportError(f"{what} run on Atlas only in the fused form (GroupedMatmulV4's antiquant), which this "
                          "export does not take; export for an A2/A3 profile in float16 or bfloat16 without --graph "
                          "plain, or with --quantize none for float experts")
    elif quant is not None and quant.group_size:
        raise ExportError(f"{what} run on Atlas through GroupedMatmulV4, whose antiquant takes int8 per channel only "
                          f"(int4 in groups only without offsets), and this folder's are {quant.label()}: export "
                          "with --group_size 0 (per channel), or with --quantize none for float experts")


def resolve(cfg: ExportConfig, model_cfg: ModelConfig) -> ExportConfig:
    """`cfg` with the device's defaults filled in: the prompt-length buckets when none were given, the graph form."""
    profile = get_profile(cfg.device)
    buckets = cfg.prefill_buckets
    if buckets is None:
        buckets = default_buckets(profile, cfg.seq_length)
    graph = graph_form(profile, cfg.dtype, cfg.graph, model_cfg.head_dim, model_cfg.kv_groups)
    chunks, scores = cfg.chunk_sizes, cfg.score_sizes
    steps = cfg.step_rows
    if steps is None:  # tensor-parallel folders: none by default, as they have no chunk graphs (the server's)
        steps = default_step_rows(profile, cfg.batch_size) if cfg.tp_size == 1 else ()
    if cfg.tp_size > 1:  # the server does not serve tensor-parallel folders (lite_runtime/serve/cli.py)
        chunks = scores = ()
    else:
        if chunks is None:
            chunks = default_chunks(profile, cfg.seq_length, cfg.dtype)
        if scores is None:
            scores = default_scores(profile, cfg.seq_length)
    return dataclasses.replace(cfg, prefill_buckets=buckets, graph=graph, chunk_sizes=chunks, score_sizes=scores,
                               step_rows=tuple(sorted(set(steps))), block_size=cfg.block_size or profile.block_size)


# what each stage does, in order, for a person watching (run_export's on_stage)
STAGES = {"check": "checking the checkpoint and the settings", "golden": "golden references (float32 numpy reference)",
          "compile": "compiling the graphs", "weights": "writing the weights", "files": "writing the folder's files"}


def run_export(cfg: ExportConfig, show_progress: bool = False,
               on_stage: Optional[Callable[[str], None]] = None) -> ExportSummary:
    """Export `cfg.checkpoint` to `cfg.output`. Nothing is left behind if it fails.

    show_progress: tqdm bars, on a terminal only (tqdm's disable=None: piped to a file they would leave
    `\r`-joined lines). on_stage: called with each stage's STAGES text as it starts (the CLI prints it when the bars
    are off)."""
    with PeakAnon() as memory:
        summary = _run_export(cfg, show_progress, on_stage or (lambda _: None))
    summary.peak_anon_bytes = memory.peak
    return summary


def _run_export(cfg: ExportConfig, show_progress: bool, on_stage: Callable[[str], None]) -> ExportSummary:
    from export.writers.graphs import graph_plan
    from export.checkpoints import open_checkpoint

    start = time.time()
    stages: Dict[str, float] = {}
    model_cfg, profile = prepare(cfg)
    cfg = resolve(cfg, model_cfg)
    where = open_checkpoint(cfg.checkpoint)
    quant, tables, quant_notes = _quantization(cfg, model_cfg, profile, where)
    _moe_supported(cfg, model_cfg, quant)
    for note in quant_notes:
        log.warning("%s", note) if note.startswith("group size") else log.info("%s", note)
    output = os.path.abspath(cfg.output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    _sweep_leftovers(parent)
    log.info("stage check")
    on_stage(STAGES["check"])
    network, layouts, values, where = _plan(cfg, model_cfg, where, quant, tables)
    n_graphs = len(graph_plan(cfg)) * cfg.tp_size
    _check_space(parent, sum(layout.size for layout in layouts) + n_graphs * GRAPH_BYTES_ESTIMATE
                 + _small_files_bytes(cfg.checkpoint, profile))
    stages["check"] = time.time() - start
    tmp = os.path.join(parent, f".{os.path.basename(output)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    early = None
    try:
        # the golden before the graphs: its float32 working set and what MindSpore keeps after compiling (~0.35 GiB
        # at 7B) then never coexist, and damaged weights fail before minutes of compiling. A quantized folder's
        # after its weights: the reference reads the integers written (export/network/quantize.py FolderMeaning) instead
        # of quantizing every layer again on each of its passes (docs/architecture.md, "Quantized folders")
        if quant is None:
            doc = _timed(stages, "golden", on_stage, _write_golden, cfg, model_cfg, tmp, show_progress)
        else:  # the agreement's prefill of the checkpoint's prompts meanwhile, on what compile leaves of the cores
            early = _agreement_prefill(cfg, model_cfg)
        graphs = _timed(stages, "compile", on_stage, _compile, cfg, network, show_progress)
        hashed, stats = _timed(stages, "weights", on_stage, _write_weights, tmp, layouts, where, values, show_progress)
        if quant is not None:
            doc = _timed(stages, "golden", on_stage, _write_golden, cfg, model_cfg, tmp, show_progress,
                         (quant, tables), layouts, early)
            early = None
        _timed(stages, "files", on_stage, _write_folder_files, cfg, model_cfg, profile, tmp, graphs, layouts, hashed,
               network.kernels, network.vocab_shards > 1, (quant, tables))
        release_cache(tmp, layouts)  # on disk before the folder is in place, and out of the page cache
        _replace(tmp, output)
    except OSError as exc:
        _cancel(early)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(_os_error_line(exc, tmp, output)) from None
    except BaseException:
        _cancel(early)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(output) for f in fs)
    files = sum(len(fs) for _, _, fs in os.walk(output))
    prompts = sum(len(b["rows"]) for b in doc["batches"])
    return ExportSummary(cfg.output, files, total, stats.bytes_written, time.time() - start, 0,
                         golden_prompts=prompts, golden_seconds=doc["seconds"], stages=stages,
                         weights={"convert": stats.convert_seconds, "hash": stats.hash_seconds,
                                  "write": stats.write_seconds},
                         device=profile.name, dtype=cfg.dtype, compute_dtype=cfg.compute_dtype, graph=cfg.graph,
                         quantization=None if quant is None else quant.label(), notes=quant_notes,
                         tables="" if tables is None else tables.text(),
                         agreement=doc.get("agreement"), limits=doc.get("limits"))


def _timed(stages: Dict[str, float], name: str, on_stage: Callable[[str], None], fn, *args):
    log.info("stage %s", name)
    on_stage(STAGES[name])
    start = time.time()
    try:
        return fn(*args)
    finally:
        stages[name] = time.time() - start


def _quantization(cfg: ExportConfig, model_cfg: ModelConfig, profile, where):
    """The folder's QuantMethod and TablePlan (or None, None) and notes for the user; refused where the device cannot
    run it, or where a tensor-parallel split would cut a group."""
    from export.config import tensor_parallel_config
    from export.checkpoints.methods import is_linear
    from export.network.quantize import resolve, resolve_tables

    tp = cfg.tp_size
    rank = tensor_parallel_config(model_cfg, tp) if tp > 1 else model_cfg
    heads = rank.num_attention_heads * rank.head_dim
    inputs = [model_cfg.hidden_size, heads, rank.intermediate_size] + (
        [rank.moe_intermediate_size] if model_cfg.num_experts else []) + (
        [model_cfg.shared_expert_intermediate_size] if model_cfg.shared_expert_intermediate_size else [])
    method, notes = resolve(cfg.quantize, cfg.group_size, where, inputs, cfg.checkpoint)
    tied = bool(model_cfg.tie_word_embeddings)
    tables = resolve_tables(cfg.quantize_tables, method, where, tied, model_cfg.hidden_size, cfg.dtype,
                            profile.quant_bits, profile.quant_groups, atlas=cfg.device != "cpu")
    if method is None:
        return None, None, notes
    if method.source != "rtn" and cfg.compute_dtype != "float32":
        # what the folder's compute dtype cannot hold as the checkpoint gives it (its scales, Q4_1's offsets)
        if cfg.compute_dtype == "bfloat16":
            notes.append(f"the checkpoint's float16 scales are rounded to bfloat16 (--dtype bfloat16); --dtype "
                         "float16 keeps them as published")
        if method.source == "gguf:Q4_1":
            notes.append(f"Q4_1's offsets (8 + m / d per block) are rounded to {cfg.compute_dtype}, the "
                         "WeightQuantBatchMatmul offset's dtype (the golden references use the rounded values)")
    if method.bits not in profile.quant_bits:
        supported = ", ".join(f"int{b}" for b in profile.quant_bits) or "none"
        raise ExportError(f"--device {profile.name} ({profile.hardware}): {method.label()} is not supported there "
                          f"(WeightQuantBatchMatmul on {profile.soc or 'this device'}: {supported}); "
                          + ("export --quantize int8" if profile.quant_bits else "export float weights (--quantize none)"))
    if method.group_size and not profile.quant_groups:
        raise ExportError(f"--device {profile.name} ({profile.hardware}): {method.label()}: its "
                          "WeightQuantBatchMatmul takes per-channel scales only; export --quantize int8 --group_size 0")
    if tp > 1:
        for name in (n for n in where if is_linear(n) and n.endswith(("o_proj.weight", "down_proj.weight"))
                     and ".shared_expert." not in n):  # Qwen2-MoE's shared expert: every rank's, whole
            share = where[name].shape(name)[1] // tp
            if (method.group_size and share % method.group_size) or (method.bits == 4 and share % 2):
                other = "--group_size 0" if method.source == "rtn" else "--quantize none for float weights"
                raise ExportError(f"{cfg.checkpoint}: --tp_size {tp} would cut {name}'s groups of "
                                  f"{method.group_size} ({share} inputs per rank); pick a --tp_size whose share is a "
                                  f"multiple of the group size, or {other}")
    return method, tables, notes


def _plan(cfg: ExportConfig, model_cfg: ModelConfig, where, quant=None, tables=None):
    """The network (no weights; every rank's is the same), each rank's weights file layout, the values the export
    generates per rank, and the tensors the weights file is written from (a quantized folder's: export/network/quantize.py
    FolderTensors); the checkpoint's names and shapes checked first."""
    import numpy as np

    from export.checkpoints import plan_weights
    from export.writers.graphs import Network
    from export.writers.reference import weight_shapes
    from export.writers.weights_file import plan_layouts, split_axis
    from lite_runtime.folder import data_location, rank_name
    from lite_runtime.mindspore_lock import MINDSPORE_LOCK

    # names and shapes, by name, before anything runs (the reference reads exactly the network's weights:
    # tests/test_golden.py)
    plan_weights(weight_shapes(model_cfg), where, tied=bool(model_cfg.tie_word_embeddings))
    with MINDSPORE_LOCK:
        network = Network(cfg, model_cfg, quant, tables)
    params = network.parameters()
    if quant is not None:
        from export.network.quantize import Quantized

        where = Quantized(where, quant, cfg.compute_dtype, _native_loader(where), tables).folder_tensors()
    if model_cfg.num_experts:  # the graphs read each layer's experts stacked, each expert's folder tensors
        from export.writers.stacked import stack_experts  # (export/writers/stacked.py)

        where = stack_experts(model_cfg, where, params, cfg.tp_size, transposed=cfg.graph == "fused")
    tp, shards = cfg.tp_size, network.vocab_shards
    splits = {}
    if tp > 1:
        for name in params:
            axis = split_axis(name, vocab_parallel=shards > 1, transposed_experts=cfg.graph == "fused")
            # a per-channel scale of a row-parallel layer is every rank's: [1, O] whole
            if axis is not None and name in where and where[name].shape(name)[axis] == params[name][0][axis]:
                axis = None
            splits[name] = axis
    # vocab-parallel: each rank's first vocabulary row (export/network/model.py Embedding)
    values = {"model.embed_tokens.vocab_start": [np.array([r * (model_cfg.vocab_size // shards)], np.int32)
                                                 for r in range(tp)]} if shards > 1 else {}
    locations = [data_location(rank_name(cfg.name, rank, tp)) for rank in range(tp)]
    return network, plan_layouts([params] * tp, where, locations, splits, values), values, where


def _quant_record(quant) -> Optional[Dict[str, Any]]:
    """The manifest's, the yaml's and golden.json's `quantization` (export/network/quantize.py QuantMethod.record) of a
    (QuantMethod, TablePlan) pair, or None for a float folder."""
    method, tables = quant if quant is not None else (None, None)
    return None if method is None else method.record(tables)


def _native_loader(where):
    """For export/network/quantize.py Quantized: a tensor's own quantized form, where the checkpoint holds it in `method`."""
    def native(name: str, method):
        src = where[name]
        if getattr(src, "native_method_of", lambda _: None)(name) == method:
            return lambda: src.quantized(name)
        return None
    return native


def _bar(show_progress: bool, **kwargs) -> tqdm:
    """A tqdm bar on a terminal; off when stderr is not one (disable=None) or without show_progress (-q)."""
    return tqdm(disable=None if show_progress else True, **kwargs)


def _compile(cfg: ExportConfig, network, show_progress: bool):
    from export.writers.graphs import compile_graphs, graph_plan

    with _bar(show_progress, total=len(graph_plan(cfg)), desc="graphs", unit="graph") as bar:
        return compile_graphs(cfg, network, progress=bar.update)


def _golden_sizes(cfg: ExportConfig):
    return sorted(set(cfg.prefill_buckets) | {cfg.seq_length})  # the prefill graphs of the folder


def _agreement_prefill(cfg: ExportConfig, model_cfg: ModelConfig):
    """export/writers/golden.py AgreementPrefill, started (a quantized export's, before its compile stage)."""
    from export.writers import golden

    return golden.AgreementPrefill(model_cfg, cfg.checkpoint, _golden_sizes(cfg), cfg.seq_length, cfg.batch_size)


def _cancel(early) -> None:
    if early is not None:
        early.cancel()


def _write_golden(cfg: ExportConfig, model_cfg: ModelConfig, tmp: str, show_progress: bool,
                  quant=None, layouts=None, early=None) -> Dict[str, Any]:
    """Fixed prompts through the float32 reference (export/writers/golden.py), written to golden.json. A quantized folder's
    from the weights its files in `tmp` hold (`layouts`), dequantized, beside the checkpoint's own float weights (the
    agreement)."""
    from export.writers import golden
    from export.network.quantize import FolderMeaning
    from lite_runtime.golden import write_golden

    sizes = _golden_sizes(cfg)
    log.info("computing golden references (float32 numpy reference)")
    total = golden.max_steps(sizes, cfg.seq_length, cfg.batch_size, quantized=quant is not None)
    kernels = cfg.device == "cpu" and cfg.use_cpu_kernels()
    with _bar(show_progress, total=total, desc="golden", unit="step") as bar:
        doc = golden.compute(model_cfg, cfg.checkpoint, sizes, cfg.seq_length, cfg.batch_size, progress=bar.update,
                             matrices_in=cfg.dtype if cfg.half_weights_on_cpu else "float32",
                             kv_in=cfg.kv_dtype(kernels) if cfg.device == "cpu" else "float32",
                             quant=None if quant is None else (_quant_record(quant),
                                                               FolderMeaning(tmp, layouts, cfg.graph == "fused")),
                             lanes=golden.lanes_for(None if quant is None else quant[0].bits,
                                                    cfg.dtype if cfg.half_weights_on_cpu else "float32",
                                                    kernels),
                             early=early)
    write_golden(tmp, doc)
    return doc


def _write_weights(tmp: str, layouts, where, values, show_progress: bool):
    from export.writers.weights_file import write_files

    total = sum(layout.size for layout in layouts)
    with _bar(show_progress, total=total, desc="weights", unit="B", unit_scale=True, unit_divisor=1024) as bar:
        return write_files(tmp, layouts, where, progress=bar.update, values=values)


def _write_folder_files(cfg: ExportConfig, model_cfg: ModelConfig, profile, tmp: str, graphs, layouts,
                        hashed: Dict[str, str], kernels: bool, vocab_parallel: bool, quant=None) -> None:
    import mindspore as ms

    from export.writers.graphs import write_graph
    from lite_runtime.folder import GE_CONFIG
    from lite_runtime.manifest import InferSection, write_manifest, write_yaml

    entries = [write_graph(tmp, cfg, g, rank, layouts[rank], kernels) for rank in range(cfg.tp_size) for g in graphs]
    shutil.copyfile(profile.ini_path, os.path.join(tmp, GE_CONFIG))
    tokenizer_files = checkpoint_files.copy_tokenizer(cfg.checkpoint, tmp)
    ids = checkpoint_files.special_token_ids(cfg.checkpoint, model_cfg.eos_token_id)
    rank0 = [e for e in entries if not e.rank]  # each rank loads its own (lite_runtime.folder)
    full = next(e for e in rank0 if e.role == "prefill" and e.tokens == cfg.seq_length)
    inc = next(e for e in rank0 if e.role == "inc" and e.rows is None)
    infer = InferSection(model_name=model_cfg.model_type, seq_length=cfg.seq_length, batch_size=cfg.batch_size,
                         dtype=cfg.dtype, compute_dtype=cfg.compute_dtype, device=profile.name, soc=profile.soc,
                         vocab_size=model_cfg.vocab_size, eos_token_id=ids["eos_token_id"],
                         pad_token_id=ids["pad_token_id"], prefill_model_path=full.file,
                         increment_model_path=inc.file,
                         prefill_buckets=sorted(e.tokens for e in rank0 if e.role == "prefill"),
                         tp_size=cfg.tp_size, cpu_kernels=kernels, graph=cfg.graph,
                         chunk_sizes=list(cfg.chunk_sizes), score_sizes=list(cfg.score_sizes),
                         quantization=_quant_record(quant),
                         kv_cache=_kv_cache(cfg, model_cfg, kernels).to_dict())
    export = {**dataclasses.asdict(cfg), "checkpoint": os.path.abspath(cfg.checkpoint),
              "output": os.path.abspath(cfg.output), "mindspore_version": ms.__version__,
              "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokenizer_files": tokenizer_files}
    if cfg.tp_size > 1:  # how the ranks share the tables (model_dirs/README.md)
        export["vocab_parallel"] = vocab_parallel
    model = {"model_type": model_cfg.model_type, "family": model_cfg.model_type, "config": model_cfg.to_dict()}
    write_yaml(tmp, cfg.name, model, export, infer)
    write_manifest(tmp, cfg.name, entries, hashed, exported_with=checkpoint_files.exporter_versions(ms.__version__),
                   family=model_cfg.model_type, quantization=_quant_record(quant))


def _kv_cache(cfg: ExportConfig, model_cfg: ModelConfig, kernels: bool):
    """The paged KV cache the graphs read and write (lite_runtime/folder.py KVCacheSpec), one rank's heads."""
    from export.config import tensor_parallel_config
    from lite_runtime.folder import KVCacheSpec

    rank = tensor_parallel_config(model_cfg, cfg.tp_size) if cfg.tp_size > 1 else model_cfg
    return KVCacheSpec(block_size=cfg.block_size, max_blocks=-(-cfg.seq_length // cfg.block_size),
                       layout="blocks_heads" if kernels else "blocks_tokens", layers=model_cfg.num_hidden_layers,
                       kv_heads=rank.num_key_value_heads, head_dim=model_cfg.head_dim,
                       dtype=cfg.kv_dtype(kernels))


def _small_files_bytes(checkpoint: str, profile) -> int:
    """Tokenizer files, config.ini, and room for golden.json, the yaml and the manifest."""
    files = [os.path.join(checkpoint, f) for f in checkpoint_files.TOKENIZER_FILES] + [profile.ini_path]
    return sum(os.path.getsize(f) for f in files if os.path.isfile(f)) + (4 << 20)


def _check_space(parent: str, needed: int) -> None:
    """Refuse up front when the output's file system cannot hold the folder."""
    try:
        st = os.statvfs(parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise ExportError(f"{parent}: {_size(free)} free, the model folder needs {_size(needed)}; free space there "
                          "or pass an --output on a larger file system")


_HINTS = {errno.ENOSPC: "the disk is full: free space there or pass an --output on a larger file system",
          errno.EDQUOT: "your disk quota is used up: free space or pass an --output elsewhere",
          errno.EACCES: "check the folder's permissions or pass another --output",
          errno.EPERM: "check the folder's permissions or pass another --output",
          errno.EROFS: "the file system is read-only: pass another --output",
          errno.EFBIG: "a file size limit was hit (ulimit -f): raise it or pass another --output",
          errno.EIO: "the disk reported an I/O error: check it, or pass an --output on another disk"}


def _os_error_line(exc: OSError, tmp: str, output: str) -> str:
    """One line for an OSError met while exporting: the file, what happened, what to do; nothing was kept."""
    path = exc.filename or tmp
    if isinstance(path, str) and path.startswith(tmp):
        path = output + path[len(tmp):]  # the user knows the output's name, not the partial folder's
    hint = _HINTS.get(exc.errno, "nothing was written; fix the cause and export again")
    return f"{path}: {exc.strerror or exc}; {hint} (nothing was kept)"


_LEFTOVER = re.compile(r"^\..+\.(partial|old)-(\d+)$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _sweep_leftovers(parent: str) -> None:
    """Remove `.<name>.partial-<pid>` / `.old-<pid>` folders of exports whose process no longer exists.

    An export killed outright (SIGKILL, the OOM killer, a lost machine) cannot clean up after itself;
    for a 7B checkpoint its partial folder is ~15 GB. Folders of live processes are left alone.
    """
    for entry in sorted(os.listdir(parent)):
        match = _LEFTOVER.match(entry)
        path = os.path.join(parent, entry)
        if not match or not os.path.isdir(path) or _pid_alive(int(match.group(2))):
            continue
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s (%s), left by an export (process %s) that did not finish", path, _size(size),
                    match.group(2))


def _replace(tmp: str, output: str) -> None:
    """Move the finished folder into place; an old folder (--overwrite) goes only once the new one is there."""
    old = None
    if os.path.exists(output):
        old = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.old-{os.getpid()}")
        os.replace(output, old)
    os.replace(tmp, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # the files were hashed as they were written: the first load need not hash them again (lite_runtime.folder)
    from lite_runtime.folder import MANIFEST
    from lite_runtime.verified import record_verified

    with open(os.path.join(output, MANIFEST), encoding="utf-8") as fh:
        files = json.load(fh)["files"]
    record_verified({os.path.join(output, rel): entry["sha256"] for rel, entry in files.items()})
