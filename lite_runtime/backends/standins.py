"""The `ms` backend's CPU stand-ins for Ascend's fused operators: a parsed MindIR's fused-op nodes rewritten, before
the graph is loaded, into aot Custom ops calling cpu_kernels/atlas_ops.cc.

A `--graph fused` folder (export/network/atlas_layers.py) calls PromptFlashAttention, PagedAttention, ReshapeAndCache,
RmsNorm, AddRmsNorm and RotaryPositionEmbedding (and WeightQuantBatchMatmul when quantized; a mixture of experts
MoeGatingTopKSoftmax, MoeInitRoutingV2, GroupedMatmulV4 and MoeTokenUnpermute, export/network/moe.py). MindSpore's CPU
build infers their shapes, so the graphs export, but it has no kernels for them. Each node is replaced in place: same
data inputs, same output (the node's recorded shape, which is what a loaded Custom op's abstract comes from), the op's
scalar arguments (scale, sparse_mode, epsilon, ...) passed as a float32 constant, and the arguments a stand-in does not
implement refused with one line naming the op and value. Everything else in the graph is untouched: the stand-ins prove
the folder's own wiring, not Ascend's kernels.

Node inputs by position follow MindSpore 2.10's op definitions (mindspore/ops/auto_generate/gen_ops_prim.py:
PromptFlashAttention.__call__, ReshapeAndCache, PagedAttention, RmsNorm, AddRmsNorm, RotaryPositionEmbedding,
MoeGatingTopKSoftmax, ...), in which the constructor's arguments follow the tensors. Importable without MindSpore (it
edits the proto only).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lite_runtime.errors import InferError

LAYOUT_BNSD = 1  # MindSpore's enum for input_layout "BNSD" (str_to_enum; "BSH" is 0); tests hold it to MindSpore's


@dataclass(frozen=True)
class Standin:
    """How one fused op becomes a Custom op: which node inputs are its tensors, which are scalars it reads (passed as
    the float32 `attrs` tensor, in this order), which must be None, and what each scalar may be."""

    function: str  # in cpu_kernels/atlas_ops.cc
    tensors: Tuple[int, ...]
    scalars: Tuple[int, ...]
    nones: Tuple[int, ...] = ()
    checks: Tuple[Tuple[int, str, Callable[[object], bool]], ...] = ()  # (input, name, accepts)
    outputs: int = 1
    arity: int = 0  # inputs of the node in MindSpore 2.10's definition
    optional: Tuple[int, ...] = ()  # tensors that may be None: passed after `tensors` when set, left out when not
    writes: bool = False  # writes a Parameter input in place (ReshapeAndCache): no attrs, marked side_effect_mem
    listed: bool = False  # its one output is a list (GroupedMatmulV4's TensorList): the Custom op returns a tuple


_STANDINS: Dict[str, Standin] = {
    # q, k, v, atten_mask, actual_seq_lengths, actual_seq_lengths_kv | pse_shift .. quant_offset2 | num_heads,
    # scale_value, pre_tokens, next_tokens, input_layout, num_key_value_heads, sparse_mode, inner_precise
    "PromptFlashAttention": Standin(
        "MsliteLlmAtlasPromptFlashAttention", (0, 1, 2, 3, 4, 5), (13, 18, 14, 15), nones=tuple(range(6, 12)),
        checks=((16, "input_layout", lambda v: v == LAYOUT_BNSD), (18, "sparse_mode", lambda v: v in (0, 2, 3))),
        arity=20),
    # x, gamma, epsilon -> y, rstd
    "RmsNorm": Standin("MsliteLlmAtlasRmsNorm", (0, 1), (2,), outputs=2, arity=3),
    # x1, x2, gamma, epsilon -> y, rstd, x1 + x2
    "AddRmsNorm": Standin("MsliteLlmAtlasAddRmsNorm", (0, 1, 2), (3,), outputs=3, arity=4),
    "RotaryPositionEmbedding": Standin("MsliteLlmAtlasRotaryPositionEmbedding", (0, 1, 2), (3,),
                                       checks=((3, "mode", lambda v: v in (0, 1)),), arity=4),
    # x, weight, antiquant_scale, antiquant_offset | quant_scale, quant_offset, bias | transpose_x, transpose_weight,
    # antiquant_group_size (quantized folders: export/network/layers.py QuantMatmul; the weight as [N, K])
    "WeightQuantBatchMatmul": Standin(
        "MsliteLlmAtlasWeightQuantBatchMatmul", (0, 1, 2), (9,), nones=(4, 5, 6),
        checks=((7, "transpose_x", lambda v: not v), (8, "transpose_weight", lambda v: bool(v))), arity=10,
        optional=(3,)),
}
_STANDINS.update({
    # key, value, key_cache, value_cache, slot_mapping, U (the side effect's monad) -> key's shape; writes the caches
    "ReshapeAndCache": Standin("MsliteLlmAtlasReshapeAndCache", (0, 1, 2, 3, 4), (), arity=6, writes=True),
    # query, key_cache, value_cache, block_tables, context_lens | antiquant_scale, antiquant_offset, attn_mask,
    # q_seq_lens, alibi_mask | head_num, scale_value, kv_head_num, kv_cache_quant_mode, mask_mode, mla_v_dim
    "PagedAttention": Standin(
        "MsliteLlmAtlasPagedAttention", (0, 1, 2, 3, 4), (10, 11, 12), nones=(5, 6, 7, 8, 9),
        checks=((13, "kv_cache_quant_mode", lambda v: v == 0), (14, "mask_mode", lambda v: v == 0),
                (15, "mla_v_dim", lambda v: v == 0)), arity=16),
})
_STANDINS.update({
    # a mixture of experts' fused form (export/network/moe.py FusedExperts), dropless, as vllm-mindspore calls them:
    # x, finished | k -> y, expert_idx, row_idx
    "MoeGatingTopKSoftmax": Standin("MsliteLlmAtlasMoeGatingTopKSoftmax", (0,), (2,), nones=(1,), outputs=3, arity=3),
    # x, expert_idx | active_num, expert_capacity, expert_num, drop_pad_mode, expert_tokens_count_or_cumsum_flag,
    # expert_tokens_before_capacity_flag -> expanded_x, expanded_row_idx, expert_tokens_count_or_cumsum, before_capacity
    "MoeInitRoutingV2": Standin(
        "MsliteLlmAtlasMoeInitRoutingV2", (0, 1), (2, 3, 4, 5, 6, 7),
        checks=((2, "active_num", lambda v: v == 0), (5, "drop_pad_mode", lambda v: v == 0)), outputs=4, arity=8),
    # x, weight (one-tensor lists), bias, scale, offset | antiquant_scale, antiquant_offset (weight-only quantized) |
    # pre_token_scale, group_list, activation_input, activation_quant_scale, activation_quant_offset | split_item,
    # group_type, group_list_type, act_type, output_dtype -> [y]
    "GroupedMatmulV4": Standin(
        "MsliteLlmAtlasGroupedMatmulV4", (0, 1, 8), (12, 13, 14, 15), nones=(2, 3, 4, 7, 9, 10, 11, 16),
        checks=((12, "split_item", lambda v: v == 3), (13, "group_type", lambda v: v == 0),
                (14, "group_list_type", lambda v: v in (0, 1)), (15, "act_type", lambda v: v == 0)),
        arity=17, optional=(5, 6), listed=True),
    # MoeTokenUnpermute as MindSpore 2.10 writes it in a graph: permuted_tokens, sorted_indices | probs | padded_mode,
    # restore_shape
    "InnerMoeTokenUnpermute": Standin(
        "MsliteLlmAtlasMoeTokenUnpermute", (0, 1), (3,), nones=(4,), checks=((3, "padded_mode", lambda v: not v),),
        arity=5, optional=(2,)),
})
FUSED_OPS = tuple(_STANDINS)

# ops the export inserts between a tensor and a fused op's tuple-typed input: the stand-in reads the tensor itself
_PASS_THROUGH = ("TensorToTuple",)


def _primitives(model) -> Dict[str, object]:
    return {prim.name: prim for prim in model.primitives}


def _op_of(node, prims) -> str:
    name = node.op_type[len("REF::"):] if node.op_type.startswith("REF::") else node.op_type
    prim = prims.get(name)
    return prim.op_type if prim is not None else name


def _scalar(node) -> object:
    """The value of a Constant node holding a scalar (INT64, FLOAT, BOOL, NONE), else raises ValueError."""
    for attr in node.attribute:
        if attr.name != "value":
            continue
        kind = type(attr).AttributeType.Name(attr.type)
        if kind == "NONE":
            return None
        if kind in ("INT64", "INT32", "INT8", "UINT8", "BOOL"):
            return attr.i
        if kind in ("FLOAT", "DOUBLE"):
            return attr.f if kind == "FLOAT" else attr.d
    raise ValueError(node.name)


def substitute(model, local_func: Callable[[str], str], where: str) -> Dict[str, int]:
    """Rewrite every fused-op node of `model` (a parsed MindIR ModelProto) into its stand-in, in place.
    Returns {op type: nodes rewritten}. `local_func(function)` is the Custom op's func (this machine's library)."""
    prims = _primitives(model)
    if not any(prim.op_type in _STANDINS for prim in prims.values()):  # a plain graph: nothing to read
        return {}
    nodes = {out: node for node in model.graph.node for out in node.output}
    done: Dict[str, int] = {}
    added: List[object] = []
    for node in list(model.graph.node):
        op = _op_of(node, prims)
        spec = _STANDINS.get(op)
        if spec is None:
            continue
        inputs = list(node.input)
        if len(inputs) != spec.arity:
            raise InferError(f"{where}: {op} has {len(inputs)} inputs where MindSpore 2.10 writes {spec.arity}; the "
                             "CPU stand-ins follow 2.10's definitions: re-export with mindspore 2.10 to check it here")
        for index in spec.scalars + spec.nones + tuple(c[0] for c in spec.checks):
            if index >= len(inputs) or inputs[index] not in nodes or nodes[inputs[index]].op_type != "Constant":
                raise InferError(f"{where}: {op} input {index} is not a constant; this folder's graph was not written "
                                 "by mslite-llm's export, whose CPU stand-ins expect its own calls")
        for index in spec.nones:
            if _scalar(nodes[inputs[index]]) is not None:
                raise InferError(f"{where}: {op} input {index} is set, which the CPU stand-in does not implement; "
                                 "check this folder on the device")
        for index, name, accepts in spec.checks:
            value = _scalar(nodes[inputs[index]])
            if not accepts(value):
                raise InferError(f"{where}: {op} {name} {value!r} is not implemented by the CPU stand-in; check this "
                                 "folder on the device, or re-export it with --graph plain")
        scalars = [float(_scalar(nodes[inputs[index]])) for index in spec.scalars]
        tensors = [_through(inputs[index], nodes, prims) for index in spec.tensors]
        for index in spec.optional:
            node_in = nodes.get(inputs[index])
            if node_in is None or node_in.op_type != "Constant" or _scalar_or_tensor(node_in) is not None:
                tensors.append(_through(inputs[index], nodes, prims))
        if spec.writes:
            extra = []
        else:
            attrs = _constant(model, f"{node.name}:standin_attrs", scalars)
            added.append(attrs)
            extra = [attrs.output[0]]
        prim = _custom_primitive(model, local_func(spec.function), spec.outputs > 1 or spec.listed,
                                 len(model.primitives), spec.writes)
        del node.input[:]
        node.input.extend(tensors + extra)
        node.op_type = "REF::" + prim.name
        shown = op[len("Inner"):] if op.startswith("Inner") else op  # InnerMoeTokenUnpermute: MoeTokenUnpermute
        done[shown] = done.get(shown, 0) + 1
    if done:  # the int4 weights a stand-in reads (WeightQuantBatchMatmul's, GroupedMatmulV4's) as the bytes they are
        _rebuild(model, added)
        _int4_as_bytes(model)
    return done


def _int4_as_bytes(model) -> None:
    """int4 weights (MindSpore's qint4x2, declared [N, K / 2]: two per byte) as the uint8 bytes they are, which
    the stand-in reads (cpu_kernels/quant.cc); the `ms` backend maps them as uint8 too."""
    types = type(model.graph.parameter[0]).DataType if len(model.graph.parameter) else None
    if types is None:
        return
    for param in model.graph.parameter:
        if param.data_type == types.Value("QINT4X2"):
            param.data_type = types.Value("UINT8")


def _scalar_or_tensor(node):
    """A Constant node's value when it is a scalar or None; a tensor constant counts as set (returns True)."""
    try:
        return _scalar(node)
    except ValueError:
        return True


def _through(name: str, nodes, prims) -> str:
    """A tensor input, seen through the ops the export inserts before tuple-typed inputs (TensorToTuple) and one-tensor
    lists (MakeTuple)."""
    node = nodes.get(name)
    if node is None:
        return name
    op = _op_of(node, prims)
    if op in _PASS_THROUGH or (op == "MakeTuple" and len(node.input) == 1):
        return node.input[0]
    return name


def _constant(model, name: str, values: Sequence[float]):
    """A Constant node of a float32 [len(values)] tensor (not yet in the graph: substitute puts it first)."""
    return constant_bytes(model, name, "FLOAT", len(values), struct.pack(f"<{len(values)}f", *values))


def constant_bytes(model, name: str, data_type: str, length: int, raw: bytes):
    """A Constant node (output `name`) of a one-dimensional tensor of `length` elements of MindIR's `data_type`, its
    bytes `raw` (not yet in the graph: the caller puts it before its readers)."""
    node = type(model.graph.node[0])()
    node.op_type = "Constant"
    node.name = name
    node.output.append(name)
    attr = node.attribute.add()
    attr.name = "value"
    attr.type = type(attr).AttributeType.Value("TENSORS")
    tensor = attr.tensors.add()
    tensor.dims.append(length)
    tensor.data_type = type(tensor).DataType.Value(data_type)
    tensor.name = "value0"
    tensor.raw_data = raw
    return node


def _custom_primitive(model, func: str, multi_output: bool, index: int, writes: bool = False):
    prim = model.primitives.add()
    prim.name = f"Custom:standin{index}"
    prim.op_type = "Custom"
    prim.instance_name = ""
    for name, value in (("imply_path", ""), ("uniq_name", "Custom__" + func), ("func_type", "aot"),
                        ("func_name", func)):
        attr = prim.attribute.add()
        attr.name, attr.s = name, value.encode()
        attr.type = type(attr).AttributeType.Value("STRING")
    flags = (("multi_output", multi_output), ("autodiff", False)) + ((("side_effect_mem", True),) if writes else ())
    for name, value in flags:
        attr = prim.attribute.add()
        attr.name, attr.i = name, int(value)
        attr.type = type(attr).AttributeType.Value("BOOL")
    prim.prim_type = type(prim).PrimType.Value("PRIMITIVE")
    return prim


def _rebuild(model, constants) -> None:
    """The node list with the new constants first (a node comes before its readers) and without the nodes nothing
    reads any more (the scalar arguments, TensorToTuple), removed until none is left."""
    nodes = list(constants) + list(model.graph.node)
    while True:
        used = {name for node in nodes for name in node.input}
        used.update(out.name for out in model.graph.output)
        keep = [node for node in nodes if any(out in used for out in node.output)]
        if len(keep) == len(nodes):
            break
        nodes = keep
    set_nodes(model, nodes)


def set_nodes(model, nodes) -> None:
    """A parsed MindIR's node list replaced by `nodes`, in that order."""
    _replace(model.graph.node, nodes)


def set_parameters(model, params) -> None:
    """A parsed MindIR's parameter list replaced by `params`, in that order."""
    _replace(model.graph.parameter, params)


def _replace(field, items) -> None:
    """A repeated message field's items replaced by copies of `items` (a message cannot stay in the field it
    leaves)."""
    copies = []
    for item in items:
        copied = type(item)()
        copied.CopyFrom(item)
        copies.append(copied)
    del field[:]
    field.extend(copies)


def describe(done: Dict[str, int]) -> Optional[str]:
    """'PromptFlashAttention x2, RmsNorm x9' for check's report, or None when nothing was substituted."""
    return ", ".join(f"{op} x{n}" for op, n in sorted(done.items())) or None
