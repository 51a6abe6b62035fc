"""run_export: checkpoint -> model folder, written into a temporary folder and renamed at the end."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import resource
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict

from tqdm import tqdm

from export.config import ExportConfig, ModelConfig
from export.devices import default_buckets, get_profile
from export.errors import ExportError
from export import folder as fmt

log = logging.getLogger(__name__)


@dataclass
class ExportSummary:
    output: str
    files: int
    total_bytes: int
    weight_bytes: int
    seconds: float
    peak_rss_bytes: int
    golden_prompts: int = 0
    golden_seconds: float = 0.0

    def line(self) -> str:
        return (f"exported {self.output}: {self.files} files, {_size(self.total_bytes)} "
                f"(weights {_size(self.weight_bytes)}), {self.seconds:.1f} s, peak RSS {_size(self.peak_rss_bytes)}; "
                f"golden references: {self.golden_prompts} prompt{'s' if self.golden_prompts != 1 else ''} "
                f"in {self.golden_seconds:.2f} s")


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def prepare(cfg: ExportConfig) -> tuple:
    """Every check that needs no weights: config.json, settings, device, the target folder."""
    model_cfg = ModelConfig.from_file(os.path.join(cfg.checkpoint, "config.json"))
    profile = get_profile(cfg.device)
    cfg.validate(model_cfg, profile.dtypes)
    if os.path.exists(cfg.output) and not cfg.overwrite:
        raise ExportError(f"{cfg.output} already exists. Delete it or pass --overwrite")
    return model_cfg, profile


def resolve(cfg: ExportConfig) -> ExportConfig:
    """`cfg` with the device's default prompt-length buckets filled in when none were given."""
    if cfg.prefill_buckets is not None:
        return cfg
    return dataclasses.replace(cfg, prefill_buckets=default_buckets(get_profile(cfg.device), cfg.seq_length))


def run_export(cfg: ExportConfig, show_progress: bool = False) -> ExportSummary:
    """Export `cfg.checkpoint` to `cfg.output`. Nothing is left behind if it fails."""
    start = time.time()
    model_cfg, profile = prepare(cfg)
    cfg = resolve(cfg)
    output = os.path.abspath(cfg.output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    _sweep_leftovers(parent)
    tmp = os.path.join(parent, f".{os.path.basename(output)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # The golden references first: they fail fast on damaged weights, and their memory map of the checkpoint
        # is released before the network maps it (the network's float32 weights are views of that map, so two maps
        # alive together would count the checkpoint's pages twice in the peak RSS).
        doc = _write_golden(cfg, model_cfg, tmp, show_progress)
        weight_bytes, gemv, graphs, hashed = _write_graphs(cfg, model_cfg, tmp, show_progress)
        _write_folder_files(cfg, model_cfg, profile, tmp, graphs, hashed, gemv)
        _replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(output) for f in fs)
    files = sum(len(fs) for _, _, fs in os.walk(output))
    prompts = sum(len(b["rows"]) for b in doc["batches"])
    return ExportSummary(cfg.output, files, total, weight_bytes, time.time() - start, _peak_rss(),
                         golden_prompts=prompts, golden_seconds=doc["seconds"])


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


def _write_graphs(*args, **kwargs):
    """Build and export the graphs, holding the ms backend's MindSpore lock (a pipeline in this process may be
    compiling a graph in its idle warm-up thread; MindSpore's compiler is not thread-safe)."""
    from lite_runtime.backends.ms import MINDSPORE_LOCK

    with MINDSPORE_LOCK:
        return _build_and_export_graphs(*args, **kwargs)


def _build_and_export_graphs(cfg: ExportConfig, model_cfg: ModelConfig, tmp: str, show_progress: bool):
    """Every graph, with its weights file: one set, or one per rank with --tp_size (each rank its own weights)."""
    weight_bytes, graphs, hashed, gemv = 0, [], {}, False
    for rank in range(cfg.tp_size):
        got, gemv, rank_graphs, rank_hashed = _export_rank_graphs(cfg, model_cfg, tmp, show_progress, rank)
        weight_bytes += got
        graphs += rank_graphs
        hashed.update(rank_hashed)
    return weight_bytes, gemv, graphs, hashed


def _export_rank_graphs(cfg: ExportConfig, model_cfg: ModelConfig, tmp: str, show_progress: bool, rank: int):
    import mindspore as ms
    import numpy as np

    from export.config import tensor_parallel_config
    from export.model import CausalLM, DecodeGraph, PrefillGraph, SlotPrefillGraph
    from export.shared_weights import data_location, share_weights
    from export.weights import load_into

    ms.set_context(mode=ms.GRAPH_MODE)
    gemv = cfg.use_cpu_kernels()
    # every full-graph matmul through our kernel: 16-bit matrices need it; float32 ones only for few rows
    # (export/model.py KERNEL_PREFILL_MAX_ROWS)
    gemm = gemv and cfg.half_weights_on_cpu
    tp = cfg.tp_size
    net = CausalLM(tensor_parallel_config(model_cfg, tp) if tp > 1 else model_cfg, cfg.batch_size, cfg.seq_length,
                   cfg.compute_dtype, gemv=gemv, gemm=gemm, weight_dtype=cfg.dtype, tensor_parallel=tp > 1)
    # a tensor-parallel folder names each rank's files <name>_rank<r>_...
    name = f"{cfg.name}_rank{rank}" if tp > 1 else cfg.name
    n_weights = len([p for p in net.get_parameters() if not p.name.endswith(("key_cache", "value_cache"))])
    desc = f"weights (rank {rank})" if tp > 1 else "weights"
    with tqdm(total=n_weights, desc=desc, unit="tensor", disable=not show_progress) as bar:
        weight_bytes = load_into(net, cfg.checkpoint, progress=bar.update, shard=(rank, tp))
    b, s = cfg.batch_size, cfg.seq_length
    buckets = sorted(set(cfg.prefill_buckets) | {s})
    plan = [("prefill", n) for n in buckets] + [("inc", 1)]
    if b > 1:  # a slot graph per bucket: one prompt into one cache row, for continuous batching (lite_runtime.serve)
        plan += [("slot", n) for n in buckets]
    cells = {"prefill": PrefillGraph(net), "inc": DecodeGraph(net), "slot": SlotPrefillGraph(net)}
    files = []
    for role, tokens in tqdm(plan, desc="graphs", unit="graph", disable=not show_progress):
        prefix = fmt.graph_prefix(name, role, tokens, s)
        log.info("exporting the %s graph (%d tokens)", role, tokens)
        rows = 1 if role == "slot" else b
        args = [ms.Tensor(np.zeros((rows, tokens), np.int32)),
                ms.Tensor(np.full((rows,), 2 if role == "inc" else 1, np.int32))]
        if role == "slot":
            args.append(ms.Tensor(np.zeros((1,), np.int32)))
        ms.export(cells[role], *args, file_name=os.path.join(tmp, prefix), file_format="MINDIR")
        files.append(fmt.place_graph(tmp, prefix))
    _, data_sha256 = share_weights(tmp, name, files, edit=fmt.portable_kernel_paths if gemv else None)
    rank_field = {"rank": rank} if tp > 1 else {}
    graphs = [{"role": role, "file": f, "variables": data_location(name), "tokens": tokens, **rank_field,
               **fmt.read_graph_spec(os.path.join(tmp, f))} for (role, tokens), f in zip(plan, files)]
    return weight_bytes, gemv, graphs, {data_location(name): data_sha256}


def _write_golden(cfg: ExportConfig, model_cfg: ModelConfig, tmp: str, show_progress: bool) -> Dict[str, Any]:
    """Fixed prompts through the float32 reference (export/golden.py), written to golden.json."""
    from export import golden

    sizes = sorted(set(cfg.prefill_buckets) | {cfg.seq_length})  # the prefill graphs _write_graphs will export
    log.info("computing golden references (float32 numpy reference)")
    total = golden.max_steps(sizes, cfg.seq_length, cfg.batch_size)
    with tqdm(total=total, desc="golden", unit="step", disable=not show_progress) as bar:
        doc = golden.compute(model_cfg, cfg.checkpoint, sizes, cfg.seq_length, cfg.batch_size, progress=bar.update,
                             matrices_in=cfg.dtype if cfg.half_weights_on_cpu else "float32")
    golden.write(tmp, doc)
    return doc


def _write_folder_files(cfg: ExportConfig, model_cfg: ModelConfig, profile, tmp: str, graphs,
                        hashed: Dict[str, str], gemv: bool) -> None:
    import mindspore as ms

    shutil.copyfile(profile.ini_path, os.path.join(tmp, fmt.GE_CONFIG))
    tokenizer_files = fmt.copy_tokenizer(cfg.checkpoint, tmp)
    ids = fmt.special_token_ids(cfg.checkpoint, model_cfg.eos_token_id)
    # rank 0's graphs in a tensor-parallel folder (each rank loads its own: lite_runtime.folder)
    full = next(g for g in graphs if g["role"] == "prefill" and g["tokens"] == cfg.seq_length and not g.get("rank"))
    inc = next(g for g in graphs if g["role"] == "inc" and not g.get("rank"))
    content: Dict[str, Any] = {
        "model": {"model_type": model_cfg.model_type, "family": model_cfg.model_type, "config": model_cfg.to_dict()},
        "export": {**dataclasses.asdict(cfg), "checkpoint": os.path.abspath(cfg.checkpoint),
                   "output": os.path.abspath(cfg.output), "mindspore_version": ms.__version__,
                   "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "tokenizer_files": tokenizer_files},
        "infer": {"model_name": model_cfg.model_type, "seq_length": cfg.seq_length, "batch_size": cfg.batch_size,
                  "dtype": cfg.dtype, "compute_dtype": cfg.compute_dtype, "device": profile.name, "soc": profile.soc,
                  "vocab_size": model_cfg.vocab_size, **ids,
                  "prefill_model_path": full["file"], "increment_model_path": inc["file"],
                  "prefill_buckets": sorted(g["tokens"] for g in graphs if g["role"] == "prefill" and not g.get("rank")),
                  "tp_size": cfg.tp_size,
                  "cpu_kernels": gemv,
                  "ge_config_path": fmt.GE_CONFIG},
    }
    fmt.write_yaml(tmp, cfg.name, content)
    fmt.write_manifest(tmp, cfg.name, graphs, hashed, exported_with=fmt.exporter_versions(ms.__version__),
                       family=model_cfg.model_type)


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
    from lite_runtime.folder import MANIFEST, record_verified

    with open(os.path.join(output, MANIFEST), encoding="utf-8") as fh:
        files = json.load(fh)["files"]
    record_verified({os.path.join(output, rel): entry["sha256"] for rel, entry in files.items()})
