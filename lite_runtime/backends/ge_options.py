"""GE options: the ini as MindSpore Lite reads it, the options the graphs need, and GE's compile cache as data.

Facts from MindSpore Lite's source (mindspore-lite 2.7-2.10: src/common/config_file.cc,
src/extendrt/delegate/ascend_ge/ge_graph_executor.cc, python/api/model.py) and CANN's GE option
reference; nothing here has run on a device.

Compile cache. GE caches a compiled graph when the session has `ge.graph_compiler_cache_dir` (an
existing folder) and the graph a `ge.graph_key`. A key already in the folder is loaded without
comparing the graph, and Lite's automatic key is `<rank>_<load order>_<graph name>`, with no hash of the
model: a re-exported folder would silently run the old compiled graph. Caches are not promised across
CANN versions either. So no profile ini sets a cache folder; the runtime passes one per folder
content instead (`cache_plan`), through build_from_file's config_dict, which Lite applies over the
ini: `<root>/<name>-<hash of manifest.json, the Lite and CANN versions>`, and a key per graph.
Session options stay identical across the ModelGroup's graphs, as GE requires.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Optional

from lite_runtime.errors import InferError

REQUIRED_GE_OPTIONS = {"ascend_context": {"provider": "ge"},
                       "ge_session_options": {"ge.exec.precision_mode": "must_keep_origin_dtype"}}
DEFAULT_CACHE_ROOT = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                                  "mslite-llm", "ge")
OFF = ("", "none", "off")


def parse_lite_ini(path: str) -> Dict[str, Dict[str, str]]:
    """The ini as MindSpore Lite's own config parser reads it (src/common/config_file.cc), stricter where it is lax.

    Lite trims each line; a line whose first character is then `#` is a comment. `;` is NOT a
    comment: `; a=b` inside a section becomes option `; a` and is passed to GE. `[name]` opens a
    section, and `key=value` splits at the first `=`, both sides trimmed. Lite silently drops lines
    without `=` and options before any section; it keeps the first of repeated options; it reads the
    file in the locale's encoding (a UTF-8 BOM hides the first section). Its Python side treats any
    line that mentions `variable_weights_file`, even a comment, as a LoRA weight list. Here each of
    those is an error naming the line, so a shipped file means exactly what it says.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise InferError(f"{path}: unreadable GE config ({exc}); re-export the folder") from None
    sections: Dict[str, Dict[str, str]] = {}
    current = None
    for number, line in enumerate(raw.split(b"\n"), 1):
        if any(byte > 127 for byte in line):
            raise InferError(f"{path}:{number}: non-ASCII text; Lite reads the file in the locale's encoding, keep it "
                             "ASCII")
        text = line.decode("ascii").strip()
        if "variable_weights_file" in text:
            raise InferError(f"{path}:{number}: mentions variable_weights_file, which makes Lite parse a LoRA weight "
                             "list even in a comment; remove the line")
        if not text or text.startswith("#"):
            continue
        if text.startswith("[") and text.endswith("]") and text[1:-1].strip():
            current = text[1:-1].strip()
            sections.setdefault(current, {})
            continue
        key, eq, value = text.partition("=")
        if not eq or not key.strip() or current is None or key.strip().startswith(";"):
            raise InferError(f"{path}:{number}: {text!r} is neither a '#' comment, a [section] nor a key=value line "
                             f"inside a section (Lite passes such lines on as options); fix or remove it")
        if key.strip() in sections[current]:
            raise InferError(f"{path}:{number}: option {key.strip()} repeated in [{current}]; keep one")
        sections[current][key.strip()] = value.strip()
    return sections


def read_ge_config(path: str) -> Dict[str, Dict[str, str]]:
    """The ini as {section: {option: value}} (parsed as Lite parses it), checked for what the graphs rely on."""
    sections = parse_lite_ini(path)
    for section, options in REQUIRED_GE_OPTIONS.items():
        for key, value in options.items():
            if sections.get(section, {}).get(key) != value:
                raise InferError(f"{path}: [{section}] {key}={value} is required (found "
                                 f"{sections.get(section, {}).get(key)!r}); use an ini from ge_configs/")
    return sections


def cache_plan(config, lite_version: Optional[str], cann: Optional[Dict[str, str]]) -> Optional[Dict[str, Any]]:
    """GE compile-cache options for this folder on this Lite and CANN, or None when off.

    Off when `config.ge_cache_dir` is "none" (or ""), and for graph files loaded without a folder:
    their content has no manifest to fingerprint.
    """
    root = DEFAULT_CACHE_ROOT if config.ge_cache_dir is None else config.ge_cache_dir
    if str(root).lower() in OFF or config.folder is None:
        return None
    digest = hashlib.sha256()
    with open(os.path.join(config.folder.path, "manifest.json"), "rb") as fh:
        digest.update(fh.read())  # every file's sha256: a re-export changes it
    digest.update(f"|lite={lite_version}|cann={(cann or {}).get('lines', '')}".encode())
    digest.update(f"|blocks={config.num_blocks}".encode())  # the KV pool's size is in the graphs GE compiles
    folder = os.path.join(os.path.abspath(os.path.expanduser(root)), f"{config.folder.name}-{digest.hexdigest()[:16]}")
    return {"dir": folder, "session_options": {"ge.graph_compiler_cache_dir": folder},
            "graph_keys": {key: f"{config.folder.name}_{key}_rank{int(config.rank_id)}" for key in config.graph_paths()}}
