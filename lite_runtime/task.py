"""InferTask (the task registry) and pipeline(): a model folder, two graph files or an InferConfig -> a task."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Type

from lite_runtime.backends import CHOICES
from lite_runtime.config import InferConfig
from lite_runtime.errors import InferError
from lite_runtime.generator import TextGenerator


class InferTask:
    task_mapping: Dict[str, Type] = {"text_generation": TextGenerator}

    @classmethod
    def support_list(cls) -> List[str]:
        return list(cls.task_mapping)

    @classmethod
    def check_task_valid(cls, task: str) -> bool:
        return task in cls.task_mapping

    @classmethod
    def get_infer_task(cls, task: str, config: InferConfig, **kwargs: Any):
        if not cls.check_task_valid(task):
            raise InferError(f"task {task!r} is not supported; supported: {', '.join(cls.support_list())}")
        return cls.task_mapping[task](config, **kwargs)


def pipeline(task: str = "text_generation", model=None, tokenizer=None, backend: Optional[str] = None,
             **kwargs: Any):
    """Load a model for `task`.

    model: a model folder (the usual case), a (prefill_path, increment_path) pair, or an InferConfig.
    backend: "mslite" (Atlas, GE), "ms" (MindSpore, any CPU) or "auto" (mslite when importable); None: an
        InferConfig's own, else "auto", as every command defaults.
    kwargs: InferConfig fields (device_id, rank_id, ge_config_path, verify_checksums, ...).
    Bad combinations are refused before anything is loaded.
    """
    if not InferTask.check_task_valid(task):
        raise InferError(f"task {task!r} is not supported; supported: {', '.join(InferTask.support_list())}")
    if backend is None:
        backend = model.backend if isinstance(model, InferConfig) else "auto"
    if backend not in CHOICES:
        raise InferError(f"backend {backend!r} is not one of {', '.join(CHOICES)}")
    if isinstance(model, InferConfig):
        config = dataclasses.replace(model, backend=backend, **kwargs)
        config.validate()
    elif isinstance(model, (tuple, list)) and len(model) == 2:
        fields = {f.name for f in dataclasses.fields(InferConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InferError(f"unknown InferConfig field(s) {', '.join(unknown)}")
        config = InferConfig(prefill_model_path=str(model[0]), increment_model_path=str(model[1]),
                             backend=backend, **kwargs)
        config.validate()
    elif isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        config = InferConfig.from_folder(str(model), backend=backend, **kwargs)
    elif model is None:
        raise InferError("pipeline needs model=<model folder>, (prefill_path, increment_path) or an InferConfig")
    else:
        raise InferError(f"model {model!r}: not a model folder; pass a folder written by python -m export, "
                         "(prefill_path, increment_path) or an InferConfig")
    return InferTask.get_infer_task(task, config, tokenizer=tokenizer)
