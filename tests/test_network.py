"""The MindSpore network against HF Qwen2ForCausalLM on the same random weights (fp32); the other families: test_families.py."""
from __future__ import annotations

import numpy as np
import pytest

from reference import hf_last_logits, load_into, paged_inputs, prompts, rel_err, right_pad

TOL = 1e-4


def build(checkpoint: str, batch: int, seq: int, dtype: str = "float32"):
    from export.config import ModelConfig
    from export.network.model import CausalLM, DecodeGraph, PrefillGraph

    net = CausalLM(ModelConfig.from_file(f"{checkpoint}/config.json"), batch, seq, dtype, block_size=8)
    load_into(net, checkpoint)
    return PrefillGraph(net), DecodeGraph(net)


def run(cell, ids, lengths):
    """A prefill or decode step, each row's sequence in blocks of its own whose table runs backwards."""
    import mindspore as ms

    net = cell.net
    tables, slots = paged_inputs(ids, lengths, net.seq_length, net.block_size)
    return cell(ms.Tensor(np.asarray(ids, np.int32)), ms.Tensor(np.asarray(lengths, np.int32)), ms.Tensor(tables),
                ms.Tensor(slots)).asnumpy()


@pytest.fixture(scope="module")
def nets(checkpoints):
    """(prefill, decode) cells per checkpoint, batch 2, seq_length 24, built once: compiling is the slow part."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = build(checkpoints[name], batch=2, seq=24)
        return built[name]
    return get


@pytest.mark.parametrize("name", ["gqa_tied", "mha_untied"])
def test_prefill_and_decode_match_hf_batch_of_two(nets, checkpoints, name):
    """Batch of 2 prompts of different lengths; prefill, then 3 greedy decode steps, each row vs HF."""
    ckpt = checkpoints[name]
    prefill, decode = nets(name)
    rows = prompts(2, [5, 11], seed=3)
    logits = run(prefill, right_pad(rows, 24), [len(r) for r in rows])
    for step in range(4):
        for b, row in enumerate(rows):
            ref = hf_last_logits(ckpt, row)
            assert rel_err(logits[b], ref) < TOL, (step, b)
            assert int(logits[b].argmax()) == int(ref.argmax())
        nxt = logits.argmax(-1)
        for b in range(2):
            rows[b].append(int(nxt[b]))
        logits = run(decode, nxt.reshape(2, 1), [len(r) for r in rows])


def test_prefill_n_then_one_step_equals_full_forward_n_plus_1(nets, checkpoints):
    ckpt = checkpoints["gqa_tied"]
    prefill, decode = nets("gqa_tied")
    row, other = prompts(2, [9, 4], seed=5)
    run(prefill, right_pad([row[:8], other], 24), [8, 4])
    stepped = run(decode, [[row[8]], [other[-1]]], [9, 4])[0]  # row 1 rewrites its last token: unchanged
    full = run(prefill, right_pad([row, other], 24), [9, 4])[0]
    assert rel_err(stepped, full) < TOL
    assert rel_err(stepped, hf_last_logits(ckpt, row)) < TOL


def test_prompt_filling_the_whole_cache(nets, checkpoints):
    """A prompt of exactly seq_length tokens: no padding at all."""
    ckpt = checkpoints["mha_untied"]
    prefill, _ = nets("mha_untied")
    row, other = prompts(2, [24, 3], seed=7)
    out = run(prefill, right_pad([row, other], 24), [24, 3])
    assert rel_err(out[0], hf_last_logits(ckpt, row)) < TOL
    assert rel_err(out[1], hf_last_logits(ckpt, other)) < TOL


def test_float16_network_stays_close_to_hf(checkpoints):
    """fp16 is an export dtype for Atlas; on CPU it must still agree with the fp32 reference loosely."""
    ckpt = checkpoints["gqa_tied"]
    prefill, _ = build(ckpt, batch=1, seq=16, dtype="float16")
    row = prompts(1, [7], seed=9)[0]
    assert rel_err(run(prefill, right_pad([row], 16), [7])[0], hf_last_logits(ckpt, row)) < 2e-2
