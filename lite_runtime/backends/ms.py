"""The `ms` backend: MindSpore's MindIR executor (mindspore.load + nn.GraphCell). CPU default; tests run it.

Weights and KV cache are held once: the longest prefill graph is loaded with its data, every
other graph is loaded without parameter data (a copy of its proto with the data references
cleared), and each of its Parameters is pointed at the first graph's with `set_data`, which
shares the storage. So all graphs read and write the same cache, and nothing is handed over.
(`GraphCell(params_init=...)` would copy instead: one more copy of the weights per graph.)
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, Tuple

import numpy as np

from lite_runtime.backends import unavailable
from lite_runtime.folder import TensorSpec

_DTYPES = {"INT32": "int32", "INT64": "int64", "FLOAT": "float32", "FLOAT16": "float16",
           "BFLOAT16": "bfloat16", "BOOL": "bool"}


def _mindspore():
    try:
        import mindspore
        from mindspore import nn
    except ImportError:
        raise unavailable("ms", "MindSpore", "pip install mindspore==2.10.0 'numpy<2' "
                          "(or use backend 'mslite' on Atlas)") from None
    return mindspore, nn


def _read_mindir(path: str):
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    return model


def mindir_specs(model) -> Tuple[Tuple[TensorSpec, ...], Tuple[TensorSpec, ...]]:
    """Input and output specs as a parsed MindIR declares them (names without the graph prefix)."""
    from mindspore.train import mind_ir_pb2

    name_of = mind_ir_pb2.TensorProto.DataType.Name

    def spec(value, name):
        t = value.tensor[0]
        return TensorSpec(name, _DTYPES.get(name_of(t.data_type), name_of(t.data_type).lower()), tuple(t.dims))

    inputs = tuple(spec(v, v.name.rsplit(":", 1)[-1]) for v in model.graph.input)
    outputs = tuple(spec(v, "logits" if i == 0 else f"output_{i}") for i, v in enumerate(model.graph.output))
    return inputs, outputs


def _load_without_data(ms, model, name: str):
    """mindspore.load of a parsed MindIR with its parameters' data (embedded or external) cleared.

    Clears the fields on `model` itself; read its specs first.
    """
    for param in model.graph.parameter:
        param.ClearField("raw_data")
        param.ClearField("external_data")
    with tempfile.TemporaryDirectory(prefix="mslite-llm-") as tmp:
        stripped = os.path.join(tmp, name)
        with open(stripped, "wb") as fh:
            fh.write(model.SerializeToString())
        return ms.load(stripped)


def _set_cpu_threads(ms, threads) -> None:
    """MindSpore's CPU kernels default to a pool of 25-30 threads whatever the machine; use the cores we have.

    It can be set once per process; a process that set it already keeps its own choice.
    """
    if not threads:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ms.device_context.cpu.op_tuning.threads_num(int(threads))
    except RuntimeError:
        pass


class MsBackend:
    name = "ms"

    def __init__(self, config) -> None:
        ms, nn = _mindspore()
        if config.dtype == "bfloat16":
            from lite_runtime.errors import InferError

            raise InferError(f"{config.prefill_model_path}: a bfloat16 graph has no CPU kernels in MindSpore; "
                             "run it with backend 'mslite' on Atlas A2, or re-export with --dtype float32")
        ms.set_context(mode=ms.GRAPH_MODE)
        _set_cpu_threads(ms, config.cpu_threads)
        paths = config.graph_paths()  # the longest prefill graph first
        first, *others = paths
        self.specs = {}
        self.cells = {first: nn.GraphCell(ms.load(paths[first]))}
        self.specs[first] = mindir_specs(_read_mindir(paths[first]))
        owned = {p.name: p for p in self.cells[first].get_parameters()}
        for key in others:
            model = _read_mindir(paths[key])  # parsed once: specs first, then loaded without its data
            self.specs[key] = mindir_specs(model)
            cell = nn.GraphCell(_load_without_data(ms, model, os.path.basename(paths[key])))
            for param in cell.get_parameters():
                if param.name not in owned:
                    from lite_runtime.errors import InferError

                    raise InferError(f"{paths[key]}: parameter {param.name} is not in {paths[first]}; the graphs "
                                     "do not belong to one export")
                param.set_data(owned[param.name])
            self.cells[key] = cell
        self._tensor = ms.Tensor

    def input_specs(self, key: str) -> Tuple[TensorSpec, ...]:
        return self.specs[key][0]

    def run(self, key: str, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        args = [self._tensor(inputs[spec.name]) for spec in self.specs[key][0]]
        return self.cells[key](*args).asnumpy()
