"""The paged KV cache's block manager (lite_runtime/engine/blocks.py) as plain data: the null block, reference counts, the
LRU free queue, full-block hashes over parent, tokens and the folder's identity, and the invariants under any sequence
of operations (hypothesis)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from lite_runtime.engine.blocks import NULL_BLOCK, BlockPool, PoolExhausted, SequenceBlocks, slots_of


def test_the_null_block_is_never_handed_out_and_blocks_come_least_recently_freed_first():
    pool = BlockPool(5, 4)
    assert pool.capacity == 4 and pool.num_free == 4 and pool.usage() == 0.0
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert NULL_BLOCK not in a + b and sorted(a + b) == [1, 2, 3, 4]
    assert pool.usage() == 1.0
    with pytest.raises(PoolExhausted, match="1 blocks asked, 0 free of 4"):
        pool.allocate(1)
    pool.release(b)  # freed last block first: b[1], then b[0]
    pool.release(a)
    assert list(pool.free) == [b[1], b[0], a[1], a[0]]
    assert pool.allocate(1) == [b[1]]
    with pytest.raises(ValueError, match="released more often than taken"):
        pool.release([a[0]])


def test_a_freed_prefix_is_found_again_until_its_block_is_handed_out():
    pool = BlockPool(6, 4, identity=b"folder-a")
    first = SequenceBlocks(pool)
    prompt = list(range(10, 20))  # 10 tokens: two full blocks and two tokens
    first.reserve(len(prompt))
    first.tokens = list(prompt)
    held = list(first.blocks)
    first.release()  # committed: its two full blocks findable, the partial one not
    assert pool.num_free == 5
    again = SequenceBlocks(pool)
    assert again.adopt(prompt + [99]) == 8 and again.blocks == held[:2]
    assert pool.refs[held[0]] == pool.refs[held[1]] == 1
    # at most `most` blocks: the prompt's last token must be computed, so a prompt of exactly two blocks finds one
    other = SequenceBlocks(pool)
    assert other.adopt(prompt[:8], most=(8 - 1) // 4) == 4 and other.blocks == held[:1]
    assert pool.refs[held[0]] == 2  # shared: two sequences read it, neither writes it
    other.release(), again.release()
    # another folder's identity, or a different first block, finds nothing
    assert BlockPool(6, 4, identity=b"folder-b").match(prompt) == []
    assert pool.match([0] + prompt[1:]) == []
    # a block handed out again forgets what it held
    pool.allocate(pool.num_free)
    assert pool.match(prompt) == []


def test_hashes_cover_the_parent_so_equal_blocks_after_different_prefixes_differ():
    pool = BlockPool(3, 2)
    x = pool.hashes([1, 2, 3, 4])
    y = pool.hashes([9, 9, 3, 4])
    assert len(x) == 2 and x[0] != y[0] and x[1] != y[1]
    assert pool.hashes([1, 2, 3, 4, 5], done=x[:1]) == x  # incremental equals whole
    assert pool.hashes([1, 2, 3]) == x[:1]  # a partial block has no hash


def test_truncate_gives_back_the_blocks_past_the_kept_positions():
    pool = BlockPool(8, 4)
    seq = SequenceBlocks(pool)
    seq.reserve(13)  # 4 blocks
    seq.tokens = list(range(13))
    seq.commit()
    assert len(seq.blocks) == 4 and len(seq.hashes) == 3
    seq.truncate(6)  # positions 0..5: two blocks
    assert len(seq.blocks) == 2 and seq.tokens == list(range(6)) and len(seq.hashes) == 1
    assert pool.num_free == 5
    assert not seq.fits(4 * 7 + 1) and seq.fits(4 * 7)
    with pytest.raises(PoolExhausted):
        seq.reserve(4 * 7 + 1)
    assert len(seq.blocks) == 2  # nothing taken by a failed reserve


def test_scatter_makes_every_table_skip_and_run_backwards():
    pool = BlockPool(9, 2)
    pool.scatter()
    blocks = pool.allocate(8)
    assert sorted(blocks) == list(range(1, 9))
    assert all(b != a + 1 for a, b in zip(blocks, blocks[1:]))
    assert slots_of(blocks, 1, 3, 2) == [blocks[0] * 2 + 1, blocks[1] * 2, blocks[1] * 2 + 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "release", "truncate", "adopt", "commit"]),
                          st.integers(0, 3), st.integers(0, 24)), max_size=60))
def test_the_pool_stays_consistent_under_any_operations(ops):
    """Whatever sequences do: every block is free xor referenced, references equal the sequences holding it, no
    sequence holds the null block, a hash maps to one block that carries it, and a sequence's blocks hold its
    tokens."""
    pool = BlockPool(10, 3, identity=b"x")
    seqs = [SequenceBlocks(pool) for _ in range(4)]
    vocab = [1, 2]  # few tokens: prefixes collide, so sharing happens
    for op, i, n in ops:
        seq = seqs[i]
        if op == "grow":
            want = len(seq.tokens) + n % 7
            if seq.fits(want) and want <= 27:
                seq.reserve(want)
                seq.tokens += [vocab[(len(seq.tokens) + n) % 2] for _ in range(want - len(seq.tokens))]
        elif op == "release":
            seq.release(commit=n % 2 == 0)
        elif op == "truncate":
            cut = min(n, len(seq.tokens))
            if cut % 3 == 0 or pool.refs[seq.blocks[cut // 3]] == 1:  # never into a shared block (the engine's rule)
                seq.truncate(cut)
        elif op == "adopt" and not seq.blocks:
            seq.adopt([vocab[k % 2] for k in range(n)], most=max(0, (n - 1) // 3))
        elif op == "commit":
            seq.commit()
        held = {}
        for s in seqs:
            assert NULL_BLOCK not in s.blocks and len(s.blocks) >= pool.blocks_for(len(s.tokens))
            # a block findable by a hash holds what the hash says: the sequence's tokens up to its end
            full = pool.hashes(s.tokens)
            for j, b in enumerate(s.blocks):
                if pool.hash_of[b] is not None:
                    assert j < len(full) and pool.hash_of[b] == full[j]
            for b in s.blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(1, pool.num_blocks):
            assert pool.refs[b] == held.get(b, 0)
            assert (b in pool.free) == (pool.refs[b] == 0)
        assert NULL_BLOCK not in pool.free
        for h, b in pool.by_hash.items():
            assert pool.hash_of[b] == h
