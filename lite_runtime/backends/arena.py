"""The `ms` backend's arena calls: a parsed MindIR's nodes calling our CPU kernels rewritten, before the graph is
loaded, to hand each op its weights as places in one arena instead of one tensor each (docs/architecture.md, "Weights
handed over as one arena").

MindSpore's CPU runtime pays for every tensor it hands a kernel, ~0.5-1 us each once a decode step's weights have swept
the caches (docs/performance-log.md 57): a quantized layer op takes ~40 tensors, 25 of them weights, ~1,200 a SmolLM2
step. At load the backend copies the weights our kernels read into one arena of huge pages (ms.py _into_huge_pages).
Here each such node becomes a call of cpu_kernels/registry.cc MsliteLlmArenaCall with three kinds of input: a table
(an int64 Constant: the op's function, and per input of the op where it is and its dtype and shape), the arena (one
uint8 Parameter every graph of the folder shares), and the op's other inputs in their order (activations, the KV
caches, the step's lengths and tables), then the side effects' monads as before. The op's Constant inputs (eps, a
layout, a zero bias) are folded into the table. The kernel rebuilds the op's tensor lists and calls it: the same
pointers, the same results, ~10-15 tensors handed over instead of ~40.

Never in a folder: the arena's places and the function's address are this process's. A folder whose graph names
MsliteLlmArenaCall is refused at load like any function the library does not list (cpu_kernels.unknown_functions).
Importable without MindSpore (it edits the proto only).
"""
from __future__ import annotations

import math
import struct
from typing import Callable, Dict, List, Optional

ARENA_PARAMETER = "mslite_llm.arena"  # the arena's Parameter in a rewritten graph (uint8 [its bytes])
MAGIC = 0x314E524141534D4C  # cpu_kernels/registry.cc ARENA_MAGIC
# cpu_kernels/registry.cc ARENA_DTYPES, by MindIR's TensorProto.DataType names
DTYPES = {"FLOAT": 0, "FLOAT16": 1, "BFLOAT16": 2, "INT8": 3, "UINT8": 4, "INT16": 5, "INT32": 6, "INT64": 7,
          "BOOL": 8, "DOUBLE": 9}
SIZES = {0: 4, 1: 2, 2: 2, 3: 1, 4: 1, 5: 2, 6: 4, 7: 8, 8: 1, 9: 8}
PASSED, IN_ARENA, IN_TABLE = 0, 1, 2  # where an input of the op is (registry.cc MsliteLlmArenaCall)
MAX_TENSORS = 256  # registry.cc ARENA_MAX: an op's inputs and outputs
MONADS = ("UMONAD", "IOMONAD")


def _constant_tensor(node):
    """A Constant node's one tensor (dims, dtype code, bytes) when it holds one whose bytes are all there, else None."""
    if node.op_type != "Constant" or len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if type(attr).AttributeType.Name(attr.type) != "TENSORS" or len(attr.tensors) != 1:
        return None
    tensor = attr.tensors[0]
    code = DTYPES.get(type(tensor).DataType.Name(tensor.data_type))
    if code is None:
        return None
    if len(tensor.dims) > 8 or math.prod(int(d) for d in tensor.dims) * SIZES[code] != len(tensor.raw_data):
        return None
    return [int(d) for d in tensor.dims], code, bytes(tensor.raw_data)


def _is_monad(node, op_of) -> bool:
    if node is None:
        return False
    if node.op_type == "Constant":
        return any(type(a).AttributeType.Name(a.type) in MONADS for a in node.attribute)
    return op_of(node) == "UpdateState"


def _table(node_name: str, model, address: int, entries: List[tuple], passed: int, blobs: List[bytes]):
    """The table's Constant node: [MAGIC, address, inputs, passed, per input (where, offset, dtype, rank, dims...)],
    then the folded constants' bytes (each at an 8-byte boundary; an entry's offset is from the table's start)."""
    head = 8 * (4 + sum(4 + len(dims) for _, _, _, dims in entries))
    blob_at, data = [], b""
    for blob in blobs:
        blob_at.append(head + len(data))
        data += blob + b"\0" * (-len(blob) % 8)
    words = [MAGIC, address, len(entries), passed]
    for where, offset, code, dims in entries:  # a table entry's offset: its blob's index, here its place
        words += [where, blob_at[offset] if where == IN_TABLE else offset, code, len(dims), *dims]
    from lite_runtime.backends.standins import constant_bytes

    raw = struct.pack(f"<{len(words)}q", *(w - (1 << 64) if w >= 1 << 63 else w for w in words)) + data
    return constant_bytes(model, node_name + ":arena_table", "INT64", len(raw) // 8, raw)


def call_through_arena(model, places: Dict[str, int], arena_bytes: int, address: Callable[[str], int],
                       wrapper: str, skip=()) -> int:
    """Rewrite the nodes of `model` (a parsed MindIR, its Custom ops pointed at this machine's library) that call one
    of our kernels (any function but `skip`'s) and read a weight in the arena, in place. `places`: parameter name
    (without its graph's prefix) -> its byte offset in the arena (ms.py _into_huge_pages), the arena `arena_bytes`
    long; `address(function)`: the function's address in the loaded library (cpu_kernels.function_address); `wrapper`:
    MsliteLlmArenaCall's func string (cpu_kernels.local_func). Adds the arena Parameter (ARENA_PARAMETER) and drops the
    weights' Parameters nothing else reads. Returns how many nodes."""
    import cpu_kernels

    from lite_runtime.backends.ms import _our_calls
    from lite_runtime.backends.standins import _rebuild, set_parameters

    ours, op_of, _ = _our_calls(model)  # a primitive calling one of our kernels -> its function
    funcs = {prim: function for prim, function in ours.items() if function not in skip
             and function != cpu_kernels.ARENA_CALL}
    if not funcs or not places:
        return 0
    prims = {prim.name: prim for prim in model.primitives}
    params = {p.name: p for p in model.graph.parameter}
    nodes = {out: node for node in model.graph.node for out in node.output}
    short = lambda name: name.rsplit(":", 1)[-1]
    arena_name = _arena_name(model)

    def in_arena(name: str) -> Optional[str]:
        """The parameter `name` is (through Load nodes, not Depend: _our_calls' resolve takes both) when it is in the
        arena."""
        while name not in params:
            node = nodes.get(name)
            if node is None or not node.input or op_of(node) != "Load":
                return None
            name = node.input[0]
        return name if short(name) in places else None

    wrappers: Dict[str, object] = {}
    tables = []
    rewritten = 0
    for node in model.graph.node:
        prim_name = node.op_type.rpartition("::")[2]
        function = funcs.get(prim_name)
        if function is None:
            continue
        entries, passed, monads, blobs = [], [], [], []
        for name in node.input:
            source = nodes.get(name)
            param = in_arena(name)
            if param is not None:
                p = params[param]
                code = DTYPES.get(type(p).DataType.Name(p.data_type))
                dims = [int(d) for d in p.dims]
                if code is None or len(dims) > 8 or places[short(param)] + math.prod(dims) * SIZES[code] > arena_bytes:
                    entries = None  # not a weight of the arena's form: the node is left as it is
                    break
                entries.append((IN_ARENA, places[short(param)], code, dims))
            elif _is_monad(source, op_of):
                monads.append(name)
            elif source is not None and (constant := _constant_tensor(source)) is not None:
                dims, code, raw = constant
                entries.append((IN_TABLE, len(blobs), code, dims))
                blobs.append(raw)
            else:
                entries.append((PASSED, 0, 0, []))
                passed.append(name)
        if entries is None or not any(e[0] == IN_ARENA for e in entries) or \
                len(entries) + len(node.output) > MAX_TENSORS:
            continue
        if prim_name not in wrappers:
            prim = model.primitives.add()
            prim.CopyFrom(prims[prim_name])
            prim.name = prim_name + ":arena"
            for attr in prim.attribute:
                if attr.name == "func_name":
                    attr.s = wrapper.encode()
                elif attr.name == "uniq_name":
                    attr.s = ("Custom__" + wrapper).encode()
            wrappers[prim_name] = prim
        table = _table(node.name, model, address(function), entries, len(passed), blobs)
        tables.append(table)
        del node.input[:]
        node.input.extend([table.output[0], arena_name] + passed + monads)
        node.op_type = "REF::" + wrappers[prim_name].name
        rewritten += 1
    if not rewritten:
        return 0
    arena = model.graph.parameter.add()
    arena.name = arena_name
    arena.dims.append(int(arena_bytes))
    arena.data_type = type(arena).DataType.Value("UINT8")
    _rebuild(model, tables)
    used = {name for node in model.graph.node for name in node.input}
    kept = [p for p in model.graph.parameter if p.name in used or short(p.name) not in places]
    if len(kept) != len(model.graph.parameter):
        set_parameters(model, kept)
    return rewritten


def _arena_name(model) -> str:
    """ARENA_PARAMETER under the prefix the graph's parameters carry ("<graph>:<name>")."""
    for p in model.graph.parameter:
        if p.name != ARENA_PARAMETER and ":" in p.name and not p.name.endswith(":" + ARENA_PARAMETER):
            return p.name.rsplit(":", 1)[0] + ":" + ARENA_PARAMETER
    return ARENA_PARAMETER
