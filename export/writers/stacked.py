"""A mixture of experts' weights stacked at export: the checkpoint holds each expert's projections apart
(`mlp.experts.N.{gate,up,down}_proj.weight`, Qwen's layout, whatever the source: safetensors, GPTQ dequantized,
GGUF split per expert by its reader); the graphs read one tensor per layer and kind, as transformers 5 holds them in
memory: `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
[E, H, I]. The weights writer (weights_file.py) reads a stacked tensor a few experts at a time (its chunks are
rows of the first dimension), so memory holds a chunk, never a layer (docs/architecture.md, "Mixture of experts")."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np


class _Rows:
    """A stacked tensor as the writer reads it: shape, ndim, reshape to [E, -1] and rows (experts) by slice."""

    def __init__(self, parts: List[List[Tuple[object, str]]], shape: Tuple[int, ...], flat: bool = False) -> None:
        self.parts, self.shape, self.flat = parts, shape, flat
        self.ndim = len(shape)

    def reshape(self, rows: int, _=-1) -> "_Rows":
        return _Rows(self.parts, (rows, int(np.prod(self.shape[1:]))), flat=True)

    def _expert(self, e: int) -> np.ndarray:
        block = np.concatenate([np.asarray(src.stored(name)) for src, name in self.parts[e]], axis=0)
        return block.reshape(-1) if self.flat else block

    def __getitem__(self, index):
        if isinstance(index, slice):
            return np.stack([self._expert(e) for e in range(*index.indices(self.shape[0]))])
        return self._expert(index)


class StackedExperts:
    """The stacked tensors of one checkpoint (`where`: name -> source), under their graph names, with the source
    interface the weights writer reads (path, offset, shape, stored)."""

    def __init__(self, where: Dict[str, object], stacks: Dict[str, Tuple[Tuple[int, ...], List[List[str]]]]) -> None:
        self.where = where
        self.stacks = stacks
        first = next(iter(stacks.values()))[1][0][0]
        self.path = getattr(where[first], "path", "")

    def names(self) -> List[str]:
        return list(self.stacks)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.stacks[name][0]

    def offset(self, name: str) -> int:
        first = self.stacks[name][1][0][0]
        return self.where[first].offset(first)

    def stored(self, name: str) -> _Rows:
        shape, experts = self.stacks[name]
        return _Rows([[(self.where[n], n) for n in names] for names in experts], shape)


def stack_experts(cfg, where: Dict[str, object]) -> Dict[str, object]:
    """`where` with each sparse layer's stacked tensors added (cfg: the ModelConfig)."""
    stacks: Dict[str, Tuple[Tuple[int, ...], List[List[str]]]] = {}
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        if not cfg.sparse(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        stacks[p + "gate_up_proj"] = ((e, 2 * i, h), [[f"{p}{n}.gate_proj.weight", f"{p}{n}.up_proj.weight"]
                                                      for n in range(e)])
        stacks[p + "down_proj"] = ((e, h, i), [[f"{p}{n}.down_proj.weight"] for n in range(e)])
    if not stacks:
        return where
    source = StackedExperts(where, stacks)
    return {**where, **{name: source for name in source.names()}}
