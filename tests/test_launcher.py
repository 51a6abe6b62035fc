"""scripts/run_infer_main.py end to end (lite_runtime/launcher.py), its text checked against HF greedy decoding."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reference import hf_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "scripts", "run_infer_main.py")


@pytest.fixture(scope="module")
def want(checkpoints, tokenizer):
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    ref = hf_generate(checkpoints["gqa_tied"], ids, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(ref[len(ids):], skip_special_tokens=True)


def launch(*args, stdin=None):
    return subprocess.run([sys.executable, LAUNCHER, *args], capture_output=True, text=True, input=stdin,
                          timeout=600)


def test_prompt_once(exported, want):
    proc = launch("--model_dir", exported["gqa_tied"], "--backend", "ms", "--prompt", "Hello world",
                  "--max_output_length", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    timing = [line for line in proc.stderr.splitlines() if line.startswith("[timing]")]
    assert len(timing) == 1 and " ms, decode " in timing[0] and "backend ms" in timing[0]


def test_interactive_streaming_loop_until_exit(exported, want):
    """Backend auto falls back to ms here; each line streams its answer; `exit` ends the loop.
    The bucketed folder with no warm-up: every graph compiles inside the first request that needs it."""
    proc = launch("--model_dir", exported["gqa_tied_buckets"], "--max_output_length", "8", "--stream", "--warm_up", "none",
                  stdin="Hello world\nHello world\nexit\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(want + "\n") == 2
    assert sum(line.startswith("[timing]") for line in proc.stderr.splitlines()) == 2


def test_launcher_errors(exported, capsys):
    from lite_runtime import launcher

    folder = exported["gqa_tied"]
    assert launcher.main(["--model_dir", folder, "--backend", "ms", "--prompt", "Hello " * 40]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: row 0 has ") and err.endswith(
        "tokens, more than the graphs' seq_length 32; shorten the prompt or re-export with a larger --seq_length")
    assert launcher.main(["--model_dir", folder, "--backend", "mslite", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: backend 'mslite' on the CPU cannot share the KV cache between the two graphs (weight sharing is "
        "GE-only); use backend 'ms' for a folder exported with --device cpu")
    assert launcher.main(["--backend", "ms", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: pass --model_dir, or both --prefill_model_path and --increment_model_path")
