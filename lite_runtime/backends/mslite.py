"""The `mslite` backend: mindspore_lite (cp311 wheels from 2.4.1) with the GE provider on Atlas. NOT RUN here.

mindspore_lite cannot be installed where this project is developed and tested (PyPI has only
2.0.0 for Python 3.7, and there is no Ascend device). So this module is kept thin: every
decision (context settings, which ini, the ModelGroup and build order) is made by the plain
functions `context_plan`, `build_plan` and `read_ge_config`, which the tests check as data;
`MsLiteBackend` only carries those plans out against the documented mindspore_lite API:

    ctx = Context(); ctx.target = ["ascend"]; ctx.ascend.device_id/rank_id; ctx.ascend.provider = "ge"
    one Model per graph (each prefill bucket, then inc)
    group = ModelGroup(ModelGroupFlag.SHARE_WEIGHT); group.add_model([...all models])   # before building
    model.build_from_file(path, ModelType.MINDIR, ctx, config_path=<config.ini>) for each

`add_model` must come before `build_from_file`: it tags both models with one group id, and that
id is what makes GE build them into one session, sharing the weights and the KV cache Parameters.

Before anything is built, `mindspore_lite.__version__` is compared with the MindSpore that
exported the folder (manifest `exported_with`): an older Lite is refused, a newer one warned
about (lite_runtime/versions.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np

import logging

from lite_runtime.backends import bind_inputs, unavailable
from lite_runtime.errors import InferError
from lite_runtime.folder import TensorSpec
from lite_runtime.versions import check_lite

log = logging.getLogger(__name__)

INSTALL_HINT = ("install the mindspore_lite wheel that matches your CANN from "
                "https://www.mindspore.cn/lite/docs/en/master/use/downloads.html and source CANN's set_env.sh, "
                "or pass backend 'ms' to run on the CPU with MindSpore")
# mindspore_lite.DataType member name -> numpy dtype name
_DTYPES = {"INT32": "int32", "INT64": "int64", "FLOAT32": "float32", "FLOAT16": "float16", "BOOL": "bool"}
REQUIRED_GE_OPTIONS = {"ascend_context": {"provider": "ge"},
                       "ge_session_options": {"ge.exec.precision_mode": "must_keep_origin_dtype"}}


def context_plan(config) -> Dict[str, Any]:
    """The Context attributes to set, in order, as {attribute path: value}."""
    if config.target == "CPU":
        raise InferError("backend 'mslite' on the CPU cannot share the KV cache between the two graphs (weight "
                         "sharing is GE-only); use backend 'ms' for a folder exported with --device cpu")
    return {"ascend.device_id": int(config.device_id), "ascend.rank_id": int(config.rank_id),
            "ascend.provider": "ge", "target": ["ascend"]}


def parse_lite_ini(path: str) -> Dict[str, Dict[str, str]]:
    """The ini as MindSpore Lite's own config parser reads it (src/common/config_file.cc), stricter where it is lax.

    Lite: a line whose first non-blank character is `#` is a comment (`;` is NOT: `; a=b` inside a
    section becomes option `; a` and goes to GE); `[name]` opens a section; `key=value` splits at the
    first `=`, both sides trimmed; the file is read in the locale's encoding. Here any other line,
    an option before the first section, a repeated option and a non-ASCII byte are errors naming the line.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InferError(f"{path}: unreadable GE config ({exc}); re-export the folder") from None
    sections: Dict[str, Dict[str, str]] = {}
    current = None
    for number, line in enumerate(raw.split(b"\n"), 1):
        if any(byte > 127 for byte in line):
            raise InferError(f"{path}:{number}: non-ASCII text; Lite reads the file in the locale's encoding, keep it "
                             "ASCII")
        text = line.decode("ascii").strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("[") and text.endswith("]") and text[1:-1].strip():
            current = text[1:-1].strip()
            sections.setdefault(current, {})
            continue
        key, eq, value = text.partition("=")
        if not eq or not key.strip() or current is None or key.strip().startswith(";"):
            raise InferError(f"{path}:{number}: {text!r} is neither a '#' comment, a [section] nor a key=value line "
                             f"inside a section (Lite passes such lines on as options); fix or remove it")
        if key.strip() in sections[current]:
            raise InferError(f"{path}:{number}: option {key.strip()} repeated in [{current}]; keep one")
        sections[current][key.strip()] = value.strip()
    return sections


def read_ge_config(path: str) -> Dict[str, Dict[str, str]]:
    """The ini as {section: {option: value}} (parsed as Lite parses it), checked for what the graphs rely on."""
    sections = parse_lite_ini(path)
    for section, options in REQUIRED_GE_OPTIONS.items():
        for key, value in options.items():
            if sections.get(section, {}).get(key) != value:
                raise InferError(f"{path}: [{section}] {key}={value} is required (found "
                                 f"{sections.get(section, {}).get(key)!r}); use an ini from ge_configs/")
    return sections


def build_plan(config) -> List[Tuple]:
    """The calls that load every graph into one ModelGroup, in the order they must happen."""
    if not config.ge_config_path:
        raise InferError("backend 'mslite' needs ge_config_path (the folder's config.ini); pass a model folder "
                         "or ge_config_path")
    read_ge_config(config.ge_config_path)
    paths = config.graph_paths()
    return ([("Model", key) for key in paths] + [("ModelGroup", "SHARE_WEIGHT"), ("add_model", tuple(paths))]
            + [("build_from_file", key, path, "MINDIR", config.ge_config_path) for key, path in paths.items()])


def exported_mindspore(config):
    """The MindSpore version that wrote the folder's graphs, or None (graph files without a folder, old folders)."""
    return config.folder.exported_with.get("mindspore") if config.folder is not None else None


def short_name(tensor_name: str) -> str:
    """MindIR input names may carry the graph's prefix (`<graph>:input_ids`)."""
    return tensor_name.rsplit(":", 1)[-1]


class MsLiteBackend:  # pragma: no cover - needs mindspore_lite and an Ascend device
    name = "mslite"

    def __init__(self, config) -> None:
        settings, plan = context_plan(config), build_plan(config)  # decided (and refused) before importing
        try:
            import mindspore_lite as mslite
        except (ImportError, OSError):
            raise unavailable("mslite", "mindspore_lite", INSTALL_HINT) from None
        check_lite(exported_mindspore(config), getattr(mslite, "__version__", None), log)
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
                _, key, path, model_type, ini = step
                models[key].build_from_file(path, getattr(mslite.ModelType, model_type), context, config_path=ini)
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
