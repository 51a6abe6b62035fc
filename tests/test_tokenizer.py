"""The runtime reads a folder's tokenizer without transformers; it must agree with AutoTokenizer on that folder."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from hiding import hide

TEXTS = ["Hello world", "  leading spaces and trailing  ", "naïve café, 数字 123 — ok?", "line one\nline two\n\n",
         "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", ""]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
]


@pytest.fixture(scope="module")
def both(exported):
    from transformers import AutoTokenizer

    from lite_runtime.tokenizer import FolderTokenizer

    folder = exported["gqa_tied"]
    return FolderTokenizer(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_match_autotokenizer(both, text):
    ours, hf = both
    for special in (False, True):
        ids = ours(text, add_special_tokens=special)["input_ids"]
        assert ids == hf(text, add_special_tokens=special)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode([ids, ids[:2]]) == hf.batch_decode([ids, ids[:2]])


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_autotokenizer(both, messages):
    ours, hf = both
    for prompt in (False, True):
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours.eos_token_id == hf.eos_token_id and ours.pad_token_id == hf.pad_token_id


def test_text_generation_loads_neither_transformers_nor_torch(exported):
    """A text prompt through the folder's tokenizer: the runtime imports only MindSpore, not torch (2-4 s)."""
    code = f"""
import sys
from lite_runtime import pipeline
pipe = pipeline("text_generation", model={exported['gqa_tied']!r}, backend="ms", warm_up="none")
print(repr(pipe("Hello world", max_new_tokens=3, do_sample=False)))
print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'transformers'}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text, imported = proc.stdout.strip().splitlines()[-2:]
    assert imported == "[]"

    from lite_runtime import pipeline
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(exported["gqa_tied"])
    pipe = pipeline("text_generation", model=exported["gqa_tied"], backend="ms", tokenizer=hf_tok, warm_up="none")
    assert text == repr(pipe("Hello world", max_new_tokens=3, do_sample=False))


def test_bos_token_follows_add_bos_token_like_transformers_llama_tokenizer(tmp_path):
    """A Llama tokenizer folder: tokenizer.json's template adds <|begin_of_text|> (Llama 3), and the folder agrees
    with AutoTokenizer. tokenizer_config.json's add_bos_token / add_eos_token, when present, rebuild the template
    as transformers' LlamaTokenizer does (update_post_processor): BOS in front, EOS at the end, or neither."""
    import json
    import os

    from transformers import AutoTokenizer

    from export.checkpoints import random_checkpoint
    from lite_runtime.tokenizer import FolderTokenizer

    folder = str(tmp_path / "llama")
    random_checkpoint.build_tokenizer(bos=True).save_pretrained(folder)
    hf, ours = AutoTokenizer.from_pretrained(folder), FolderTokenizer(folder)
    text = "Hello world"
    plain = hf(text, add_special_tokens=False)["input_ids"]
    bos, eos = hf.bos_token_id, hf.eos_token_id
    assert ours(text)["input_ids"] == hf(text)["input_ids"] == [bos] + plain
    assert ours(text, add_special_tokens=False)["input_ids"] == plain

    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    for flags, want in (({"add_bos_token": False}, plain), ({"add_bos_token": True, "add_eos_token": True},
                                                            [bos] + plain + [eos]),
                        ({"add_eos_token": True}, [bos] + plain + [eos])):
        with open(config_path, "w") as fh:
            json.dump({**config, **flags}, fh)
        assert FolderTokenizer(folder)(text)["input_ids"] == want, flags
    # a template without BOS (Llama 2's tokenizer.json before LlamaTokenizer rebuilds it) and add_bos_token true
    with open(os.path.join(folder, "tokenizer.json")) as fh:
        tok = json.load(fh)
    tok["post_processor"] = None
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        json.dump(tok, fh)
    with open(config_path, "w") as fh:
        json.dump({**config, "add_bos_token": True}, fh)
    assert FolderTokenizer(folder)(text)["input_ids"] == [bos] + plain


NO_JINJA2 = hide(("jinja2",)) + """
from lite_runtime import InferError, pipeline
pipe = pipeline("text_generation", model=sys.argv[1], backend="ms")
print(pipe("hi", max_new_tokens=2) != "")  # a plain prompt needs no jinja2
try:
    pipe("hi", apply_chat_template=True, max_new_tokens=2)
except InferError as exc:
    print(f"{type(exc).__name__}: {exc}")
from lite_runtime.launcher import main
sys.exit(main(["--model_dir", sys.argv[1], "--backend", "ms", "--chat", "--prompt", "hi"]))
"""


def test_chat_without_jinja2_is_one_line_naming_it_and_the_fix(exported):
    """pipe(..., apply_chat_template=True) and the launcher's --chat (scripts/run_infer_main.py) where jinja2 cannot be
    imported."""
    proc = subprocess.run([sys.executable, "-c", NO_JINJA2, exported["gqa_tied"]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the launcher's exit code for an InferError
    assert proc.stdout.splitlines() == [
        "True", "MissingDependencyError: rendering the chat template needs jinja2, which cannot be imported here: "
                "pip install jinja2"]
    assert proc.stderr.splitlines() == [
        "error: rendering the chat template needs jinja2, which cannot be imported here: pip install jinja2"]
