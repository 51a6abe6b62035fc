"""Backends: the registry (mslite, ms) and `auto`, which picks mslite where it can run, else ms."""
from __future__ import annotations

import logging
from typing import Dict, List, Sequence

import numpy as np

from lite_runtime.errors import BackendUnavailableError, InferError

log = logging.getLogger(__name__)

BACKENDS = ("mslite", "ms")
CHOICES = BACKENDS + ("auto",)


def mslite_importable() -> bool:
    try:
        import mindspore_lite  # noqa: F401
    except (ImportError, OSError):  # OSError: the wheel is there but CANN's libraries are not
        return False
    return True


def resolve_backend(name: str, target: str) -> str:
    """The backend to load; `auto` says which it chose and why."""
    if name not in CHOICES:
        raise InferError(f"backend {name!r} is not one of {', '.join(CHOICES)}")
    if name != "auto":
        return name
    if target == "Ascend" and mslite_importable():
        log.info("backend auto: mindspore_lite is importable and the folder targets Ascend -> mslite")
        return "mslite"
    reason = "the folder targets the CPU" if target != "Ascend" else "mindspore_lite is not installed"
    log.info("backend auto: %s -> ms (MindSpore)", reason)
    return "ms"


def load_backend(name: str, config):
    """Construct the backend `name` (mslite or ms) for an InferConfig."""
    if name == "mslite":
        from lite_runtime.backends.mslite import MsLiteBackend

        return MsLiteBackend(config)
    if name == "ms":
        from lite_runtime.backends.ms import MsBackend

        return MsBackend(config)
    raise InferError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")


def check_inputs(key: str, arrays: Dict[str, np.ndarray], specs: Sequence) -> None:
    """Inputs bound by name must match the graph's declared names, dtypes and shapes exactly."""
    names = [s.name for s in specs]
    if sorted(arrays) != sorted(names):
        raise InferError(f"the {key} graph takes inputs {', '.join(names)}; the input mapping made "
                         f"{', '.join(arrays)}; the folder and model_name do not belong together")
    for spec in specs:
        arr = arrays[spec.name]
        if str(arr.dtype) != spec.dtype or tuple(arr.shape) != tuple(spec.shape):
            raise InferError(f"the {key} graph's input {spec.name} is {spec.dtype} {list(spec.shape)}, "
                             f"got {arr.dtype} {list(arr.shape)}")


def bind_inputs(key: str, names: Sequence[str], arrays: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """The arrays in the graph's input order, found by each input's short name (`<graph>:input_ids` ->
    `input_ids`). An input the mapping did not make is an InferError that names it, never a KeyError."""
    short = [n.rsplit(":", 1)[-1] for n in names]
    missing = [n for n in short if n not in arrays]
    if missing:
        raise InferError(f"the {key} graph needs input(s) {', '.join(missing)}, which the input mapping did not make "
                         f"(it made {', '.join(sorted(arrays)) or 'none'}); the folder and model_name do not belong "
                         "together")
    return [np.ascontiguousarray(arrays[n]) for n in short]


def unavailable(backend: str, what: str, how: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"backend {backend!r} needs {what}, which cannot be imported here: {how}")
