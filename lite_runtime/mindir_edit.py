"""Set the KV cache Parameters' block count in a MindIR graph's bytes, without MindSpore or protobuf (an Atlas box has
only mindspore_lite): a minimal reader and writer of protobuf's wire format over the three messages involved.

A folder's graphs declare each layer's caches with a nominal first dimension (their blocks) and no data; the runtime
sizes the pool when it loads the folder (docs/architecture.md, "The KV cache: a pool of blocks"). The `ms` backend
edits the parsed proto (backends/ms.py); the `mslite` backend writes a sized copy of each graph with this module
(backends/mslite.py sized_graphs). Field numbers are mind_ir.proto's (MindSpore's mind_ir_pb2; tests/test_paged.py
holds them to it): ModelProto.graph 7 and functions 8 (GraphProto), GraphProto.parameter 3 (TensorProto),
TensorProto.dims 1 (int64, packed or not) and name 7. Everything else is copied byte for byte.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Tuple

MODEL_GRAPH, MODEL_FUNCTIONS = 7, 8
GRAPH_PARAMETER = 3
TENSOR_DIMS, TENSOR_NAME = 1, 7
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class MindIRError(ValueError):
    """The bytes are not a MindIR graph this module can read."""


def _read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise MindIRError("a varint runs past the end of the message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 as protobuf writes it: ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf: bytes) -> Iterator[Tuple[int, int, int, int, int]]:
    """(field number, wire type, start of the field's tag, start of its value, end) of each field of a message."""
    pos = 0
    while pos < len(buf):
        start = pos
        tag, pos = _read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, end = _read_varint(buf, pos)
        elif wire == _I64:
            end = pos + 8
        elif wire == _I32:
            end = pos + 4
        elif wire == _LEN:
            length, pos = _read_varint(buf, pos)
            end = pos + length
        else:
            raise MindIRError(f"wire type {wire} (groups) is not used by mind_ir.proto")
        if end > len(buf):
            raise MindIRError("a field runs past the end of the message")
        yield number, wire, start, pos, end
        pos = end


def _rewrite(buf: bytes, number: int, edit: Callable[[bytes], Optional[bytes]]) -> bytes:
    """The message with each length-delimited field `number` replaced by edit(its bytes) (None: unchanged)."""
    out: List[bytes] = []
    last = 0
    for field, wire, start, value, end in _fields(buf):
        if field != number or wire != _LEN:
            continue
        new = edit(buf[value:end])
        if new is None:
            continue
        out += [buf[last:start], _varint((number << 3) | _LEN), _varint(len(new)), new]
        last = end
    out.append(buf[last:])
    return b"".join(out)


def tensor_name(tensor: bytes) -> Optional[str]:
    for field, wire, _, value, end in _fields(tensor):
        if field == TENSOR_NAME and wire == _LEN:
            return tensor[value:end].decode("utf-8", "replace")
    return None


def _set_first_dim(tensor: bytes, size: int) -> bytes:
    for field, wire, start, value, end in _fields(tensor):
        if field != TENSOR_DIMS:
            continue
        if wire == _VARINT:  # one dim per field: the first one
            return tensor[:start] + _varint(TENSOR_DIMS << 3) + _varint(size) + tensor[end:]
        if wire == _LEN:  # packed: the whole list
            dims, pos = [], value
            while pos < end:
                d, pos = _read_varint(tensor, pos)
                dims.append(d)
            body = b"".join(_varint(d) for d in [size] + dims[1:])
            return tensor[:start] + _varint((TENSOR_DIMS << 3) | _LEN) + _varint(len(body)) + body + tensor[end:]
    raise MindIRError(f"parameter {tensor_name(tensor)} has no dims")


def set_first_dims(model: bytes, wanted: Callable[[str], bool], size: int) -> Tuple[bytes, int]:
    """`model` (a serialized ModelProto) with the first dimension of every graph parameter whose short name (past the
    graph's `<prefix>:`) `wanted` says, set to `size`; and how many were set."""
    count = 0

    def parameter(tensor: bytes) -> Optional[bytes]:
        nonlocal count
        name = tensor_name(tensor)
        if name is None or not wanted(name.rsplit(":", 1)[-1]):
            return None
        count += 1
        return _set_first_dim(tensor, size)

    def graph(body: bytes) -> bytes:
        return _rewrite(body, GRAPH_PARAMETER, parameter)

    out = _rewrite(_rewrite(model, MODEL_GRAPH, graph), MODEL_FUNCTIONS, graph)
    return out, count
