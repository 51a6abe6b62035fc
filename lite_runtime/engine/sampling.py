"""Generation settings and the logits processors, in numpy, with the semantics of transformers' own.

Order as HF generate: sequence bias, repetition penalty, then the OpenAI penalties (presence, frequency: no HF
processor; between the penalties, as vLLM applies them), suppressed tokens (processors, also applied in greedy
mode), then, only when sampling, temperature, top-k, top-p and min-p (warpers), then softmax and a draw.
HF's names where HF has them (`sequence_bias`, `suppress_tokens`, `min_p`, `eos_token_id`); OpenAI's for
`presence_penalty` and `frequency_penalty`, vLLM's for `ignore_eos`. tests/test_sampling.py holds each processor
to transformers' own, and the OpenAI penalties to their formula on fixed logits.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.errors import InferError


@dataclass
class GenerationSettings:
    """HF GenerationConfig names and defaults; a folder's generation_config.json overrides the defaults."""

    max_new_tokens: Optional[int] = None
    max_length: Optional[int] = None
    do_sample: bool = False
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # HF's MinPLogitsWarper: drop tokens under min_p x the top token's probability (0: off)
    # OpenAI's penalties over the generated tokens (not the prompt): logit - count * frequency - (count > 0) * presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's sequence_bias: ((token ids), bias) pairs; a bias is added to the last id's logit where the ids before it
    # end the sequence so far (one id: always). Given as {ids or id: bias} or [[ids, bias], ...] (generation_config)
    sequence_bias: Optional[Tuple[Tuple[Tuple[int, ...], float], ...]] = None
    suppress_tokens: Optional[Tuple[int, ...]] = None  # HF's: these ids are never chosen (-inf)
    eos_token_id: Optional[Tuple[int, ...]] = None
    ignore_eos: bool = False  # vLLM's: an eos token does not end the generation (max_new_tokens does)
    pad_token_id: Optional[int] = None
    seed: Optional[int] = None

    @classmethod
    def from_generation_config(cls, folder: Optional[str]) -> "GenerationSettings":
        settings = cls()
        path = os.path.join(folder, "generation_config.json") if folder else ""
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
            known = {f.name for f in dataclasses.fields(cls)} - {"seed", "max_length"}
            settings = settings.updated(**{k: v for k, v in raw.items() if k in known and v is not None})
        return settings

    def updated(self, **kwargs: Any) -> "GenerationSettings":
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise InferError(f"unknown generation argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
        values = {k: v for k, v in kwargs.items() if v is not None}
        for key in ("eos_token_id", "suppress_tokens"):
            if key in values:
                values[key] = _ids(key, values[key])
        if "sequence_bias" in values:
            values["sequence_bias"] = _sequence_bias(values["sequence_bias"])
        new = dataclasses.replace(self, **values)
        new.validate()
        return new

    def validate(self) -> None:
        if self.temperature <= 0:
            raise InferError(f"temperature must be > 0, got {self.temperature}; use do_sample=False for greedy")
        if not 0 < self.top_p <= 1:
            raise InferError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InferError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise InferError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InferError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        for key in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise InferError(f"{key} must be in [-2, 2] (OpenAI's range), got {value}")
        for key in ("max_new_tokens", "max_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise InferError(f"{key} must be >= 1, got {value}")


def _ids(key: str, value: Any) -> Tuple[int, ...]:
    """One token id or a list of them, as a tuple of ints; an InferError naming `key` otherwise."""
    items = [value] if isinstance(value, (int, np.integer)) else value
    try:
        out = tuple(int(i) for i in items if not isinstance(i, bool) and int(i) == i and i >= 0)
        if len(out) != len(list(items)):
            raise ValueError
    except (TypeError, ValueError):
        raise InferError(f"{key} must be a token id or a list of token ids (integers >= 0), got {value!r}") from None
    return out


def _sequence_bias(value: Any) -> Tuple[Tuple[Tuple[int, ...], float], ...]:
    """HF's sequence_bias in its two forms ({(ids): bias}, [[ids, bias], ...]), single ids allowed as keys, as
    ((ids), bias) pairs; an InferError naming the entry otherwise. A repeated sequence: the last bias (a dict's)."""
    pairs = value.items() if isinstance(value, dict) else value
    out: Dict[Tuple[int, ...], float] = {}
    try:
        for ids, bias in pairs:
            key = _ids("sequence_bias", ids)
            if not key or isinstance(bias, bool) or not math.isfinite(float(bias)):
                raise ValueError
            out[key] = float(bias)
    except (TypeError, ValueError, InferError):
        raise InferError(f"sequence_bias must map token ids (one id or a tuple of them) to finite biases, as "
                         f"{{(id, ...): bias}} or [[ids, bias], ...]; got {value!r}"[:300]) from None
    return tuple(out.items())


def check_vocabulary(s: "GenerationSettings", vocab: int) -> None:
    """An InferError naming the setting whose token id is outside [0, vocab) (HF raises it at the first step)."""
    for key, ids in (("eos_token_id", s.eos_token_id), ("suppress_tokens", s.suppress_tokens),
                     ("sequence_bias", [i for seq, _ in s.sequence_bias or () for i in seq])):
        bad = next((i for i in ids or () if i >= vocab), None)
        if bad is not None:
            raise InferError(f"{key} has the token id {bad}, outside this model's vocabulary [0, {vocab})")


def sequence_bias(scores: np.ndarray, seen: Sequence[int], bias) -> np.ndarray:
    """HF's SequenceBiasLogitsProcessor on one row: each ((ids), b) adds b to ids[-1]'s score where ids[:-1] end
    `seen` (a single id: always)."""
    if not bias:
        return scores
    out = scores.copy()
    for ids, b in bias:
        n = len(ids) - 1
        if n == 0 or n <= len(seen) and list(seen[len(seen) - n:]) == list(ids[:-1]):
            out[ids[-1]] += np.float32(b)
    return out


def openai_penalties(scores: np.ndarray, generated: Sequence[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties: logit[j] - count[j] * frequency - (count[j] > 0) * presence, the
    counts over the generated tokens."""
    if not (presence or frequency) or not len(generated):
        return scores
    ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
    out = scores.copy()
    out[ids] -= (counts * np.float32(frequency) + np.float32(presence)).astype(np.float32)
    return out


def min_p_filter(scores: np.ndarray, p: float) -> np.ndarray:
    """HF's MinPLogitsWarper: tokens whose probability is below p x the top token's -inf (the top one kept)."""
    if p <= 0:
        return scores
    probs = softmax(scores)
    remove = probs < p * probs.max()
    remove[int(np.argmax(probs))] = False
    return np.where(remove, -np.inf, scores).astype(scores.dtype)


def repetition_penalty(scores: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """scores [V] of one row; every token in `seen` is divided (positive) or multiplied (negative) by penalty."""
    if penalty == 1.0 or not len(seen):
        return scores
    out = scores.copy()
    idx = np.unique(np.asarray(seen, np.int64))
    s = out[idx]
    with np.errstate(over="ignore", divide="ignore"):  # a penalty near 0 or huge: scores run to +-inf, as in HF
        out[idx] = np.where(s < 0, s * penalty, s / penalty)
    return out


def top_k_filter(scores: np.ndarray, k: int) -> np.ndarray:
    """Keep the k highest scores (ties with the k-th kept, as HF does); the rest -inf."""
    if k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = np.partition(scores, -k)[-k]
    return np.where(scores < kth, -np.inf, scores).astype(scores.dtype)


def top_p_filter(scores: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of highest-probability tokens whose mass exceeds p (at least one)."""
    if p >= 1.0:
        return scores
    order = np.argsort(scores, kind="stable")  # ascending, as HF sorts
    cumulative = np.cumsum(softmax(scores[order]))
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[-1] = False
    remove = np.zeros_like(remove_sorted)
    remove[order] = remove_sorted
    return np.where(remove, -np.inf, scores).astype(scores.dtype)


def softmax(scores: np.ndarray) -> np.ndarray:
    z = scores.astype(np.float64) - np.max(scores)
    e = np.exp(z)
    return e / e.sum()


def process(scores: np.ndarray, seen: Sequence[int], s: GenerationSettings, prompt_length: int = 0) -> np.ndarray:
    """The scores the next token is chosen from (float32 [V]); `seen` the sequence so far, its first
    `prompt_length` tokens the prompt (the OpenAI penalties count the rest)."""
    scores = sequence_bias(np.asarray(scores, np.float32), seen, s.sequence_bias)
    scores = repetition_penalty(scores, seen, s.repetition_penalty)
    scores = openai_penalties(scores, seen[prompt_length:], s.presence_penalty, s.frequency_penalty)
    if s.suppress_tokens:
        scores = scores.copy()  # never the caller's array (asarray of float32 logits is the graph's buffer)
        scores[list(s.suppress_tokens)] = -np.inf
    if s.do_sample:
        if s.temperature != 1.0:
            scores = (scores / np.float32(s.temperature)).astype(np.float32)
        scores = min_p_filter(top_p_filter(top_k_filter(scores, s.top_k), s.top_p), s.min_p)
    return scores


def seeded(seed: Optional[int]) -> np.random.Generator:
    """The generator a seed names: any integer (OpenAI's `seed` may be negative: taken modulo 2**64, which numpy
    needs non-negative); None: fresh entropy."""
    return np.random.default_rng(None if seed is None else int(seed) % (1 << 64))


def pick(scores: np.ndarray, do_sample: bool, rng: Optional[np.random.Generator]) -> int:
    """The next token: argmax (no softmax over the vocabulary: ~1 ms of a decode step at 151,936 tokens), or a draw
    from softmax(scores) when sampling (rng needed then)."""
    if not do_sample:
        return int(np.argmax(scores))
    probs = softmax(scores)
    token = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(token, len(probs) - 1)


def probability(scores: np.ndarray, token: int) -> float:
    """softmax(scores)[token], in float64."""
    z = np.asarray(scores, np.float64)
    peak = z.max()
    return float(np.exp(z[token] - peak) / np.exp(z - peak).sum())
