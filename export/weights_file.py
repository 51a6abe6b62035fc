"""Each rank's weights file, written once, tensor by tensor, straight from the checkpoint's safetensors.

No graph export writes parameter data (export/graphs.py takes each graph's proto without it); this module
writes `<name>_variables/data_0` of every rank in one pass over the checkpoint, in the checkpoint's own order
(shard by shard, each tensor where it lies, so a cold read is sequential), and every graph refers to it by
(location, offset, length). Each tensor is converted to the folder's dtype and split for the ranks in chunks:
- worker threads (one per core) read a chunk from the checkpoint's memory map and convert it (numpy releases
  the GIL while it casts);
- the calling thread hashes each rank's bytes in order (sha256 for the manifest, so nothing is read again);
- one writer thread appends them to the ranks' files.
Memory is a few chunks in flight, whatever the model's size; the disk holds the folder and nothing else.

The file keeps MindSpore's layout (lite_runtime/folder.py DATA_HEADER, DATA_ALIGN). The KV cache
Parameters are written as zeros after the weights. Tensor order differs from exports before this
module (which followed the first graph's parameter order); each tensor's bytes are the same.
"""
from __future__ import annotations

import collections
import hashlib
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from export.errors import ExportError
from export.weights import SafetensorsFile, split_axis, stored_as
from lite_runtime.folder import DATA_ALIGN, DATA_HEADER

CHUNK_BYTES = 16 << 20  # source bytes converted per job: memory in flight is a few of these per core
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
CACHE_SUFFIXES = ("key_cache", "value_cache")


@dataclass(frozen=True)
class Entry:
    """One parameter in one rank's weights file."""

    name: str
    shape: Tuple[int, ...]  # this rank's
    dtype: str  # as stored: float32, float16 or bfloat16
    offset: int
    nbytes: int


@dataclass
class Layout:
    """One rank's weights file: where each parameter lies (`location` relative to the folder)."""

    location: str
    entries: Dict[str, Entry] = field(default_factory=dict)
    size: int = DATA_HEADER

    def add(self, name: str, shape: Tuple[int, ...], dtype: str) -> None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        self.entries[name] = Entry(name, tuple(shape), dtype, self.size, nbytes)
        self.size += nbytes + (-nbytes % DATA_ALIGN)


@dataclass
class WriteStats:
    """Where the weights phase spent its time: wall seconds, and busy seconds of each kind of work (the kinds
    overlap in threads, so busy seconds may add up to more than the wall)."""

    seconds: float = 0.0
    convert_seconds: float = 0.0  # read from the checkpoint's map and convert (all worker threads together)
    hash_seconds: float = 0.0
    write_seconds: float = 0.0  # in write(2), i.e. waiting for the disk once the page cache is full
    bytes_written: int = 0


def plan_layouts(params: Sequence[Dict[str, Tuple[Tuple[int, ...], str]]], where: Dict[str, SafetensorsFile],
                 locations: Sequence[str]) -> List[Layout]:
    """One Layout per rank. `params[r]`: rank r's parameters, name -> (shape, dtype), as its graphs declare them.

    Checkpoint tensors come first, in the checkpoint's order (file, then offset in it); the KV cache after."""
    order = sorted((n for n in params[0] if not n.endswith(CACHE_SUFFIXES)),
                   key=lambda n: (where[n].path, where[n].offset(n)))
    caches = [n for n in params[0] if n.endswith(CACHE_SUFFIXES)]
    layouts = []
    for rank_params, location in zip(params, locations):
        layout = Layout(location)
        for name in order + caches:
            shape, dtype = rank_params[name]
            layout.add(name, shape, dtype)
        layouts.append(layout)
    return layouts


def _chunks(rows: int, row_bytes: int) -> Iterator[Tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _rank_parts(block: np.ndarray, start: int, stop: int, axis: Optional[int], tp: int,
                rank_rows: int) -> List[Optional[np.ndarray]]:
    """Each rank's share of rows [start, stop) of a converted tensor, contiguous, or None where a rank has none."""
    if axis is None:
        return [block] * tp
    if axis == 1:
        width = block.shape[1] // tp
        return [np.ascontiguousarray(block[:, r * width:(r + 1) * width]) for r in range(tp)]
    parts: List[Optional[np.ndarray]] = []
    for r in range(tp):
        lo, hi = max(start, r * rank_rows), min(stop, (r + 1) * rank_rows)
        parts.append(block[lo - start:hi - start] if lo < hi else None)
    return parts


class _Writer(threading.Thread):
    """Appends (file index, bytes) jobs to the open files in order; the first OSError is kept for the caller."""

    def __init__(self, fds: List[int], paths: List[str]) -> None:
        super().__init__(name="weights-writer", daemon=True)
        self.fds, self.paths = fds, paths
        self.jobs: "queue.Queue" = queue.Queue(maxsize=4)
        self.error: Optional[OSError] = None
        self.seconds = 0.0

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is not None:
                continue  # drain: the caller raises at its next put
            index, data = job
            start = time.perf_counter()
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(self.fds[index], view):]
            except OSError as exc:
                self.error = OSError(exc.errno, exc.strerror, self.paths[index])
            self.seconds += time.perf_counter() - start

    def put(self, index: int, data) -> None:
        if self.error is not None:
            raise self.error
        self.jobs.put((index, data))


def write_files(folder: str, layouts: List[Layout], where: Dict[str, SafetensorsFile],
                progress: Optional[Callable[[int], None]] = None,
                threads: Optional[int] = None) -> Tuple[Dict[str, str], WriteStats]:
    """Write every rank's weights file below `folder`, in one pass over the checkpoint.

    Returns ({location: sha256}, stats). `progress(n)` is called with the bytes written. An OSError (a full disk,
    a permission, an I/O error) is raised with the file's path; the caller removes the folder.
    """
    tp = len(layouts)
    stats = WriteStats()
    started = time.perf_counter()
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    paths = [os.path.join(folder, layout.location) for layout in layouts]
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    digests = [hashlib.sha256() for _ in layouts]
    written = [0] * tp
    writer = _Writer(fds, paths)
    writer.start()
    convert_seconds = [0.0]
    lock = threading.Lock()

    def emit(rank: int, data) -> None:
        nbytes = memoryview(data).nbytes
        start = time.perf_counter()
        digests[rank].update(data)
        stats.hash_seconds += time.perf_counter() - start
        writer.put(rank, data)
        written[rank] += nbytes
        stats.bytes_written += nbytes
        if progress is not None:
            progress(nbytes)

    def pad(rank: int) -> None:
        gap = -written[rank] % DATA_ALIGN
        if gap:
            emit(rank, bytes(gap))

    def convert(source: np.ndarray, dtype: str) -> np.ndarray:
        start = time.perf_counter()
        out = stored_as(source, dtype)
        # read the checkpoint here, in a worker, even when nothing needs converting (a view of the map)
        out = np.array(out) if out is source else np.ascontiguousarray(out)
        with lock:
            convert_seconds[0] += time.perf_counter() - start
        return out

    def jobs() -> Iterator[Tuple[Entry, int, int, bool, np.ndarray]]:
        """(entry, first row, end row, whether it is the tensor's last chunk, source rows) of every checkpoint
        tensor, chunk by chunk, in file order."""
        for entry in layouts[0].entries.values():
            if entry.name.endswith(CACHE_SUFFIXES):
                continue
            source = where[entry.name].stored(entry.name)
            rows = source.shape[0] if source.ndim else 1
            flat = source.reshape(rows, -1)
            for a, b in _chunks(rows, flat[0].nbytes if rows else 0):
                yield entry, a, b, b == rows, flat[a:b]

    try:
        header = (1 if sys.byteorder == "little" else 0).to_bytes(1, "little") + bytes(DATA_HEADER - 1)
        for rank in range(tp):
            emit(rank, header)
        with ThreadPoolExecutor(threads, thread_name_prefix="weights") as pool:
            window: "collections.deque" = collections.deque()
            todo = jobs()
            for job in todo:
                window.append((job, pool.submit(convert, job[4], job[0].dtype)))
                if len(window) < 2 * threads:
                    continue
                _consume(window.popleft(), layouts, emit, pad, written, paths)
            while window:
                _consume(window.popleft(), layouts, emit, pad, written, paths)
        zeros = bytes(CHUNK_BYTES)
        for rank, layout in enumerate(layouts):
            for entry in layout.entries.values():
                if not entry.name.endswith(CACHE_SUFFIXES):
                    continue
                left = entry.nbytes
                while left:
                    emit(rank, memoryview(zeros)[:min(left, CHUNK_BYTES)])
                    left -= min(left, CHUNK_BYTES)
                pad(rank)
                _expect(layout, entry.name, written[rank], paths[rank])
        writer.put(0, b"")  # raises a write error seen meanwhile
    finally:
        writer.jobs.put(None)
        writer.join()
        for fd in fds:
            os.close(fd)
    if writer.error is not None:
        raise writer.error
    stats.convert_seconds = convert_seconds[0]
    stats.write_seconds = writer.seconds
    stats.seconds = time.perf_counter() - started
    return {layout.location: d.hexdigest() for layout, d in zip(layouts, digests)}, stats


def _consume(item, layouts: List[Layout], emit, pad, written: List[int], paths: List[str]) -> None:
    """Hand one converted chunk's rank parts to `emit`; after a tensor's last chunk, align and check each file."""
    (entry, start, stop, last, _), job = item
    tp = len(layouts)
    axis = split_axis(entry.name) if tp > 1 else None
    for rank, part in enumerate(_rank_parts(job.result(), start, stop, axis, tp, entry.shape[0] if axis == 0 else 0)):
        if part is not None:
            emit(rank, part)
    if last:
        for rank in range(tp):
            pad(rank)
            _expect(layouts[rank], entry.name, written[rank], paths[rank])


def _expect(layout: Layout, name: str, written: int, path: str) -> None:
    """The bytes written so far end where the layout says `name` ends (its offset plus its aligned size)."""
    entry = layout.entries[name]
    end = entry.offset + entry.nbytes + (-entry.nbytes % DATA_ALIGN)
    if written != end:
        raise ExportError(f"{path}: {name} ends at byte {written}, its layout says {end}; this is a bug in "
                          "export/weights_file.py, please report it")
