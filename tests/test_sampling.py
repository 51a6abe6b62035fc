"""Sampling: seeded reproducibility, top_k=1 = greedy, and the processors against transformers' own (min_p,
sequence_bias, suppress_tokens too); OpenAI's presence and frequency penalties, which HF has no processor for,
against their formula on fixed logits and, in generate, against HF's logits with the formula applied (a
LogitsProcessor written here from OpenAI's definition)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from lite_runtime.errors import InferError
from lite_runtime.engine.sampling import (GenerationSettings, min_p_filter, openai_penalties, process, repetition_penalty,
                                   sequence_bias, top_k_filter, top_p_filter)
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_sequence_bias_and_suppression_agree_with_transformers(seed):
    logits = fixed_logits(seed)
    for p in (0.0, 0.05, 0.3, 0.9, 1.0):
        np.testing.assert_array_equal(min_p_filter(logits, p), hf(MinPLogitsWarper(p), logits))
    seen = [4, 9, 17, 9, 250]
    bias = {(5,): 2.5, (9, 250, 31): -3.0, (17, 9, 250, 299): 7.0, (250, 8): 1.5, (1, 2, 3): 9.0, (299,): -100.0}
    got = sequence_bias(logits, seen, tuple(bias.items()))
    np.testing.assert_allclose(got, hf(SequenceBiasLogitsProcessor(bias), logits, seen), rtol=1e-6)
    assert got[31] == pytest.approx(logits[31] - 3) and got[3] == logits[3]  # matched / not matched
    s = GenerationSettings(suppress_tokens=[3, 77])
    np.testing.assert_array_equal(process(logits, seen, s), hf(SuppressTokensLogitsProcessor([3, 77]), logits))


def _openai(logits, generated, presence, frequency):
    """OpenAI's definition, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = np.array(logits, np.float64)
    for j in set(generated):
        c = generated.count(j)
        out[j] = out[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.2, -0.4), (-2.0, 2.0)])
def test_openai_penalties_follow_their_formula(presence, frequency):
    logits = fixed_logits(7)
    prompt, generated = [3, 3, 8], [8, 8, 8, 12, 299, 12]
    got = openai_penalties(logits, generated, presence, frequency)
    np.testing.assert_allclose(got, _openai(logits, generated, presence, frequency), rtol=1e-6, atol=1e-6)
    s = GenerationSettings(presence_penalty=presence, frequency_penalty=frequency)
    full = process(logits, prompt + generated, s, prompt_length=len(prompt))  # the prompt's tokens are not counted
    np.testing.assert_allclose(full, _openai(logits, generated, presence, frequency), rtol=1e-6, atol=1e-6)
    assert full[3] == logits[3]


class OpenAIPenalties(LogitsProcessor):
    """The reference for generate: OpenAI's formula over the tokens past the prompt, on HF's logits."""

    def __init__(self, prompt_length, presence, frequency):
        self.n, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for i in range(input_ids.shape[0]):
            generated = input_ids[i, self.n:].tolist()
            out[i] = torch.tensor(_openai(scores[i].numpy(), generated, self.presence, self.frequency), dtype=out.dtype)
        return out


def test_new_processors_in_greedy_generate_match_hf(pipes, checkpoints):
    """pipeline().generate with HF's names (sequence_bias, suppress_tokens) gives HF generate's tokens; with the
    OpenAI penalties, HF generate's with the formula as a LogitsProcessor."""
    from reference import hf_generate

    pipe, ckpt = pipes["gqa_tied"], checkpoints["gqa_tied"]
    plain = pipe.generate(ROWS, max_new_tokens=10).sequences
    changed = set()
    for row, base in zip(ROWS, plain):
        first = base[len(row)]
        kwargs = dict(sequence_bias={(first,): -4.0, (row[-1], base[len(row) + 1]): 3.0}, suppress_tokens=[7, 11],
                      repetition_penalty=1.2)
        got = pipe.generate([row], max_new_tokens=10, **kwargs)[0]
        assert got == hf_generate(ckpt, row, max_new_tokens=10, do_sample=False, **kwargs)
        assert 7 not in got[len(row):] and 11 not in got[len(row):]
        changed.add(("bias", got != base))
        got = pipe.generate([row], max_new_tokens=10, presence_penalty=1.5, frequency_penalty=0.8)[0]
        changed.add(("penalties", got != base))
        ref = hf_generate(ckpt, row, max_new_tokens=10, do_sample=False,
                          logits_processor=[OpenAIPenalties(len(row), 1.5, 0.8)])
        assert got == ref
    assert ("bias", True) in changed and ("penalties", True) in changed  # the settings did change the answers


def test_min_p_1_samples_the_top_token_and_ignore_eos_runs_to_the_limit(pipes):
    pipe = pipes["gqa_tied"]
    greedy = pipe.generate(ROWS, max_new_tokens=8).sequences
    assert pipe.generate(ROWS, do_sample=True, min_p=1.0, temperature=1.5, top_k=0, seed=4,
                         max_new_tokens=8).sequences == greedy
    eos = pipe.defaults.eos_token_id[0]
    out = pipe.generate([ROWS[0]], max_new_tokens=6, sequence_bias={(eos,): 80.0})
    assert out[0][len(ROWS[0]):] == [eos] and out.finish_reasons == ["eos"]
    out = pipe.generate([ROWS[0]], max_new_tokens=6, sequence_bias={(eos,): 80.0}, ignore_eos=True)
    assert out[0][len(ROWS[0]):] == [eos] * 6 and out.finish_reasons == ["length"]


def test_full_chain_agrees_with_transformers():
    """Every processor at once, in HF generate's order (sequence bias, repetition penalty, suppressed tokens,
    temperature, top-k, top-p, min-p)."""
    logits, seen = fixed_logits(5), [1, 2, 3, 200]
    bias = {(200, 5): 4.0, (17,): -2.0}
    s = GenerationSettings(do_sample=True, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2, min_p=0.05,
                           sequence_bias=tuple(bias.items()), suppress_tokens=(6,))
    ref = hf(SequenceBiasLogitsProcessor(bias), logits, seen)
    ref = hf(RepetitionPenaltyLogitsProcessor(1.2), ref, seen)
    for warper in (SuppressTokensLogitsProcessor([6]), TemperatureLogitsWarper(0.8), TopKLogitsWarper(30),
                   TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)):
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
    (dict(beams=4), "unknown generation argument(s) beams; valid: do_sample, eos_token_id, frequency_penalty, "
                    "ignore_eos, max_length, max_new_tokens, min_p, pad_token_id, presence_penalty, "
                    "repetition_penalty, seed, sequence_bias, suppress_tokens, temperature, top_k, top_p"),
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 disables it), got 1.5"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (OpenAI's range), got 2.5"),
    (dict(suppress_tokens=[1, -2]), "suppress_tokens must be a token id or a list of token ids (integers >= 0), got "
                                    "[1, -2]"),
    (dict(sequence_bias={(1, "a"): 2.0}), "sequence_bias must map token ids (one id or a tuple of them) to finite "
                                          "biases, as {(id, ...): bias} or [[ids, bias], ...]; got {(1, 'a'): 2.0}"),
    (dict(sequence_bias=[[[3], float("nan")]]), "sequence_bias must map token ids (one id or a tuple of them) to "
                                                "finite biases, as {(id, ...): bias} or [[ids, bias], ...]; got "
                                                "[[[3], nan]]"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(InferError) as err:
        GenerationSettings().updated(**kwargs)
    assert str(err.value) == message
