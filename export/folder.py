"""Writing the model folder: graph files, specs read back from the MindIR, yaml, tokenizer, manifest."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Dict, List, Optional

import yaml

from export.errors import ExportError

FORMAT = "mslite-llm-model-folder"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
GE_CONFIG = "config.ini"
GOLDEN = "golden.json"  # export/golden.py writes it
# Files a HF checkpoint may carry that the runtime's tokenizer (and generation defaults) need.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
_TOKENIZER_CORE = ("tokenizer.json", "vocab.json", "tokenizer.model")
_MINDIR_DTYPES = {"INT32": "int32", "INT64": "int64", "FLOAT": "float32", "FLOAT16": "float16",
                  "BFLOAT16": "bfloat16", "BOOL": "bool"}


def graph_prefix(name: str, role: str, tokens: int, seq_length: int) -> str:
    """`<name>_prefill` (the seq_length graph), `<name>_prefill_<tokens>` (a bucket), `<name>_inc`; the slot graphs
    of batch_size > 1 folders likewise `<name>_slot` and `<name>_slot_<tokens>`."""
    return f"{name}_{role}" if role == "inc" or tokens == seq_length else f"{name}_{role}_{tokens}"


def place_graph(folder: str, prefix: str) -> str:
    """Bring what mindspore.export wrote for `prefix` to `<prefix>_graph.mindir`; returns that name.

    MindSpore writes `<prefix>.mindir` for small nets and `<prefix>_graph.mindir` plus
    `<prefix>_variables/` above 1 GB; shared_weights then moves all weights to one file.
    """
    split = os.path.join(folder, prefix + "_graph.mindir")
    single = os.path.join(folder, prefix + ".mindir")
    if os.path.isfile(single):
        os.replace(single, split)
    if not os.path.isfile(split):
        raise ExportError(f"{split}: MindSpore did not write the graph file; see the log above")
    return os.path.basename(split)


def portable_kernel_paths(model) -> int:
    """Store our CPU kernels' Custom ops by library name, not by this machine's path; returns how many.

    `model` is a parsed MindIR proto (share_weights applies this before it writes each graph).
    mindspore.export records the absolute path of the library the op was built with; the `ms`
    backend points the name at the loading machine's library (cpu_kernels.local_func).
    """
    import cpu_kernels

    return cpu_kernels.retarget(model, lambda func: cpu_kernels.graph_func(func.rpartition(":")[2]))


def read_graph_spec(path: str) -> Dict[str, List[Dict[str, Any]]]:
    """Input names, dtypes and shapes, and output dtypes and shapes, as stored in a MindIR file."""
    from mindspore.train import mind_ir_pb2

    model = mind_ir_pb2.ModelProto()
    with open(path, "rb") as fh:
        model.ParseFromString(fh.read())
    names = mind_ir_pb2.TensorProto.DataType.Name

    def spec(value, name: str) -> Dict[str, Any]:
        tensor = value.tensor[0]
        return {"name": name, "dtype": _MINDIR_DTYPES.get(names(tensor.data_type), names(tensor.data_type).lower()),
                "shape": [int(d) for d in tensor.dims]}

    inputs = [spec(v, v.name.rsplit(":", 1)[-1]) for v in model.graph.input]
    outputs = [spec(v, "logits" if i == 0 else f"output_{i}") for i, v in enumerate(model.graph.output)]
    return {"inputs": inputs, "outputs": outputs}


def copy_tokenizer(checkpoint: str, folder: str) -> List[str]:
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(checkpoint, f))]
    if not any(f in present for f in _TOKENIZER_CORE):
        raise ExportError(f"{checkpoint}: no tokenizer files (tokenizer.json, vocab.json + merges.txt or "
                          "tokenizer.model); copy the model's tokenizer into the checkpoint folder")
    for f in present:
        shutil.copyfile(os.path.join(checkpoint, f), os.path.join(folder, f))
    return present


def special_token_ids(checkpoint: str, model_eos) -> Dict[str, Any]:
    """eos and pad ids: generation_config.json first, then config.json (as HF generate does)."""
    gen: Dict[str, Any] = {}
    path = os.path.join(checkpoint, "generation_config.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                gen = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ExportError(f"{path}: not valid JSON ({exc}); fix or delete it") from None
    eos = gen.get("eos_token_id", model_eos)
    eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = gen.get("pad_token_id")
    if pad is None:
        pad = eos_list[0] if eos_list else 0
    return {"eos_token_id": eos_list, "pad_token_id": int(pad)}


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(folder: str, known: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """sha256 and size of every file below `folder` (relative, '/'-separated), manifest excluded.

    `known` gives the sha256 of files hashed as they were written (the weights file), by relative path.
    """
    known = known or {}
    table = {}
    for root, _, files in os.walk(folder):
        for f in sorted(files):
            path = os.path.join(root, f)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                table[rel] = {"sha256": known.get(rel) or sha256_file(path), "size": os.path.getsize(path)}
    return dict(sorted(table.items()))


def write_yaml(folder: str, name: str, content: Dict[str, Any]) -> str:
    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# {name}: written by `python -m export`; the runtime reads the `infer` section.\n")
        yaml.safe_dump(content, fh, sort_keys=False)
    return path


def exporter_versions(mindspore_version: str) -> Dict[str, str]:
    """What wrote the folder: MindSpore (the MindIR's producer; Lite must not be older) and this project."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        ours = version("mslite-llm")
    except PackageNotFoundError:  # run from a checkout that was not pip-installed
        ours = "unknown"
    return {"mindspore": mindspore_version, "mslite_llm": ours}


def write_manifest(folder: str, name: str, graphs: List[Dict[str, Any]],
                   known: Optional[Dict[str, str]] = None,
                   exported_with: Optional[Dict[str, str]] = None, family: Optional[str] = None) -> Dict[str, Any]:
    """`golden` names the golden references (export/golden.py) when the folder has them; `family` is the model
    family (export/families), the runtime's InputOfInfer key."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": name, "yaml": f"{name}.yaml",
                **({"family": family} if family else {}),
                "ge_config": GE_CONFIG, "exported_with": exported_with or {}, "graphs": graphs,
                "files": file_table(folder, known)}
    if GOLDEN in manifest["files"]:
        manifest["golden"] = GOLDEN
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    return manifest
