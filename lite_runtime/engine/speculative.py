"""Speculative decoding: propose K tokens cheaply, check them in one call of the target's score graph.

The score graph (export/network/model.py ChunkGraph `every`) takes the row's last chosen token and the K draft tokens as a
piece at the row's own position and returns the logits after each of them: K + 1 positions of the target for one
reading of its weights. The tokens the target agrees with are kept, and the logits after the last kept one choose
the next token as a plain step would. Rejected positions need no cleanup: the row's length is a graph input, so
what lies past it is never read before it is written again (the sequence's blocks are cut back to the kept tokens).

Proposers (HF's names):
- prompt lookup (`prompt_lookup_num_tokens`): the tokens that followed the last n-gram (3, 2, then 1 tokens) where
  it occurred earlier in the sequence, as transformers' PromptLookupCandidateGenerator finds them (the earliest
  occurrence with a continuation). No second model; strong when the answer copies its input (rewriting,
  correcting, editing code).
- a draft folder (`assistant_model`): a smaller or quantized folder with the same tokenizer, e.g. the same model's
  own int4 folder. Its row 0 is kept in step with the sequence by the cheapest call that brings it there (a step,
  a piece through its score graph, or a prefill).

Greedy: a draft token is kept when it is the target's argmax there, so the output is token for token what decoding
without speculation gives. Sampling: the speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): keep
draft token d drawn from q with probability min(1, p(d) / q(d)), else draw the next token from the residual
max(0, p - q) renormalised and stop; p and q are the target's and the draft's distributions after the same
processors (repetition penalty, temperature, top-k, top-p). Prompt lookup's q is a point mass on d. The output is
then distributed as the target's own sampling (`accept`; tests/test_speculative.py checks it statistically).

K adapts as transformers' "heuristic" schedule does (+2 after a round that kept every draft token, -1 otherwise,
between 1 and the asked number); under that bound `Pacer` takes the K that makes the most tokens a second by what it
measured: each piece length's verify time and the recent rate of kept drafts (where a verify's cost grows steeply
with K, as the quantized forms' on an AVX2 CPU, it drafts fewer tokens after a miss). It also holds speculation to a
loss budget: it times plain steps, verifies and draft tokens as it goes, sets each round against what plain steps
would have cost for the tokens it made, and drafts only while a round's worst case fits in a few percent of the
generation's plain time. Free generation where drafts are rarely right therefore loses at most about that budget and
one round.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.errors import InferError
from lite_runtime.engine.sampling import GenerationSettings, process, softmax

log = logging.getLogger(__name__)

NGRAM_MAX = 3  # prompt lookup: the longest n-gram matched first (transformers' default is 2)


def common_prefix(a: Optional[Sequence[int]], b: Sequence[int]) -> int:
    if not a:
        return 0
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def lookup(seq: Sequence[int], k: int, ngram_max: int = NGRAM_MAX) -> List[int]:
    """Prompt lookup: up to k tokens that followed the sequence's last n-gram where it first occurred before (n from
    ngram_max down to 1); [] when it never did."""
    if k <= 0 or len(seq) < 2:
        return []
    arr = np.asarray(seq, np.int64)
    for n in range(min(ngram_max, len(arr) - 1), 0, -1):
        tail = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram that has a token after it
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            begin = int(hits[0]) + n
            return arr[begin:begin + k].tolist()
    return []


def accept(p: np.ndarray, q: Optional[np.ndarray], token: int, rng: np.random.Generator) -> Optional[int]:
    """The speculative-sampling rule for one draft token: None when `token` (drawn from q; q None: a point mass on it)
    is kept, else the token drawn from the residual max(0, p - q) renormalised. p and q are probability vectors."""
    q_token = 1.0 if q is None else float(q[token])
    p_token = float(p[token])
    if q_token > 0 and rng.random() * q_token < p_token:  # u < p / q, with u uniform in [0, 1)
        return None
    if q is None:
        residual = p.astype(np.float64).copy()
        residual[token] = 0.0
    else:
        residual = np.maximum(p.astype(np.float64) - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q exactly (nothing left to correct): a draw from p
        residual, total = p.astype(np.float64), float(p.sum())
    return min(int(np.searchsorted(np.cumsum(residual), rng.random() * total, side="right")), len(p) - 1)


@dataclass
class SpecStats:
    """What speculation did in one generate call (GenerateOutput.speculative) or a server's lifetime (/metrics)."""

    rounds: int = 0  # score-graph calls that checked drafts
    drafted: int = 0  # draft tokens checked
    accepted: int = 0  # of them, kept

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Pacer:
    """How many tokens to draft next, 0 for a plain step (module doc). K follows transformers' heuristic (+2 after a
    round that kept every draft, -1 otherwise, within 1..k_max) as a bound; under it, the K whose round makes the most
    tokens a second as measured: a round of K drafts makes E(K) = 1 + a + ... + a^K tokens on average where a is the
    recent rate of kept drafts (each round's kept and rejected drafts, the older rounds' counts halved: RECENT), and
    costs K draft tokens and a verify of K + 1 tokens, each piece length's time as measured (those not measured yet
    estimated on the line through a plain step and the nearest measured one; none measured: 2 steps each, so the
    bound is taken). A verify of 8 tokens costs 1.3 steps on one CPU form and 3.6 on another (SmolLM2 int8 on an AVX2
    CPU: 1.04 steps for 2 tokens, 1.57 for 4, 3.56 for 8; docs/performance-log.md 65). And a loss budget keeps
    speculation from making a generation slower than plain steps by more than a few percent: every round's time is
    set against what plain steps would have taken for the tokens it made (`lost`, net of gains, credit capped), and a
    round runs only while its worst case (nothing kept: a draft model's catch-up, K draft tokens and a verify, for
    one token) fits in what is left of BUDGET of the request's plain-step time (the tokens made and those it may still
    make) plus ALLOWANCE steps. A request whose drafts keep failing stops drafting and loses at most about BUDGET of a
    request that runs to its limit, plus one round; the costs are measured as it goes (plain step, verify, one draft
    token)."""

    WARM = 2  # plain steps timed before the first round
    # a token a draft model has not seen yet costs it about this many plain steps to take in (a prompt's token in
    # pieces of 128: SmolLM2-135M float32, 10.8 steps a piece, docs/performance-log.md section 31): counted in a
    # round's worst case, so a draft does not start on a long prompt unless the budget holds its catch-up
    INGEST = 0.1
    BUDGET = 0.03  # of the plain-step time of the tokens made, that speculation may lose net
    ALLOWANCE = 2.0  # plain steps it may lose before it has made anything
    CREDIT = 4.0  # plain steps of gains kept as credit at most
    RECENT = 0.5  # the weight a round's kept and rejected draft counts keep at each later round (the kept rate's)

    def __init__(self, k_max: int, k: Optional[int] = None) -> None:
        self.k_max = max(1, int(k_max))
        self.k = min(self.k_max, max(1, int(k or k_max)))
        # seconds of a plain step: the fastest seen (a slow outlier must not make losing rounds look like wins, and
        # while rounds win no plain step refreshes it; steps slow a little as the row grows, so this errs toward
        # counting a round as lost)
        self.step_time: Optional[float] = None
        self.verify_by: dict = {}  # seconds of a verify call by its tokens (drafts + 1; running means)
        self.kept_recent = 0.0  # drafts kept and rejected in recent rounds (older rounds' counts weigh RECENT each)
        self.missed_recent = 0.0
        self.draft_time = 0.0  # seconds to propose one draft token (running mean; ~0 for prompt lookup)
        self.tokens = 0  # tokens made, plain and speculative
        self.lost = 0.0  # seconds lost to speculation, net of its gains
        self.warm = self.WARM

    def plan(self, lacking: int = 0, remaining: int = 0) -> int:
        """Draft tokens for the next round: 0 means a plain step. `lacking`: tokens the proposer must take in first
        (a draft model behind the sequence); `remaining`: tokens the request may still make (the budget is of the
        whole request's plain time, so a draft model's catch-up on the prompt may be spent up front)."""
        if self.warm > 0 or self.step_time is None:
            return 0
        step = self.step_time
        room = (self.BUDGET * (self.tokens + remaining) + self.ALLOWANCE) * step - self.lost \
            - lacking * self.INGEST * step
        best, best_rate = 0, 0.0
        for k in range(self.k, 0, -1):
            cost = k * self.draft_time + self.verify_seconds(k + 1)
            if cost - step > room:  # the round's loss if nothing is kept does not fit
                continue
            rate = self.expected_tokens(k) / cost
            if rate > best_rate * (1 + 1e-9):  # ties: the larger K (met first)
                best, best_rate = k, rate
        return best

    def verify_seconds(self, tokens: int) -> float:
        """A verify of `tokens` tokens: as measured, else on the line through a plain step (1 token) and the measured
        length nearest to it (the larger of two as near), else 2 plain steps."""
        step = self.step_time
        if tokens in self.verify_by:
            return self.verify_by[tokens]
        if not self.verify_by:
            return 2 * step
        near = min(self.verify_by, key=lambda n: (abs(n - tokens), -n))
        per_token = max(self.verify_by[near] - step, 0.0) / max(near - 1, 1)
        return step + per_token * (tokens - 1)

    def expected_tokens(self, k: int) -> float:
        """Tokens a round of k drafts makes on average at the recent rate of kept drafts: 1 + a + ... + a^k."""
        seen = self.kept_recent + self.missed_recent
        a = self.kept_recent / seen if seen > 0 else 1.0
        return float(sum(a ** i for i in range(k + 1)))

    def plain(self, seconds: float) -> None:
        self.step_time = seconds if self.step_time is None else min(self.step_time, seconds)
        self.tokens += 1
        self.warm -= 1

    def round(self, seconds: float, verify_seconds: float, drafted: int, kept: int) -> None:
        """A round that checked `drafted` tokens and kept `kept` (it made kept + 1 tokens) in `seconds`, of which the
        verify call took `verify_seconds`."""
        made = kept + 1
        self.tokens += made
        step = self.step_time or seconds
        self.lost = max(self.lost + seconds - made * step, -self.CREDIT * step)
        n = drafted + 1
        self.verify_by[n] = verify_seconds if n not in self.verify_by else \
            0.7 * self.verify_by[n] + 0.3 * verify_seconds
        self.kept_recent = self.RECENT * self.kept_recent + kept
        self.missed_recent = self.RECENT * self.missed_recent + (1 if kept < drafted else 0)
        if drafted:
            per = max(seconds - verify_seconds, 0.0) / drafted
            self.draft_time = 0.7 * self.draft_time + 0.3 * per if self.draft_time else per
        self.k = min(self.k_max, self.k + 2) if kept == drafted else max(1, self.k - 1)


class PromptLookup:
    """Drafts from the sequence itself (lookup). q is a point mass on each proposed token."""

    def lacking(self, seq: List[int]) -> int:
        return 0

    def propose(self, seq: List[int], k: int, settings: GenerationSettings,
                rng: Optional[np.random.Generator]) -> Tuple[List[int], List[Optional[np.ndarray]]]:
        drafts = lookup(seq, k)
        return drafts, [None] * len(drafts)


class DraftFolder:
    """Drafts from another folder's TextGenerator (the same tokenizer), greedy or sampled with the request's
    settings; keeps the draft's row 0 holding the sequence."""

    def __init__(self, generator) -> None:
        self.generator = generator
        self.runner = generator.runner

    def lacking(self, seq: List[int]) -> int:
        """Tokens of `seq` the draft's row 0 does not hold yet (what its next proposal takes in first)."""
        return len(seq) - common_prefix(self.generator.seqs[0].tokens, seq)

    def logits_after(self, seq: List[int]) -> Optional[np.ndarray]:
        """The draft's logits after `seq` [V] (its row 0's sequence made to hold it), or None when seq does not fit its
        graphs."""
        from lite_runtime.engine.runner import StepRow

        g, r = self.generator, self.runner
        if len(seq) > r.seq_length - 1:
            return None
        cache = g.seqs[0]
        kept = min(common_prefix(cache.tokens, seq), len(seq) - 1)
        new = seq[kept:]
        with r.request():
            cache.truncate(kept)  # what it holds past the common prefix is another sequence's
            if kept and (len(new) == 1 or (r.score_sizes and len(new) <= r.score_sizes[-1])):
                g._reserve(cache, len(seq))
                if len(new) == 1:
                    rows = r.idle()
                    rows[0] = StepRow(new[0], len(seq), cache.blocks)
                    out = r.step(rows)[0]
                else:
                    out = r.chunk(new, kept, cache.blocks, r.idle(), every=True)[1][-1]
                cache.tokens = list(seq)
                return out
            if not r.prefill_sizes or len(seq) > r.prefill_sizes[-1]:
                return None
            return g._prefill([seq])[0]

    def propose(self, seq: List[int], k: int, settings: GenerationSettings,
                rng: Optional[np.random.Generator]) -> Tuple[List[int], List[Optional[np.ndarray]]]:
        drafts: List[int] = []
        qs: List[Optional[np.ndarray]] = []
        for _ in range(k):
            logits = self.logits_after(seq + drafts)
            if logits is None:
                break
            scores = process(logits, seq + drafts, settings)
            if settings.do_sample:
                q = softmax(scores)
                token = min(int(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right")), len(q) - 1)
                qs.append(q)
            else:
                token = int(np.argmax(scores))
                qs.append(None)
            drafts.append(token)
        return drafts, qs


def same_vocabulary(target, draft) -> None:
    """Refuse a draft folder whose tokenizer or vocabulary is not the target's, naming both."""
    tc, dc = target.config, draft.config
    where = f"{dc.model_dir or dc.prefill_model_path} (vocab_size {dc.vocab_size})"
    mine = f"{tc.model_dir or tc.prefill_model_path} (vocab_size {tc.vocab_size})"
    if int(tc.vocab_size or 0) != int(dc.vocab_size or 0):
        raise InferError(f"assistant_model {where} has another vocabulary than the model {mine}; a draft folder "
                         "needs the same tokenizer and vocabulary")
    try:
        a, b = _vocab(target.tokenizer), _vocab(draft.tokenizer)
    except InferError:
        return  # a folder without a tokenizer: token ids only, checked by vocab_size alone
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise InferError(f"assistant_model {where} has another tokenizer than the model {mine} (e.g. "
                         f"{', '.join(f'{t!r}: {i}' for t, i in differ)}); a draft folder needs the same tokenizer")


def _vocab(tokenizer) -> dict:
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None:
        return inner.get_vocab(with_added_tokens=True)
    return dict(tokenizer.get_vocab())

