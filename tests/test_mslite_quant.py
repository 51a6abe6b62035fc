"""The mslite backend and quantized folders (issue 31): a folder whose int8/int4 layers the Ascend SoC cannot run is
refused in one line before any graph is built, against this device's SoC (pyACL) and the SoC the folder records. The
decision is data (mindspore_lite and pyACL cannot run here), held to export/devices.py profile by profile, to every
SoC x quantization of the table, and driven through build_plan and `python -m lite_runtime.check` with exported
folders."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from export.devices import PROFILES
from export.checkpoints.random_checkpoint import make_checkpoint
from lite_runtime import InferConfig, InferError
from lite_runtime.backends.mslite import (QUANT_SOCS, UNKNOWN_SOC, build_plan, device_soc, quant_support,
                                          quantization_plan)
from hiding import hide
from tests.test_quantize import _export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATLAS_INI = PROFILES["atlas_800i_a2"].ini_path


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Three small quantized folders: A2 int4 in groups of 32 (fused graphs), 310P int8 per channel, CPU int8."""
    root = tmp_path_factory.mktemp("mslite_quant")
    ckpt = make_checkpoint(str(root / "ckpt"), family="qwen2", seed=11)
    return {"a2_int4": _export(ckpt, str(root / "a2_int4"), quantize="int4", group_size=32, dtype="float16",
                               device="atlas_800i_a2"),
            "310p_int8": _export(ckpt, str(root / "310p_int8"), quantize="int8", dtype="float16",
                                 device="atlas_300i_duo"),
            "cpu_int8": _export(ckpt, str(root / "cpu_int8"), quantize="int8")}


def _manifest(folder: str) -> str:
    return os.path.join(folder, "manifest.json")


# ------------------------------------------------------------------------------------------------------ the table

@pytest.mark.parametrize("name", list(PROFILES))
def test_the_runtime_table_agrees_with_the_export_profiles(name):
    """Each export profile's quant_bits / quant_groups are what the runtime lets its SoC run, and the runtime names
    that profile in its fix; the CPU profile's folders (soc "") are refused on Ascend whatever they hold."""
    profile = PROFILES[name]
    if profile.soc == "":
        with pytest.raises(InferError):
            quantization_plan({"bits": 8, "group_size": 0, "symmetric": True, "source": "rtn"}, "", "m/manifest.json",
                              recorded_in="m.yaml")
        return
    support = quant_support(profile.soc)
    assert support is not UNKNOWN_SOC and profile.soc.startswith(support.prefix)
    assert (support.bits, support.groups) == (profile.quant_bits, profile.quant_groups)
    assert name in support.profiles


def test_every_profile_the_runtime_suggests_is_an_export_profile_of_that_soc():
    for row in QUANT_SOCS:
        for name in row.profiles:
            assert quant_support(PROFILES[name].soc) == row, (row, name)
    assert [row.prefix for row in QUANT_SOCS if not row.profiles] == ["Ascend910_93"]  # A3: no export profile yet


FORMS = {  # the manifest's quantization -> its label in the error
    "int8 per channel": ({"bits": 8, "group_size": 0, "symmetric": True, "source": "rtn",
                          "tables": {"bits": 8, "group_size": 0, "symmetric": True}},
                         "int8 (per channel, symmetric, from rtn)"),
    "int8 groups": ({"bits": 8, "group_size": 32, "symmetric": True, "source": "gguf:Q8_0"},
                    "int8 (groups of 32, symmetric, from gguf:Q8_0)"),
    "int4 per channel": ({"bits": 4, "group_size": 0, "symmetric": False, "source": "rtn"},
                         "int4 (per channel, with offsets, from rtn)"),
    "int4 groups": ({"bits": 4, "group_size": 128, "symmetric": False, "source": "gptq"},
                    "int4 (groups of 128, with offsets, from gptq)"),
}
A2_A3 = ("Ascend910B1", "Ascend910B4", "Ascend910_9392")
P310 = ("Ascend310P1", "Ascend310P3")
TRAINING_910 = ("Ascend910A", "Ascend910ProA", "Ascend910PremiumA", "Ascend910ProB")
UNKNOWN = ("Ascend310B1", "Ascend310")
SERIES = {**{soc: " (Atlas inference series)" for soc in P310},  # after the SoC's name in the error; none if unknown
          **{soc: " (Atlas training series)" for soc in TRAINING_910}, **{soc: "" for soc in UNKNOWN}}
P310_TAKES = "int8, per channel only; re-export with --device atlas_300i_duo --quantize int8"
EXPECTED = {  # (SoC family, form) -> what follows "whose WeightQuantBatchMatmul takes "; None: it runs
    **{(A2_A3, form): None for form in FORMS},
    (P310, "int8 per channel"): None,
    (P310, "int8 groups"): P310_TAKES + " --group_size 0, or --quantize none",
    (P310, "int4 per channel"): P310_TAKES + ", or --quantize none",
    (P310, "int4 groups"): P310_TAKES + ", or --quantize none",
    **{(TRAINING_910, form): "none; re-export with --device atlas_800 --quantize none for float weights"
       for form in FORMS},
    **{(UNKNOWN, form): "none that this runtime knows of; re-export with --quantize none for float weights"
       for form in FORMS},
}


@pytest.mark.parametrize("soc,form,tail", [(soc, form, tail) for (socs, form), tail in EXPECTED.items()
                                           for soc in socs])
def test_quantization_plan_for_every_soc_and_method(soc, form, tail):
    quantization, label = FORMS[form]
    manifest = "/models/m/manifest.json"
    assert quantization_plan(None, soc, manifest) is None  # float folders run everywhere
    if tail is None:
        assert quantization_plan(quantization, soc, manifest) is None
        return
    with pytest.raises(InferError) as err:
        quantization_plan(quantization, soc, manifest)
    assert str(err.value) == (f"{manifest}: {label} cannot run on this device's SoC {soc}{SERIES[soc]}, whose "
                              f"WeightQuantBatchMatmul takes {tail}")


# ------------------------------------------------------------------------------------------------------ the SoC

def test_the_device_soc_is_unknown_without_pyacl():
    """pyACL (CANN's `acl`) hidden, as where CANN is not installed: no SoC, and nothing of MindSpore, torch or
    transformers imported on the way."""
    script = hide(("acl", "mindspore", "torch", "transformers")) + (
        "from lite_runtime.backends.mslite import device_soc\n"
        "print(device_soc())\n"
        "assert not any(m.split('.')[0] in HIDDEN for m in sys.modules), 'imported a hidden module'\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "None\n"


@pytest.mark.parametrize("answer,soc", [("Ascend310P3", "Ascend310P3"), (None, None), ("", None)])
def test_the_device_soc_is_what_pyacl_answers(monkeypatch, answer, soc):
    """pyACL's get_soc_name returns the SoC's name, or None when it cannot tell (CANN's pyACL reference)."""
    monkeypatch.setitem(sys.modules, "acl", types.SimpleNamespace(get_soc_name=lambda: answer))
    assert device_soc() == soc


# ------------------------------------------------------------------------------------------------------ folders

def test_build_plan_refuses_a_quantized_folder_the_device_cannot_run(quantized):
    """An A2 int4 folder: built on A2 and A3 (or where the SoC is unknown), refused on a 310P and a 910A before any
    model is made; the same plan whichever SoC runs it."""
    folder = quantized["a2_int4"]
    config = InferConfig.from_folder(folder)
    assert config.target == "Ascend" and config.ge_config_path == os.path.join(folder, "config.ini")
    plan = build_plan(config)
    assert plan[0] == ("Model", "prefill_32") and ("ModelGroup", "SHARE_WEIGHT") in plan
    for soc in ("Ascend910B2", "Ascend910_9391"):
        assert build_plan(config, soc=soc) == plan
    label = "int4 (groups of 32, with offsets, from rtn)"
    with pytest.raises(InferError) as err:
        build_plan(config, soc="Ascend310P3")
    assert str(err.value) == (f"{_manifest(folder)}: {label} cannot run on this device's SoC Ascend310P3 (Atlas "
                              "inference series), whose WeightQuantBatchMatmul takes int8, per channel only; re-export "
                              "with --device atlas_300i_duo --quantize int8, or --quantize none")
    with pytest.raises(InferError) as err:
        build_plan(config, soc="Ascend910ProA")
    assert str(err.value) == (f"{_manifest(folder)}: {label} cannot run on this device's SoC Ascend910ProA (Atlas "
                              "training series), whose WeightQuantBatchMatmul takes none; re-export with --device "
                              "atlas_800 --quantize none for float weights")


def test_a_310p_int8_folder_runs_on_a_310p_not_on_a_910a(quantized):
    config = InferConfig.from_folder(quantized["310p_int8"])
    assert build_plan(config, soc="Ascend310P3") == build_plan(config)
    with pytest.raises(InferError) as err:
        build_plan(config, soc="Ascend910A")
    assert str(err.value) == (f"{_manifest(quantized['310p_int8'])}: int8 (per channel, symmetric, from rtn) cannot "
                              "run on this device's SoC Ascend910A (Atlas training series), whose "
                              "WeightQuantBatchMatmul takes none; re-export with --device atlas_800 --quantize none "
                              "for float weights")


def test_a_float_folder_is_built_on_any_soc(exported):
    config = InferConfig.from_folder(exported["gqa_tied"], target="Ascend", ge_config_path=ATLAS_INI)
    assert build_plan(config, soc="Ascend910A") == build_plan(config, soc="Ascend310B1") == build_plan(config)


def _hand_edited(quantized, tmp_path) -> str:
    """The 310P int8 folder whose manifest was edited to say int4 in groups (the manifest is not in its own file
    table, so the folder still loads)."""
    folder = str(tmp_path / "edited")
    shutil.copytree(quantized["310p_int8"], folder)
    with open(_manifest(folder)) as fh:
        manifest = json.load(fh)
    manifest["quantization"].update(bits=4, group_size=32, symmetric=False)
    with open(_manifest(folder), "w") as fh:
        json.dump(manifest, fh, indent=2)
    return folder


def test_a_hand_edited_manifest_is_refused_by_the_soc_the_folder_records(quantized, tmp_path):
    """With no SoC from the device, or with one that would run it, the folder's own infer.soc refuses it."""
    folder = _hand_edited(quantized, tmp_path)
    config = InferConfig.from_folder(folder)
    message = (f"{_manifest(folder)}: int4 (groups of 32, with offsets, from rtn) cannot run on Ascend310P (Atlas "
               "inference series; infer.soc of m.yaml), whose WeightQuantBatchMatmul takes int8, per channel only; "
               "re-export with --device atlas_300i_duo --quantize int8, or --quantize none")
    for soc in (None, "Ascend910B1"):
        with pytest.raises(InferError) as err:
            build_plan(config, soc=soc)
        assert str(err.value) == message


def test_a_quantized_cpu_folder_is_refused_on_ascend(quantized):
    """Forced onto Ascend (the CPU target is refused by context_plan already), a CPU folder's quantized layers call
    this project's CPU kernels, which GE does not have."""
    folder = quantized["cpu_int8"]
    config = InferConfig.from_folder(folder, target="Ascend", ge_config_path=ATLAS_INI)
    with pytest.raises(InferError) as err:
        build_plan(config, soc="Ascend910B1")
    assert str(err.value) == (
        f"{_manifest(folder)}: int8 (per channel, symmetric, from rtn) was exported for the CPU (m.yaml infer.soc is "
        "empty): its layers call this project's CPU kernels, which Lite on Ascend does not have; re-export with the "
        "--device of your Atlas (atlas_800i_a2, atlas_800t_a2, atlas_300i_duo) and a --quantize it runs or "
        "--quantize none, or run it with backend 'ms'")


CHECK = hide() + """
from lite_runtime.check import main
code = main(sys.argv[1:])
assert not any(m.split(".")[0] in HIDDEN for m in sys.modules), "imported a hidden module"
sys.exit(code)
"""
# an Atlas host as far as this project can tell: only numpy, pyyaml and (were it installable) mindspore_lite
ATLAS_HIDDEN = "acl,mindspore,torch,transformers,tokenizers,safetensors,tqdm,sentencepiece,mindspore_lite,cpu_kernels"


def test_check_refuses_before_it_needs_mindspore_lite(quantized, tmp_path):
    """`python -m lite_runtime.check --backend mslite`: the edited folder is refused by the quantization check,
    before the backend asks for mindspore_lite; the A2 folder passes it and stops only there."""
    folder = _hand_edited(quantized, tmp_path)
    runs = {}
    for name, path in (("edited", folder), ("a2", quantized["a2_int4"])):
        runs[name] = subprocess.run([sys.executable, "-c", CHECK, ATLAS_HIDDEN, path, "--backend", "mslite", "-q"],
                                    capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert runs["edited"].returncode == 2 and runs["edited"].stderr.strip() == (
        f"error: {_manifest(folder)}: int4 (groups of 32, with offsets, from rtn) cannot run on Ascend310P "
        "(Atlas inference series; infer.soc of m.yaml), whose WeightQuantBatchMatmul takes int8, per channel only; "
        "re-export with --device atlas_300i_duo --quantize int8, or --quantize none")
    assert runs["a2"].returncode == 2 and runs["a2"].stderr.strip().startswith(
        "error: backend 'mslite' needs mindspore_lite, which cannot be imported here"), runs["a2"].stderr[-2000:]
