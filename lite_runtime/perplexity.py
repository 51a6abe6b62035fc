"""Perplexity of a folder over a text, through its score graphs (every position's logits).

    python -m lite_runtime.perplexity <folder> --text FILE [--backend ms|mslite|auto] [--window N]

prints `perplexity: <value> over <n> tokens`. The text is tokenized whole (no special tokens added) and scored in
windows of at most the graphs' seq_length tokens (`--window` for fewer), each from an empty cache: the first token of
a window has no context and is not scored, every other token is scored given the tokens before it in its window
(as transformers' perplexity guide does with stride = window). A text longer than one window says so in the output.
Each window goes in pieces of the largest score graph, and only the log-softmax of the next token is kept per
position: memory holds one piece's logits [C, V], never the text's.

`perplexity(pipe, ids)` is the same as a function; `score(runner, ids)` gives the log-probabilities themselves.
Nothing here needs MindSpore, torch or transformers beyond what the backend loads.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from lite_runtime.errors import InferError


def log_softmax_at(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """log softmax(logits[i])[tokens[i]] for each row i, in float64 (logits [n, V] float32)."""
    x = np.asarray(logits, np.float64)
    peak = x.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1))
    return x[np.arange(len(tokens)), np.asarray(tokens, np.int64)] - lse


def score(runner, ids: Sequence[int], progress: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i in 1..len-1 ([len - 1] float64), from position 0 of a sequence of its own (blocks
    of the runner's pool, given back after), in pieces of the largest score graph (the graph rows idle). `ids` must fit the graphs (seq_length)."""
    if not runner.score_sizes:
        raise InferError(runner.missing("score"))
    ids = [int(t) for t in ids]
    if len(ids) > runner.seq_length:
        raise InferError(f"{len(ids)} tokens do not fit the graphs' seq_length {runner.seq_length}; score them in "
                         "windows (perplexity() does)")
    from lite_runtime.engine.runner import SequenceBlocks

    size = runner.score_sizes[-1]
    out = np.empty(max(len(ids) - 1, 0), np.float64)
    cache = SequenceBlocks(runner.pool)
    with runner.request():
        try:
            cache.reserve(len(ids))
            for start in range(0, len(ids) - 1, size):
                piece = ids[start:start + size]
                _, logits = runner.chunk(piece, start, cache.blocks, runner.idle(), every=True)
                n = min(len(piece), len(ids) - 1 - start)  # the piece's positions that predict a token of ids
                out[start:start + n] = log_softmax_at(logits[:n], ids[start + 1:start + 1 + n])
                if progress is not None:
                    progress(len(piece))
        finally:
            cache.release(commit=False)
    return out


@dataclass
class Perplexity:
    value: float
    tokens: int  # tokens scored (each window's first is not)
    windows: int
    window: int  # tokens per window
    nll: float  # mean negative log-likelihood, nats per token

    def __str__(self) -> str:
        where = f" ({self.windows} windows of up to {self.window} tokens, each scored from an empty context)" \
            if self.windows > 1 else ""
        return f"perplexity: {self.value:.6g} over {self.tokens} tokens{where}"


def perplexity(pipe, ids: Sequence[int], window: Optional[int] = None,
               progress: Optional[Callable[[int], None]] = None) -> Perplexity:
    """The perplexity of token ids under a pipeline's folder (module doc): windows of `window` tokens (default: the
    graphs' seq_length)."""
    runner = pipe.runner
    window = int(window or runner.seq_length)
    if not 2 <= window <= runner.seq_length:
        raise InferError(f"window {window} must be between 2 and the graphs' seq_length {runner.seq_length}")
    ids = [int(t) for t in ids]
    vocab = pipe.config.vocab_size
    if vocab and not all(0 <= t < vocab for t in ids):
        raise InferError(f"a token id is outside [0, {vocab}); was the text tokenized by another tokenizer?")
    parts: List[np.ndarray] = []
    windows = 0
    for begin in range(0, len(ids), window):
        chunk = ids[begin:begin + window]
        if len(chunk) < 2:  # a last window of one token predicts nothing
            if progress is not None:
                progress(len(chunk))
            continue
        parts.append(score(runner, chunk, progress))
        windows += 1
    n = sum(len(p) for p in parts)
    if n == 0:
        raise InferError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    nll = -float(np.concatenate(parts).sum()) / n
    return Perplexity(math.exp(nll), n, windows, window, nll)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lite_runtime.perplexity",
                                description="Perplexity of a model folder over a text file, through its score graphs.")
    p.add_argument("model_dir", help="the folder written by python -m export")
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--backend", default="auto", choices=("auto", "ms", "mslite"),
                   help="mslite (Atlas, GE), ms (MindSpore, any CPU) or auto (default: mslite when importable)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default: the folder's seq_length); each window is scored from an empty "
                        "context")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with open(args.text, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: --text {args.text}: {exc}", file=sys.stderr)
        return 2
    from lite_runtime.errors import ModelFolderError
    from lite_runtime.task import pipeline

    try:
        # only the score graphs (and inc, always loaded) run: on Atlas GE compiles no prefill graph for this
        pipe = pipeline("text_generation", model=args.model_dir, backend=args.backend, prefill_graphs=False,
                        warm_up="none")
        ids = list(pipe.tokenizer(text, add_special_tokens=False)["input_ids"])
        bar = None
        if not args.quiet:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(ids), desc="scoring", unit="tok", disable=None, leave=False)
            except ImportError:
                bar = None
        try:
            result = perplexity(pipe, ids, args.window, bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
    except (InferError, ModelFolderError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
