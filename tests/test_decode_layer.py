"""The decode step's layer in one kernel call (cpu_kernels DECODE_LAYER): what the inc graphs of a CPU folder call,
and that they decode as HF does (the golden replay of check and HF's greedy tokens)."""
from __future__ import annotations

import collections
import json
import os

from reference import hf_generate, prompts


def kernel_calls(path: str) -> collections.Counter:
    """Our library's functions a MindIR graph calls, and how many times."""
    from mindspore.train import mind_ir_pb2

    import cpu_kernels

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    funcs = {}
    for prim in model.primitives:
        for attr in prim.attribute:
            if attr.name == "func_name" and cpu_kernels.names_our_library(attr.s.decode()):
                funcs[prim.name] = attr.s.decode().rpartition(":")[2]
    return collections.Counter(funcs[n.op_type.rpartition("::")[2]] for n in model.graph.node
                               if n.op_type.rpartition("::")[2] in funcs)


def test_every_inc_graph_calls_one_kernel_per_layer(exported, pipes, checkpoints):
    import cpu_kernels

    folder = exported["gqa_tied"]  # 2 layers, a q/k/v bias, no o_proj or MLP bias
    with open(os.path.join(folder, "manifest.json")) as fh:
        incs = [g["file"] for g in json.load(fh)["graphs"] if g["role"] == "inc"]
    assert len(incs) == 2  # the batch-2 graph and the 1-row one
    for file in incs:
        calls = kernel_calls(os.path.join(folder, file))
        assert calls[cpu_kernels.DECODE_LAYER] == 2, (file, calls)
        assert not {cpu_kernels.DECODE_QKV, cpu_kernels.DECODE_ATTENTION, cpu_kernels.DECODE_TAIL} & set(calls)
    # the chunk and score graphs' layer in one call too, the form that computes only the rows holding a token
    with open(os.path.join(folder, "manifest.json")) as fh:
        pieces = [g["file"] for g in json.load(fh)["graphs"] if g["role"] in ("chunk", "score")]
    assert pieces
    for file in pieces:
        calls = kernel_calls(os.path.join(folder, file))
        assert calls[cpu_kernels.DECODE_LAYER_VALID] == 2, (file, calls)
        assert not {cpu_kernels.QKV_ROPE, cpu_kernels.QKV_ROPE_VALID, cpu_kernels.DECODE_ATTENTION,
                    cpu_kernels.DECODE_TAIL, cpu_kernels.WRITE_CACHE} & set(calls), (file, calls)
    # the prefill graphs keep the three ops' first two (their o_proj and MLP run over the prompt's rows)
    prefill = kernel_calls(os.path.join(folder, "gqa_tied_prefill_graph.mindir"))
    assert cpu_kernels.DECODE_LAYER not in prefill and prefill[cpu_kernels.DECODE_QKV] == 2
    rows = prompts(2, [6, 9], seed=44)
    for row, got in zip(rows, pipes["gqa_tied"].generate(rows, max_new_tokens=10).sequences):
        assert got == hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=10, do_sample=False)
