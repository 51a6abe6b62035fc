"""Speculative decoding (lite_runtime/engine/speculative.py) through the score graphs: greedy output token-identical to
decoding without it (and to HF's), the speculative-sampling rule's output distributed as the target's, the pacer, and the
draft folder's refusals."""
from __future__ import annotations

import numpy as np
import pytest

from reference import hf_generate, prompts

from lite_runtime.errors import InferError
from lite_runtime.engine.speculative import Pacer, accept, lookup


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


def test_pacer_holds_speculation_to_its_loss_budget():
    """Plain steps first (timed); rounds run while their worst case fits the budget; losing rounds stop it, plain
    tokens refill the budget and it tries again with the K that fits; a winning round earns credit."""
    step = 0.010
    pacer = Pacer(7, 5)
    assert pacer.plan() == 0
    pacer.plain(step)
    pacer.plain(step)
    assert pacer.plan() == 5  # prompt lookup: drafting is free, a verify (2 steps assumed) fits the allowance
    pacer.round(0.015, 0.015, 5, 5)  # 6 tokens in 1.5 steps: a win, K grows by 2
    assert pacer.k == 7 and pacer.lost < 0
    losses = 0
    while pacer.plan():
        pacer.round(0.015, 0.015, pacer.plan(), 0)  # one token for 1.5 steps: 0.5 step lost a round
        losses += 1
    # the credit (4 steps) and the allowance (2 steps) spent at 0.5 step a round
    assert 1 <= losses <= 14 and pacer.lost <= (Pacer.BUDGET * pacer.tokens + Pacer.ALLOWANCE) * step
    plain = 0
    while not pacer.plan():
        pacer.plain(step)
        plain += 1
    assert plain >= 10  # refilled at BUDGET of a step per token
    # a draft model's round costs its K draft tokens too: K is cut to what the budget's room holds
    drafty = Pacer(7, 5)
    drafty.plain(step)
    drafty.plain(step)
    drafty.round(0.045, 0.015, 3, 0)  # 3 drafts at 10 ms and a verify: 3.5 steps lost for one token
    assert drafty.draft_time == pytest.approx(0.010) and drafty.plan() == 0


def test_pacer_takes_the_k_that_makes_the_most_tokens_a_second():
    """Under the heuristic's bound, K is the one whose round makes the most tokens a second: expected tokens at the
    recent rate of kept drafts over the measured verify time of K + 1 tokens (unmeasured lengths on the line through a
    plain step and the nearest measured one). A verify that costs a step more per 2 tokens (a quantized form on an
    AVX2 CPU) drafts few after a miss; one that costs little more than a step keeps the bound."""
    step = 0.010

    def after_a_miss(verify_of_8: float) -> Pacer:
        pacer = Pacer(7, 7)
        pacer.plain(step)
        pacer.plain(step)
        assert pacer.plan() == 7  # nothing measured: a verify is taken as 2 steps at any length, so the bound
        pacer.round(verify_of_8, verify_of_8, 7, 7)  # all kept
        assert pacer.verify_seconds(8) == verify_of_8
        assert pacer.verify_seconds(4) == pytest.approx(step + (verify_of_8 - step) * 3 / 7)
        assert pacer.plan() == 7  # every draft kept lately: 8 tokens a round, the most a second at either cost
        pacer.round(verify_of_8, verify_of_8, 7, 1)  # a miss: the rate of kept drafts (3.5 + 1) / (4.5 + 1)
        assert pacer.k == 6
        return pacer

    steep = after_a_miss(0.040)  # 4 steps for 8 tokens
    assert steep.plan() == 2  # E(2) = 1 + a + a^2 = 2.49 tokens in 1.86 steps: 1.34 a step; E(3) 1.33, E(6) 1.16
    assert after_a_miss(0.013).plan() == 6  # 1.3 steps for 8 tokens: the bound
    steep.round(0.018, 0.018, 2, 2)  # measured: a verify of 3 tokens costs 1.8 steps
    assert steep.verify_seconds(3) == 0.018 and steep.verify_seconds(2) == pytest.approx(0.014)  # the line to 3


def test_refusals(target, score_folders):
    row = prompts(1, [5], seed=1)[0]
    with pytest.raises(InferError, match="vocabulary|tokenizer") as err:
        target.generate([row], max_new_tokens=4, assistant_model=score_folders["other_tok"])
    assert score_folders["other_tok"] in str(err.value) and score_folders["target"] in str(err.value)
    with pytest.raises(InferError, match="one row at a time"):
        target.generate([row, row], max_new_tokens=4, prompt_lookup_num_tokens=3)
    # texts through the pipeline's call go one after another instead
    texts = ["hello there", "the cat sat on the mat, the cat sat"]
    assert target(texts, max_new_tokens=6, prompt_lookup_num_tokens=3) == target(texts, max_new_tokens=6)
    with pytest.raises(InferError, match=r"prompt_lookup_num_tokens 16 must be between 1 and 15"):
        target.generate([row], max_new_tokens=4, prompt_lookup_num_tokens=16)
    from lite_runtime import pipeline

    bare = pipeline("text_generation", model=score_folders["no_score"], backend="ms")
    with pytest.raises(InferError, match="no score graph .*re-export it with python -m export"):
        bare.generate([row], max_new_tokens=4, prompt_lookup_num_tokens=3)


# --- the server ---------------------------------------------------------------------------------------------------
def test_server_speculation_is_token_identical_and_counted(target, score_folders, checkpoints):
    """Prompt lookup (the server's default): a request decoding alone drafts from its prompt; its tokens are HF's
    greedy ones, streamed or not, and a seeded sampled request's are pipeline().generate's with that seed; /metrics
    counts the drafted and accepted tokens; `speculative: false` declines."""
    import httpx

    from serving import served

    row = repetitive(7)
    want = hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=24, do_sample=False)[len(row):]
    with served(score_folders["target"]) as server:
        tokenizer = server.service.generator.tokenizer
        for extra in ({}, {"stream": True}, {"speculative": False}):
            body = {"prompt": row, "max_tokens": 24, "temperature": 0, "logprobs": 0, **extra}
            if extra.get("stream"):
                text = ""
                with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            import json

                            text += json.loads(line[6:])["choices"][0]["text"]
            else:
                text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            assert text == tokenizer.decode(want, skip_special_tokens=True), extra
        # sampled with a seed: each token is still one draw, in order, from the model's distribution: the same tokens
        # as pipeline().generate with that seed, drafts or not
        body = {"prompt": row, "max_tokens": 24, "temperature": 0.8, "seed": 3, "logprobs": 0}
        sampled = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        plain = target.generate([row], max_new_tokens=24, do_sample=True, temperature=0.8, seed=3)
        assert all(e is not None for e in sampled["logprobs"]["token_logprobs"]) and sampled["text"] == \
            tokenizer.decode(plain[0][len(row):], skip_special_tokens=True)
        metrics = httpx.get(server.url + "/metrics").text
        drafted = float(next(line.split()[1] for line in metrics.splitlines()
                             if line.startswith("mslite_llm:spec_decode_num_draft_tokens_total")))
        accepted = float(next(line.split()[1] for line in metrics.splitlines()
                              if line.startswith("mslite_llm:spec_decode_num_accepted_tokens_total")))
        assert drafted == server.service.engine.spec.drafted > 0 and 0 < accepted <= drafted


def test_server_draft_model_and_refusals(score_folders, checkpoints):
    import httpx

    from lite_runtime.serve import load_service
    from serving import served

    row = prompts(1, [8], seed=9)[0]
    want = hf_generate(checkpoints["gqa_tied"], row, max_new_tokens=16, do_sample=False)[len(row):]
    with served(score_folders["target"], draft_model=score_folders["draft"]) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": row, "max_tokens": 16, "temperature": 0})
        assert r.json()["choices"][0]["text"] == server.service.generator.tokenizer.decode(want,
                                                                                           skip_special_tokens=True)
        assert server.service.engine.spec.drafted > 0
    with pytest.raises(InferError, match="another tokenizer"):
        load_service(score_folders["target"], backend="ms", draft_model=score_folders["other_tok"])
    with served(score_folders["no_score"]) as bare:
        r = httpx.post(bare.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "speculative": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
