"""Reading a family's own config.json keys: shared by the family modules, which import nothing else of export/."""
from __future__ import annotations

from typing import Any, Dict

from export.errors import ExportError


def flag(raw: Dict[str, Any], name: str, default: bool, source: str) -> bool:
    """A boolean config.json key (HF writes true/false; absent means the family's default)."""
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ExportError(f"{source}: {name} must be true or false, got {value!r}")
    return value
