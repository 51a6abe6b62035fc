"""One request of the serving engine (lite_runtime/engine/scheduler.py) and what happens to it at each token: the choice of
the next token from its row's logits, and the text that token completes.

Text is decoded from the generated ids as a whole each step, so multi-byte characters and stop strings split across
tokens come out right: text that could still be the start of a stop string is held back until it cannot.
`logprobs` is None unless the request asked for them (`SlotRequest.logprobs` = how many alternatives): then the
`TokenLogprob`s of the tokens whose text an event completes, log-softmax of the raw float32 logits of the graphs
(before the repetition penalty, temperature, top-k/top-p and any grammar mask: what the model gives, as OpenAI and
vLLM's default report).

A reasoning model's request carries a `think` (lite_runtime/reasoning.py ThinkState): the tokens a thinking budget
forces (`\n</think>\n\n`) are taken before any choice, and its `constraint` applies to the answer only (while the
first token may still open a block, that token is allowed beside the grammar's).

A request may carry a `constraint` (lite_runtime.serve.grammar: a grammar's token mask): its `mask(scores)` is
applied to the logits before the sampling transforms, `accept(token)` follows the chosen token, and `finished()` ends
the request (finish reason "stop") when the grammar can take nothing more. Greedy asks `allows(token)` of the
unmasked argmax first and masks only when it is refused (the masked argmax is the same token whenever it is
allowed; the mask costs ~0.1 ms at 152K tokens, the question 0.5 us).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from lite_runtime.engine.sampling import GenerationSettings, pick, process, seeded
from lite_runtime.text_machine import partial


class TokenLogprob(NamedTuple):
    token: int
    logprob: Optional[float]  # None: the prompt's first token (echo), which nothing predicts
    top: Optional[List[Tuple[int, float]]]  # the `logprobs` most likely tokens, most likely first; None with logprob


@dataclass
class SlotRequest:
    prompt: List[int]
    max_tokens: int
    settings: GenerationSettings  # sampling (do_sample, temperature, top_k, top_p, repetition_penalty, seed)
    emit: Callable[[Tuple[Any, ...]], None]
    stop: Sequence[str] = ()
    eos: Sequence[int] = ()
    logprobs: Optional[int] = None  # None: none; k: each token's log-probability and the k most likely
    constraint: Any = None  # mask(scores) -> scores, accept(token), finished() -> bool
    echo: Optional[str] = None  # completions' echo: this text (the prompt's) is sent before the completion
    # echo with logprobs: the prompt goes in through the score graphs (every position's logits) from position 0, and
    # each prompt token's TokenLogprob is sent with the echo (the first's logprob None); this many alternatives
    prompt_logprobs: Optional[int] = None
    # speculative decoding (lite_runtime/engine/speculative.py): a proposer (PromptLookup, DraftFolder) or None; it drafts
    # while this request is the only one decoding (BatchEngine._speculate), with its own Pacer
    proposer: Any = None
    pacer: Any = None
    # a reasoning model's block on token ids (lite_runtime/reasoning.py ThinkState): its thinking budget, and where the
    # constraint's grammar begins (the answer); None: no reasoning parser
    think: Any = None
    spec_drafted: int = 0  # draft tokens checked for it
    spec_accepted: int = 0  # of them, kept
    cancelled: bool = False  # set by the caller (client gone); the engine frees the row at its next step
    deadline: Optional[float] = None  # time.monotonic() past which the engine ends it ("timeout" error)
    # filled in by the engine
    generated: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    text: str = ""  # sent so far
    submitted: float = field(default_factory=time.monotonic)
    started: Optional[float] = None  # when it took its row (its prefill began)
    token_times: List[float] = field(default_factory=list)  # when each generated token was chosen (monotonic)
    ended: Optional[float] = None
    slot: Optional[int] = None  # its graph row while it runs
    seq: Any = None  # its blocks of the KV pool and the tokens in them (lite_runtime/engine/blocks.py SequenceBlocks)
    order: int = 0  # when it was (last) admitted: the youngest is preempted first
    begun: bool = False  # its prompt has started going in (prefix caching looked it up)
    recomputing: bool = False  # preempted: its context goes in again, and no token is chosen at its end
    preempted: int = 0  # times it gave its blocks back
    cached: int = 0  # prompt tokens found in the pool's blocks (prefix caching): not prefilled again
    prefilled: int = 0  # tokens of its context in its blocks so far (cached ones included)
    token_logprobs: List[TokenLogprob] = field(default_factory=list)
    prompt_entries: List[TokenLogprob] = field(default_factory=list)  # prompt_logprobs: one per prompt token so far
    _sent_logprobs: int = 0  # token_logprobs already sent with text

    def __post_init__(self) -> None:
        self.rng = seeded(self.settings.seed)

    def context(self) -> List[int]:
        """What must be in its blocks before its next step: the prompt and every generated token but the newest
        (which the next step feeds)."""
        return self.prompt + self.generated[:-1] if self.generated else self.prompt

    @property
    def decoding(self) -> bool:
        """Its context is in its blocks and it has a token to feed to the next decode step."""
        return bool(self.generated) and self.seq is not None and len(self.seq.tokens) == len(self.context())


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` must wait: an incomplete character (U+FFFD from a split UTF-8
    sequence) or the longest tail that is the start of a stop string."""
    keep = 0
    while keep < len(text) and text[len(text) - 1 - keep] == "\ufffd":
        keep += 1
    body = text[:len(text) - keep]
    return keep + max((partial(body, stop) for stop in stops), default=0)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under softmax(logits) and the `top` most likely tokens (float64 sums)."""
    x = np.asarray(logits, np.float64)
    peak = x.max()
    lse = peak + np.log(np.exp(x - peak).sum())
    best: List[Tuple[int, float]] = []
    if top > 0:
        part = np.argpartition(-x, top - 1)[:top]
        part = part[np.lexsort((part, -x[part]))]  # most likely first; ties by id
        best = [(int(i), float(x[i] - lse)) for i in part]
    return TokenLogprob(int(token), float(x[token] - lse), best)


def score_piece(request: SlotRequest, start: int, rows: np.ndarray) -> None:
    """The prompt logprobs a piece of the prompt at `start` gives: rows[j] [V] are the logits after prompt token
    start + j, which predict token start + j + 1."""
    prompt = request.prompt
    if start == 0 and not request.prompt_entries:
        request.prompt_entries.append(TokenLogprob(prompt[0], None, None))
    for j in range(len(rows)):
        nxt = start + j + 1
        if nxt < len(prompt):
            request.prompt_entries.append(token_logprob(rows[j], prompt[nxt], request.prompt_logprobs))


def send_echo(request: SlotRequest) -> None:
    """The echo's event: the prompt's text, with its tokens' logprobs when asked."""
    request.emit(("text", request.echo, request.prompt_entries if request.prompt_logprobs is not None else None))


def next_token(request: SlotRequest, logits: np.ndarray, tokenizer) -> Optional[str]:
    """Choose the request's next token from its row's logits [V], send the text it completes; the finish reason
    ("stop" or "length") when the request is done, else None."""
    think = request.think
    token = think.next_forced() if think is not None else None  # a thinking budget's close (lite_runtime/reasoning.py)
    opener = think.may_open() if think is not None else None
    grammar = request.constraint if think is None or think.answering or opener is not None else None
    if token is None:
        token = _choose(request, logits, grammar, opener)
    else:
        grammar = None
    request.generated.append(token)
    request.token_times.append(time.monotonic())
    if request.logprobs is not None and token not in request.eos:
        request.token_logprobs.append(token_logprob(logits, token, request.logprobs))
    if think is not None:
        think.observe(request.generated)
        if grammar is not None and think.state == "reasoning":  # the token opened a block: not the grammar's
            grammar = None
    if grammar is not None:
        grammar.accept(token)
    if token in request.eos or grammar is not None and grammar.finished():
        send_text(request, tokenizer, final=True)
        return "stop"
    if send_text(request, tokenizer, final=False):
        return "stop"
    if len(request.generated) >= request.max_tokens:
        send_text(request, tokenizer, final=True)
        return "length"
    return None


def _choose(request: SlotRequest, logits: np.ndarray, grammar, opener: Optional[int]) -> int:
    """The token the settings choose, within `grammar`'s mask when given (`opener`, a reasoning block's first token,
    allowed beside it)."""
    seen, n, s = request.prompt + request.generated, len(request.prompt), request.settings

    def masked() -> np.ndarray:
        out = grammar.mask(logits)
        if opener is not None:
            out = np.array(out)
            out[opener] = logits[opener]
        return out

    if s.do_sample:
        return pick(process(logits if grammar is None else masked(), seen, s, n), True, request.rng)
    token = pick(process(logits, seen, s, n), False, None)
    if grammar is not None and token != opener and not grammar.allows(token):  # else the masked argmax is the same
        token = pick(process(masked(), seen, s, n), False, None)
    return token


def send_text(request: SlotRequest, tokenizer, final: bool) -> bool:
    """Send the text the new token completed; True when a stop string was reached (the text ends before it)."""
    ids = request.generated[:-1] if request.generated and request.generated[-1] in request.eos else request.generated
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hit = None
    if request.stop:
        since = max(0, len(request.text) - max(len(s) for s in request.stop))
        found = [i for i in (text.find(s, since) for s in request.stop) if i >= 0]
        hit = min(found) if found else None
    end = hit if hit is not None else len(text) if final else len(text) - held_back(text, request.stop)
    pending = request.logprobs is not None and (final or hit is not None) and \
        request._sent_logprobs < len(request.token_logprobs)
    if end > len(request.text) or pending:
        logprobs = None
        if request.logprobs is not None:
            logprobs = request.token_logprobs[request._sent_logprobs:]
            request._sent_logprobs = len(request.token_logprobs)
        request.emit(("text", text[len(request.text):end], logprobs))
        request.text = text[:max(end, len(request.text))]
    return hit is not None
