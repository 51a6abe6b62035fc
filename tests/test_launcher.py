"""scripts/run_infer_main.py end to end, its text checked against HF greedy decoding."""
from __future__ import annotations

import os
import subprocess
import sys

from reference import hf_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "scripts", "run_infer_main.py")


def launch(*args, stdin=None):
    return subprocess.run([sys.executable, LAUNCHER, *args], capture_output=True, text=True, input=stdin,
                          timeout=600)


def test_prompt_once_then_interactive_loop(exported, checkpoints, tokenizer):
    folder = exported["gqa_tied"]
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    ref = hf_generate(checkpoints["gqa_tied"], ids, max_new_tokens=8, do_sample=False)
    want = tokenizer.decode(ref[len(ids):], skip_special_tokens=True)

    proc = launch("--model_dir", folder, "--backend", "ms", "--prompt", "Hello world", "--max_output_length", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    timing = [line for line in proc.stderr.splitlines() if line.startswith("[timing]")]
    assert len(timing) == 1 and " ms, decode " in timing[0] and "backend ms" in timing[0]

    streamed = launch("--model_dir", folder, "--prompt", "Hello world", "--max_output_length", "8", "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == want + "\n"  # backend auto falls back to ms here

    loop = launch("--model_dir", folder, "--backend", "ms", "--max_output_length", "8",
                  stdin="Hello world\nHello world\nexit\nnever read\n")
    assert loop.returncode == 0, loop.stderr
    assert loop.stdout.count(want + "\n") == 2
    assert sum(line.startswith("[timing]") for line in loop.stderr.splitlines()) == 2


def test_launcher_errors(exported):
    folder = exported["gqa_tied"]
    too_long = launch("--model_dir", folder, "--backend", "ms", "--prompt", "Hello " * 40)
    assert too_long.returncode == 2
    assert too_long.stderr.strip().splitlines()[-1].startswith("error: row 0 has ")
    assert too_long.stderr.strip().splitlines()[-1].endswith(
        "tokens, more than the graphs' seq_length 32; shorten the prompt or re-export with a larger --seq_length")
    mslite = launch("--model_dir", folder, "--backend", "mslite", "--prompt", "hi")
    assert mslite.returncode == 2
    assert mslite.stderr.strip().splitlines()[-1] == (
        "error: backend 'mslite' on the CPU cannot share the KV cache between the two graphs (weight sharing is "
        "GE-only); use backend 'ms' for a folder exported with --device cpu")
    neither = launch("--backend", "ms", "--prompt", "hi")
    assert (neither.returncode, neither.stderr.strip()) == (
        2, "error: pass --model_dir, or both --prefill_model_path and --increment_model_path")
