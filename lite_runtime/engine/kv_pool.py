"""How many blocks the paged KV cache pool has: the deployer's choice when a folder is loaded (`--num_blocks`, or
`--kv_cache_memory` in GiB), else sized from free memory as vLLM and MindIE size theirs (docs/runtime.md, "The KV
cache pool"). A folder's graphs index the caches only through block tables and slots, so any pool of at least one
longest request's blocks (plus the null block) runs them; the backends allocate it at load (the `ms` backend: zero
pages, which become memory as blocks are written; `mslite`: the caches' first dimension in each graph before GE
builds it).

Default: KV_MEMORY_FRACTION of what is free after the weights and a margin for activations, at most what every graph
row needs at the longest context four times over (a pool past that only keeps more finished prefixes), at least one
longest request. Refused at load, with the numbers: a pool that cannot hold one longest request, and more memory than
is free.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from lite_runtime.errors import InferError
from lite_runtime.folder import KVCacheSpec

GIB = 1 << 30
KV_MEMORY_FRACTION = 0.5  # of the memory free after the weights: the rest for activations, the OS and others
ACTIVATION_MARGIN = 1 * GIB  # kept free beside the pool: graphs' activations, MindSpore's runtime
POOL_ROWS_FACTOR = 4  # the default pool holds at most this many longest requests per graph row


@dataclass(frozen=True)
class PoolPlan:
    """The pool a loaded folder runs with."""

    num_blocks: int  # the null block included
    block_size: int
    block_bytes: int  # over every layer's key and value caches, this rank's heads
    how: str  # where the size came from, in words

    @property
    def tokens(self) -> int:
        """Positions sequences may hold at once (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def line(self) -> str:
        return (f"KV cache: {self.num_blocks - 1} blocks of {self.block_size} tokens ({self.tokens} tokens, "
                f"{size_text(self.bytes)}), {self.how}")


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB below one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def plan_pool(spec: KVCacheSpec, seq_length: int, batch_size: int, where: str, num_blocks: Optional[int] = None,
              kv_cache_memory: Optional[float] = None, available: Optional[int] = None) -> PoolPlan:
    """The pool for a folder (`spec`: its infer.kv_cache; `where`: its path, for errors): `num_blocks` if given, else
    `kv_cache_memory` GiB, else the default from `available` bytes (free memory after the weights; None: unknown,
    then one longest request per graph row, twice)."""
    block = spec.block_bytes
    need = spec.max_blocks + 1  # one longest request and the null block
    if num_blocks is not None and kv_cache_memory is not None:
        raise InferError("give --num_blocks or --kv_cache_memory, not both")
    if num_blocks is not None:
        blocks, how = int(num_blocks), "--num_blocks"
        if available is not None and blocks * block > available:
            raise InferError(f"{where}: --num_blocks {blocks} is {blocks * block / GIB:.2f} GiB of KV cache, more than "
                             f"the {available / GIB:.1f} GiB free here (after the weights); give fewer")
    elif kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise InferError(f"--kv_cache_memory {kv_cache_memory}: give a positive size in GiB")
        want = float(kv_cache_memory) * GIB
        if available is not None and want > available:
            raise InferError(f"{where}: --kv_cache_memory {kv_cache_memory:g} GiB is more than the {available / GIB:.1f} "
                             "GiB free here (after the weights); give less, or --num_blocks")
        blocks, how = int(want // block), f"--kv_cache_memory {kv_cache_memory:g} GiB"
    else:
        most = 1 + POOL_ROWS_FACTOR * batch_size * spec.max_blocks
        if available is None:
            blocks, how = 1 + 2 * batch_size * spec.max_blocks, ("two longest requests per row (free memory not "
                                                                 "measured; --num_blocks or --kv_cache_memory size it)")
        else:
            room = max(0, available - ACTIVATION_MARGIN) * KV_MEMORY_FRACTION
            blocks = max(need, min(most, int(room // block)))
            how = (f"sized from free memory ({KV_MEMORY_FRACTION:.0%} of the {available / GIB:.1f} GiB free after the "
                   f"weights and {ACTIVATION_MARGIN // GIB} GiB for activations, at most {POOL_ROWS_FACTOR} longest "
                   "requests per row)")
            if blocks * block > available:
                raise InferError(f"{where}: one request of seq_length {seq_length} needs {need * block / GIB:.2f} GiB "
                                 f"of KV cache and {available / GIB:.2f} GiB is free here; re-export with a smaller "
                                 "--seq_length, or free memory")
    if blocks < need:
        raise InferError(f"{where}: a KV cache pool of {blocks} blocks ({max(blocks - 1, 0) * spec.block_size} tokens, "
                         f"{blocks * block / GIB:.3f} GiB) cannot hold one request of seq_length {seq_length} "
                         f"({spec.max_blocks} blocks of {spec.block_size}, and the null block); give --num_blocks "
                         f"{need} or more (--kv_cache_memory {need * block / GIB:.3f} or more)")
    return PoolPlan(blocks, spec.block_size, block, how)


def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    """The KV cache pool's size, as every command that loads a folder takes it (lite_runtime/engine/kv_pool.py)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--kv_cache_memory", type=float, default=None, metavar="GIB",
                   help="memory for the paged KV cache, in GiB (default: half of what is free after the weights and "
                        "1 GiB for activations, at most four longest requests per graph row)")
    g.add_argument("--num_blocks", type=int, default=None,
                   help="the KV cache's blocks instead (the null block included; the folder's block size each)")
