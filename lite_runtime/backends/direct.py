"""The `ms` backend's direct steps: a graph made of our CPU kernels and a few small integer ops, run by calling the
kernels in the graph's own order from Python, without MindSpore's executor (docs/architecture.md, "Direct steps").

Once a decode step's work is our ops (one per layer, their weights handed over as one arena: arena.py), what MindSpore
adds around them is the step's largest cost after the kernels: ~11 us between two of our ops and ~0.5 ms at the graph
call's boundary, 0.9 ms of a 4 ms SmolLM2 int4 step (docs/performance-log.md 62). A plan built at load from the same
rewritten MindIR the backend would hand MindSpore runs the same nodes in the same order on the same memory: our ops
through ctypes with their tensor lists built once (every buffer lives as long as the plan: the weights and the arena,
the KV caches, which MindSpore's graphs share since their Parameters hold the same arrays, each node's output, and the
inputs, copied in a call), the graph's few other ops (positions, RoPE rows, masks: Reshape, Sub, Gather, ...) in numpy.
The logits are copied out. The same kernels on the same pointers: bit-identical to MindSpore's run of the graph.

A graph with an op this file does not know (a tensor-parallel AllReduce, a prefill graph's MindSpore matmuls) gets no
plan, and MindSpore runs it as before; `MSLITE_LLM_DIRECT_STEPS=0` runs every graph through MindSpore (an A/B, a
suspicion). Importable without MindSpore (it reads the proto only).
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, List, Tuple

import numpy as np

from lite_runtime.backends.ms import _NUMPY, _our_calls
from lite_runtime.backends.standins import _scalar

# MindIR TensorProto.DataType name -> the dtype string MindSpore's aot CPU kernels are handed (the numpy dtype:
# ms._NUMPY's)
KERNEL_DTYPES = {"FLOAT": "float32", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "DOUBLE": "float64", "INT8": "int8",
                 "UINT8": "uint8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "BOOL": "bool"}
MONAD = object()  # a side effect's ordering token: what Constant UMONAD/IOMONAD and UpdateState give
# the ops a plan runs besides ours, each only in the forms handled below (anything else: no plan)
PLAIN = ("Reshape", "Sub", "Add", "Mul", "Muls", "FloorDiv", "Minimum", "Maximum", "Less", "Cast", "Gather",
         "StridedSlice", "Concat", "Stack", "Transpose", "BroadcastTo", "ExpandDims", "Squeeze")
PASS = ("Load", "Depend")  # pass their first input on
VIEWS = ("Reshape", "ExpandDims", "Squeeze")  # of PLAIN's, those whose output is a view of their input
STRIDED_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


class NoPlan(Exception):
    """The graph holds something a plan does not run (the message says what): MindSpore runs it."""


class KernelError(RuntimeError):
    """One of our ops returned an error code in a direct step (what MindSpore reports as a failed launch)."""


def _type_name(proto) -> str:
    return type(proto).DataType.Name(proto.data_type)


def _numpy_of(proto) -> Tuple[type, str]:
    """(numpy dtype, kernel dtype string) of a tensor or parameter proto."""
    name = _type_name(proto)
    if name not in KERNEL_DTYPES or name not in _NUMPY:
        raise NoPlan(f"dtype {name}")
    return _NUMPY[name], KERNEL_DTYPES[name]


def _constant(node):
    """A Constant node's value: a numpy array (a tensor), a Python scalar, a tuple of them, None, or MONAD."""
    if len(node.attribute) != 1:
        raise NoPlan(f"constant {node.name}")
    attr = node.attribute[0]
    kind = type(attr).AttributeType.Name(attr.type)
    if kind in ("UMONAD", "IOMONAD"):
        return MONAD
    if kind in ("NONE", "INT64", "INT32", "INT8", "UINT8", "BOOL", "FLOAT", "DOUBLE"):
        try:
            return _scalar(node)
        except ValueError:
            raise NoPlan(f"constant {node.name}") from None
    if kind == "TENSORS" and len(attr.tensors) == 1:
        tensor = attr.tensors[0]
        dtype, _ = _numpy_of(tensor)
        shape = tuple(int(d) for d in tensor.dims)
        data = np.frombuffer(tensor.raw_data, dtype=dtype)
        if data.size != int(np.prod(shape, dtype=np.int64)):
            raise NoPlan(f"constant {node.name}: its bytes are not its shape's")
        return data.reshape(shape).copy()
    if kind in ("TUPLE", "LIST"):
        values = []
        for v in attr.values:
            k = type(v).AttributeType.Name(v.type)
            if k not in ("INT64", "INT32", "INT8", "UINT8", "BOOL"):
                raise NoPlan(f"constant {node.name}: a {kind} of {k}")
            values.append(int(v.ints[0]) if len(v.ints) == 1 else int(v.i))
        return tuple(values)
    raise NoPlan(f"constant {node.name} of kind {kind}")


def _prim_attr(prim, name: str):
    for attr in prim.attribute:
        if attr.name == name:
            kind = type(attr).AttributeType.Name(attr.type)
            if kind in ("INT64", "INT32", "INT8", "UINT8", "BOOL"):
                return int(attr.i)
            raise NoPlan(f"{prim.op_type} attribute {name} of kind {kind}")
    return None


def _gives_tuple(node) -> bool:
    """Whether the node's recorded output is a tuple (of one tensor each: our ops of several outputs; their
    primitive's multi_output flag is not kept in the MindIR)."""
    return any(attr.name == "shape" and type(attr).AttributeType.Name(attr.type) == "TUPLE" for attr in node.attribute)


def _output_specs(node) -> List[Tuple[tuple, type, str]]:
    """The node's outputs as the graph recorded them: (shape, numpy dtype, kernel dtype string) each."""
    for attr in node.attribute:
        if attr.name == "shape":
            # one output: its tensor; several (a tuple): a value of one tensor each
            tensors = list(attr.tensors) if attr.tensors else [v.tensors[0] for v in attr.values if len(v.tensors) == 1]
            if attr.values and len(tensors) != len(attr.values):
                raise NoPlan(f"node {node.name}: an output that is not a tensor")
            return [(tuple(int(d) for d in t.dims),) + _numpy_of(t) for t in tensors]
    raise NoPlan(f"node {node.name} records no output shape")


class Plan:
    """A graph's direct run: `run(inputs)` -> a copy of its output. Built by `build`."""

    def __init__(self, inputs: List[Tuple[str, np.ndarray]], steps: List[Callable[[], None]], output: np.ndarray,
                 keep: list) -> None:
        self.inputs = inputs  # (graph input name, its buffer)
        self.steps = steps
        self.output = output
        self._keep = keep  # the ctypes arrays and buffers the steps point at

    def run(self, arrays: List[np.ndarray]) -> np.ndarray:
        for (name, buffer), array in zip(self.inputs, arrays):
            if array.shape != buffer.shape:
                raise ValueError(f"input {name}: shape {array.shape}, the graph's is {buffer.shape}")
            np.copyto(buffer, array, casting="same_kind")
        for step in self.steps:
            step()
        return self.output.copy()


def _kernel_call(fn, name: str, tensors: List[np.ndarray], kinds: List[str], keep: list) -> Callable[[], None]:
    """One of our ops called as MindSpore's aot CPU kernel calls it (registry.cc): its tensor lists built once."""
    n = len(tensors)
    params = (ctypes.c_void_p * n)(*[t.ctypes.data for t in tensors])
    ndims = (ctypes.c_int * n)(*[t.ndim for t in tensors])
    rows = [(ctypes.c_int64 * max(t.ndim, 1))(*t.shape) for t in tensors]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(r, ctypes.POINTER(ctypes.c_int64)) for r in rows])
    names = (ctypes.c_char_p * n)(*[k.encode() for k in kinds])
    keep += [params, ndims, rows, shapes, names, tensors]

    def call() -> None:
        code = fn(n, params, ndims, shapes, names, None, None)
        if code:
            raise KernelError(f"{name} returned error {code} in a direct step")

    return call


def build(model, memory: Dict[str, np.ndarray], library: ctypes.CDLL) -> Plan:
    """The plan of a parsed, rewritten MindIR (what the backend would load). `memory`: parameter name without its
    graph's prefix -> the array MindSpore's Parameter holds (weights, arena, KV caches); `library`: our kernels'
    library, loaded. Raises NoPlan."""
    functions, op_of, _ = _our_calls(model)  # Custom primitive -> our function's name
    prims = {p.name: p for p in model.primitives}
    values: Dict[str, object] = {}
    kinds: Dict[str, str] = {}  # value name -> the kernel dtype string of an array value
    keep: list = []
    inputs = []
    for spec in model.graph.input:
        if len(spec.tensor) != 1:
            raise NoPlan(f"input {spec.name}")
        dtype, kind = _numpy_of(spec.tensor[0])
        buffer = np.zeros(tuple(int(d) for d in spec.tensor[0].dims), dtype)
        values[spec.name], kinds[spec.name] = buffer, kind
        inputs.append((spec.name, buffer))
    for param in model.graph.parameter:
        array = memory.get(param.name.rsplit(":", 1)[-1])
        dtype, kind = _numpy_of(param)
        shape = tuple(int(d) for d in param.dims)
        if array is None or array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
            raise NoPlan(f"parameter {param.name}: not held as the graph declares it")
        values[param.name], kinds[param.name] = array, kind

    def get(name: str):
        if name not in values:
            raise NoPlan(f"{name} is used before it is made")
        return values[name]

    steps: List[Callable[[], None]] = []
    for node in model.graph.node:
        op = op_of(node)
        prim = prims.get(node.op_type.rpartition("::")[2])
        if op == "Constant":
            values[node.output[0]] = _constant(node)
            if isinstance(values[node.output[0]], np.ndarray):
                kinds[node.output[0]] = KERNEL_DTYPES[_type_name(node.attribute[0].tensors[0])]
            continue
        if len(node.output) != 1:
            raise NoPlan(f"node {node.name} has {len(node.output)} outputs")
        out_name = node.output[0]
        if op in PASS:
            values[out_name] = get(node.input[0])
            if node.input[0] in kinds:
                kinds[out_name] = kinds[node.input[0]]
            continue
        if op == "UpdateState":  # an ordering: the steps run in the graph's order
            for name in node.input:
                get(name)
            values[out_name] = MONAD
            continue
        if op == "MakeTuple":  # a Concat's parts, or what an UpdateState orders
            values[out_name] = tuple(get(name) for name in node.input)
            continue
        if op == "TupleGetItem":  # one output of one of our ops of several
            whole, index = get(node.input[0]), get(node.input[1]) if len(node.input) == 2 else None
            if not isinstance(whole, tuple) or not isinstance(index, int) or not 0 <= index < len(whole) or \
                    not isinstance(kinds.get(node.input[0]), tuple):
                raise NoPlan(f"TupleGetItem {node.name}")
            values[out_name], kinds[out_name] = whole[index], kinds[node.input[0]][index]
            continue
        function = functions.get(node.op_type.rpartition("::")[2])
        specs = _output_specs(node)
        if function is not None:
            args = [name for name in node.input if get(name) is not MONAD]
            if any(not isinstance(values[a], np.ndarray) for a in args):
                raise NoPlan(f"node {node.name}: an input that is not a tensor")
            if any(not values[a].flags.c_contiguous for a in args):
                raise NoPlan(f"node {node.name}: an input that is not contiguous")
            outs = [np.zeros(shape, dtype) for shape, dtype, _ in specs]
            if not outs:
                raise NoPlan(f"node {node.name}: no output")
            steps.append(_kernel_call(getattr(library, function), function, [values[a] for a in args] + outs,
                                      [kinds[a] for a in args] + [k for _, _, k in specs], keep))
            multi = _gives_tuple(node)
            if not multi and len(outs) != 1:
                raise NoPlan(f"node {node.name}: {len(outs)} outputs")
            values[out_name], kinds[out_name] = ((tuple(outs), tuple(k for _, _, k in specs)) if multi else
                                                 (outs[0], specs[0][2]))
            continue
        if op not in PLAIN or len(specs) != 1:
            raise NoPlan(f"op {op}")
        shape, dtype, kind = specs[0]
        args = [get(name) for name in node.input]
        if any(a is MONAD for a in args):
            raise NoPlan(f"node {node.name}: a monad input")
        if op in VIEWS:  # a view of its input: nothing to run
            x = args[0]
            if not isinstance(x, np.ndarray) or x.size != int(np.prod(shape, dtype=np.int64)) or \
                    not x.flags.c_contiguous or x.dtype != dtype:
                raise NoPlan(f"{op} {node.name}")
            values[out_name], kinds[out_name] = x.reshape(shape), kind
            continue
        out = np.zeros(shape, dtype)
        steps.append(_plain(op, prim, node.name, args, out))
        values[out_name], kinds[out_name] = out, kind
    if len(model.graph.output) != 1:
        raise NoPlan("the graph has several outputs")
    output = get(model.graph.output[0].name)
    if not isinstance(output, np.ndarray):
        raise NoPlan("the graph's output is not a tensor")
    return Plan(inputs, steps, output, keep)


def _plain(op: str, prim, name: str, args: list, out: np.ndarray) -> Callable[[], None]:
    """One of PLAIN's ops as numpy, writing `out` (the node's recorded shape and dtype); NoPlan for forms not
    handled."""
    def tensor(i: int) -> np.ndarray:
        a = args[i]
        if isinstance(a, np.ndarray):
            return a
        if isinstance(a, int) or (isinstance(a, float) and out.dtype.kind == "f"):
            return np.asarray(a, out.dtype)  # a scalar in the op's dtype, as MindSpore's scalar ops take it
        raise NoPlan(f"{op} {name}: input {i}")

    def checked(shape) -> None:
        if tuple(shape) != out.shape:
            raise NoPlan(f"{op} {name}: gives {tuple(shape)}, the graph records {out.shape}")

    if op in ("Sub", "Add", "Mul", "Muls", "FloorDiv", "Minimum", "Maximum", "Less"):
        x, y = tensor(0), tensor(1)
        checked(np.broadcast_shapes(x.shape, y.shape))
        ufunc = {"Sub": np.subtract, "Add": np.add, "Mul": np.multiply, "Muls": np.multiply,
                 "FloorDiv": np.floor_divide, "Minimum": np.minimum, "Maximum": np.maximum, "Less": np.less}[op]
        if op != "Less" and (x.dtype != out.dtype or y.dtype != out.dtype):
            raise NoPlan(f"{op} {name}: mixed dtypes")
        if op == "FloorDiv" and out.dtype.kind not in "iu":  # (integers only: a float's floor of a quotient may
            raise NoPlan(f"FloorDiv {name}: not integers")  # round otherwise than MindSpore's)
        if op == "FloorDiv":
            def floor_div() -> None:
                if (y == 0).any():
                    raise KernelError(f"FloorDiv {name}: a division by zero")
                np.floor_divide(x, y, out=out)

            return floor_div
        return lambda: ufunc(x, y, out=out)
    if op == "Transpose":  # x, perm
        x, perm = tensor(0), args[1] if len(args) == 2 else None
        if not isinstance(perm, tuple) or sorted(perm) != list(range(x.ndim)):
            raise NoPlan(f"Transpose {name}")
        checked(tuple(x.shape[i] for i in perm))
        return lambda: np.copyto(out, np.transpose(x, perm))
    if op == "Stack":  # a tuple of tensors, the axis an attribute
        parts, axis = args[0], _prim_attr(prim, "axis")
        if len(args) != 1 or not isinstance(parts, tuple) or not parts or axis is None or \
                not all(isinstance(p, np.ndarray) and p.dtype == out.dtype for p in parts):
            raise NoPlan(f"Stack {name}")
        checked(np.stack([np.empty(p.shape, p.dtype) for p in parts], axis=axis).shape)
        return lambda: np.stack(parts, axis=axis, out=out)
    if op == "Cast":
        x = tensor(0)
        checked(x.shape)
        if x.dtype.kind == "f" and out.dtype.kind in "iub":
            raise NoPlan(f"Cast {name}: float to integer")
        return lambda: np.copyto(out, x, casting="unsafe")
    if op == "BroadcastTo":
        x = tensor(0)
        if x.dtype != out.dtype:
            raise NoPlan(f"BroadcastTo {name}: dtype")
        np.broadcast_shapes(x.shape, out.shape)
        return lambda: np.copyto(out, x)
    if op == "Gather":  # params, indices, axis, batch_dims
        if len(args) != 4 or not isinstance(args[2], int) or args[3] != 0:
            raise NoPlan(f"Gather {name}")
        table, indices, axis = tensor(0), tensor(1), args[2]
        if indices.dtype.kind not in "iu" or table.dtype != out.dtype:
            raise NoPlan(f"Gather {name}: dtypes")
        axis %= table.ndim
        checked(table.shape[:axis] + indices.shape + table.shape[axis + 1:])
        bound = table.shape[axis]

        def gather() -> None:  # as MindSpore's CPU Gather: a negative index counts from the end, past it an error
            try:
                np.take(table, indices, axis=axis, out=out)
            except IndexError:
                raise KernelError(f"Gather {name}: an index outside [-{bound}, {bound})") from None

        return gather
    if op == "StridedSlice":  # x, begin, end, strides, then begin, end, ellipsis, new axis and shrink masks
        if len(args) != 9 or not all(isinstance(a, int) for a in args[4:]) or args[6] or args[7] or \
                any(_prim_attr(prim, m) for m in STRIDED_MASKS):
            raise NoPlan(f"StridedSlice {name}: masks")
        x = tensor(0)
        begin, end, strides = args[1], args[2], args[3]
        if not all(isinstance(t, tuple) and len(t) == len(begin) for t in (begin, end, strides)) or \
                len(begin) > x.ndim or 0 in strides:
            raise NoPlan(f"StridedSlice {name}")
        index = []
        for i, (b, e, st) in enumerate(zip(begin, end, strides)):
            if args[8] >> i & 1:
                index.append(b)  # shrink: the one index, its axis gone
            else:
                index.append(slice(None if args[4] >> i & 1 else b, None if args[5] >> i & 1 else e, st))
        index = tuple(index)
        checked(x[index].shape)
        return lambda: np.copyto(out, x[index])
    if op == "Concat":
        parts, axis = args[0], args[1] if len(args) == 2 else _prim_attr(prim, "axis")
        if not isinstance(parts, tuple) or not parts or not isinstance(axis, int) or len(args) > 2 or \
                not all(isinstance(p, np.ndarray) and p.dtype == out.dtype for p in parts):
            raise NoPlan(f"Concat {name}")
        checked(np.concatenate([np.empty(p.shape, p.dtype) for p in parts], axis=axis).shape)
        return lambda: np.concatenate(parts, axis=axis, out=out)
    raise NoPlan(f"op {op}")
