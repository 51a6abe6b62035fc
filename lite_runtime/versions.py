"""Versions: of this package, of the engine and CANN (for reports), and whether a Lite can load a folder's graphs.

A MindIR written by MindSpore x.y is only promised to load in a MindSpore Lite of the same x.y
or newer (Lite's MindIR loader refuses a newer mind_ir_version, and nothing promises that an older
Lite understands newer graphs). `lite_decision` turns the two versions into a plain decision that
the `mslite` backend acts on and the tests check as data.
"""
from __future__ import annotations

import os
import platform
import re
from typing import Any, Dict, Optional, Tuple

from lite_runtime.errors import InferError

CANN_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("mslite-llm")
    except PackageNotFoundError:
        return "unknown"


def major_minor(text: str) -> Optional[Tuple[int, int]]:
    """(x, y) of a version string such as 2.10.0, 2.4.1rc1 or 2.7.0.post1; None when it has none."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(text or ""))
    return (int(match.group(1)), int(match.group(2))) if match else None


def lite_decision(exported: Optional[str], lite: Optional[str]) -> Tuple[str, str]:
    """("ok" | "warn" | "refuse", message) for loading graphs written by MindSpore `exported` in Lite `lite`."""
    want, have = major_minor(exported or ""), major_minor(lite or "")
    if want is None:
        return "warn", ("the folder does not record which MindSpore exported it (exported before mslite-llm "
                        "recorded it); if the graphs fail to load, re-export with the mindspore that matches "
                        f"mindspore_lite {lite or '(unknown version)'}")
    if have is None:
        return "warn", (f"mindspore_lite does not report its version; the folder was exported with MindSpore "
                        f"{exported}: use mindspore_lite {want[0]}.{want[1]} or newer")
    if have < want:
        return "refuse", (f"mindspore_lite {lite} is older than MindSpore {exported}, which exported this folder: "
                          f"an older Lite may not load newer MindIR graphs. Re-export with "
                          f"pip install mindspore=={have[0]}.{have[1]}.* (the MindSpore that matches this Lite), "
                          f"or install mindspore_lite {want[0]}.{want[1]}")
    if have > want:
        return "warn", (f"mindspore_lite {lite} is newer than MindSpore {exported}, which exported this folder; "
                        "newer Lite releases load older graphs, but run python -m lite_runtime.check on this folder "
                        "once to be sure")
    return "ok", f"mindspore_lite {lite} matches MindSpore {exported}, which exported this folder"


def check_lite(exported: Optional[str], lite: Optional[str], log) -> None:
    """Act on lite_decision: raise InferError on refuse, log a warning on warn."""
    action, message = lite_decision(exported, lite)
    if action == "refuse":
        raise InferError(message)
    if action == "warn":
        log.warning("%s", message)


def cann_version() -> Dict[str, str]:
    """Best effort: the CANN toolkit's version file, as set_env.sh points at it; {} when none is found."""
    homes = [os.environ[k] for k in CANN_HOMES if os.environ.get(k)] + [CANN_DEFAULT]
    for home in homes:
        for rel in ("version.cfg", "compiler/version.info", "runtime/version.info"):
            path = os.path.join(home, rel)
            if os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8", errors="replace") as fh:
                        lines = [line.strip() for line in fh if "version" in line.lower()][:3]
                except OSError:
                    continue
                return {"file": path, "lines": "; ".join(lines)}
    return {}


def environment(backend: str) -> Dict[str, Any]:
    """What a report should carry about this machine, for the person who reads it elsewhere."""
    import numpy

    info: Dict[str, Any] = {"mslite_llm": package_version(), "python": platform.python_version(),
                            "platform": platform.platform(), "numpy": numpy.__version__}
    if backend == "ms":
        import mindspore

        info["mindspore"] = mindspore.__version__
    elif backend == "mslite":
        import mindspore_lite

        info["mindspore_lite"] = getattr(mindspore_lite, "__version__", "unknown")
        info["cann"] = cann_version()
    return info
