"""Writing a model folder's manifest and yaml: the writing half of the contract lite_runtime/folder.py reads.

`python -m export` writes every folder through here, so the schema of both files is defined once, beside the
reader that checks it (model_dirs/README.md documents both).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lite_runtime.folder import FORMAT, FORMAT_VERSION, GE_CONFIG, GOLDEN, MANIFEST, QUANTIZED_FORMAT_VERSION, sha256_file


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the manifest's `graphs` list."""

    role: str  # prefill, inc or chunk
    file: str  # relative to the folder
    variables: str  # the weights file it refers to (folder.data_location)
    tokens: int
    inputs: tuple  # of TensorSpec, in graph order
    outputs: tuple
    rank: Optional[int] = None  # tensor-parallel folders only
    rows: Optional[int] = None  # step rows of an inc or score graph, fewer than batch_size (lite_runtime/folder.py)

    def to_dict(self) -> Dict[str, Any]:
        entry: Dict[str, Any] = {"role": self.role, "file": self.file, "variables": self.variables,
                                 "tokens": self.tokens}
        if self.rows is not None:
            entry["rows"] = self.rows
        if self.rank is not None:
            entry["rank"] = self.rank
        entry["inputs"] = [t.to_dict() for t in self.inputs]
        entry["outputs"] = [t.to_dict() for t in self.outputs]
        return entry


@dataclass(frozen=True)
class InferSection:
    """The yaml's `infer` section: everything the runtime reads to run the folder (model_dirs/README.md)."""

    model_name: str  # the family: InputOfInfer.MAPPING key
    seq_length: int
    batch_size: int
    dtype: str  # the weights' (the matrices' on CPU folders with 16-bit weights)
    compute_dtype: str
    device: str  # the export's device profile
    soc: str
    vocab_size: int
    eos_token_id: List[int]
    pad_token_id: int
    prefill_model_path: str  # rank 0's seq_length prefill graph
    increment_model_path: str
    prefill_buckets: List[int]  # the token counts of all prefill graphs
    tp_size: int
    cpu_kernels: bool
    ge_config_path: str = GE_CONFIG
    graph: str = "plain"  # the graph form: plain, or fused (Ascend's fused operators; CPU stand-ins on the ms backend)
    chunk_sizes: List[int] = dataclasses.field(default_factory=list)  # of the chunk graphs (the server's prefill pieces)
    score_sizes: List[int] = dataclasses.field(default_factory=list)  # of the score graphs (every position's logits)
    # the linear layers' weight-only quantization {bits, group_size, symmetric, source} (export/network/quantize.py), or None
    quantization: Optional[Dict[str, Any]] = None
    # the paged KV cache the graphs read and write (lite_runtime/folder.py KVCacheSpec.to_dict); the pool's size is
    # the runtime's choice at load
    kv_cache: Optional[Dict[str, Any]] = None


def write_yaml(folder: str, name: str, model: Dict[str, Any], export: Dict[str, Any], infer: InferSection) -> str:
    import yaml

    path = os.path.join(folder, f"{name}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f"# {name}: written by `python -m export`; the runtime reads the `infer` section.\n")
        yaml.safe_dump({"model": model, "export": export, "infer": dataclasses.asdict(infer)}, fh, sort_keys=False)
    return path


def file_table(folder: str, known: Optional[Dict[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """sha256 and size of every file below `folder` (relative, '/'-separated), the manifest excluded.

    `known` gives the sha256 of files hashed as they were written (the weights files), by relative path.
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


def write_manifest(folder: str, name: str, graphs: List[GraphEntry], known: Optional[Dict[str, str]] = None,
                   exported_with: Optional[Dict[str, str]] = None, family: Optional[str] = None,
                   quantization: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """`family` is the model family (export/families), the runtime's InputOfInfer key; `golden` is set when the
    folder holds golden.json; `quantization` (export/checkpoints/methods.py QuantMethod) makes it a format version 2 folder."""
    version = QUANTIZED_FORMAT_VERSION if quantization else FORMAT_VERSION
    manifest = {"format": FORMAT, "format_version": version, "name": name, "yaml": f"{name}.yaml",
                **({"family": family} if family else {}),
                **({"quantization": quantization} if quantization else {}),
                "ge_config": GE_CONFIG, "exported_with": exported_with or {}, "graphs": [g.to_dict() for g in graphs],
                "files": file_table(folder, known)}
    if GOLDEN in manifest["files"]:
        manifest["golden"] = GOLDEN
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    return manifest
