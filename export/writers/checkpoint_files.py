"""What export takes from the checkpoint into a folder besides the weights: tokenizer files, special token ids, and
what wrote it. The folder's names and files are lite_runtime's contract (lite_runtime/folder.py, manifest.py)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List

from export.errors import ExportError

# Files a HF checkpoint may carry that the runtime's tokenizer (and generation defaults) need.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
_TOKENIZER_CORE = ("tokenizer.json", "vocab.json", "tokenizer.model")


def copy_tokenizer(checkpoint: str, folder: str) -> List[str]:
    """The checkpoint's tokenizer files (and generation_config.json) into `folder`; a GGUF's written from its
    metadata. Returns their names."""
    from export.checkpoints.gguf import is_gguf, write_tokenizer_files

    if is_gguf(checkpoint):
        return write_tokenizer_files(checkpoint, folder)
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(checkpoint, f))]
    if not any(f in present for f in _TOKENIZER_CORE):
        raise ExportError(f"{checkpoint}: no tokenizer files (tokenizer.json, vocab.json + merges.txt or "
                          "tokenizer.model); copy the model's tokenizer into the checkpoint folder")
    for f in present:
        shutil.copyfile(os.path.join(checkpoint, f), os.path.join(folder, f))
    return present


def special_token_ids(checkpoint: str, model_eos) -> Dict[str, Any]:
    """eos and pad ids: generation_config.json first, then config.json (as HF generate does); a GGUF's metadata."""
    from export.checkpoints.gguf import generation_config, is_gguf
    from export.checkpoints.gguf_file import open_gguf_file

    gen: Dict[str, Any] = {}
    path = os.path.join(checkpoint, "generation_config.json")
    if is_gguf(checkpoint):
        gen = generation_config(open_gguf_file(checkpoint))
    elif os.path.isfile(path):
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


def exporter_versions(mindspore_version: str) -> Dict[str, str]:
    """What wrote the folder: MindSpore (the MindIR's producer; Lite must not be older) and this project."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        ours = version("mslite-llm")
    except PackageNotFoundError:  # run from a checkout that was not pip-installed
        ours = "unknown"
    return {"mindspore": mindspore_version, "mslite_llm": ours}
