"""The start of a `python -c` script that makes modules unimportable, as on a machine where they are not installed
(an Atlas host with only mindspore_lite, an install without torch or jinja2). The script reads the names as
`HIDDEN`."""
from __future__ import annotations

from typing import Optional, Sequence

_FINDER = '''
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError("hidden for the test: " + name)
sys.meta_path.insert(0, Hide())
'''


def hide(modules: Optional[Sequence[str]] = None) -> str:
    """The prelude hiding `modules`; None: the script's first argument, comma-separated, taken off sys.argv."""
    names = "tuple(sys.argv.pop(1).split(','))" if modules is None else repr(tuple(modules))
    return f"import sys\nHIDDEN = {names}\n{_FINDER}"
