"""The block pool's accounting: grow, share, free, and always back to full."""
from __future__ import annotations

import random

import pytest

from deepinfer.cache import BlockPool, BlockPoolError


def full(pool: BlockPool) -> bool:
    return pool.num_free == pool.num_blocks and pool.num_free_seq_slots == pool.max_num_seqs and len(pool) == 0


def test_allocate_grows_by_tokens_and_free_returns_all():
    pool = BlockPool(num_blocks=8, block_size=4, max_num_seqs=2)
    seq = pool.allocate_for("a", 5)  # 5 positions -> 2 blocks
    assert len(seq.block_table) == 2 and pool.num_free == 6 and pool.usage == pytest.approx(2 / 8)
    assert pool.allocate_for("a", 8) is seq and len(seq.block_table) == 2  # still covered
    pool.allocate_for("a", 9)
    assert len(seq.block_table) == 3 and seq.num_tokens == 9
    pool.allocate_for("a", 3)  # never shrinks
    assert len(seq.block_table) == 3 and seq.num_tokens == 9
    pool.check_invariants()
    pool.free("a")
    pool.check_invariants()
    assert full(pool)


def test_slot_mapping_follows_block_table():
    pool = BlockPool(num_blocks=4, block_size=4, max_num_seqs=2)
    pool.allocate_for("x", 2)  # takes block 0
    seq = pool.allocate_for("a", 6)
    b0, b1 = seq.block_table
    assert [seq.slot(p) for p in range(6)] == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    with pytest.raises(IndexError):
        seq.slot(6)


def test_fixed_slots_are_distinct_and_limited():
    pool = BlockPool(num_blocks=16, block_size=4, max_num_seqs=2)
    a = pool.allocate_for("a", 1)
    b = pool.allocate_for("b", 1)
    assert a.window_slot != b.window_slot and a.state_slot != b.state_slot
    assert not pool.can_allocate_for("c", 1)  # blocks are free but no sequence slot is
    with pytest.raises(BlockPoolError, match="sequence slots"):
        pool.allocate_for("c", 1)
    pool.free("a")
    c = pool.allocate_for("c", 1)
    assert {c.window_slot, b.window_slot} == {0, 1}
    pool.check_invariants()


def test_out_of_blocks_is_all_or_nothing():
    pool = BlockPool(num_blocks=3, block_size=2, max_num_seqs=4)
    pool.allocate_for("a", 4)
    assert pool.blocks_needed("b", 4) == 2 and not pool.can_allocate_for("b", 4)
    with pytest.raises(BlockPoolError, match="need 2 blocks, 1 free"):
        pool.allocate_for("b", 4)
    assert "b" not in pool and pool.num_free == 1 and pool.num_free_seq_slots == 3
    pool.check_invariants()


def test_double_free_and_unknown_ids_raise():
    pool = BlockPool(num_blocks=4, block_size=4, max_num_seqs=2)
    pool.allocate_for("a", 3)
    pool.free("a")
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free("a")
    with pytest.raises(BlockPoolError, match="unknown"):
        pool.slots("nope")
    assert full(pool)


def test_fork_shares_whole_blocks_with_refcounts():
    pool = BlockPool(num_blocks=8, block_size=4, max_num_seqs=3)
    parent = pool.allocate_for("p", 10)  # 3 blocks, the last one partial
    with pytest.raises(BlockPoolError, match="whole blocks"):
        pool.fork("p", "c", 10)
    child = pool.fork("p", "c", 8)
    assert child.block_table == parent.block_table[:2]
    assert child.block_table is not parent.block_table
    assert [pool.ref_count(b) for b in parent.block_table] == [2, 2, 1]
    pool.allocate_for("c", 12)  # the child grows into its own block
    pool.check_invariants()
    pool.free("p")
    assert all(pool.ref_count(b) == 1 for b in child.block_table)
    pool.check_invariants()
    pool.free("c")
    assert full(pool)


def test_invariant_check_catches_a_corrupted_table():
    pool = BlockPool(num_blocks=4, block_size=4, max_num_seqs=2)
    a = pool.allocate_for("a", 4)
    b = pool.allocate_for("b", 4)
    b.block_table[0] = a.block_table[0]  # a block in two tables without a reference saying so
    with pytest.raises(AssertionError, match="refcount"):
        pool.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_constructor_validates(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=bad, block_size=4, max_num_seqs=2)


def test_random_workload_always_returns_to_full():
    rng = random.Random(0)
    pool = BlockPool(num_blocks=32, block_size=4, max_num_seqs=6)
    live: dict[str, int] = {}
    for step in range(2000):
        op = rng.random()
        if live and op < 0.3:
            pool.free(_pop(live, rng))
        elif live and op < 0.4 and pool.num_free_seq_slots:
            parent = rng.choice(sorted(live))
            shared = (live[parent] // 4) * 4
            child = f"f{step}"
            pool.fork(parent, child, shared)
            live[child] = shared
        else:
            sid = rng.choice(sorted(live)) if live and op < 0.8 else f"s{step}"
            want = live.get(sid, 0) + rng.randint(0, 9)
            if pool.can_allocate_for(sid, want):
                pool.allocate_for(sid, want)
                live[sid] = max(live.get(sid, 0), want)
        pool.check_invariants()
    for sid in sorted(live):
        pool.free(sid)
    pool.check_invariants()
    assert full(pool)


def _pop(live: dict[str, int], rng: random.Random) -> str:
    sid = rng.choice(sorted(live))
    del live[sid]
    return sid
