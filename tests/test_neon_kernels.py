"""The CPU kernels' NEON path (cpu_kernels/matmul16.cc's rows kernels, the Atlas hosts' AArch64 CPUs) on this x86
machine: the whole library (cpu_kernels/*.cc) built with Debian's cross compiler,
run under qemu-user, against float64 references and against the plain C++ path of the same binary
(MSLITE_LLM_CPU_KERNELS_ISA=generic): the GEMV kernels, and the attention (whose scores are the NEON rows form and
whose softmax and values are the generic C++, compiled for AArch64). Skipped, with the reason, where the tools are missing:
apt-get install g++-aarch64-linux-gnu qemu-user. Speed on an AArch64 CPU cannot be measured here."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
TOOLS = [t for t in (CXX, QEMU) if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(bool(TOOLS), reason=f"{' and '.join(TOOLS)} not found: apt-get install "
                                                    "g++-aarch64-linux-gnu qemu-user")


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("neon") / "gemv_driver")
    sources = sorted(glob.glob(os.path.join(ROOT, "cpu_kernels", "*.cc")))  # the library, as setup.py builds it
    subprocess.run([CXX, "-O2", "-std=c++14", "-static", "-pthread", os.path.join(ROOT, "tests", "data",
                    "gemv_driver.cc")] + sources + ["-o", out], check=True, capture_output=True, text=True)
    return out


def run(binary, tmp_path, isa=None, attention=False, quant=False, activations=None):
    """(the path the library chose, every case the driver wrote[, the attention cases][, the quantized matmul's]);
    `activations`: the quantized matmuls' (MSLITE_LLM_QUANT_ACTIVATIONS), default int16."""
    tag = f"{isa or 'native'}-{activations or 'int16'}"
    path = str(tmp_path / f"cases-{tag}.bin")
    att = str(tmp_path / f"attention-{tag}.bin")
    qm = str(tmp_path / f"quant-{tag}.bin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MSLITE_LLM_CPU_KERNELS_ISA", "MSLITE_LLM_QUANT_ACTIVATIONS")}
    if isa:
        env["MSLITE_LLM_CPU_KERNELS_ISA"] = isa
    if activations:
        env["MSLITE_LLM_QUANT_ACTIVATIONS"] = activations
    proc = subprocess.run([QEMU, binary, path] + ([att] if attention or quant else []) + ([qm] if quant else []),
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if quant:
        return proc.stdout.split()[0], parse_quant(qm)
    if attention:
        return proc.stdout.split()[0], parse(path), parse_attention(att)
    return proc.stdout.split()[0], parse(path)


def parse_quant(path):
    """The driver's quantized matmul cases, each with W dequantized here (float64) from q as stored."""
    from test_quant_kernels import dequantize

    take, more = reader(path)
    cases = []
    while more():
        int4, group, offset, rows, k, n, rc = (int(v) for v in take(7, np.int64))
        x = take(rows * k, np.float32).reshape(rows, k)
        q = take(n * k // (2 if int4 else 1), np.uint8).reshape(n, -1)
        q = q if int4 else q.view(np.int8)
        scale = take(k // group * n, np.float32).reshape(-1, n)
        off = take(k // group * n, np.float32).reshape(-1, n) if offset else None
        y = take(rows * n, np.float32).reshape(rows, n)
        cases.append(dict(int4=int4, group=group, offset=offset, rows=rows, k=k, rc=rc, x=x,
                          w=dequantize(q, scale, off), wq=dequantize(q, scale), y=y))
    return cases


def reader(path):
    """(take, more) over a file the driver wrote: take(n, dtype) the next n values, more() whether any are left."""
    data, at = open(path, "rb").read(), 0

    def take(n, dtype):
        nonlocal at
        a = np.frombuffer(data, dtype, n, at)
        at += a.nbytes
        return a

    return take, lambda: at < len(data)


def parse_attention(path):
    """The driver's attention cases, each sequence's caches gathered back through its block table to [1, KH, S, D]."""
    take, more = reader(path)
    cases, (h, kh, s) = [], (14, 2, 160)
    while more():
        d, n, rc, bs, nb = (int(v) for v in take(5, np.int64))
        q = take(n * h * d, np.float32).reshape(n, h * d)
        k, v = (take(nb * kh * bs * d, np.float32).reshape(nb, kh, bs, d) for _ in range(2))
        table = take(s // bs, np.int32)
        out = take(n * h * d, np.float32).reshape(n, h * d)
        k, v = (np.concatenate([c[b] for b in table], axis=1)[None] for c in (k, v))  # [1, KH, S, D]
        cases.append(dict(d=d, n=n, rc=rc, q=q, k=k, v=v, out=out))
    return cases


def test_neon_attention_against_float64(binary, tmp_path):
    """The kernels' attention as the CPU prefill graph calls it (150 queries of one sequence, lengths 1..150: blocks
    of 8 queries, read from the paged cache's blocks of 32 through a table that runs backwards; head sizes 64 and 80,
    and 64 over bfloat16 caches, widened as read), built for AArch64 and run under qemu."""
    from test_fused_kernels import check_attention

    isa, _, cases = run(binary, tmp_path, attention=True)
    assert isa == "neon" and [c["d"] for c in cases] == [64, 80, 64]
    for c in cases:
        assert c["rc"] == 0
        check_attention(c["out"], c["q"], c["k"], c["v"], np.arange(1, c["n"] + 1), [0] * c["n"])


def parse(path):
    take, more = reader(path)
    cases = []
    while more():
        d, rows, inp, out, bias, rc = (int(v) for v in take(6, np.int64))
        x = take(rows * inp, np.float32).reshape(rows, inp)
        if d == 0:
            w = take(out * inp, np.float32).astype(np.float64)
        elif d == 1:
            w = take(out * inp, np.float16).astype(np.float64)
        else:
            w = (take(out * inp, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        b = take(out, np.float32)
        y = take(rows * out, np.float32).reshape(rows, out)
        cases.append(dict(dtype=("float32", "float16", "bfloat16")[d], rows=rows, inp=inp, bias=bias, rc=rc, x=x,
                          w=w.reshape(out, inp), b=b, y=y))
    return cases


def test_neon_gemv_against_float64_and_the_plain_path(binary, tmp_path):
    isa, neon = run(binary, tmp_path)
    generic_isa, generic = run(binary, tmp_path, "generic")
    assert (isa, generic_isa) == ("neon", "generic")
    assert len(neon) == len(generic) == 3 * 6 * 3 * 2  # dtypes x rows x input sizes x bias
    for a, g in zip(neon, generic):
        where = f"{a['dtype']} rows {a['rows']} in {a['inp']} bias {a['bias']}"
        assert a["rc"] == g["rc"] == 0, where
        ref = a["x"].astype(np.float64) @ a["w"].T + (a["b"] if a["bias"] else 0)
        scale = np.abs(a["x"]).sum(1, keepdims=True) * np.abs(a["w"]).max() + 1e-30  # the sum's magnitude
        assert np.all(np.abs(a["y"] - ref) <= 1e-5 * scale), where  # float32 sums of up to 899 products
        assert np.all(np.abs(a["y"] - g["y"]) <= 2e-5 * scale), where


def test_neon_quant_matmul_against_float64_and_the_plain_path(binary, tmp_path):
    """The int8/int4 weight matmul's decode form (x rounded to int16 per block of 32, exact integer products; NEON's
    vmlal_s16) and its plain float form (K = 100, not whole blocks), built for AArch64 and run under qemu: within the
    bound of x's rounding of the float64 product (test_quant_kernels.int16_rounding), and with the plain C++ path of
    the same binary, whose integers are the same, within float32 rounding of the sums."""
    from test_quant_kernels import int16_rounding

    isa, neon = run(binary, tmp_path, quant=True)
    generic_isa, generic = run(binary, tmp_path, "generic", quant=True)
    assert (isa, generic_isa) == ("neon", "generic")
    assert len(neon) == len(generic) == 2 * (3 + 1) * 2 * 4  # bits x (3 groups of K = 256, per channel of 100) ...
    for a, g in zip(neon, generic):
        where = f"int{4 if a['int4'] else 8} group {a['group']} offset {a['offset']} rows {a['rows']} K {a['k']}"
        assert a["rc"] == g["rc"] == 0, where
        ref = a["x"].astype(np.float64) @ a["w"].T
        scale = np.abs(a["x"]).sum(1, keepdims=True) * np.abs(a["w"]).max() + 1e-30  # the sum's magnitude
        rounding = int16_rounding(a["x"], a["wq"], a["group"], a["int4"])
        assert a["k"] % 32 or rounding.max() > 0, where  # the decode form ran where it can
        assert np.all(np.abs(a["y"] - ref) <= rounding + 1e-5 * scale), where
        assert np.all(np.abs(a["y"] - g["y"]) <= 2e-5 * scale), where

def test_neon_quant_matmul_with_exact_activations(binary, tmp_path):
    """MSLITE_LLM_QUANT_ACTIVATIONS=exact (what check runs): x in two int16 parts, so the decode form's products are
    the float64 product's to float32's rounding of the sums, on NEON and the plain C++ path, without int16's
    allowance (which they would exceed in int16 mode on these cases)."""
    from test_quant_kernels import int16_rounding

    for isa in (None, "generic"):
        _, cases = run(binary, tmp_path, isa, quant=True, activations="exact")
        for a in cases:
            where = f"{isa} int{4 if a['int4'] else 8} group {a['group']} rows {a['rows']} K {a['k']}"
            assert a["rc"] == 0, where
            ref = a["x"].astype(np.float64) @ a["w"].T
            scale = np.abs(a["x"]).sum(1, keepdims=True) * np.abs(a["w"]).max() + 1e-30
            assert np.all(np.abs(a["y"] - ref) <= 2e-6 * scale), where
            if a["k"] % 32 == 0:  # the decode form: int16's rounding is far larger than what remains
                assert np.abs(a["y"] - ref).max() < 0.05 * int16_rounding(a["x"], a["wq"], a["group"]).max(), where
