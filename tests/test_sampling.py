"""Sampling: seeded reproducibility, top_k=1 = greedy, and the processors against transformers' own."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from lite_runtime.errors import InferError
from lite_runtime.sampling import GenerationSettings, process, repetition_penalty, top_k_filter, top_p_filter
from reference import prompts

ROWS = prompts(2, [5, 9], seed=31)


def fixed_logits(seed: int = 0, vocab: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(vocab).astype(np.float32) * 3
    logits[:40] = -np.abs(logits[:40])  # negative scores too, where the penalty multiplies
    return logits


def hf(processor, logits: np.ndarray, ids=None) -> np.ndarray:
    ids = torch.tensor([ids if ids is not None else [0]])
    return processor(ids, torch.tensor(logits)[None].clone())[0].numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processors_agree_with_transformers(seed):
    logits = fixed_logits(seed)
    seen = [3, 7, 7, 50, 120, 299, 5]
    np.testing.assert_allclose(repetition_penalty(logits, seen, 1.3),
                               hf(RepetitionPenaltyLogitsProcessor(1.3), logits, seen), rtol=1e-6)
    np.testing.assert_allclose(process(logits, [], GenerationSettings(do_sample=True, temperature=0.7, top_k=0)),
                               hf(TemperatureLogitsWarper(0.7), logits), rtol=1e-6)
    for k in (1, 5, 40):
        np.testing.assert_array_equal(top_k_filter(logits, k), hf(TopKLogitsWarper(k), logits))
    for p in (0.1, 0.5, 0.9, 0.99):
        np.testing.assert_array_equal(top_p_filter(logits, p), hf(TopPLogitsWarper(p), logits))


def test_full_chain_agrees_with_transformers():
    logits, seen = fixed_logits(5), [1, 2, 3, 200]
    s = GenerationSettings(do_sample=True, temperature=0.8, top_k=30, top_p=0.7, repetition_penalty=1.2)
    ref = hf(RepetitionPenaltyLogitsProcessor(1.2), logits, seen)
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(30), TopPLogitsWarper(0.7)):
        ref = hf(warper, ref)
    got = process(logits, seen, s)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    np.testing.assert_allclose(got[~np.isinf(got)], ref[~np.isinf(ref)], rtol=1e-6)


def test_seeded_sampling_is_reproducible(pipes):
    pipe = pipes["gqa_tied"]
    kw = dict(do_sample=True, top_k=20, top_p=0.9, temperature=1.5, max_new_tokens=10)
    a = pipe.generate(ROWS, seed=7, **kw).sequences
    assert pipe.generate(ROWS, seed=7, **kw).sequences == a
    assert any(pipe.generate(ROWS, seed=s, **kw).sequences != a for s in (8, 9, 10))


def test_top_k_1_equals_greedy(pipes):
    pipe = pipes["mha_untied"]
    greedy = pipe.generate(ROWS, max_new_tokens=10).sequences
    assert pipe.generate(ROWS, do_sample=True, top_k=1, temperature=2.0, seed=3, max_new_tokens=10).sequences == greedy


def test_repetition_penalty_in_greedy_matches_hf(pipes, checkpoints):
    from reference import hf_generate

    out = pipes["gqa_tied"].generate(ROWS, max_new_tokens=10, repetition_penalty=1.5).sequences
    for row, got in zip(ROWS, out):
        assert got == hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=10, do_sample=False,
                                  repetition_penalty=1.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0), "temperature must be > 0, got 0; use do_sample=False for greedy"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-1), "top_k must be >= 0 (0 disables it), got -1"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(beams=4), "unknown generation argument(s) beams; valid: do_sample, eos_token_id, max_length, "
                    "max_new_tokens, pad_token_id, repetition_penalty, seed, temperature, top_k, top_p"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(InferError) as err:
        GenerationSettings().updated(**kwargs)
    assert str(err.value) == message
