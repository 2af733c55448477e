"""Per-step reads of a request's tokens and a sequence's block table that must not walk the whole sequence:
`Request.token_ids_to_compute` / `known_token_ids` / `last_token_id` against the whole-sequence formula on
every span of random states (prompt, outputs, pending, drafts), and `SequenceSlots.table`'s cached tuple
(the same object while the table is unchanged, a new one once it grows, an in-place rewrite caught)."""
from __future__ import annotations

import random

import pytest

from deepinfer.cache.block_pool import BlockPool
from deepinfer.scheduler.request import PENDING_TOKEN, Request


def _whole(req: Request) -> list[int]:
    return (req.prompt_token_ids + req.output_token_ids + [PENDING_TOKEN] * req.num_pending_tokens
            + req.draft_token_ids)


def test_spans_equal_the_whole_sequence_formula():
    rng = random.Random(3)
    for _ in range(200):
        req = Request("r", [rng.randrange(100) for _ in range(rng.randrange(1, 9))], max_tokens=50)
        req.output_token_ids = [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
        req.num_pending_tokens = rng.randrange(0, 3)
        req.draft_token_ids = [rng.randrange(100) for _ in range(rng.randrange(0, 4))]
        whole = _whole(req)
        for start in range(len(whole) + 1):
            for num in range(len(whole) - start + 1):
                assert req.token_ids_to_compute(start, num) == whole[start : start + num]
            for stop in range(start, len(whole) + 2):
                assert req.known_token_ids(start, stop) == whole[start : min(stop, req.num_tokens)]
        assert req.last_token_id == (req.prompt_token_ids + req.output_token_ids)[-1]
        with pytest.raises(ValueError, match="pass the"):
            req.token_ids_to_compute(len(whole), 1)


def test_table_tuple_is_cached_until_the_table_grows():
    pool = BlockPool(num_blocks=16, block_size=4, max_num_seqs=2)
    seq = pool.allocate_for("a", 5)  # 2 blocks
    first = seq.table
    assert first == tuple(seq.block_table) and seq.table is first
    pool.allocate_for("a", 8)  # still 2 blocks: the same tuple
    assert seq.table is first
    pool.allocate_for("a", 9)  # a third block: a new tuple with it
    assert seq.table is not first and seq.table == tuple(seq.block_table) and len(seq.table) == 3
    pool.check_invariants()
    seq.block_table[0] = seq.block_table[0]  # (unchanged value: still consistent)
    pool.check_invariants()
    free_block = next(b for b in range(16) if b not in seq.block_table)
    seq.block_table[1] = free_block  # a rewrite in place, which the pool never does: the cache is stale
    with pytest.raises(AssertionError):
        pool.check_invariants()
