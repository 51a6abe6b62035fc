"""Weights stored once on disk: every graph of a folder points at one external data file.

mindspore.export embeds each graph's parameters (small nets) or writes them to a
`<prefix>_variables/` folder of its own (above 1 GB), so a folder of N graphs holds the weights
N times. This rewrites the graphs after export so that each parameter's bytes are written once,
to `<name>_variables/data_0`, and every graph's proto refers to them by (location, offset,
length) — MindIR's own external-data fields, read by mindspore.load and by MindSpore Lite.

The data file keeps MindSpore's layout: a 64-byte header (byte 0 = 1 on little-endian machines),
then each tensor aligned to 64 bytes.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from export.errors import ExportError

HEADER = 64
ALIGN = 64


def data_location(name: str) -> str:
    return f"{name}_variables/data_0"


def _param_bytes(folder: str, param) -> bytes:
    if param.raw_data:
        return bytes(param.raw_data)
    ext = param.external_data
    if not ext.location:
        raise ExportError(f"{folder}: parameter {param.name} has neither data nor an external location")
    with open(os.path.join(folder, ext.location), "rb") as fh:
        fh.seek(ext.offset)
        data = fh.read(ext.length)
    if len(data) != ext.length:
        raise ExportError(f"{os.path.join(folder, ext.location)}: shorter than parameter {param.name} needs")
    return data


def share_weights(folder: str, name: str, graph_files: List[str],
                  edit: Optional[Callable[[Any], Any]] = None) -> Tuple[str, str]:
    """Rewrite `graph_files` (in `folder`) to share one data file. Returns (its path, its sha256).

    The file's sha256 is computed as it is written, so the manifest need not read it again.
    `edit`, if given, is applied to each graph's parsed proto before it is written back, so a
    further rewrite costs no extra parse and write.
    """
    from mindspore.train import mind_ir_pb2

    location = data_location(name)
    data_path = os.path.join(folder, location)
    staging = data_path + ".partial"
    os.makedirs(os.path.dirname(data_path), exist_ok=True)
    written: Dict[str, Tuple[int, int, str]] = {}  # parameter -> (offset, length, sha256)
    old_locations = set()
    models = []
    file_digest = hashlib.sha256()

    def write(out, data: bytes) -> None:
        out.write(data)
        file_digest.update(data)

    with open(staging, "wb") as out:
        write(out, (1 if sys.byteorder == "little" else 0).to_bytes(1, "little") + bytes(HEADER - 1))
        offset = HEADER
        for graph in graph_files:
            model = mind_ir_pb2.ModelProto()
            with open(os.path.join(folder, graph), "rb") as fh:
                model.ParseFromString(fh.read())
            for param in model.graph.parameter:
                key = param.name.rsplit(":", 1)[-1]
                data = _param_bytes(folder, param)
                digest = hashlib.sha256(data).hexdigest()
                if key in written:
                    if written[key][1:] != (len(data), digest):
                        raise ExportError(f"{graph}: parameter {key} differs from the first graph's; "
                                          "the graphs cannot share weights")
                else:
                    write(out, data + bytes(-len(data) % ALIGN))
                    written[key] = (offset, len(data), digest)
                    offset += len(data) + (-len(data) % ALIGN)
                if param.external_data.location:
                    old_locations.add(param.external_data.location.split("/")[0])
                param.ClearField("raw_data")
                param.external_data.location = location
                param.external_data.offset, param.external_data.length = written[key][0], written[key][1]
            models.append((graph, model))
    for old in old_locations:  # MindSpore's per-graph variables folders
        shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    os.replace(staging, data_path)
    for graph, model in models:
        if edit is not None:
            edit(model)
        path = os.path.join(folder, graph)
        os.chmod(path, 0o644)  # MindSpore leaves its files read-only
        with open(path, "wb") as fh:
            fh.write(model.SerializeToString())
    return data_path, file_digest.hexdigest()
