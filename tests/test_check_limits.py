"""check's derived limits for quantized CPU folders, shown two-sided over many shapes (issue 43, goal 2): hidden sizes
64 to 1024, tied and untied, int8 and int4, symmetric and not, groups of 32, 64 and 128 (and per channel), from the
export's own rounding and from GPTQ and AWQ checkpoints. Every correct folder passes with at least 3x to spare on both
limits (the replays with x exact and the fast replay: x in int8 where the kernels take it so, int16 elsewhere); every
tampered one fails: one group's scale 1 % off, or one
nibble of a weight inverted, in a linear layer drawn at random. The shapes are drawn by hypothesis (derandomized: CI
runs the same ones); the sweep behind docs/checking.md's table is benchmarks/measure_check_limits.py --quantized."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.limits_harness import Spec, check, make_folder, tamper

MARGIN = 3.0


@st.composite
def specs(draw) -> Spec:
    hidden = draw(st.sampled_from([64, 128, 256, 512, 768, 1024]))
    source = draw(st.sampled_from(["rtn", "gptq", "awq"]))
    bits = 4 if source == "awq" else draw(st.sampled_from([8, 4]))
    groups = [32, 64, 128] + ([0] if bits == 8 and source == "rtn" else [])
    group = draw(st.sampled_from([g for g in groups if g == 0 or hidden % g == 0]))
    symmetric = source == "gptq" or (source == "rtn" and bits == 8)
    return Spec(hidden, 2, draw(st.booleans()), bits, group, symmetric, source, draw(st.integers(0, 99)))


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(spec=specs())
@example(spec=Spec(64, 2, True, 8, 0, True, "rtn", 1))
@example(spec=Spec(1024, 2, False, 4, 128, False, "awq", 10))
@example(spec=Spec(1024, 2, True, 4, 32, False, "rtn", 11))
@example(spec=Spec(256, 2, False, 4, 64, True, "gptq", 3))
def test_correct_folders_pass_with_margin_and_tampered_ones_fail(tmp_path_factory, spec):
    root = str(tmp_path_factory.mktemp("limits"))
    folder = make_folder(root, spec)
    good = check(folder)
    assert good["passed"], good["verdict"]
    assert "with int8 activations within" in good["verdict"], good["verdict"]
    assert good["exact_limit"] >= MARGIN * good["exact"], good
    assert good["int16_limit"] >= MARGIN * good["int16"], good  # the harness's name for the fast replay's
    rng = np.random.default_rng(spec.seed)
    for kind in ("scale", "nibble"):
        where = tamper(folder, os.path.join(root, kind), kind, rng)
        bad = check(os.path.join(root, kind))
        assert not bad["passed"], (kind, where, bad["verdict"])


@pytest.mark.parametrize("hidden, tied, seed", [(64, True, 21), (256, False, 22), (512, True, 23)])
def test_bfloat16_folders_pass_with_margin_and_tampered_ones_fail(tmp_path_factory, hidden, tied, seed):
    """The limits derived for a bfloat16 CPU folder (golden.json `exact` and `bf16`: 10x the reorder lane, 10x the
    lane with x rounded to bfloat16 at every matmul, as the AVX512-BF16 form rounds it) over three shapes: a correct
    folder passes both replays with at least 3x to spare; one weight row of a linear layer 1 % off fails."""
    from export.config import ExportConfig
    from export.pipeline import run_export
    from export.checkpoints.random_checkpoint import make_checkpoint

    root = str(tmp_path_factory.mktemp("limits-bf16"))
    spec = Spec(hidden, 2, tied, 16, 0, True, "rtn", seed)
    ckpt = make_checkpoint(os.path.join(root, "ckpt"), **spec.checkpoint_shape())
    folder = os.path.join(root, "bf16")
    run_export(ExportConfig(checkpoint=ckpt, output=folder, name="m", seq_length=48, batch_size=2, device="cpu",
                            dtype="bfloat16", prefill_buckets=(16,)))
    good = check(folder)
    assert good["passed"], good["verdict"]
    assert "with bfloat16 activations within" in good["verdict"], good["verdict"]
    assert good["exact_limit"] >= MARGIN * good["exact"], good
    assert good["int16_limit"] >= MARGIN * good["int16"], good  # the harness's name for the fast replay's
    where = tamper(folder, os.path.join(root, "row"), "row", np.random.default_rng(seed))
    bad = check(os.path.join(root, "row"))
    assert not bad["passed"], (where, bad["verdict"])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_folder_with_an_int16_limit_replays_in_int16_and_says_so(tmp_path_factory, monkeypatch, bits):
    """An int4 or int8 CPU folder exported before the kernels took its x in int8 (golden.json limits `exact` and
    `int16`, from a lane with x in int16) replays its fast path in int16 (cpu_kernels' ACTIVATIONS_INT16), the rounding
    its limit covers, passes with margin, and says in a line of its own that the int8 form this installation serves
    (int4: every form; int8: its bands, on AVX-512 VNNI) was not replayed and how to check it."""
    import json

    import cpu_kernels
    from export.writers import golden
    from lite_runtime.check import run_check

    monkeypatch.setattr(golden, "lanes_for", lambda bits, matrices_in, cpu: ("int16", "reorder") if cpu else ())
    root = str(tmp_path_factory.mktemp(f"limits-int{bits}-old"))
    folder = make_folder(root, Spec(256, 2, False, bits, 64, bits == 8, "rtn", 5))
    with open(os.path.join(folder, "golden.json"), encoding="utf-8") as fh:
        assert set(json.load(fh)["limits"]) == {"exact", "int16"}
    report = run_check(folder, backend="ms")
    assert report.passed, report.verdict()
    assert report.fast_mode == "int16"
    fast = max(r.max_rel for r in report.rows if r.graph.endswith("@int16"))
    assert MARGIN * fast <= report.fast.rel, (fast, report.fast.rel)
    line = report.activations_line()
    if bits == 4 or cpu_kernels.quant_form() == "avx512_vnni":
        assert f"serves the int{bits} matmuls with x in int8" in line and "re-export the folder" in line, line
    else:
        assert "re-export" not in line, line
