"""What a run on this machine's CPU needs in memory, against what the machine has: refused up front, never an OOM kill.

The `ms` backend maps a folder's weights file (page cache, given back at will); a folder whose graphs call the CPU
kernels has the weights they read copied into huge pages at load (weights_copy_bytes: anonymous memory of about the
weights' size, where it fits). A float16 folder (the Atlas default) is
different: MindSpore's CPU float16 MatMul keeps a float32 copy of every weight it multiplies.
Measured on the Qwen2-0.5B shape (0.93 GiB of float16 weights, 4 graphs): `check` peaked at 3.22
GiB of anonymous memory, 4.95 GiB at batch 2 (7 graphs), against 1.68 GiB for the float32 CPU
folder. So such a run needs at least twice the weights, plus MindSpore's own (FLOAT16_OVERHEAD);
a 7B float16 folder (14.2 GiB) needs more than 29 GiB.
"""
from __future__ import annotations

import os
from typing import List, Optional

GIB = 1 << 30
FLOAT16_OVERHEAD = 1 * GIB  # MindSpore's runtime, graphs and activations beyond the float32 copies (at least)


def anon_bytes(pid="self") -> int:
    """A process's anonymous memory (RssAnon: what it holds itself, not the page cache its maps touch); 0 when it
    cannot be read (the process is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_bytes() -> Optional[int]:
    """What this process can still allocate without swapping or being killed: the machine's MemAvailable, and in a
    container or any memory-limited cgroup the room left under each limit above it (cgroup v1 or v2). None where
    nothing is known."""
    found = []
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            found += [int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    found += _cgroup_room()
    return min(found) if found else None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2) means no limit


def _cgroup_room() -> List[int]:
    """limit - usage of this process's memory cgroup and every ancestor that has a limit."""
    rooms = []
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return rooms
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            roots, limit_file, usage_file = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            roots, limit_file, usage_file = ("/sys/fs/cgroup/memory",), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        for root in roots:
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                folder = os.path.join(root, *parts[:depth])
                limit, usage = _read_int(os.path.join(folder, limit_file)), _read_int(os.path.join(folder, usage_file))
                if limit is not None and usage is not None and limit < (1 << 60):
                    rooms.append(max(0, limit - usage))
    return rooms


def ms_backend_needs(folder, rank: int = 0) -> int:
    """Anonymous memory the `ms` backend needs at least for `folder` (a lite_runtime.folder.ModelFolder): twice the
    rank's weights file for float16 compute (MindSpore's float32 copies), else nothing beyond the mapped file."""
    compute = folder.infer.get("compute_dtype") or folder.infer.get("dtype")
    if compute != "float16":
        return 0
    return 2 * _weights_file_bytes(folder, rank) + FLOAT16_OVERHEAD


def _weights_file_bytes(folder, rank: int) -> int:
    """The size of the rank's weights file(s), as the manifest names them."""
    files = {os.path.join(folder.path, g["variables"]) for g in folder.manifest.get("graphs", [])
             if int(g.get("rank", 0)) == rank and g.get("variables")}
    return sum(os.path.getsize(f) for f in files if os.path.isfile(f))


def _kernel_weight_bytes(folder, rank: int) -> int:
    """What lite_runtime/backends/ms.py _into_huge_pages lays out for the rank: every weight a node calling our kernels
    reads in its step graph (_kernel_weights: not the KV caches, not an untied embedding only a lookup reads), each at a
    4 KiB boundary; the arena's size, exactly, for the folders measured (tied and untied, float and quantized: the step
    graph reads every layer, the final norm and the head). The weights file's size where that graph cannot be read
    here."""
    try:
        from lite_runtime.backends.ms import _NUMPY, _arena_slot, _kernel_weights, _param_nbytes, _read_mindir
        from mindspore.train import mind_ir_pb2

        model = _read_mindir(folder.graph_paths(rank)["inc"])
        ours = _kernel_weights(model)
    except Exception:  # no MindSpore, a graph missing or unreadable: the load says so; plan as before
        return _weights_file_bytes(folder, rank)
    total = 0
    for param in model.graph.parameter:
        dtype = _NUMPY.get(mind_ir_pb2.TensorProto.DataType.Name(param.data_type))
        if param.name.rsplit(":", 1)[-1] in ours and dtype is not None:
            total += _arena_slot(_param_nbytes(tuple(param.dims), dtype))
    return total


def weights_copy_bytes(folder, rank: int = 0, have: Optional[int] = None) -> int:
    """Bytes the `ms` backend copies at load into huge pages (lite_runtime/backends/ms.py _into_huge_pages): the
    weights our CPU kernels read (_kernel_weight_bytes: an untied embedding only a lookup reads is left out, 1 GiB at
    the Qwen2.5-7B shape in bfloat16), for a folder whose graphs call them
    (manifest infer `cpu_kernels`); 0 where it copies nothing: MSLITE_LLM_HUGE_PAGES=0, no CPU kernels, or too little
    memory (`have`, default available_bytes() when first asked in this process, the answer kept: the copy and 1 GiB
    must fit, else the weights stay mapped, as page cache). The KV pool's default is sized after it
    (lite_runtime/engine/runner.py), and the load copies as it said (lite_runtime/backends/ms.py)."""
    if os.environ.get("MSLITE_LLM_HUGE_PAGES") == "0" or not folder.infer.get("cpu_kernels"):
        return 0
    if have is not None:
        weights = _kernel_weight_bytes(folder, rank)
        return weights if weights + GIB <= have else 0
    key = (os.path.realpath(folder.path), rank)  # one answer a process: the pool's plan and the load agree
    if key not in _COPY_DECISIONS:  # (the step graph parsed once: the runner and the backend both ask)
        weights, have = _kernel_weight_bytes(folder, rank), available_bytes()
        _COPY_DECISIONS[key] = weights if have is None or weights + GIB <= have else 0
    return _COPY_DECISIONS[key]


_COPY_DECISIONS: dict = {}  # (folder, rank) -> weights_copy_bytes' first answer without `have`


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def refuse_if_too_big(folder, rank: int = 0) -> None:
    """InferError, with the numbers, when the `ms` backend cannot hold `folder` here (a float16 folder whose float32
    copies do not fit); called before MindSpore reads a weight, where the OOM killer would end it minutes later."""
    from lite_runtime.errors import InferError

    need, have = ms_backend_needs(folder, rank), available_bytes()
    if need and have is not None and need > have:
        raise InferError(f"{folder.path}: this float16 folder needs about {gib(need)} of memory on MindSpore's CPU "
                         f"(its float16 MatMul keeps a float32 copy of every weight), and {gib(have)} is available; "
                         "check it on the Atlas device it is for (python -m lite_runtime.check there), or export a "
                         "--device cpu folder of the checkpoint to check its weights on this machine")
