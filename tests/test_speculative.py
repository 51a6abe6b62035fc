"""Speculative decoding (lite_runtime/speculative.py) through the score graphs: greedy output token-identical to decoding
without it (and to HF's), the speculative-sampling rule's output distributed as the target's, the pacer, and the
draft folder's refusals."""
from __future__ import annotations

import numpy as np
import pytest

from reference import hf_generate, prompts

from lite_runtime.errors import InferError
from lite_runtime.speculative import Pacer, accept, lookup


@pytest.fixture(scope="module")
def target(score_folders):
    from lite_runtime import pipeline

    return pipeline("text_generation", model=score_folders["target"], backend="ms")


def repetitive(seed: int, n: int = 10):
    """A prompt that repeats itself, so prompt lookup finds n-grams to draft from."""
    base = prompts(1, [n], seed=seed)[0]
    return base + base + base[:4]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_lookup_greedy_is_token_identical(target, checkpoints, seed):
    row = repetitive(seed)
    plain = target.generate([row], max_new_tokens=30)
    fast = target.generate([row], max_new_tokens=30, prompt_lookup_num_tokens=10)
    assert fast[0] == plain[0] == hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=30, do_sample=False)
    assert fast.speculative.drafted > 0 and fast.speculative.rounds > 0
    assert fast.finish_reasons == plain.finish_reasons


def test_draft_folders_greedy_is_token_identical(target, score_folders):
    """A poor draft (another model) and a perfect one (the folder itself: every draft kept) change nothing."""
    for seed in (3, 4):
        row = prompts(1, [9], seed=seed)[0]
        plain = target.generate([row], max_new_tokens=40)
        other = target.generate([row], max_new_tokens=40, assistant_model=score_folders["draft"])
        same = target.generate([row], max_new_tokens=40, assistant_model=target)
        assert other[0] == plain[0] and same[0] == plain[0]
        assert same.speculative.accepted == same.speculative.drafted > 0
        assert other.speculative.accepted < other.speculative.drafted


def test_speculation_stops_at_the_limit_and_the_graphs(target):
    """max_new_tokens is never overshot by kept drafts, and a row near seq_length drafts only what fits."""
    row = repetitive(5, 20)  # 44 tokens of 64
    for limit in (1, 2, 7, 20):
        out = target.generate([row], max_new_tokens=limit, prompt_lookup_num_tokens=15)
        assert out[0] == target.generate([row], max_new_tokens=limit)[0]
        assert len(out[0]) - len(row) <= limit


def test_accept_follows_the_speculative_sampling_rule():
    """Output of one drafted position (draft d ~ q kept with min(1, p/q), else a draw from max(0, p - q)) is
    distributed as p: chi-square over a 6-token vocabulary, 40,000 draws, fixed seed; the point-mass q of prompt
    lookup too."""
    rng = np.random.default_rng(7)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    q = np.array([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    n = 40_000

    def draws(point):
        counts = np.zeros(len(p))
        for _ in range(n):
            d = 2 if point else int(rng.choice(len(q), p=q))
            fixed = accept(p, None if point else q, d, rng)
            counts[d if fixed is None else fixed] += 1
        return counts

    for point in (False, True):
        counts = draws(point)
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 20.5, (point, counts / n)  # chi-square, 5 degrees of freedom: p = 0.001


def test_sampled_speculation_runs_and_keeps_within_the_vocabulary(target):
    """Sampling with drafts (seeded): every token is in the vocabulary and the run repeats for a seed."""
    row = repetitive(6)
    a = target.generate([row], max_new_tokens=20, do_sample=True, seed=11, prompt_lookup_num_tokens=5)
    b = target.generate([row], max_new_tokens=20, do_sample=True, seed=11, prompt_lookup_num_tokens=5)
    assert a[0] == b[0] and all(0 <= t < target.config.vocab_size for t in a[0])


def test_lookup_finds_the_first_earlier_ngram():
    assert lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [9, 9, 1]  # the trigram's first occurrence
    assert lookup([5, 6, 7, 5], 2) == [6, 7]  # only a unigram matches
    assert lookup([1, 2, 3], 4) == []


def test_pacer_turns_speculation_off_while_it_loses_and_retries():
    pacer = Pacer(7, 3)
    assert not pacer.speculate()
    pacer.plain(0.010)
    pacer.plain(0.010)
    assert pacer.speculate()
    pacer.round(0.030, 3, 3)  # 4 tokens in 30 ms: 7.5 ms a token, a win; K grows by 2
    assert pacer.k == 5 and pacer.speculate()
    for _ in range(Pacer.PATIENCE):
        pacer.round(0.016, 5, 0)  # 16 ms a token: losing
    assert not pacer.speculate()
    for _ in range(Pacer.PAUSE):
        assert not pacer.speculate()
        pacer.plain(0.010)
    assert pacer.speculate() and pacer.pause == 2 * Pacer.PAUSE


def test_refusals(target, score_folders):
    row = prompts(1, [5], seed=1)[0]
    with pytest.raises(InferError, match="vocabulary|tokenizer") as err:
        target.generate([row], max_new_tokens=4, assistant_model=score_folders["other_tok"])
    assert score_folders["other_tok"] in str(err.value) and score_folders["target"] in str(err.value)
    with pytest.raises(InferError, match="one row at a time"):
        target.generate([row, row], max_new_tokens=4, prompt_lookup_num_tokens=3)
    with pytest.raises(InferError, match=r"prompt_lookup_num_tokens 16 must be between 1 and 15"):
        target.generate([row], max_new_tokens=4, prompt_lookup_num_tokens=16)
    from lite_runtime import pipeline

    bare = pipeline("text_generation", model=score_folders["no_score"], backend="ms")
    with pytest.raises(InferError, match="no score graph .*re-export it with python -m export"):
        bare.generate([row], max_new_tokens=4, prompt_lookup_num_tokens=3)
