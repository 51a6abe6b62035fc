"""The `ms` backend: MindSpore's MindIR executor (mindspore.load + nn.GraphCell). CPU default; tests run it.

Two GraphCells never share Parameters (each copies its own), so after every prefill the KV
cache Parameters are handed from the prefill cell to the incremental cell.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from lite_runtime.backends import unavailable
from lite_runtime.folder import TensorSpec

CACHE_SUFFIXES = ("key_cache", "value_cache")
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


def mindir_specs(path: str) -> Tuple[Tuple[TensorSpec, ...], Tuple[TensorSpec, ...]]:
    """Input and output specs as the MindIR file declares them (names without the graph prefix)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    name_of = mind_ir_pb2.TensorProto.DataType.Name

    def spec(value, name):
        t = value.tensor[0]
        return TensorSpec(name, _DTYPES.get(name_of(t.data_type), name_of(t.data_type).lower()), tuple(t.dims))

    inputs = tuple(spec(v, v.name.rsplit(":", 1)[-1]) for v in model.graph.input)
    outputs = tuple(spec(v, "logits" if i == 0 else f"output_{i}") for i, v in enumerate(model.graph.output))
    return inputs, outputs


class MsBackend:
    name = "ms"

    def __init__(self, config) -> None:
        ms, nn = _mindspore()
        if config.dtype == "bfloat16":
            from lite_runtime.errors import InferError

            raise InferError(f"{config.prefill_model_path}: a bfloat16 graph has no CPU kernels in MindSpore; "
                             "run it with backend 'mslite' on Atlas A2, or re-export with --dtype float32")
        ms.set_context(mode=ms.GRAPH_MODE)
        paths = {"prefill": config.prefill_model_path, "inc": config.increment_model_path}
        self.cells = {role: nn.GraphCell(ms.load(path)) for role, path in paths.items()}
        self.specs = {role: mindir_specs(path) for role, path in paths.items()}
        self._tensor = ms.Tensor
        inc_params = {p.name: p for p in self.cells["inc"].get_parameters()}
        self._cache_pairs = [(p, inc_params[p.name]) for p in self.cells["prefill"].get_parameters()
                             if p.name.endswith(CACHE_SUFFIXES)]

    def input_specs(self, role: str) -> Tuple[TensorSpec, ...]:
        return self.specs[role][0]

    def run(self, role: str, inputs: Dict[str, np.ndarray]) -> np.ndarray:
        args = [self._tensor(inputs[spec.name]) for spec in self.specs[role][0]]
        out = self.cells[role](*args)
        if role == "prefill":
            for src, dst in self._cache_pairs:
                dst.set_data(src)
        return out.asnumpy()
