"""The `mslite` backend: mindspore_lite (cp311 wheels from 2.4.1) with the GE provider on Atlas. NOT RUN here.

mindspore_lite cannot be installed where this project is developed and tested (PyPI has only
2.0.0 for Python 3.7, and there is no Ascend device). So this module is kept thin: every
decision (context settings, which ini, the ModelGroup and build order) is made by the plain
functions `context_plan`, `build_plan` and `read_ge_config`, which the tests check as data;
`MsLiteBackend` only carries those plans out against the documented mindspore_lite API:

    ctx = Context(); ctx.target = ["ascend"]; ctx.ascend.device_id/rank_id; ctx.ascend.provider = "ge"
    one Model per graph (each prefill bucket, then inc)
    group = ModelGroup(ModelGroupFlag.SHARE_WEIGHT); group.add_model([...all models])   # before building
    model.build_from_file(path, ModelType.MINDIR, ctx, config_path=<config.ini>, config_dict=<cache options>)

`add_model` must come before `build_from_file`: it tags both models with one group id, and that
id is what makes GE build them into one session, sharing the weights and the KV cache Parameters.

The KV cache pool (docs/architecture.md, "The KV cache: a pool of blocks"): a folder's graphs declare each layer's
caches as Parameters of a nominal block count and no data. MindSpore's MindIR loader gives a Parameter without data
a zero tensor of its declared shape, and GE keeps a Parameter that ReshapeAndCache writes as a variable (read from
MindSpore's load_model.cc and GE's graph converter; helper report in docs/architecture.md). So the pool's size is set
by rewriting the caches' first dimension in a copy of each graph (`sized_graphs`, written under the GE cache root: a
graph without its weights is kilobytes to a few megabytes), built with `[model_file] mindir_path` pointing at the
folder's own graph file, so that the weights file resolves in the folder (Lite takes the directory of mindir_path as
the base of `external_data.location`). The default size comes from the device's free memory (pyACL
`acl.rt.get_mem_info`, `device_free_bytes`) less this rank's weights.

Before anything is built, `mindspore_lite.__version__` is compared with the MindSpore that
exported the folder (manifest `exported_with`): an older Lite is refused, a newer one warned
about (lite_runtime/versions.py); and a quantized folder is refused on a SoC whose WeightQuantBatchMatmul cannot
run its linear layers (`quantization_plan`, with the SoC from pyACL: `device_soc`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

import logging

from lite_runtime.backends import bind_inputs, unavailable
from lite_runtime.backends.ge_options import cache_plan, parse_lite_ini, read_ge_config  # noqa: F401 (re-exported)
from lite_runtime.errors import InferError
from lite_runtime.folder import MANIFEST, TensorSpec, quantization_label
from lite_runtime.versions import cann_version, check_lite

log = logging.getLogger(__name__)

INSTALL_HINT = ("install the mindspore_lite wheel that matches your CANN from "
                "https://www.mindspore.cn/lite/docs/en/master/use/downloads.html and source CANN's set_env.sh, "
                "or pass backend 'ms' to run on the CPU with MindSpore")
# mindspore_lite.DataType member name -> numpy dtype name
_DTYPES = {"INT32": "int32", "INT64": "int64", "FLOAT32": "float32", "FLOAT16": "float16", "BOOL": "bool"}


def rank_and_device(config) -> Tuple[int, int]:
    """(rank_id, device_id). A tensor-parallel folder runs one process per rank, as Lite's distributed examples do:
    the rank is InferConfig.rank_id, or $RANK_ID when that is 0; the card is InferConfig.device_id, or $DEVICE_ID
    when that is 0, else the rank's number (one card per rank)."""
    rank, device = int(config.rank_id), int(config.device_id)
    if config.tp_size == 1:
        return rank, device
    if rank == 0 and os.environ.get("RANK_ID"):
        rank = int(os.environ["RANK_ID"])
    if device == 0:
        device = int(os.environ["DEVICE_ID"]) if os.environ.get("DEVICE_ID") else rank
    tp = config.tp_size
    if not 0 <= rank < tp:
        raise InferError(f"{config.folder.path}: rank {rank}, but the folder is split over {tp} ranks (0..{tp - 1}); "
                         "pass rank_id or set RANK_ID per process")
    return rank, device


def rank_table(config) -> Optional[str]:
    """The HCCL rank table of a tensor-parallel folder's job (GE reads it: [ascend_context] rank_table_file)."""
    if config.tp_size == 1:
        return None
    path = config.rank_table_file or os.environ.get("RANK_TABLE_FILE") or \
        read_ge_config(config.ge_config_path).get("ascend_context", {}).get("rank_table_file")
    if not path:
        raise InferError(f"{config.folder.path}: the folder is split over {config.tp_size} ranks, which HCCL "
                         "connects through a rank table: pass rank_table_file=... (run_infer_main.py "
                         "--rank_table_file) or set RANK_TABLE_FILE (README, \"Two cards\")")
    if not os.path.isfile(path):
        raise InferError(f"rank table {path}: not found")
    return os.path.abspath(path)


def context_plan(config) -> Dict[str, Any]:
    """The Context attributes to set, in order, as {attribute path: value}."""
    if config.target == "CPU":
        raise InferError("backend 'mslite' on the CPU cannot share the KV cache between the two graphs (weight "
                         "sharing is GE-only); use backend 'ms' for a folder exported with --device cpu")
    rank, device = rank_and_device(config)
    return {"ascend.device_id": device, "ascend.rank_id": rank, "ascend.provider": "ge", "target": ["ascend"]}


class QuantSupport(NamedTuple):
    """The weight-only quantization one family of Ascend SoCs runs (WeightQuantBatchMatmul)."""

    prefix: str  # of the SoC's name, as pyACL reports it and as the folder's yaml records it (infer.soc)
    series: str
    profiles: Tuple[str, ...]  # the export's --device profiles for it (export/devices.py), the first suggested
    bits: Tuple[int, ...]  # as export/devices.py's quant_bits
    groups: bool  # per-group scales besides per channel (quant_groups)


# Which SoC runs what; the first row whose prefix starts the SoC's name decides, an unknown SoC runs none. The same
# facts as export/devices.py's quant_bits / quant_groups (tests/test_mslite_quant.py holds the two together):
# - CANN 8.3.RC1, aclnnWeightQuantBatchMatmulV2, its product support table: Atlas A2, A3 and the Atlas inference
#   series (310P) yes; the Atlas training series (910A) and the Atlas 200I/500 A2 (Ascend310B) no.
#   https://www.hiascend.com/document/detail/zh/canncommercial/83RC1/API/aolapi/context/aclnnWeightQuantBatchMatmulV2.md
# - torch_npu 7.0.0, npu_weight_quant_batchmatmul (which calls it): the inference series takes int8 weights, per
#   tensor or per channel; A2 and A3 int8 and int4 (packed in int32), per tensor, per channel or per group.
#   https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001256.html
# - pyACL's get_soc_name (CANN 6.0.1): "Ascend310P*" on the 310P, "Ascend910*" on the 910, the suffix by grade.
QUANT_SOCS: Tuple[QuantSupport, ...] = (
    QuantSupport("Ascend910B", "Atlas A2", ("atlas_800i_a2", "atlas_800t_a2"), (8, 4), True),
    QuantSupport("Ascend910_93", "Atlas A3", (), (8, 4), True),
    QuantSupport("Ascend310P", "Atlas inference series", ("atlas_300i_duo",), (8,), False),
    # Ascend910A, Ascend910ProA, Ascend910PremiumA, Ascend910ProB: the training series
    QuantSupport("Ascend910", "Atlas training series", ("atlas_800",), (), False),
)
UNKNOWN_SOC = QuantSupport("", "unknown", (), (), False)


def quant_support(soc: str) -> QuantSupport:
    """The QUANT_SOCS row of the SoC named `soc` (Ascend910B3, Ascend310P3, ...); UNKNOWN_SOC for any other."""
    return next((row for row in QUANT_SOCS if soc.startswith(row.prefix)), UNKNOWN_SOC)


def device_soc() -> Optional[str]:
    """This host's Ascend SoC as pyACL names it (`acl.get_soc_name()`, CANN's aclrtGetSocName), or None where pyACL
    cannot be imported or does not answer: then only the SoC the folder records is checked. MindSpore is not
    imported (it cannot share a process with a Lite of another version)."""
    try:
        import acl  # CANN's pyACL, on the path once set_env.sh is sourced
    except (ImportError, OSError):
        return None
    get_soc_name = getattr(acl, "get_soc_name", None)
    name = get_soc_name() if get_soc_name is not None else None
    return str(name) if name else None


def quantization_plan(quantization: Optional[Dict[str, Any]], soc: str, manifest: str,
                      recorded_in: Optional[str] = None) -> None:
    """Refuse a quantized folder's layers on a SoC whose WeightQuantBatchMatmul cannot run them; a float folder
    (`quantization` None) passes. `soc` is this device's (device_soc), or with `recorded_in` (the yaml's name) the
    one the folder was exported for: "" there is a CPU folder, whose layers call this project's CPU kernels."""
    if not quantization:
        return
    label = quantization_label(quantization)
    if recorded_in is not None and soc == "":
        atlas = ", ".join(p for row in QUANT_SOCS if row.bits for p in row.profiles)
        raise InferError(f"{manifest}: {label} was exported for the CPU ({recorded_in} infer.soc is empty): its "
                         "layers call this project's CPU kernels, which Lite on Ascend does not have; re-export with "
                         f"the --device of your Atlas ({atlas}) and a --quantize it runs or --quantize none, or run it "
                         "with backend 'ms'")
    support = quant_support(soc)
    # the linear layers', then each quantized table's (a GGUF's Q8_0 embedding in groups of 32, ...): the first that
    # the SoC cannot run is refused
    tables = quantization.get("tables") if isinstance(quantization.get("tables"), dict) else {}
    methods = [(label, quantization)] + [
        (f"its {role} table {quantization_label(t)}", t) for role, t in tables.items()
        if isinstance(t, dict) and "bits" in t]
    for label, method in methods:
        bits, group = int(method["bits"]), int(method["group_size"])
        if not (bits in support.bits and (group == 0 or support.groups)):
            break
    else:
        return
    device = f"--device {support.profiles[0]} " if support.profiles else ""
    if method is not quantization and support.bits:  # a table: the layers run here, the table does not
        fix = f"re-export with {device}--quantize_tables none (float tables)"
        takes = " and ".join(f"int{b}" for b in support.bits) + (
            ", per channel or in groups" if support.groups else ", per channel only")
    elif not support.bits:
        takes = "none" if support is not UNKNOWN_SOC else "none that this runtime knows of"
        fix = f"re-export with {device}--quantize none for float weights"
    else:
        takes = " and ".join(f"int{b}" for b in support.bits) + (
            ", per channel or in groups" if support.groups else ", per channel only")
        want = bits if bits in support.bits else support.bits[0]
        fix = (f"re-export with {device}--quantize int{want}{' --group_size 0' if bits in support.bits else ''}, "
               "or --quantize none")
    series = [support.series] if support is not UNKNOWN_SOC else []
    if recorded_in is None:
        where = f"this device's SoC {soc}" + "".join(f" ({s})" for s in series)
    else:
        where = f"{soc} ({'; '.join(series + [f'infer.soc of {recorded_in}'])})"
    raise InferError(f"{manifest}: {label} cannot run on {where}, whose WeightQuantBatchMatmul takes {takes}; {fix}")


def quantization_check(config, soc: Optional[str]) -> None:
    """quantization_plan for a folder's config: against the SoC the folder records (a hand-edited manifest, a CPU
    folder), then against this device's `soc` when known (device_soc). Graph files without a folder pass."""
    folder = config.folder
    if folder is None or folder.quantization is None:
        return
    manifest = os.path.join(folder.path, MANIFEST)
    if "soc" in folder.infer:
        quantization_plan(folder.quantization, str(folder.infer["soc"] or ""), manifest,
                          recorded_in=os.path.basename(folder.yaml_path))
    if soc:
        quantization_plan(folder.quantization, soc, manifest)


def build_plan(config, cache: Optional[Dict[str, Any]] = None, soc: Optional[str] = None,
               sized: Optional[Dict[str, str]] = None) -> List[Tuple]:
    """The calls that load every graph into one ModelGroup, in the order they must happen.

    Each build_from_file carries a config_dict (applied over the ini): with `cache` (cache_plan), GE's
    compile-cache directory for the session and this graph's cache key; with `sized` (sized_graphs: key -> the
    graph's copy with the pool's block count), the copy is built and `[model_file] mindir_path` names the folder's
    own graph, whose directory Lite resolves the weights file in. A quantized folder is first checked against the
    SoC it records and this device's `soc` (device_soc; None: unknown), quantization_check.
    """
    quantization_check(config, soc)
    if not config.ge_config_path:
        raise InferError("backend 'mslite' needs ge_config_path (the folder's config.ini); pass a model folder "
                         "or ge_config_path")
    read_ge_config(config.ge_config_path)
    if config.tp_size > 1:  # this process's rank's graphs (a copy: the caller's config is not changed)
        config = dataclasses.replace(config, rank_id=rank_and_device(config)[0])
    paths = config.graph_paths()
    table = rank_table(config)

    def options(key: str) -> Dict[str, Dict[str, str]]:
        out: Dict[str, Dict[str, str]] = {"ascend_context": {"rank_table_file": table}} if table else {}
        if cache is not None:
            out.update({"ge_session_options": dict(cache["session_options"]),
                        "ge_graph_options": {"ge.graph_key": cache["graph_keys"][key]}})
        if sized is not None:
            out["model_file"] = {"mindir_path": os.path.abspath(paths[key])}
        return out

    return ([("Model", key) for key in paths] + [("ModelGroup", "SHARE_WEIGHT"), ("add_model", tuple(paths))]
            + [("build_from_file", key, sized[key] if sized is not None else path, "MINDIR", config.ge_config_path,
                options(key)) for key, path in paths.items()])


def pool_dir(config) -> str:
    """Where the graphs sized to this load's pool are written: per folder (its manifest's digest), block count and
    rank, under the GE cache root (~/.cache/mslite-llm by default; also when the GE cache itself is off)."""
    import hashlib

    from lite_runtime.backends.ge_options import DEFAULT_CACHE_ROOT, OFF

    root = DEFAULT_CACHE_ROOT if config.ge_cache_dir is None or str(config.ge_cache_dir).lower() in OFF \
        else config.ge_cache_dir
    with open(os.path.join(config.folder.path, MANIFEST), "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    return os.path.join(os.path.abspath(os.path.expanduser(root)), "pool",
                        f"{config.folder.name}-{digest}-{int(config.num_blocks)}blocks-rank{int(config.rank_id)}")


def sized_graphs(config, num_blocks: int, dest: str) -> Dict[str, str]:
    """Each graph of `config` (this rank's) with its KV caches' first dimension set to `num_blocks`, written to `dest`
    (atomically: a temporary file renamed), keyed like graph_paths; the rest of each graph, its weights' locations
    included, byte for byte (lite_runtime/mindir_edit.py). Data only: tests read the files back."""
    from lite_runtime.folder import is_kv_cache
    from lite_runtime.mindir_edit import MindIRError, set_first_dims

    os.makedirs(dest, exist_ok=True)
    out = {}
    for key, path in config.graph_paths().items():
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            sized, count = set_first_dims(data, is_kv_cache, num_blocks)
        except MindIRError as exc:
            raise InferError(f"{path}: {exc}; re-copy the model folder") from None
        if not count:
            raise InferError(f"{path}: the graph has no KV cache parameters; re-export the folder")
        target = os.path.join(dest, os.path.basename(path))
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(sized)
        os.replace(tmp, target)
        out[key] = target
    return out


def device_free_bytes(device_id: int) -> Optional[int]:  # pragma: no cover - needs pyACL and an Ascend device
    """The device's free on-chip memory (HBM; DDR on the 310P, which pyACL maps itself), in bytes, through pyACL's
    `acl.rt.get_mem_info(ACL_HBM_MEM)` (CANN: "get the free and total memory of the device, excluding the system's
    reserve"; the device must be set first). None where pyACL cannot be imported or does not answer."""
    try:
        import acl
    except (ImportError, OSError):
        return None
    acl_hbm_mem = 1
    try:
        acl.init()  # 100002 (initialized already) is fine
        if acl.rt.set_device(int(device_id)) != 0:
            return None
        try:
            free, _total, ret = acl.rt.get_mem_info(acl_hbm_mem)
        finally:
            acl.rt.reset_device(int(device_id))
    except Exception:  # noqa: BLE001  (an old pyACL without these calls: the default is then the safe one)
        return None
    return int(free) if ret == 0 and free else None


def pool_free_bytes(config) -> Optional[int]:  # pragma: no cover - needs pyACL and an Ascend device
    """What the KV pool may take on this rank's device: its free memory less this rank's weights (loaded next)."""
    free = device_free_bytes(rank_and_device(config)[1])
    if free is None or config.folder is None:
        return None
    from lite_runtime.folder import data_location, rank_name

    folder = config.folder
    weights = os.path.join(folder.path, data_location(rank_name(folder.name, int(config.rank_id), config.tp_size)))
    return max(0, free - (os.path.getsize(weights) if os.path.isfile(weights) else 0))


def exported_mindspore(config):
    """The MindSpore version that wrote the folder's graphs, or None (graph files without a folder, old folders)."""
    return config.folder.exported_with.get("mindspore") if config.folder is not None else None


def short_name(tensor_name: str) -> str:
    """MindIR input names may carry the graph's prefix (`<graph>:input_ids`)."""
    return tensor_name.rsplit(":", 1)[-1]


class MsLiteBackend:  # pragma: no cover - needs mindspore_lite and an Ascend device
    name = "mslite"

    def __init__(self, config) -> None:
        self.standins: Dict[str, int] = {}  # Lite runs the graphs as written: nothing is substituted (backends/ms.py)
        if config.tp_size > 1:  # the caller's config with this process's rank resolved, as a copy
            config = dataclasses.replace(config, rank_id=rank_and_device(config)[0])
        self.config = config
        settings = context_plan(config)
        quantized = config.folder is not None and config.folder.quantization is not None
        soc = device_soc() if quantized else None  # pyACL is imported only where a quantized folder needs the SoC
        if quantized:
            log.info("Ascend SoC: %s", soc or "unknown (pyACL cannot tell): the SoC the folder records is checked")
        build_plan(config, soc=soc)  # every refusal happens before mindspore_lite is imported
        try:
            import mindspore_lite as mslite
        except (ImportError, OSError):
            raise unavailable("mslite", "mindspore_lite", INSTALL_HINT) from None
        lite_version = getattr(mslite, "__version__", None)
        check_lite(exported_mindspore(config), lite_version, log)
        cache = cache_plan(config, lite_version, cann_version())
        if cache is not None:
            os.makedirs(cache["dir"], exist_ok=True)  # GE wants it to exist
            log.warning("GE compile cache: %s (a restart with this folder, Lite and CANN reuses the compiled graphs; "
                        "delete it to reclaim the disk)", cache["dir"])
        # the pool's size (the runner's plan, lite_runtime/engine/kv_pool.py) written into a copy of each graph
        sized = sized_graphs(config, int(config.num_blocks), pool_dir(config))
        plan = build_plan(config, cache, soc, sized)
        context = mslite.Context()
        for attr, value in settings.items():
            owner = context
            *path, last = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, last, value)
        models: Dict[str, Any] = {}
        group = None
        for step in plan:
            if step[0] == "Model":
                models[step[1]] = mslite.Model()
            elif step[0] == "ModelGroup":
                group = mslite.ModelGroup(getattr(mslite.ModelGroupFlag, step[1]))
            elif step[0] == "add_model":
                group.add_model([models[key] for key in step[1]])
            elif step[0] == "build_from_file":
                _, key, path, model_type, ini, options = step
                models[key].build_from_file(path, getattr(mslite.ModelType, model_type), context, config_path=ini,
                                            config_dict=options or None)
        self._group = group  # kept alive with the models
        self.models = models
        self._inputs = {key: model.get_inputs() for key, model in models.items()}

    def input_specs(self, key: str) -> Tuple[TensorSpec, ...]:
        return tuple(TensorSpec(short_name(t.name), _DTYPES.get(t.dtype.name, t.dtype.name.lower()), tuple(t.shape))
                     for t in self._inputs[key])

    def run(self, key: str, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        tensors = self._inputs[key]
        for tensor, array in zip(tensors, bind_inputs(key, [t.name for t in tensors], inputs)):
            tensor.set_data_from_numpy(array)
        outputs = self.models[key].predict(tensors)
        return outputs[0].get_data_to_numpy()
