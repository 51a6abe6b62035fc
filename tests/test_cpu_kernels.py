"""Our CPU GEMV kernel (cpu_kernels): against numpy, where export puts it, and what happens without it."""
from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

import cpu_kernels
from reference import hf_generate, prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call_kernel(function: str, *arrays: np.ndarray, dtypes=None) -> int:
    """Call an exported kernel function the way MindSpore's aot CPU kernel does."""
    lib = ctypes.CDLL(cpu_kernels.library_path())
    n = len(arrays)
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shape_rows = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shape_rows])
    names = (ctypes.c_char_p * n)(*[(d or "float32").encode() for d in (dtypes or [None] * n)])
    return getattr(lib, function)(n, params, ndims, shapes, names, None, None)


def test_library_was_built_at_install():
    assert cpu_kernels.library_path() is not None, cpu_kernels.BUILD_HINT


@pytest.mark.parametrize("rows,inp,out", [(1, 896, 300), (3, 37, 5), (4, 4864, 896), (2, 7, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_against_numpy(rows, inp, out, bias):
    rng = np.random.default_rng(rows * inp + out)
    x = rng.standard_normal((rows, inp), dtype=np.float32)
    w = rng.standard_normal((out, inp), dtype=np.float32)
    b = rng.standard_normal((out,), dtype=np.float32)
    y = np.full((rows, out), np.nan, np.float32)
    args = (x, w, b, y) if bias else (x, w, y)
    assert call_kernel(cpu_kernels.GEMV_BIAS if bias else cpu_kernels.GEMV, *args) == 0
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_gemv_refuses_what_it_cannot_compute():
    x, w, y = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.float32), np.zeros((2, 3), np.float32)
    assert call_kernel(cpu_kernels.GEMV, x, w) == 1  # wrong number of tensors
    assert call_kernel(cpu_kernels.GEMV, x, w, y, dtypes=["float16", None, None]) == 2
    assert call_kernel(cpu_kernels.GEMV, x, np.zeros((3, 9), np.float32), y) == 4  # inner sizes differ
    assert call_kernel(cpu_kernels.GEMV, x, w, np.zeros((2, 4), np.float32)) == 4  # output shape


def custom_funcs(graph_path: str):
    """(Counter of Custom func names among primitives, number of graph nodes that call a Custom primitive)."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(graph_path, "rb") as fh:
        model.ParseFromString(fh.read())
    funcs = collections.Counter(a.s.decode() for p in model.primitives for a in p.attribute if a.name == "func_name")
    calls = sum(1 for node in model.graph.node if node.op_type.startswith("REF::Custom"))
    return funcs, calls


def test_decode_graph_calls_our_kernel_and_prefill_does_not(exported):
    folder = exported["gqa_tied"]
    with open(os.path.join(folder, "manifest.json")) as fh:
        graphs = {g["role"]: g["file"] for g in json.load(fh)["graphs"]}
    funcs, calls = custom_funcs(os.path.join(folder, graphs["inc"]))
    # stored by library name only, never by the exporting machine's path
    assert set(funcs) == {"mslite_llm_cpu_kernels.so:MsliteLlmGemv", "mslite_llm_cpu_kernels.so:MsliteLlmGemvBias"}
    assert calls == 7 * 2 + 1  # q, k, v, o, gate, up, down in each of 2 layers, and the lm_head
    assert custom_funcs(os.path.join(folder, graphs["prefill"])) == (collections.Counter(), 0)
    with open(os.path.join(folder, "gqa_tied.yaml")) as fh:
        assert yaml.safe_load(fh)["infer"]["cpu_kernels"] is True


def test_cpu_kernels_off_gives_plain_graphs_and_the_same_tokens(tmp_path, checkpoints):
    from export.config import ExportConfig
    from export.pipeline import run_export
    from lite_runtime import pipeline

    out = str(tmp_path / "plain")
    run_export(ExportConfig(checkpoint=checkpoints["gqa_tied"], output=out, name="plain", seq_length=32,
                            batch_size=2, dtype="float32", device="cpu", cpu_kernels="off"))
    assert custom_funcs(os.path.join(out, "plain_inc_graph.mindir")) == (collections.Counter(), 0)
    rows = prompts(2, [5, 9], seed=31)
    got = pipeline("text_generation", model=out, backend="ms").generate(rows, max_new_tokens=8).sequences
    assert got == [hf_generate(checkpoints["gqa_tied"], r, max_new_tokens=8, do_sample=False) for r in rows]


def test_generation_never_writes_the_weights_file(pipes, exported):
    """The weights file is mapped copy-on-write: KV cache writes stay in the process."""
    folder = exported["gqa_tied"]
    pipes["gqa_tied"].generate(prompts(2, [6, 3], seed=5), max_new_tokens=10)
    with open(os.path.join(folder, "manifest.json")) as fh:
        want = json.load(fh)["files"]["gqa_tied_variables/data_0"]["sha256"]
    with open(os.path.join(folder, "gqa_tied_variables", "data_0"), "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == want


def test_without_the_built_library(tmp_path, exported, checkpoints):
    """An install whose kernel library was not built (no compiler): export and load say what to do."""
    shadow = tmp_path / "install" / "cpu_kernels"
    shadow.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "cpu_kernels", "__init__.py"), shadow / "__init__.py")
    folder = exported["gqa_tied"]
    script = textwrap.dedent(f"""
        import cpu_kernels
        assert cpu_kernels.__file__.startswith({str(tmp_path)!r}) and cpu_kernels.library_path() is None
        from export.__main__ import main
        main(["-q", "--checkpoint", {checkpoints["gqa_tied"]!r}, "--output", {str(tmp_path / "out")!r},
              "--device", "cpu", "--seq_length", "16", "--cpu_kernels", "on"])
        from lite_runtime import InferError, pipeline
        try:
            pipeline("text_generation", model={folder!r}, backend="ms")
        except InferError as exc:
            print("error:", exc, file=__import__("sys").stderr)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "install"), ROOT]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert errors == [
        "error: --cpu_kernels on: the CPU kernel library is not built; " + cpu_kernels.BUILD_HINT,
        f"error: {os.path.join(folder, 'gqa_tied_inc_graph.mindir')}: the graph calls mslite-llm's CPU kernels, but "
        f"the mslite-llm CPU kernel library is not built in {shadow}; {cpu_kernels.BUILD_HINT}",
    ]
    assert not (tmp_path / "out").exists()
