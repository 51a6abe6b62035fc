"""The model folder contract (model_dirs/README.md): its names and layout, and reading a folder with every check done
before anything runs. `python -m export` writes through this module and lite_runtime/manifest.py; nothing else
defines a folder's names."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from lite_runtime import verified
from lite_runtime.errors import ModelFolderError

FORMAT = "mslite-llm-model-folder"
# the paged KV cache (2026-11-28): every graph writes and reads the cache through slots and block tables, and the
# cache is not in the weights file (the runtime sizes the pool at load: infer.kv_cache). A float folder is version 3,
# a quantized one (int8/int4 linear layers, the manifest's `quantization`) version 4, so a runtime that predates
# either refuses it by its version
FORMAT_VERSION = 3
QUANTIZED_FORMAT_VERSION = 4
QUANT_BITS = (8, 4)
SUPPORTED_VERSIONS = (3, 4)
BEFORE_PAGED = (1, 2)  # folders whose caches were rows in the weights file: refused with "re-export"
# a layer's KV cache Parameters (export/network/layers.py Attention): no data in the folder, the runtime's pool
KV_CACHE_SUFFIXES = (".key_cache", ".value_cache")


def is_kv_cache(name: str) -> bool:
    return name.endswith(KV_CACHE_SUFFIXES)
MANIFEST = "manifest.json"
GE_CONFIG = "config.ini"
GOLDEN = "golden.json"
# The weights file keeps MindSpore's external-data layout, which mindspore.load and MindSpore Lite read: a header
# (byte 0 is 1 on little-endian machines), then each tensor at an offset that is a multiple of DATA_ALIGN.
DATA_HEADER = 64
DATA_ALIGN = 64
# every folder has prefill and inc graphs, and chunk and score graphs unless tensor-parallel
ROLES = ("prefill", "inc", "chunk", "score")
REQUIRED_ROLES = ("prefill", "inc")
ROWS_ROLES = ("inc", "score")  # graphs that may have fewer step rows than batch_size (the manifest's `rows`)


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache a folder's graphs read and write (the yaml's infer.kv_cache; docs/architecture.md, "The KV
    cache: a pool of blocks"): per layer two caches of `block_size`-position blocks, `layout` "blocks_heads" ([NB,
    KH, BS, D]: the CPU kernels') or "blocks_tokens" ([NB, BS, KH, D]: ReshapeAndCache's and PagedAttention's),
    `kv_heads` per rank, a sequence of at most `max_blocks` blocks (its block table's width). The pool's size, NB,
    is the runtime's choice at load; block 0 is the null block no sequence is given."""

    block_size: int
    max_blocks: int
    layout: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    LAYOUTS = ("blocks_heads", "blocks_tokens")

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over every layer's key and value caches (one rank's)."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def shape(self, blocks: int) -> Tuple[int, ...]:
        if self.layout == "blocks_heads":
            return (blocks, self.kv_heads, self.block_size, self.head_dim)
        return (blocks, self.block_size, self.kv_heads, self.head_dim)

    def to_dict(self) -> Dict[str, Any]:
        return {"block_size": self.block_size, "max_blocks": self.max_blocks, "layout": self.layout,
                "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "KVCacheSpec":
        try:
            spec = cls(int(raw["block_size"]), int(raw["max_blocks"]), str(raw["layout"]), int(raw["layers"]),
                       int(raw["kv_heads"]), int(raw["head_dim"]), str(raw["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFolderError(f"{where}: infer.kv_cache is malformed ({type(exc).__name__}: {exc}); re-export "
                                   "the folder") from None
        if spec.layout not in cls.LAYOUTS or spec.dtype not in DTYPE_BYTES or min(
                spec.block_size, spec.max_blocks, spec.layers, spec.kv_heads, spec.head_dim) < 1:
            raise ModelFolderError(f"{where}: infer.kv_cache {raw!r} is not one this runtime runs; re-export the "
                                   "folder")
        return spec


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "TensorSpec":
        return cls(raw["name"], raw["dtype"], tuple(int(d) for d in raw["shape"]))

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphSpec:
    role: str
    path: str  # absolute
    tokens: int
    inputs: tuple  # of TensorSpec, in graph order
    outputs: tuple
    # step rows: an inc graph of fewer than batch_size (graph_key), a score graph's (export/writers/graphs.py SCORE_STEP_ROWS);
    # None: batch_size
    rows: Optional[int] = None


@dataclass(frozen=True)
class ModelFolder:
    path: str
    name: str
    yaml_path: str
    infer: Dict[str, Any]  # the yaml's `infer` section
    model: Dict[str, Any]  # the yaml's `model` section
    graphs: Dict[str, GraphSpec]  # rank 0's (the only rank of a folder without tensor parallelism)
    ge_config_path: str
    manifest: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    ranks: Dict[int, Dict[str, GraphSpec]] = field(default_factory=dict, repr=False, compare=False)  # every rank's

    @property
    def exported_with(self) -> Dict[str, str]:
        """Versions that wrote the folder ({"mindspore": ..., "mslite_llm": ...}); empty for older folders."""
        return dict(self.manifest.get("exported_with") or {})

    @property
    def seq_length(self) -> int:
        return int(self.infer["seq_length"])

    @property
    def batch_size(self) -> int:
        return int(self.infer["batch_size"])

    @property
    def graph_form(self) -> str:
        """plain, or fused: Ascend's fused operators (python -m export --graph); older folders are plain."""
        return str(self.infer.get("graph", "plain"))

    @property
    def quantization(self) -> Optional[Dict[str, Any]]:
        """The linear layers' method ({bits, group_size, symmetric, source}: export/network/quantize.py), None: float."""
        q = self.manifest.get("quantization")
        return dict(q) if q else None

    @property
    def kv_cache(self) -> KVCacheSpec:
        return KVCacheSpec.from_dict(self.infer.get("kv_cache"), self.yaml_path)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks: each has its own graphs and weights file (python -m export --tp_size)."""
        return len(self.ranks) or 1

    def graph_paths(self, rank: int = 0) -> Dict[str, str]:
        if not 0 <= rank < self.tp_size:
            raise ModelFolderError(f"{self.path}: rank {rank}, but the folder has {self.tp_size} rank(s)' graphs")
        graphs = self.ranks[rank] if self.ranks else self.graphs
        return {key: spec.path for key, spec in graphs.items()}


def quantization_label(quantization: Dict[str, Any]) -> str:
    """A folder's `quantization` in words, as python -m export and the runtime name it: `int4 (groups of 128, with
    offsets, from rtn)`."""
    group = int(quantization["group_size"])
    source = quantization.get("source")
    return (f"int{quantization['bits']} ({'per channel' if group == 0 else f'groups of {group}'}, "
            f"{'symmetric' if quantization['symmetric'] else 'with offsets'}{f', from {source}' if source else ''})")


def rank_name(name: str, rank: int, tp_size: int) -> str:
    """The file stem of one rank's graphs and weights: `<name>` for a single-card folder, `<name>_rank<r>` under
    tensor parallelism (python -m export --tp_size)."""
    return f"{name}_rank{rank}" if tp_size > 1 else name


def graph_file(name: str, role: str, tokens: int, seq_length: int, rows: Optional[int] = None) -> str:
    """`<name>_prefill_graph.mindir` (the seq_length graph), `<name>_prefill_<tokens>_graph.mindir` (a bucket),
    `<name>_inc_graph.mindir` (and `<name>_inc_<rows>rows_graph.mindir`, an inc graph of fewer rows); the chunk graph
    likewise `<name>_chunk[_<tokens>]_graph.mindir`."""
    if role == "inc" and rows is not None:
        return f"{name}_inc_{rows}rows_graph.mindir"
    prefix = f"{name}_{role}" if role == "inc" or tokens == seq_length else f"{name}_{role}_{tokens}"
    return prefix + "_graph.mindir"


def data_location(name: str) -> str:
    """The weights file every graph of `name` (a rank_name) refers to, relative to the folder."""
    return f"{name}_variables/data_0"


def graph_key(role: str, tokens: int, rows: Optional[int] = None) -> str:
    """`prefill_<tokens>` for each full graph (one per prompt-length bucket), `inc` for the incremental one (and
    `inc_<rows>` for an inc graph of fewer rows than batch_size: a decode step of few sequences computes only theirs,
    docs/architecture.md "Step graphs of fewer rows"), `chunk_<tokens>` for the chunk graph (one row's prompt piece
    at an offset: continuous batching), `score_<tokens>` for the score graph (the chunk graph returning every
    position of its piece)."""
    if role == "inc":
        return "inc" if rows is None else f"inc_{int(rows)}"
    return f"{role}_{tokens}"


def graph_role(key: str) -> str:
    """`prefill`, `inc`, `chunk` or `score` (the inverse of graph_key's role)."""
    return key.split("_", 1)[0]


def graph_tokens(key: str) -> int:
    """Tokens per row of the graph `key` (the inverse of graph_key): 1 for every inc graph."""
    return 1 if graph_role(key) == "inc" else int(key.split("_", 1)[1])


def graph_rows(key: str, batch_size: int) -> int:
    """Rows of the graph `key`: an `inc_<rows>` graph's, else the folder's batch_size."""
    return int(key.split("_", 1)[1]) if graph_role(key) == "inc" and "_" in key else int(batch_size)


# MindIR TensorProto data types -> the dtype names of TensorSpec (and of the manifest)
MINDIR_DTYPES = {"INT32": "int32", "INT64": "int64", "FLOAT": "float32", "FLOAT16": "float16",
                 "BFLOAT16": "bfloat16", "BOOL": "bool", "INT8": "int8", "UINT8": "uint8", "QINT4X2": "qint4x2"}


def mindir_specs(model) -> Tuple[Tuple[TensorSpec, ...], Tuple[TensorSpec, ...]]:
    """Input and output specs as a parsed MindIR ModelProto declares them (names without the graph prefix)."""
    from mindspore.train import mind_ir_pb2

    name_of = mind_ir_pb2.TensorProto.DataType.Name

    def spec(value, name: str) -> TensorSpec:
        t = value.tensor[0]
        return TensorSpec(name, MINDIR_DTYPES.get(name_of(t.data_type), name_of(t.data_type).lower()),
                          tuple(int(d) for d in t.dims))

    inputs = tuple(spec(v, v.name.rsplit(":", 1)[-1]) for v in model.graph.input)
    outputs = tuple(spec(v, "logits" if i == 0 else f"output_{i}") for i, v in enumerate(model.graph.output))
    return inputs, outputs


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_yaml(path: str) -> Dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as exc:
        raise ModelFolderError(f"{path}: unreadable yaml ({str(exc).splitlines()[0]}); re-export the folder") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("infer"), dict):
        raise ModelFolderError(f"{path}: no `infer` section; re-export the folder with python -m export")
    return doc


def load_folder(path: str, verify: Any = True) -> ModelFolder:
    """Check and describe a model folder.

    verify: True checks every file's sha256 against the manifest, hashing only files changed since they
    last matched on this machine (lite_runtime/verified.py); "always" hashes every file; False checks sizes only.
    """
    if verify not in (True, False, "always"):
        raise ModelFolderError(f"verify_checksums {verify!r} is not one of True, False, 'always'")
    verify = "always" if verify == "always" else bool(verify)
    if not os.path.isdir(path):
        raise ModelFolderError(f"{path}: not a folder; pass a model folder written by python -m export")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise ModelFolderError(f"{manifest_path}: missing; this is not a model folder written by python -m export")
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{manifest_path}: unreadable ({exc}); re-copy the folder") from None
    if manifest.get("format") == FORMAT and manifest.get("format_version") in BEFORE_PAGED:
        raise ModelFolderError(f"{manifest_path}: format version {manifest['format_version']} was exported before "
                               "the paged KV cache (its cache is rows in the weights file, which this runtime does "
                               "not run); re-export the folder with this version's python -m export")
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in SUPPORTED_VERSIONS:
        raise ModelFolderError(f"{manifest_path}: format {manifest.get('format')!r} version "
                               f"{manifest.get('format_version')!r} is not supported (this runtime reads "
                               f"{FORMAT} version {', '.join(map(str, SUPPORTED_VERSIONS))}); re-export the folder")
    _check_files(path, manifest["files"], verify)
    if manifest.get("golden") and manifest["golden"] not in manifest["files"]:
        raise ModelFolderError(f"{manifest_path}: golden references {manifest['golden']!r} are not among its files; "
                               "re-export the folder")
    yamls = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
    if yamls != [manifest["yaml"]]:
        raise ModelFolderError(f"{path}: expected exactly one yaml, {manifest['yaml']}, found "
                               f"{', '.join(yamls) or 'none'}; remove the others")
    _check_quantization(manifest_path, manifest)
    ranks = _ranks(path, manifest)
    yaml_path = os.path.join(path, manifest["yaml"])
    doc = _read_yaml(yaml_path)
    folder = ModelFolder(path=os.path.abspath(path), name=manifest["name"], yaml_path=yaml_path,
                         infer=doc["infer"], model=doc.get("model", {}), graphs=ranks[0],
                         ge_config_path=os.path.join(os.path.abspath(path), manifest["ge_config"]), manifest=manifest,
                         ranks=ranks)
    if int(doc["infer"].get("tp_size", 1)) != folder.tp_size:
        raise ModelFolderError(f"{yaml_path}: infer.tp_size {doc['infer'].get('tp_size', 1)} disagrees with the "
                               f"{folder.tp_size} rank(s) of {MANIFEST}; re-export the folder")
    _check_specs_against_yaml(folder)
    return folder


def _check_quantization(manifest_path: str, manifest: Dict[str, Any]) -> None:
    """A version-2 folder says how its layers are quantized, in a form this runtime runs; a version-1 one says
    nothing of it."""
    q = manifest.get("quantization")
    if manifest.get("format_version") == FORMAT_VERSION:
        if q:
            raise ModelFolderError(f"{manifest_path}: format version {FORMAT_VERSION} with a quantization section; "
                                   "re-export the folder")
        return
    if not isinstance(q, dict):
        raise ModelFolderError(f"{manifest_path}: format version {QUANTIZED_FORMAT_VERSION} without its quantization "
                               "section; re-export the folder")
    bits, group = q.get("bits"), q.get("group_size")
    if bits not in QUANT_BITS or not isinstance(group, int) or group < 0 or not isinstance(q.get("symmetric"), bool):
        raise ModelFolderError(f"{manifest_path}: quantization {q!r} is not one this runtime runs (int8 or int4, "
                               "per channel or in groups); re-export the folder with this version's export")


def _check_files(path: str, files: Dict[str, Dict[str, Any]], verify: Any) -> None:
    records = verified.read_records() if verify is True else {}
    hashed = False
    for rel, entry in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise ModelFolderError(f"{full}: missing (listed in {MANIFEST}); re-copy the folder")
        size = os.path.getsize(full)
        if size != entry["size"]:
            raise ModelFolderError(f"{full}: {size} bytes, {MANIFEST} says {entry['size']} (truncated or "
                                   "changed copy); re-copy the folder")
        if not verify:
            continue
        real, stat = os.path.realpath(full), verified.stat_key(full)
        if verify is True and records.get(real) == [entry["sha256"]] + stat:
            continue
        if sha256_file(full) != entry["sha256"]:
            raise ModelFolderError(f"{full}: sha256 differs from {MANIFEST} (corrupted copy); re-copy the folder")
        records[real] = [entry["sha256"]] + stat
        hashed = True
    if hashed and verify is True:
        verified.write_records(records)
    mindirs = sorted(os.path.relpath(os.path.join(r, f), path).replace(os.sep, "/")
                     for r, _, fs in os.walk(path) for f in fs if f.endswith(".mindir"))
    extra = [m for m in mindirs if m not in files]
    if extra:
        raise ModelFolderError(f"{os.path.join(path, extra[0])}: graph not listed in {MANIFEST}; remove it or "
                               "re-export the folder")


def _ranks(path: str, manifest: Dict[str, Any]) -> Dict[int, Dict[str, GraphSpec]]:
    """Each rank's graphs (one rank, 0, unless the folder is tensor parallel), all with the same keys."""
    where = os.path.join(path, MANIFEST)
    ranks = sorted({int(raw.get("rank", 0)) for raw in manifest["graphs"]})
    if ranks != list(range(len(ranks))):
        raise ModelFolderError(f"{where}: graphs of ranks {ranks}, expected 0..{len(ranks) - 1}; re-export the folder")
    out = {r: _graphs(path, {"graphs": [g for g in manifest["graphs"] if int(g.get("rank", 0)) == r]}) for r in ranks}
    if any(set(g) != set(out[0]) for g in out.values()):
        raise ModelFolderError(f"{where}: the ranks do not have the same graphs; re-export the folder")
    return out


def _graphs(path: str, manifest: Dict[str, Any]) -> Dict[str, GraphSpec]:
    graphs: Dict[str, GraphSpec] = {}
    where = os.path.join(path, MANIFEST)
    for raw in manifest["graphs"]:
        role, tokens = raw["role"], int(raw["tokens"])
        rows = raw.get("rows")
        if rows is not None and (role not in ROWS_ROLES or not isinstance(rows, int) or rows < 1):
            raise ModelFolderError(f"{where}: graph {raw.get('file')!r} has rows {rows!r}; only an inc or score "
                                   "graph has rows (a positive count); re-export the folder")
        key = graph_key(role, tokens, rows)
        if role not in ROLES or key in graphs:
            raise ModelFolderError(f"{where}: unexpected or repeated graph {raw.get('file')!r} ({role}, {tokens} "
                                   "tokens); re-export the folder")
        graphs[key] = GraphSpec(role=role, path=os.path.join(os.path.abspath(path), raw["file"]), tokens=tokens,
                                inputs=tuple(TensorSpec.from_dict(t) for t in raw["inputs"]),
                                outputs=tuple(TensorSpec.from_dict(t) for t in raw["outputs"]), rows=rows)
    missing = [r for r in REQUIRED_ROLES if not any(g.role == r for g in graphs.values())]
    if missing:
        raise ModelFolderError(f"{where}: no {' and no '.join(missing)} graph; re-export the folder")
    for spec in graphs.values():
        if not os.path.isfile(spec.path):
            raise ModelFolderError(f"{spec.path}: {spec.role} graph is missing; re-copy the folder")
    return graphs


def _check_specs_against_yaml(folder: ModelFolder) -> None:
    infer = folder.infer
    family = folder.manifest.get("family")  # written since the model families (folders before them: qwen2 only)
    if not infer.get("model_name"):
        raise ModelFolderError(f"{folder.yaml_path}: infer.model_name is missing, so the model family (the input "
                               "mapping) is unknown; re-export the folder")
    if family is not None and infer["model_name"] != family:
        raise ModelFolderError(f"{folder.yaml_path}: infer.model_name {infer['model_name']!r} disagrees with "
                               f"{MANIFEST} family {family!r}; re-export the folder")
    b, s, vocab = folder.batch_size, folder.seq_length, int(infer["vocab_size"])
    cache = folder.kv_cache
    if cache.max_blocks * cache.block_size < s:
        raise ModelFolderError(f"{folder.yaml_path}: infer.kv_cache's {cache.max_blocks} blocks of {cache.block_size} "
                               f"do not hold seq_length {s}; re-export the folder")
    for key, spec in folder.graphs.items():
        rows = b if spec.rows is None else spec.rows
        if rows > b:
            raise ModelFolderError(f"{folder.yaml_path}: the {spec.role} graph {os.path.basename(spec.path)} has "
                                   f"{rows} rows, more than batch_size {b}; re-export the folder")
        piece = spec.role in ("chunk", "score")
        n = 1 if piece else spec.tokens
        for t in spec.inputs:
            want = {"input_ids": (rows, n), "valid_length": (rows,), "block_tables": (rows, cache.max_blocks),
                    "slot_mapping": (rows * n,), "start": (1,), "chunk_length": (1,), "chunk_ids": (1, spec.tokens),
                    "chunk_block_table": (1, cache.max_blocks), "chunk_slot_mapping": (spec.tokens,)}.get(t.name)
            if want is not None and t.shape != want:
                raise ModelFolderError(f"{folder.yaml_path}: batch_size {b} / seq_length {s} disagree with the "
                                       f"{spec.role} graph's {t.name} shape {list(t.shape)} "
                                       f"({os.path.basename(spec.path)}); re-export the folder")
        extra = {"chunk": 1, "score": spec.tokens}.get(spec.role, 0)  # the piece's last position, or all of them
        if spec.outputs[0].shape != (rows + extra, vocab):
            raise ModelFolderError(f"{folder.yaml_path}: batch_size {b} / vocab_size {vocab} disagree with the "
                                   f"{spec.role} graph's logits shape {list(spec.outputs[0].shape)}; re-export")
    if graph_key("prefill", s) not in folder.graphs:
        raise ModelFolderError(f"{folder.yaml_path}: no prefill graph of seq_length {s} tokens in {MANIFEST}; "
                               "re-export the folder")
    for key, gkey in (("prefill_model_path", graph_key("prefill", s)), ("increment_model_path", "inc")):
        if os.path.basename(folder.graphs[gkey].path) != infer.get(key):
            raise ModelFolderError(f"{folder.yaml_path}: infer.{key} {infer.get(key)!r} is not the graph of "
                                   f"{MANIFEST} ({os.path.basename(folder.graphs[gkey].path)}); re-export")
