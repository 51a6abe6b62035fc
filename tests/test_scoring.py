"""Prompt logprobs (`echo` with `logprobs` on /v1/completions) and perplexity, through the score graphs, held to HF's
log-softmax on the same weights; lm-evaluation-harness's `local-completions` model against the served folder scores a
multiple-choice task as its `hf` model does on the checkpoint."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from reference import hf_generate, hf_model, prompts
from serving import ROOT, _error, served


@pytest.fixture(scope="module")
def server(score_folders):
    with served(score_folders["target"]) as running:
        yield running


def hf_prompt_log_softmax(checkpoint: str, ids) -> np.ndarray:
    """log_softmax (float64) of HF's float32 logits after each token: [len(ids), V]."""
    import torch

    with torch.no_grad():
        logits = hf_model(checkpoint)(torch.tensor([list(ids)])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch from an old wooden fence".split()


def word_ids(server, words: int, seed: int):
    """Token ids of a text of real words (each token's text then joins to the text's)."""
    rng = np.random.default_rng(seed)
    return server.service.generator.encode(" ".join(rng.choice(WORDS, words)))


def completion(url: str, body: dict) -> dict:
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    out = {"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                out["text"] += c["text"]
                for key in out["logprobs"]:
                    out["logprobs"][key] += (c["logprobs"] or {}).get(key, [])
                out["finish_reason"] = c["finish_reason"]
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_are_hf_log_softmax(server, checkpoints, stream, max_tokens):
    """A prompt of 33-60 tokens (3 pieces of the 16-token score graph): every prompt token's logprob within 1e-4 of HF's
    log-softmax, the first null, the alternatives HF's top 2; the echoed text is the prompt's, then the completion."""
    ids = word_ids(server, 12, 31)
    assert 33 <= len(ids) <= 60
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, "echo": True, "stream": stream}
    choice = completion(server.url, body)
    lp = choice["logprobs"]
    ref = hf_prompt_log_softmax(checkpoints["gqa_tied"], ids)
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:n], ref[np.arange(n - 1), ids[1:]], atol=1e-4, rtol=0)
    tokenizer = server.service.generator.tokenizer
    from lite_runtime.serve.responses import TokenPieces

    pieces = TokenPieces(tokenizer)
    for i in range(1, n):
        want = {}
        for t in np.argsort(-ref[i - 1], kind="stable")[:2]:  # OpenAI's shape keys by text: two tokens may share one
            want.setdefault(pieces(int(t))[0], ref[i - 1][t])
        assert list(lp["top_logprobs"][i]) == list(want)
        np.testing.assert_allclose(list(lp["top_logprobs"][i].values()), list(want.values()), atol=1e-4, rtol=0)
    prompt_text = tokenizer.decode(ids)
    assert choice["text"].startswith(prompt_text) and "".join(lp["tokens"][:n]) == prompt_text
    assert len(lp["token_logprobs"]) == n + max_tokens and choice["finish_reason"] == "length"
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    if max_tokens:
        generated = hf_generate(checkpoints["gqa_tied"], ids, max_new_tokens=max_tokens, do_sample=False)[n:]
        assert choice["text"] == prompt_text + tokenizer.decode(generated)


def test_echo_beside_a_decoding_request(server, checkpoints):
    """While another request decodes, the prompt goes in through the smallest score graph (pieces of 4) in its steps;
    the numbers are the same."""
    ids = word_ids(server, 10, 32)
    other = threading.Thread(target=completion, args=(server.url, {"prompt": prompts(1, [5], seed=2)[0],
                                                                   "max_tokens": 40, "temperature": 0}))
    other.start()
    try:
        lp = completion(server.url, {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True})["logprobs"]
    finally:
        other.join()
    ref = hf_prompt_log_softmax(checkpoints["gqa_tied"], ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
    assert lp["top_logprobs"][1:] == [{}] * (len(ids) - 1)


def test_echo_without_logprobs_is_the_prompt_then_the_completion(server):
    r = completion(server.url, {"prompt": "hello there", "max_tokens": 2, "temperature": 0, "echo": True})
    assert r["text"].startswith("hello there") and r["logprobs"] is None


def test_echo_refusals(server, score_folders):
    def post(url, body, path="/v1/completions"):
        r = httpx.post(url + path, json=body, timeout=30)
        return r.status_code, r.json()

    assert post(server.url, {"prompt": "a", "echo": True, "logprobs": 21}) == (
        400, _error("'logprobs' must be in [0, 20], got 21", "logprobs"))
    assert post(server.url, {"prompt": "a", "max_tokens": 0}) == (
        400, _error("'max_tokens' 0 needs 'echo': true (the prompt's logprobs alone)", "max_tokens"))
    assert post(server.url, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
                "/v1/chat/completions") == (
        400, _error("'max_tokens' must be at least 1 in chat (0 is for completions with 'echo')", "max_tokens"))
    with served(score_folders["no_score"]) as bare:
        assert post(bare.url, {"prompt": "a b", "echo": True, "logprobs": 1, "max_tokens": 0}) == (400, _error(
            "'echo' with 'logprobs' needs the folder's score graphs (every prompt position's logits), which this "
            "folder was exported without: re-export it with python -m export (--score_sizes auto)", "echo"))


def test_perplexity_matches_hf_in_windows(score_folders, checkpoints, tmp_path):
    """python -m lite_runtime.perplexity over a text of ~150 tokens: windows of the folder's 64 tokens (said in the
    output), each scored from an empty context as HF scores it, within 1e-3 relative (float32: far closer)."""
    from lite_runtime.tokenizer import FolderTokenizer

    folder = score_folders["target"]
    rng = np.random.default_rng(0)
    text = " ".join(rng.choice(WORDS, 120))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    ids = FolderTokenizer(folder)(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 128
    total, n = 0.0, 0
    for begin in range(0, len(ids), 64):
        window = ids[begin:begin + 64]
        if len(window) > 1:
            ref = hf_prompt_log_softmax(checkpoints["gqa_tied"], window)
            total += float(ref[np.arange(len(window) - 1), window[1:]].sum())
            n += len(window) - 1
    want = math.exp(-total / n)
    run = subprocess.run([sys.executable, "-m", "lite_runtime.perplexity", folder, "--text", str(tmp_path / "t.txt"),
                          "--backend", "ms"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip().splitlines()[-1]
    windows = -(-len(ids) // 64)
    assert line.startswith("perplexity: ") and line.endswith(
        f" over {n} tokens ({windows} windows of up to 64 tokens, each scored from an empty context)")
    assert float(line.split()[1]) == pytest.approx(want, rel=1e-3)


TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_as_its_hf_model(server, score_folders, checkpoints, tmp_path, monkeypatch):
    """lm-evaluation-harness scores a 12-question multiple-choice task (local files) through `local-completions`
    against the served folder (echo + logprobs, token ids) and through `hf` on the checkpoint: the same accuracy and
    each answer's loglikelihood within 1e-3."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the test extra) is not installed")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rng = np.random.default_rng(3)
    words = "red green blue cat dog bird one two three sun moon star tree rock sea".split()
    with open(tmp_path / "data.jsonl", "w", encoding="utf-8") as fh:
        for i in range(12):
            fh.write(json.dumps({"question": f"Q: {' '.join(rng.choice(words, 5))}? A:",
                                 "choices": [" " + " ".join(rng.choice(words, 2)) for _ in range(3)],
                                 "answer": int(rng.integers(0, 3))}) + "\n")
    (tmp_path / "tiny_mc.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"), encoding="utf-8")
    manager = TaskManager(include_path=str(tmp_path))
    served_args = (f"base_url={server.url}/v1/completions,model=target,tokenizer={score_folders['target']},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    results = {}
    for name, model, args in (("served", "local-completions", served_args),
                              ("hf", "hf", f"pretrained={checkpoints['gqa_tied']},dtype=float32,device=cpu")):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=["tiny_mc"], task_manager=manager,
                                      batch_size=1, log_samples=True)
        samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
        results[name] = (out["results"]["tiny_mc"]["acc,none"],
                         [[float(r[0]) for r in s["filtered_resps"]] for s in samples])
    assert results["served"][0] == results["hf"][0]
    np.testing.assert_allclose(results["served"][1], results["hf"][1], atol=1e-3, rtol=0)
