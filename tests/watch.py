"""Every file and folder created below a folder while a block runs, seen through Linux inotify (ctypes, no package).

Used to hold the export to "the scratch folder never holds a second copy of any tensor": whatever
the export creates, even if it removes it again, is recorded here.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
from typing import Dict, Set

IN_CREATE = 0x100
IN_MOVED_TO = 0x80
IN_CLOSE_WRITE = 0x8
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")


class CreatedFiles:
    """Context manager: `.paths` holds every path created below `root` (relative, '/'-separated; folders end with
    '/'), `.sizes` the size of each file when it was last closed after writing. Raises OSError where inotify is
    unavailable."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.paths: Set[str] = set()
        self.sizes: Dict[str, int] = {}
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._libc = libc
        self._fd = libc.inotify_init1(os.O_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._dirs: Dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _watch(self, folder: str) -> None:
        wd = self._libc.inotify_add_watch(self._fd, folder.encode(), IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE)
        if wd < 0:
            return  # gone already (a folder created and removed at once): its creation was recorded
        self._dirs[wd] = folder
        for entry in os.scandir(folder):  # what was created before the watch took hold
            self._seen(entry.path, entry.is_dir(follow_symlinks=False))

    def _seen(self, path: str, is_dir: bool) -> None:
        rel = self._rel(path) + ("/" if is_dir else "")
        if rel in self.paths:
            return
        self.paths.add(rel)
        if is_dir:
            self._watch(path)

    def _drain(self) -> None:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        offset = 0
        while offset < len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size:offset + _EVENT.size + length].rstrip(b"\0").decode()
            offset += _EVENT.size + length
            folder = self._dirs.get(wd)
            if folder is None or not name:
                continue
            path = os.path.join(folder, name)
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._seen(path, bool(mask & IN_ISDIR))
            if mask & IN_CLOSE_WRITE:
                try:
                    self.sizes[self._rel(path)] = os.path.getsize(path)
                except OSError:
                    pass

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.05)
            if ready:
                self._drain()
        self._drain()

    def __enter__(self) -> "CreatedFiles":
        self._watch(self.root)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self._fd)
