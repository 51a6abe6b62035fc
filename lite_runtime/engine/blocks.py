"""The paged KV cache's blocks, as plain data: which block holds what, who uses it, which may be reused (vLLM's
BlockPool and prefix caching; docs/architecture.md, "The KV cache: a pool of blocks"). No graph, no MindSpore: the
runner turns a sequence's blocks into the graphs' block tables and slots, the engine decides who gets blocks.

- Block 0 is the null block: never given to a sequence; a graph row without a sequence reads it and writes nowhere.
- A block has a reference count: the sequences that use it. At 0 it goes to the back of the free queue, keeping its
  contents and its hash: a later prompt that begins with the same tokens takes it back (a prefix hit) as long as it
  has not been handed out again. Blocks are handed out from the front of the queue: the least recently freed first.
- Only full blocks are hashed and shared. A full block's hash covers its parent's hash, its tokens and the folder's
  identity, so a block is reused only after the very same prefix of the very same model. A sequence writes only
  positions past what it shares, into blocks of its own: a shared block is never written.
- Counts for /metrics in vLLM's units: prefix-cache queries and hits in tokens.
"""
from __future__ import annotations

import collections
import hashlib
from typing import Dict, List, Optional, Sequence

NULL_BLOCK = 0


class PoolExhausted(Exception):
    """Not enough free blocks for what was asked (the engine preempts or waits; a lone caller is told)."""


class BlockPool:
    """`num_blocks` blocks of `block_size` positions (block 0 the null block); `identity` salts every hash (the
    folder's: lite_runtime/folder.py)."""

    def __init__(self, num_blocks: int, block_size: int, identity: bytes = b"") -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (the null block and one more), got {num_blocks}")
        self.num_blocks, self.block_size, self.identity = int(num_blocks), int(block_size), bytes(identity)
        self.refs = [0] * self.num_blocks
        self.hash_of: List[Optional[bytes]] = [None] * self.num_blocks
        self.by_hash: Dict[bytes, int] = {}
        # free blocks, least recently freed first (an OrderedDict: O(1) to take one back from the middle)
        self.free: "collections.OrderedDict[int, None]" = collections.OrderedDict(
            (b, None) for b in range(1, self.num_blocks))
        self.queries = 0  # prompt tokens looked up (prefix caching), as vLLM counts them
        self.hits = 0  # of them, found in blocks already computed

    # --- the pool ---------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks a sequence may have: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free)

    def usage(self) -> float:
        """The fraction of the blocks in use (vLLM's kv_cache_usage_perc): 0 when idle, whatever is cached."""
        return self.num_used / self.capacity

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` positions."""
        return -(-int(tokens) // self.block_size)

    # --- hashing -----------------------------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int], count: Optional[int] = None, done: Sequence[bytes] = ()) -> List[bytes]:
        """The hashes of the first `count` full blocks of `tokens` (all of them by default), each over its parent's;
        `done`: the first ones' hashes, known already (only the rest are computed)."""
        bs = self.block_size
        full = len(tokens) // bs if count is None else min(count, len(tokens) // bs)
        out: List[bytes] = list(done[:full])
        parent = out[-1] if out else self.identity
        for i in range(len(out), full):
            h = hashlib.sha256(parent)
            h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens[i * bs:(i + 1) * bs]))
            parent = h.digest()
            out.append(parent)
        return out

    def match(self, tokens: Sequence[int], most: Optional[int] = None) -> List[int]:
        """The blocks already holding the longest prefix of `tokens` in full blocks (at most `most` blocks), without
        taking them (take() does)."""
        found: List[int] = []
        for h in self.hashes(tokens, most):
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def forget_contents(self) -> None:
        """The caches were replaced (ModelRunner.use_cache_dtype): no block holds a prefix any more. Only while no
        block is in use."""
        if self.num_used:
            raise ValueError(f"{self.num_used} block(s) in use: release every sequence first")
        self.hash_of = [None] * self.num_blocks
        self.by_hash = {}

    # --- taking and giving back --------------------------------------------------------------------------------
    def take(self, blocks: Sequence[int]) -> None:
        """Use `blocks` (a prefix hit): one more reference each; a free one leaves the free queue, contents kept."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1

    def allocate(self, n: int) -> List[int]:
        """`n` fresh blocks, least recently freed first (their old hashes forgotten); PoolExhausted if fewer are
        free."""
        if n > len(self.free):
            raise PoolExhausted(f"{n} blocks asked, {len(self.free)} free of {self.capacity}")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._forget(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less on each of `blocks`; the ones nobody uses join the free queue, the sequence's last block
        first freed last (so its tail is reused first and its shared head stays longest)."""
        for b in reversed(list(blocks)):
            if b == NULL_BLOCK:
                continue
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released more often than taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None

    def register(self, block: int, h: bytes) -> None:
        """Block `block` now holds the full block whose hash is `h`: findable by it. A block whose hash another block
        holds already stays unhashed (equal contents twice)."""
        if self.hash_of[block] == h or h in self.by_hash:
            return
        self._forget(block)
        self.hash_of[block], self.by_hash[h] = h, block

    def _forget(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None:
            if self.by_hash.get(h) == b:
                del self.by_hash[h]
            self.hash_of[b] = None

    def scatter(self) -> None:
        """Hand the free blocks out in an order in which no block follows the one before it in the pool (the even
        ones down, then the odd ones down: 6, 4, 2, 5, 3, 1): every sequence's block table then skips and runs
        backwards, so a graph that read the blocks in pool order instead of through its table could not pass
        `check` by accident."""
        free = sorted(self.free)
        order = sorted(free[1::2], reverse=True) + sorted(free[0::2], reverse=True)
        self.free = collections.OrderedDict((b, None) for b in order)

    def reset_cache(self) -> None:
        """Forget every hash (free blocks' contents are no longer reused): after something wrote the caches outside
        the pool's knowledge."""
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks


def slots_of(table: Sequence[int], start: int, count: int, block_size: int) -> List[int]:
    """The slots (block * block_size + position in it) of positions [start, start + count) of a sequence whose blocks
    are `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


class SequenceBlocks:
    """One sequence's blocks in the pool and the tokens whose keys and values they hold (positions [0, len(tokens)),
    in order): what a caller keeps between graph calls that extend the sequence. Taking blocks for positions before a
    call writes them (`reserve`), and giving back what it no longer needs (`truncate`, `release`), is the caller's.
    `hashes`: its full blocks' hashes computed so far (commit: they become findable for prefix caching)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: List[int] = []
        self.tokens: List[int] = []
        self.hashes: List[bytes] = []

    def adopt(self, tokens: Sequence[int], most: Optional[int] = None) -> int:
        """Begin with the blocks of the pool that hold the longest prefix of `tokens` in full blocks (at most `most`
        blocks: prefix caching); returns the tokens found. The sequence must be empty."""
        if self.blocks:
            raise ValueError("adopt() starts a sequence; this one has blocks")
        self.hashes = []
        for h in self.pool.hashes(tokens, most):
            block = self.pool.by_hash.get(h)
            if block is None:
                break
            self.hashes.append(h)
            self.blocks.append(block)
        self.pool.take(self.blocks)
        self.tokens = list(tokens[:len(self.blocks) * self.pool.block_size])
        return len(self.tokens)

    def reserve(self, length: int) -> None:
        """Blocks for positions [0, length); PoolExhausted when the pool has too few free (nothing taken then)."""
        more = self.pool.blocks_for(length) - len(self.blocks)
        if more > 0:
            self.blocks += self.pool.allocate(more)

    def fits(self, length: int) -> bool:
        """Whether `reserve(length)` would succeed now."""
        return self.pool.blocks_for(length) - len(self.blocks) <= self.pool.num_free

    def commit(self) -> None:
        """Its full blocks findable by their tokens (prefix caching): the ones not hashed yet."""
        self.hashes = self.pool.hashes(self.tokens, done=self.hashes)
        for block, h in zip(self.blocks, self.hashes):
            self.pool.register(block, h)

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): the tokens past it forgotten, the blocks past its last given back. A block
        left partly kept is written again from `length` on: it is no longer findable by what it held (and must not
        be shared: ValueError)."""
        bs = self.pool.block_size
        keep = self.pool.blocks_for(length)
        if length % bs and keep <= len(self.blocks):
            block = self.blocks[keep - 1]
            if self.pool.refs[block] > 1:
                raise ValueError(f"truncating to {length} cuts into block {block}, which other sequences share")
            self.pool._forget(block)
        del self.tokens[length:]
        del self.hashes[length // bs:]
        if keep < len(self.blocks):
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def release(self, commit: bool = True) -> None:
        """Give every block back; with `commit`, its full blocks stay findable by their tokens (prefix caching)."""
        if commit and self.tokens:
            self.commit()
        self.pool.release(self.blocks)
        self.blocks, self.tokens, self.hashes = [], [], []
