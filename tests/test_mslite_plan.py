"""The mslite backend's decisions, checked as data (mindspore_lite itself cannot run here), and the GE ini files."""
from __future__ import annotations

import dataclasses

import os
import subprocess
import sys

import pytest

from export.devices import GE_CONFIG_DIR, PROFILES
from lite_runtime import InferConfig, InferError
from lite_runtime.backends import resolve_backend
from lite_runtime.backends.mslite import build_plan, context_plan, parse_lite_ini, read_ge_config, short_name
from hiding import hide


def test_context_plan_for_ascend(exported):
    config = InferConfig.from_folder(exported["gqa_tied"], target="Ascend", device_id=3, rank_id=1)
    assert context_plan(config) == {"ascend.device_id": 3, "ascend.rank_id": 1, "ascend.provider": "ge",
                                    "target": ["ascend"]}


def test_mslite_refuses_a_cpu_folder(exported):
    config = InferConfig.from_folder(exported["gqa_tied"])
    assert config.target == "CPU"
    with pytest.raises(InferError) as err:
        context_plan(config)
    assert str(err.value) == ("backend 'mslite' on the CPU cannot share the KV cache between the two graphs "
                              "(weight sharing is GE-only); use backend 'ms' for a folder exported with --device cpu")


def test_build_plan_groups_before_building(tmp_path, exported):
    """Every graph (each prefill bucket, then the inc graphs) joins one ModelGroup before any of them is built."""
    import shutil

    folder = tmp_path / "atlas"
    shutil.copytree(exported["gqa_tied_buckets"], folder)
    ini = os.path.join(GE_CONFIG_DIR, "atlas_800i_a2.ini")
    config = InferConfig.from_folder(str(folder), target="Ascend", ge_config_path=ini)
    paths = config.graph_paths()
    keys = ("prefill_32", "prefill_16", "prefill_8", "inc", "inc_1", "score_8", "score_32")  # score: score_graphs
    assert tuple(paths) == keys
    assert build_plan(config) == (
        [("Model", k) for k in keys] + [("ModelGroup", "SHARE_WEIGHT"), ("add_model", keys)]
        + [("build_from_file", k, paths[k], "MINDIR", ini, {}) for k in keys])
    assert paths["prefill_32"] == config.prefill_model_path and paths["inc"] == config.increment_model_path
    # the server's set (chunk_graphs=True, prefill_graphs=False): inc and the chunk graph, in one group, so they share
    # weights and cache; GE compiles no prefill graph for a server, which never runs one
    served = InferConfig.from_folder(str(folder), target="Ascend", ge_config_path=ini, chunk_graphs=True,
                                     prefill_graphs=False)
    keys = ("inc", "inc_1", "chunk_32", "chunk_8", "score_8", "score_32")
    assert tuple(served.graph_paths()) == keys
    assert build_plan(served)[:len(keys) + 2] == [("Model", k) for k in keys] + [("ModelGroup", "SHARE_WEIGHT"),
                                                                               ("add_model", keys)]
    with pytest.raises(InferError) as err:  # the cpu profile's ini has no GE options at all
        build_plan(InferConfig.from_folder(str(folder), target="Ascend"))
    assert str(err.value) == (f"{folder / 'config.ini'}: [ascend_context] provider=ge is required (found None); "
                              "use an ini from ge_configs/")


@pytest.mark.parametrize("profile", [p for p in PROFILES if p != "cpu"])
def test_atlas_ini_files(profile):
    sections = read_ge_config(PROFILES[profile].ini_path)
    session = sections["ge_session_options"]
    assert sections["ascend_context"]["provider"] == "ge"
    assert session["ge.exec.precision_mode"] == "must_keep_origin_dtype"
    assert session["ge.exec.staticMemoryPolicy"] == "2"
    assert session["ge.externalWeight"] == "1"
    assert session["ge.constLifecycle"] == "session"  # weights held once for all graphs of the ModelGroup
    assert ("ge.exec.formatMode" in session) == (PROFILES[profile].soc == "Ascend910B")
    with open(PROFILES[profile].ini_path) as fh:  # every option is explained by a comment above it
        lines = [line.strip() for line in fh]
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), (profile, line)


@pytest.mark.parametrize("profile", list(PROFILES))
def test_every_shipped_ini_parses_as_lite_parses_it(profile):
    """Lite's config parser knows '#' comments, [sections] and key=value; anything else would reach GE as an option."""
    path = PROFILES[profile].ini_path
    with open(path, "rb") as fh:
        raw = fh.read()
    assert raw.isascii(), "Lite opens the ini in the locale's encoding: keep it ASCII"
    section = None
    for number, line in enumerate(raw.decode().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("[") and text.endswith("]"):
            section = text[1:-1]
            continue
        key, eq, _ = text.partition("=")
        assert eq and key.strip() and section, f"{path}:{number}: {text!r}"
    parse_lite_ini(path)  # the runtime's parser agrees


@pytest.mark.parametrize("text, message", [
    ("[ge_session_options]\n; old style comment=1\n", "{path}:2: '; old style comment=1' is neither a '#' comment, "
     "a [section] nor a key=value line inside a section (Lite passes such lines on as options); fix or remove it"),
    ("[ascend_context]\nprovider ge\n", "{path}:2: 'provider ge' is neither a '#' comment, a [section] nor a "
     "key=value line inside a section (Lite passes such lines on as options); fix or remove it"),
    ("provider=ge\n", "{path}:1: 'provider=ge' is neither a '#' comment, a [section] nor a key=value line inside a "
     "section (Lite passes such lines on as options); fix or remove it"),
    ("[ascend_context]\nprovider=ge\nprovider=acl\n", "{path}:3: option provider repeated in [ascend_context]; keep one"),
    ("# \u00e9t\u00e9\n", "{path}:1: non-ASCII text; Lite reads the file in the locale's encoding, keep it ASCII"),
    ("# no variable_weights_file here\n", "{path}:1: mentions variable_weights_file, which makes Lite parse a LoRA "
     "weight list even in a comment; remove the line"),
])
def test_lite_ini_parser_refuses_what_lite_would_misread(tmp_path, text, message):
    path = tmp_path / "config.ini"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InferError) as err:
        parse_lite_ini(str(path))
    assert str(err.value) == message.format(path=path)


def test_auto_backend_and_input_names():
    assert resolve_backend("auto", "Ascend") == "ms"  # mindspore_lite is not importable here
    assert resolve_backend("auto", "CPU") == "ms"
    assert resolve_backend("mslite", "Ascend") == "mslite"
    assert short_name("68_12_Net_construct_68:input_ids") == "input_ids" and short_name("valid_length") == "valid_length"


HIDE = hide(("mindspore", "torch", "transformers"))


def test_lite_runtime_imports_with_mindspore_and_torch_hidden(exported):
    code = HIDE + f"""
import lite_runtime
from lite_runtime import pipeline, InferConfig, InferError
from lite_runtime.backends.mslite import context_plan, build_plan
from lite_runtime.launcher import build_parser
config = InferConfig.from_folder({exported['gqa_tied']!r}, target="Ascend")
assert context_plan(config)["ascend.provider"] == "ge"
try:
    pipeline("text_generation", model={exported['gqa_tied']!r}, backend="ms")
except InferError as exc:
    print(exc)
assert not any(m.split(".")[0] in ("mindspore", "torch", "transformers") for m in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("backend 'ms' needs MindSpore, which cannot be imported here: pip install "
                                   "mindspore==2.10.0 'numpy<2' (or use backend 'mslite' on Atlas)")


@pytest.mark.parametrize("exported_ms, lite, action, message", [
    ("2.10.0", "2.10.0", "ok", "mindspore_lite 2.10.0 matches MindSpore 2.10.0, which exported this folder"),
    ("2.10.0", "2.10.1", "ok", "mindspore_lite 2.10.1 matches MindSpore 2.10.0, which exported this folder"),
    ("2.10.0", "2.7.1", "refuse",
     "mindspore_lite 2.7.1 is older than MindSpore 2.10.0, which exported this folder: an older Lite may not load "
     "newer MindIR graphs. Re-export with pip install mindspore==2.7.* (the MindSpore that matches this Lite), or "
     "install mindspore_lite 2.10"),
    ("2.7.0", "2.10.0rc1", "warn",
     "mindspore_lite 2.10.0rc1 is newer than MindSpore 2.7.0, which exported this folder; newer Lite releases load "
     "older graphs, but run python -m lite_runtime.check on this folder once to be sure"),
    (None, "2.10.0", "warn",
     "the folder does not record which MindSpore exported it (exported before mslite-llm recorded it); if the graphs "
     "fail to load, re-export with the mindspore that matches mindspore_lite 2.10.0"),
    ("2.10.0", None, "warn",
     "mindspore_lite does not report its version; the folder was exported with MindSpore 2.10.0: use "
     "mindspore_lite 2.10 or newer"),
])
def test_lite_version_against_the_exporter(exported_ms, lite, action, message):
    from lite_runtime.versions import check_lite, lite_decision

    assert lite_decision(exported_ms, lite) == (action, message)
    if action == "refuse":
        with pytest.raises(InferError) as err:
            check_lite(exported_ms, lite, None)
        assert str(err.value) == message


def test_the_exporter_version_comes_from_the_folder(exported):
    import mindspore

    from lite_runtime.backends.mslite import exported_mindspore

    assert exported_mindspore(InferConfig.from_folder(exported["gqa_tied"])) == mindspore.__version__
    folder = exported["gqa_tied"]
    paths = (os.path.join(folder, "gqa_tied_prefill_graph.mindir"), os.path.join(folder, "gqa_tied_inc_graph.mindir"))
    assert exported_mindspore(InferConfig(*paths, infer_seq_length=32, batch_size=2)) is None


def test_inputs_bound_by_name_and_a_missing_one_named():
    import numpy as np

    from lite_runtime.backends import bind_inputs

    arrays = {"input_ids": np.zeros((2, 8), np.int32), "valid_length": np.ones(2, np.int32)}
    bound = bind_inputs("prefill_8", ["7_Net:valid_length", "7_Net:input_ids"], arrays)
    assert [a.shape for a in bound] == [(2,), (2, 8)]
    with pytest.raises(InferError) as err:
        bind_inputs("inc", ["input_ids", "valid_length", "current_index"], arrays)
    assert str(err.value) == ("the inc graph needs input(s) current_index, which the input mapping did not make (it "
                              "made input_ids, valid_length); the folder and model_name do not belong together")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_graph_boundary_is_int32_in_float32_out_in_every_dtype(atlas_exported, dtype):
    """mindspore_lite.DataType has no bfloat16 and get_data_to_numpy reads bf16 as fp16: inputs and outputs of every
    graph stay int32/float32, whatever the weights' dtype (which the graphs really do carry)."""
    import json

    from mindspore.train import mind_ir_pb2

    from lite_runtime.folder import mindir_specs

    folder = atlas_exported[dtype]
    with open(os.path.join(folder, "manifest.json")) as fh:
        graphs = json.load(fh)["graphs"]
    assert sorted((g["role"], g["tokens"]) for g in graphs) == [("chunk", 32), ("inc", 1), ("prefill", 8),
                                                                 ("prefill", 32), ("score", 32)]
    for g in graphs:
        model = mind_ir_pb2.ModelProto()
        with open(os.path.join(folder, g["file"]), "rb") as fh:
            model.ParseFromString(fh.read())
        inputs, outputs = mindir_specs(model)
        spec = {"inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs]}
        assert spec == {"inputs": g["inputs"], "outputs": g["outputs"]}
        chunk = [("chunk_ids", "int32"), ("chunk_length", "int32"), ("start", "int32"), ("chunk_block_table", "int32"),
                 ("chunk_slot_mapping", "int32")] if g["role"] in ("chunk", "score") else []
        assert [(t["name"], t["dtype"]) for t in spec["inputs"]] == [("input_ids", "int32"), ("valid_length", "int32"),
                                                                   ("block_tables", "int32"),
                                                                   ("slot_mapping", "int32"), *chunk]
        assert [(t["name"], t["dtype"]) for t in spec["outputs"]] == [("logits", "float32")]
        types = {mind_ir_pb2.TensorProto.DataType.Name(p.data_type) for p in model.graph.parameter}
        assert types == {"FLOAT16" if dtype == "float16" else "BFLOAT16"}


def test_ge_compile_cache_is_keyed_by_the_folders_content(tmp_path, exported):
    """GE loads a cached graph by key without comparing it: the cache folder must change whenever the folder does."""
    import hashlib
    import json
    import shutil

    from lite_runtime.backends.ge_options import DEFAULT_CACHE_ROOT, cache_plan

    folder = tmp_path / "m"
    shutil.copytree(exported["gqa_tied_buckets"], folder)
    ini = os.path.join(GE_CONFIG_DIR, "atlas_800i_a2.ini")
    config = InferConfig.from_folder(str(folder), target="Ascend", ge_config_path=ini, rank_id=1,
                                     ge_cache_dir=str(tmp_path / "cache"), num_blocks=33)
    cann = {"file": "/usr/local/Ascend/ascend-toolkit/latest/version.cfg", "lines": "version=9.0.1"}
    plan = cache_plan(config, "2.10.0", cann)
    digest = hashlib.sha256((folder / "manifest.json").read_bytes() + b"|lite=2.10.0|cann=version=9.0.1"
                            + b"|blocks=33")  # the pool's size is in the graphs GE compiles
    want_dir = str(tmp_path / "cache" / f"gqa_tied_buckets-{digest.hexdigest()[:16]}")
    assert plan == {"dir": want_dir, "session_options": {"ge.graph_compiler_cache_dir": want_dir},
                    "graph_keys": {"prefill_32": "gqa_tied_buckets_prefill_32_rank1",
                                   "prefill_16": "gqa_tied_buckets_prefill_16_rank1",
                                   "prefill_8": "gqa_tied_buckets_prefill_8_rank1", "inc": "gqa_tied_buckets_inc_rank1",
                                   "inc_1": "gqa_tied_buckets_inc_1_rank1", "score_8": "gqa_tied_buckets_score_8_rank1",
                                   "score_32": "gqa_tied_buckets_score_32_rank1"}}
    steps = [step for step in build_plan(config, plan) if step[0] == "build_from_file"]
    assert [step[5] for step in steps] == [  # identical session options in every graph of the group, a key each
        {"ge_session_options": {"ge.graph_compiler_cache_dir": want_dir},
         "ge_graph_options": {"ge.graph_key": plan["graph_keys"][step[1]]}} for step in steps]
    # another Lite, another CANN, another pool, or a re-exported folder: another cache folder
    assert cache_plan(config, "2.9.0", cann)["dir"] != want_dir
    assert cache_plan(dataclasses.replace(config, num_blocks=34), "2.10.0", cann)["dir"] != want_dir
    assert cache_plan(config, "2.10.0", {"lines": "version=8.5.0"})["dir"] != want_dir
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["exported_with"]["mslite_llm"] = "0.1.1"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert cache_plan(InferConfig.from_folder(str(folder), ge_cache_dir=str(tmp_path / "cache")), "2.10.0",
                      cann)["dir"] != want_dir
    # off on request, and for graph files without a folder (nothing to fingerprint); the default root
    assert cache_plan(InferConfig.from_folder(str(folder), ge_cache_dir="none"), "2.10.0", cann) is None
    paths = (str(folder / "gqa_tied_buckets_prefill_graph.mindir"), str(folder / "gqa_tied_buckets_inc_graph.mindir"))
    assert cache_plan(InferConfig(*paths, infer_seq_length=32, batch_size=2), "2.10.0", cann) is None
    assert cache_plan(InferConfig.from_folder(str(folder)), "2.10.0", cann)["dir"].startswith(DEFAULT_CACHE_ROOT)


def test_warm_up_compiles_every_graph_at_load_on_atlas_and_the_short_ones_on_the_cpu():
    from lite_runtime.engine.runner import warm_up_keys

    keys = ["prefill_32", "prefill_16", "prefill_8", "inc"]
    assert warm_up_keys("auto", "mslite", keys) == keys  # GE compiles for minutes: never inside a request
    assert warm_up_keys("auto", "ms", keys) == ["prefill_8", "inc"]
    assert warm_up_keys("smallest", "mslite", keys) == ["prefill_8", "inc"]
    assert warm_up_keys("all", "ms", keys) == keys and warm_up_keys("none", "mslite", keys) == []
    # where a prompt alone goes in pieces (a CPU folder with chunk graphs: ModelRunner.prefill), the chunk graph they take
    pieces = keys + ["chunk_8", "chunk_32"]
    assert warm_up_keys("auto", "ms", pieces, pieces=True) == ["chunk_32", "inc"]
    assert warm_up_keys("auto", "ms", pieces) == ["prefill_8", "inc"]
    assert warm_up_keys("auto", "ms", keys, pieces=True) == ["prefill_8", "inc"]  # no chunk graph loaded


def test_the_pool_size_is_written_into_a_copy_of_each_graph_lite_builds(tmp_path, exported):
    """Lite sizes nothing at load: the mslite backend writes each graph with its KV caches' first dimension set to the
    pool's blocks (lite_runtime/mindir_edit.py, no MindSpore or protobuf on the device), everything else the same
    bytes' meaning, and builds that copy with [model_file] mindir_path naming the folder's own graph, whose directory
    Lite resolves the weights file in."""
    from mindspore.train import mind_ir_pb2

    from lite_runtime.backends.mslite import build_plan, pool_dir, sized_graphs
    from lite_runtime.folder import is_kv_cache

    folder = exported["gqa_tied_buckets"]
    ini = os.path.join(GE_CONFIG_DIR, "atlas_800i_a2.ini")
    config = InferConfig.from_folder(folder, target="Ascend", ge_config_path=ini, num_blocks=57)
    where = pool_dir(config)
    assert where.endswith("-57blocks-rank0") and os.path.basename(where).startswith("gqa_tied_buckets-")
    sized = sized_graphs(config, 57, str(tmp_path / "pool"))
    paths = config.graph_paths()
    assert set(sized) == set(paths)
    for key, path in paths.items():
        original, copy = mind_ir_pb2.ModelProto(), mind_ir_pb2.ModelProto()
        with open(path, "rb") as fh:
            original.ParseFromString(fh.read())
        with open(sized[key], "rb") as fh:
            copy.ParseFromString(fh.read())
        caches = [p for p in original.graph.parameter if is_kv_cache(p.name.rsplit(":", 1)[-1])]
        assert len(caches) == 4  # two layers' key and value caches
        for p in caches:
            p.dims[0] = 57
        assert copy == original  # protobuf's own edit equals ours, field for field
    steps = [step for step in build_plan(config, None, None, sized) if step[0] == "build_from_file"]
    assert [(step[2], step[5]) for step in steps] == [
        (sized[step[1]], {"model_file": {"mindir_path": os.path.abspath(paths[step[1]])}}) for step in steps]


def test_the_mindir_editor_uses_mind_ir_protos_field_numbers():
    from mindspore.train import mind_ir_pb2

    from lite_runtime import mindir_edit as e

    fields = {(m.DESCRIPTOR.name, f.name): f.number for m in (mind_ir_pb2.ModelProto, mind_ir_pb2.GraphProto,
                                                               mind_ir_pb2.TensorProto) for f in m.DESCRIPTOR.fields}
    assert (fields["ModelProto", "graph"], fields["ModelProto", "functions"]) == (e.MODEL_GRAPH, e.MODEL_FUNCTIONS)
    assert fields["GraphProto", "parameter"] == e.GRAPH_PARAMETER
    assert (fields["TensorProto", "dims"], fields["TensorProto", "name"]) == (e.TENSOR_DIMS, e.TENSOR_NAME)
    # packed dims too (proto3 writers), and a truncated message is an error, not a guess
    t = mind_ir_pb2.TensorProto(name="g:model.layers.0.self_attn.key_cache", dims=[5, 2, 8, 16])
    m = mind_ir_pb2.ModelProto()
    m.graph.parameter.append(t)
    data = m.SerializeToString()

    def field(number, body):  # a length-delimited field
        return e._varint((number << 3) | 2) + e._varint(len(body)) + body

    dims = b"".join(e._varint(d) for d in (5, 2, 8, 16))
    packed = field(7, field(3, field(1, dims) + field(7, t.name.encode())))
    for raw in (data, packed):
        out, count = e.set_first_dims(raw, lambda n: n.endswith("key_cache"), 300)
        got = mind_ir_pb2.ModelProto()
        got.ParseFromString(out)
        assert count == 1 and list(got.graph.parameter[0].dims) == [300, 2, 8, 16]
    with pytest.raises(e.MindIRError):
        e.set_first_dims(data[:-3], lambda n: True, 3)
