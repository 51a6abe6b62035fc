"""Generation settings and the logits processors, in numpy, with the semantics of transformers' own.

Order as HF generate: repetition penalty (a processor, also applied in greedy mode), then,
only when sampling, temperature, top-k and top-p (warpers), then softmax and a draw.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

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
    eos_token_id: Optional[Tuple[int, ...]] = None
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
        if "eos_token_id" in values:
            eos = values["eos_token_id"]
            values["eos_token_id"] = tuple(int(e) for e in ([eos] if isinstance(eos, (int, np.integer)) else eos))
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
        for key in ("max_new_tokens", "max_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise InferError(f"{key} must be >= 1, got {value}")


def repetition_penalty(scores: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """scores [V] of one row; every token in `seen` is divided (positive) or multiplied (negative) by penalty."""
    if penalty == 1.0 or not len(seen):
        return scores
    out = scores.copy()
    idx = np.unique(np.asarray(seen, np.int64))
    s = out[idx]
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


def process(scores: np.ndarray, seen: Sequence[int], s: GenerationSettings) -> np.ndarray:
    """The scores the next token is chosen from (float32 [V])."""
    scores = repetition_penalty(np.asarray(scores, np.float32), seen, s.repetition_penalty)
    if s.do_sample:
        if s.temperature != 1.0:
            scores = (scores / np.float32(s.temperature)).astype(np.float32)
        scores = top_p_filter(top_k_filter(scores, s.top_k), s.top_p)
    return scores


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
