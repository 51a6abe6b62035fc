"""A mixture of experts' weights stacked at export: the checkpoint holds each expert's projections apart
(`mlp.experts.N.{gate,up,down}_proj.weight`, Qwen's layout, whatever the source: safetensors, GPTQ, GGUF split per
expert by its reader); the graphs read one tensor per layer and kind, as transformers 5 holds them in memory:
`mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
[E, H, I]; the Atlas fused form's (export/network/moe.py FusedExperts, GroupedMatmul's [E, K, N]) their transposes, [E,
H, 2I] and [E, I, H], each expert's block transposed as it is read (int4: unpacked, transposed, packed again along N;
the scales stay [E, G, N]). In a quantized folder each expert is quantized as a
linear layer is (export/network/quantize.py), and the stacks are of its folder tensors: `gate_up_proj` the q [E, 2I, H
or H / 2], `gate_up_proj_scale` (and `_offset`) [E, G, 2I] (the gate's scales, then the up's, along the outputs),
`down_proj` [E, H, I or I / 2] and its [E, G, H].

The weights writer (weights_file.py) reads a stacked tensor a few experts at a time (its chunks are rows of the
first dimension), each chunk read, or quantized, in a worker when the writer converts it: memory holds a chunk,
never a layer (docs/architecture.md, "Mixture of experts")."""
from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import numpy as np

from export.network.quantize import transpose_block

# a stack: (shape, per expert the names concatenated, the axis they are concatenated along)
Stack = Tuple[Tuple[int, ...], List[List[str]], int]


def _read(src, name: str) -> np.ndarray:
    """One expert's tensor as the folder holds it: a quantized layer's folder tensor (computed by its source, once),
    else the checkpoint's stored bits."""
    if hasattr(src, "materialize"):
        return src.materialize(name)
    return np.asarray(src.stored(name))


class _Rows:
    """A stacked tensor as the writer reads it: shape, ndim, reshape to [E, -1], and rows by slice: a callable the
    writer's worker runs (the experts read then). Tensor parallel (`tp` > 1, `split`: the stack's axis the ranks
    share): each expert's block is its ranks' shares one after another, flattened, so that rank r's part of an
    expert is the r-th contiguous run of its bytes (export/writers/weights_file.py _STACKED_AXIS)."""

    def __init__(self, parts: List[List[Tuple[object, str]]], shape: Tuple[int, ...], axis: int,
                 flat: bool = False, tp: int = 1, split=None, transposed: bool = False, packed: bool = False) -> None:
        self.parts, self.shape, self.axis, self.flat = parts, shape, axis, flat
        self.tp, self.split, self.transposed, self.packed = tp, split, transposed, packed
        self.ndim = len(shape)

    def reshape(self, rows: int, _=-1) -> "_Rows":
        return _Rows(self.parts, (rows, int(np.prod(self.shape[1:]))), self.axis, True, self.tp, self.split,
                     self.transposed, self.packed)

    def _expert(self, e: int) -> np.ndarray:
        arrays = [_read(src, name) for src, name in self.parts[e]]
        turn = functools.partial(transpose_block, packed=self.packed) if self.transposed else np.ascontiguousarray
        if self.tp == 1 or self.split is None:
            block = turn(np.concatenate(arrays, axis=self.axis))
            return block.reshape(-1) if self.flat else block
        along = self.split - 1  # the split axis within one expert's block

        def share(a: np.ndarray, r: int) -> np.ndarray:
            n = a.shape[along] // self.tp
            return a[(slice(None),) * along + (slice(r * n, (r + 1) * n),)]

        return np.concatenate([turn(np.concatenate([share(a, r) for a in arrays], axis=self.axis)).reshape(-1)
                               for r in range(self.tp)])

    def _stack(self, index: slice) -> np.ndarray:
        return np.stack([self._expert(e) for e in range(*index.indices(self.shape[0]))])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return functools.partial(self._stack, index)
        return self._expert(index)


class StackedExperts:
    """The stacked tensors of one checkpoint (`where`: name -> source), under their graph names, with the source
    interface the weights writer reads (path, offset, shape, stored, row_nbytes)."""

    def __init__(self, where: Dict[str, object], stacks: Dict[str, Stack], itemsize: Dict[str, int], tp: int = 1,
                 splits: Dict[str, object] = None, transposed: bool = False, packed=()) -> None:
        self.where, self.transposed, self.packed = where, transposed, set(packed)
        self.stacks = stacks
        self.itemsize = itemsize
        self.tp, self.splits = tp, splits or {}
        first = next(iter(stacks.values()))[1][0][0]
        src = where[first]
        layer = getattr(src, "layer_of", {}).get(first)  # a quantized layer's: its checkpoint file, for the order
        self.path = src.q.where[layer].path if layer is not None else getattr(src, "path", "")

    def names(self) -> List[str]:
        return list(self.stacks)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.stacks[name][0]

    def offset(self, name: str) -> int:
        first = self.stacks[name][1][0][0]
        return self.where[first].offset(first)

    def row_nbytes(self, name: str) -> int:
        """One expert's bytes as the folder holds them (what the writer's chunks are counted in)."""
        return int(np.prod(self.shape(name)[1:])) * self.itemsize[name]

    def stored(self, name: str) -> _Rows:
        shape, experts, axis = self.stacks[name]
        turned = self.transposed and not name.endswith(("_scale", "_offset"))  # the scales stay [E, G, N]
        return _Rows([[(self.where[n], n) for n in names] for names in experts], shape, axis, tp=self.tp,
                     split=self.splits.get(name), transposed=turned, packed=turned and name in self.packed)


def stack_experts(cfg, where: Dict[str, object], params: Dict[str, Tuple[Tuple[int, ...], str]],
                  tp: int = 1, transposed: bool = False) -> Dict[str, object]:
    """`where` with each sparse layer's stacked tensors added (cfg: the ModelConfig; params: the network's parameters,
    name -> (shape, dtype), one rank's, whose stacked ones say what each stack holds: a float matrix, or a quantized
    one's q, scale and offset, taken from the folder tensors of `where`). A stack's shape is the whole model's, from
    its experts' tensors; `tp` > 1 lays each expert's rank shares out one after another (_Rows); `transposed`: the
    Atlas fused form's [E, K, N] matrices (q too; the scales stay [E, G, N])."""
    from export.writers.weights_file import split_axis

    stacks: Dict[str, Stack] = {}
    itemsize: Dict[str, int] = {}
    packed: List[str] = []
    splits: Dict[str, object] = {}
    for layer in range(cfg.num_hidden_layers):
        if not cfg.sparse(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        for stacked, kinds in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix, axis in (("", 0), ("_scale", 1), ("_offset", 1)):
                name = p + stacked + suffix
                if name not in params:
                    continue
                dtype = params[name][1]
                experts = [[f"{p}{n}.{kind}.weight{suffix}" for kind in kinds] for n in range(cfg.num_experts)]
                first = [where[n].shape(n) for n in experts[0]]
                block = list(first[0])
                block[axis] = sum(s[axis] for s in first)
                shape = (cfg.num_experts, *block)
                pack = 2 if not suffix and dtype in ("uint8", "qint4x2") else 1  # int4 q: two values a byte
                if pack == 2:
                    packed.append(name)
                # a share's size along each per-expert axis, in values: the stack's (n, k) against one rank's
                full = (block[0], block[1] * pack)
                rank = params[name][0][1:]
                if transposed and not suffix:  # the network's [E, K, N(/2)]
                    shape = (shape[0], full[1], full[0] // pack)
                    rank = (rank[1] * pack, rank[0])
                else:
                    rank = (rank[0], rank[1] * pack)
                stacks[name] = (shape, experts, axis)
                itemsize[name] = 1 if dtype in ("int8", "uint8", "qint4x2") else 2 if dtype in (
                    "float16", "bfloat16") else 4
                split = split_axis(name) if tp > 1 else None
                if split is not None and (block[split - 1] if suffix else full[split - 1]) != rank[split - 1]:
                    # (else every rank's, whole)
                    splits[name] = split
    if not stacks:
        return where
    source = StackedExperts(where, stacks, itemsize, tp, splits, transposed, packed)
    return {**where, **{name: source for name in source.names()}}
