"""Files whose sha256 matched their manifest on this machine, by path and stat: loading the same unchanged copy again
does not hash it again (2 GB of weights take 1.5 s; a 7B folder's 14 GB, 10 s).

Any write changes a file's ctime, which no user call can set back, so a changed, truncated or replaced copy is
hashed again. The record is best effort: a read-only home only means hashing again next time.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

VERIFIED_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                              "mslite-llm", "verified.json")


def stat_key(path: str) -> List[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def read_records() -> Dict[str, Any]:
    try:
        with open(VERIFIED_CACHE, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def record_verified(files: Dict[str, str]) -> None:
    """Note {path: sha256} as verified now (export calls this for the files it just hashed and wrote)."""
    records = read_records()
    for path, sha in files.items():
        try:
            records[os.path.realpath(path)] = [sha] + stat_key(path)
        except OSError:
            pass
    write_records(records)


def write_records(records: Dict[str, Any]) -> None:
    """Best effort, atomic: a read-only home only means hashing again next time. Gone files are dropped."""
    records = {p: r for p, r in records.items() if os.path.exists(p)}
    try:
        os.makedirs(os.path.dirname(VERIFIED_CACHE), exist_ok=True)
        tmp = f"{VERIFIED_CACHE}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(records, fh)
        os.replace(tmp, VERIFIED_CACHE)
    except OSError:
        pass
