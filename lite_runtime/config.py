"""InferConfig: what a loaded model needs, from a model folder or from two graph files."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from lite_runtime.errors import InferError
from lite_runtime.folder import ModelFolder, graph_key, graph_role, graph_rows, graph_tokens, load_folder

MODEL_TYPES = ("mindir",)
TARGETS = ("Ascend", "CPU")
WARM_UP = ("auto", "smallest", "all", "none")


@dataclass
class InferConfig:
    """Names follow MindFormers' InferConfig; `backend`, `model_dir` and the token ids are ours.

    Built with `InferConfig.from_folder(path)` in the usual case. Given graph paths alone,
    `infer_seq_length` and `batch_size` must be passed, and are checked against the graphs on load.
    """

    prefill_model_path: str = ""
    increment_model_path: str = ""
    model_type: str = "mindir"
    model_name: str = "qwen2"  # the InputOfInfer.MAPPING key
    infer_seq_length: Optional[int] = None
    batch_size: Optional[int] = None
    target: str = "Ascend"
    device_id: int = 0
    rank_id: int = 0
    ge_config_path: str = ""
    backend: str = "auto"
    model_dir: Optional[str] = None
    tokenizer_path: Optional[str] = None
    eos_token_id: List[int] = field(default_factory=list)
    pad_token_id: int = 0
    vocab_size: Optional[int] = None
    dtype: str = "float32"  # the weights' dtype (the matrices' on CPU folders with 16-bit weights)
    compute_dtype: str = ""  # activations and KV cache; "" means `dtype` (every folder but CPU 16-bit-weight ones)
    device: str = ""  # the export's device profile, when known
    # sha256 of every file against the manifest: True hashes files changed since they last matched on this
    # machine (lite_runtime/verified.py), "always" hashes every file, False checks sizes only
    verify_checksums: Any = True
    cpu_threads: Optional[int] = None  # ms backend: CPU kernel threads (default: the cores this process may use)
    # graphs run once at load so a request does not pay their compilation: "smallest" (the inc graph and
    # the smallest prefill graph, or the largest chunk graph where a prompt alone goes in pieces: ModelRunner.prefill;
    # longer buckets compile on the first prompt that needs them), "all", "none";
    # "auto": "all" on mslite (GE compiles for minutes per graph: never inside a request), "smallest" on ms
    warm_up: str = "auto"
    # load the folder's chunk graphs (a prompt's piece at an offset beside the running rows' step: the engine's
    # continuous batching, chunked prefill and prefix caching, lite_runtime/engine/scheduler.py; pipeline().generate
    # runs several prompts through it). None: on for ms (a graph compiles on first use), off for mslite (GE compiles
    # every loaded graph for minutes: pass True to have them)
    chunk_graphs: Optional[bool] = None
    # load the folder's score graphs (a chunk graph returning every position's logits: speculative decoding, prompt
    # logprobs, perplexity). On by default: the ms backend compiles them on first use; on Atlas GE compiles each at
    # load (one graph of 256 tokens by default), so pass False where none of the three is wanted
    score_graphs: bool = True
    # load the prefill graphs (pipeline(), check); the server runs only the chunk and inc graphs, so on Atlas GE does
    # not compile the prefill graphs for it (minutes each)
    prefill_graphs: bool = True
    # mslite backend, tensor-parallel folders (python -m export --tp_size): the HCCL rank table GE reads; None: the
    # RANK_TABLE_FILE environment variable, else [ascend_context] rank_table_file of the ini
    rank_table_file: Optional[str] = None
    # mslite backend: root of GE's compile cache, one folder per folder content, Lite and CANN version
    # (lite_runtime/backends/ge_options.py); None: ~/.cache/mslite-llm/ge, "none": no cache
    ge_cache_dir: Optional[str] = None
    # the paged KV cache's pool (lite_runtime/engine/kv_pool.py): its blocks (the null block included), or its size in GiB;
    # neither: sized from free memory at load. Fixed for the folder's life in this process
    num_blocks: Optional[int] = None
    kv_cache_memory: Optional[float] = None
    # "float32": run a folder whose KV cache is bfloat16 (a CPU folder with bfloat16 weights, infer.kv_cache) with
    # float32 caches instead (ms backend; the CPU kernels take either): check's replays with x exact, held to float32's
    # arithmetic (lite_runtime/check.py). None: the folder's
    kv_cache_dtype: Optional[str] = None
    folder: Optional[ModelFolder] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_folder(cls, path: str, **overrides: Any) -> "InferConfig":
        """Everything from the folder's manifest and yaml; `overrides` are InferConfig fields."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InferError(f"unknown InferConfig field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(f.name for f in dataclasses.fields(cls) if f.name != 'folder')}")
        folder = load_folder(path, verify=overrides.get("verify_checksums", True))
        infer = folder.infer
        full = folder.graphs[graph_key("prefill", folder.seq_length)]
        eos = infer.get("eos_token_id") or []
        values: Dict[str, Any] = dict(
            prefill_model_path=full.path, increment_model_path=folder.graphs["inc"].path,
            model_name=infer["model_name"], infer_seq_length=folder.seq_length,
            batch_size=folder.batch_size, target="CPU" if infer.get("device") == "cpu" else "Ascend",
            ge_config_path=folder.ge_config_path, model_dir=folder.path, tokenizer_path=folder.path,
            eos_token_id=[int(e) for e in (eos if isinstance(eos, list) else [eos])],
            pad_token_id=int(infer.get("pad_token_id", 0)), vocab_size=int(infer["vocab_size"]),
            dtype=infer.get("dtype", "float32"), compute_dtype=infer.get("compute_dtype", ""),
            device=infer.get("device", ""), folder=folder)
        for key in ("infer_seq_length", "batch_size"):
            if key in overrides and overrides[key] not in (None, values[key]):
                raise InferError(f"{key}={overrides[key]} disagrees with {folder.yaml_path} ({values[key]}): "
                                 "shapes are fixed at export; re-export with the size you need")
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        config.validate()
        return config

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of the folder (python -m export --tp_size); 1 without a folder."""
        return self.folder.tp_size if self.folder is not None else 1

    def graph_paths(self) -> Dict[str, str]:
        """Every graph to load, by key (`prefill_<tokens>`, `inc`, `inc_<rows>`, `chunk_<tokens>`): the prefill graphs
        longest first (unless prefill_graphs is off), inc, the inc graphs of fewer rows, then (with chunk_graphs) the chunk graphs, then the score graphs (every
        position's logits: speculative decoding, prompt logprobs, perplexity), which the ms backend compiles only
        when first used."""
        if self.folder is not None:
            paths = self.folder.graph_paths(int(self.rank_id) if self.tp_size > 1 else 0)
        else:
            paths = {graph_key("prefill", int(self.infer_seq_length)): self.prefill_model_path,
                     "inc": self.increment_model_path}

        def longest_first(role):
            return sorted((k for k in paths if graph_role(k) == role), key=lambda k: -graph_tokens(k))

        chunks = longest_first("chunk") if self.chunk_graphs else []
        scores = longest_first("score")[::-1] if self.score_graphs else []
        prefills = longest_first("prefill") if self.prefill_graphs else []
        # the inc graphs of fewer rows (a step of few sequences computes theirs only), fewest first
        steps = sorted((k for k in paths if graph_role(k) == "inc" and k != "inc"),
                       key=lambda k: graph_rows(k, int(self.batch_size or 0)))
        return {k: paths[k] for k in prefills + ["inc"] + steps + chunks + scores}

    def validate(self) -> None:
        if not self.compute_dtype:
            self.compute_dtype = self.dtype
        if self.model_type not in MODEL_TYPES:
            raise InferError(f"model_type {self.model_type!r} is not supported; use one of {', '.join(MODEL_TYPES)}")
        if self.target not in TARGETS:
            raise InferError(f"target {self.target!r} is not one of {', '.join(TARGETS)}")
        for key in ("prefill_model_path", "increment_model_path"):
            path = getattr(self, key)
            if not path:
                raise InferError(f"{key} is empty; pass a model folder or both graph files")
            if not os.path.isfile(path):
                raise InferError(f"{key} {path}: not found")
        if self.ge_config_path and not os.path.isfile(self.ge_config_path):
            raise InferError(f"ge_config_path {self.ge_config_path}: not found")
        if self.infer_seq_length is None or self.batch_size is None:
            raise InferError("infer_seq_length and batch_size are needed when loading graph files without a "
                             "model folder; pass the values the graphs were exported with")
        if self.kv_cache_dtype not in (None, "float32"):
            raise InferError(f"kv_cache_dtype {self.kv_cache_dtype!r}: only float32 (or None, the folder's) is known")
        if self.warm_up not in WARM_UP:
            raise InferError(f"warm_up {self.warm_up!r} is not one of {', '.join(WARM_UP)}")
        if self.device_id < 0 or self.rank_id < 0:
            raise InferError(f"device_id ({self.device_id}) and rank_id ({self.rank_id}) must be >= 0")
