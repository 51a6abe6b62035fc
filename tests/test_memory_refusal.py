"""Runs that cannot fit are refused up front with the numbers (lite_runtime/memory.py), here inside a real
memory-limited cgroup: a float16 folder on MindSpore's CPU, and export.compare's HF float32 model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def limited(limit: int):
    """A new memory cgroup (v1 or v2) limited to `limit` bytes: (path of its cgroup.procs, cleanup); skips the test
    where this process cannot make one (not root, no memory controller)."""
    name = f"mslite-test-{uuid.uuid4().hex[:8]}"
    for root, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        folder = os.path.join(root, name)
        try:
            os.mkdir(folder)
        except OSError:
            continue
        try:
            with open(os.path.join(folder, limit_file), "w") as fh:
                fh.write(str(limit))
        except OSError:
            os.rmdir(folder)
            continue
        return os.path.join(folder, "cgroup.procs"), lambda: os.rmdir(folder)
    pytest.skip("needs a memory cgroup this process can create (root, cgroup v1 memory or v2 with memory enabled)")


def run_limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    procs, cleanup = limited(limit)
    try:
        return subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", sys.executable, *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        cleanup()


def test_a_float16_folder_too_big_for_the_cpu_is_refused_before_it_loads(atlas_exported):
    """1 GiB of room: MindSpore's float32 copies of a float16 folder need twice the weights plus 1 GiB."""
    folder = atlas_exported["float16"]
    proc = run_limited(1 << 30, "-m", "lite_runtime.check", folder, "--backend", "ms", "-q")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert re.fullmatch(
        rf"error: {re.escape(folder)}: this float16 folder needs about 1\.0 GiB of memory on MindSpore's CPU \(its "
        r"float16 MatMul keeps a float32 copy of every weight\), and [01]\.\d GiB is available; check it on the Atlas "
        r"device it is for \(python -m lite_runtime\.check there\), or export a --device cpu folder of the "
        r"checkpoint to check its weights on this machine", err[0]), err[0]


def test_compare_refuses_a_checkpoint_hf_cannot_hold_in_float32(exported, checkpoints):
    """A float32 CPU folder needs no copies; HF's float32 model (plus 0.5 GiB) does not fit in 300 MB."""
    from export.checkpoints import open_checkpoint
    from lite_runtime.folder import load_folder
    from lite_runtime.memory import ms_backend_needs

    assert ms_backend_needs(load_folder(exported["gqa_tied"])) == 0  # mapped weights, no copies
    ckpt = checkpoints["gqa_tied"]
    params = sum(int(np.prod(f.shape(n))) for n, f in open_checkpoint(ckpt).items())
    proc = run_limited(300 << 20, "-m", "export.compare", "--checkpoint", ckpt, "--model_dir", exported["gqa_tied"],
                       "-q")
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    hf = f"{(4 * params + (1 << 29)) / (1 << 30):.1f}"
    assert re.fullmatch(
        rf"error: {re.escape(ckpt)}: HF transformers needs about {hf} GiB to run it in float32 \(4 bytes per "
        rf"parameter\), and 0\.\d GiB is available; run python -m lite_runtime\.check {re.escape(exported['gqa_tied'])}"
        r" instead: its golden references come from the export's float32 reference, which export\.compare holds to "
        r"HF on models that fit", err[0]), err[0]
