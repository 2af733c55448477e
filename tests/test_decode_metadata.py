"""DecodeMetadata.fill on the CPU: the packed host buffer (position, window slot, state slot, block table)
against a row-by-row reference for tables shorter than, equal to and longer than max_blocks, padding rows, a
refill with fewer sequences, and the errors for inputs the decode path cannot take."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kernels.decode_rows import POS, STATE, TABLE, WIN
from deepinfer.model.context import SeqContext
from deepinfer.model.decode_metadata import DecodeMetadata


def _reference(meta: DecodeMetadata, seqs, scratch_slot: int, scratch_block: int) -> torch.Tensor:
    rows = []
    for s in seqs:
        table = list(s.block_table[: meta.max_blocks])
        table += [table[0]] * (meta.max_blocks - len(table))  # past the table: its first block (masked)
        rows.append([s.start_pos, s.window_slot, s.state_slot] + table)
    pad = [0, scratch_slot, scratch_slot] + [scratch_block] * meta.max_blocks
    rows += [pad] * (meta.batch - len(seqs))
    return torch.tensor(rows, dtype=torch.long)


def test_fill_packs_every_row_like_the_reference():
    rng = random.Random(5)
    meta = DecodeMetadata(16, 2048, 256, 128, (4, 128), "cpu")  # 8 blocks per table
    for n in (16, 11, 1, 0, 16):
        seqs = []
        for i in range(n):
            pos = rng.randrange(0, 2048)
            need = pos // 256 + 1
            length = rng.choice([need, need + 1, 8, 12]) if need <= 8 else need
            table = tuple(rng.sample(range(2, 500), max(length, need)))
            seqs.append(SeqContext(pos, 1, i + 1, i + 1, table if rng.random() < 0.5 else list(table)))
        meta.fill(seqs, 0, 1)
        assert torch.equal(meta.host, _reference(meta, seqs, 0, 1)), n
        assert torch.equal(meta.buf, meta.host) and meta.num_real == n
    full = [SeqContext(7, 1, 3, 4, tuple(range(10, 18)))] * 3  # every table exactly max_blocks long
    meta.fill(full, 0, 1)
    assert torch.equal(meta.host, _reference(meta, full, 0, 1))
    assert meta.host[0, POS] == 7 and meta.host[0, WIN] == 3 and meta.host[0, STATE] == 4
    assert meta.host[0, TABLE:].tolist() == list(range(10, 18))


def test_fill_refuses_what_the_decode_path_cannot_take():
    meta = DecodeMetadata(4, 1024, 256, 128, (4,), "cpu")
    with pytest.raises(ValueError, match="one new token per sequence"):
        meta.fill([SeqContext(3, 2, 1, 1, (5,))], 0, 1)
    with pytest.raises(ValueError, match="position 1024 is past the decode path's max_context 1024"):
        meta.fill([SeqContext(1024, 1, 1, 1, tuple(range(5)))], 0, 1)
    with pytest.raises(ValueError, match="block table of 1 blocks does not cover position 300"):
        meta.fill([SeqContext(300, 1, 1, 1, (5,))], 0, 1)
    with pytest.raises(ValueError, match="does not fit bucket 4"):
        meta.fill([SeqContext(0, 1, 1, 1, (5,))] * 5, 0, 1)


def test_fill_checks_slots_and_scratch_naming_the_sequence():
    """With num_slots, fill refuses slots outside the cache and any real row on the scratch slot or block,
    naming that row's sequence (found through the flattened tables of mixed lengths), and copies nothing."""
    meta = DecodeMetadata(4, 1024, 256, 128, (4,), "cpu")  # 4 blocks per table
    good = [SeqContext(10, 1, 1, 1, (5, 6)), SeqContext(3, 1, 2, 2, (7,)), SeqContext(300, 1, 3, 3, (8, 9, 10))]
    meta.fill(good, 0, 1, num_slots=8)
    before = meta.buf.clone()
    on_block = SeqContext(300, 1, 3, 3, (1, 9, 10))  # the scratch block first in the third table (a row edge)
    cases = [([good[0], good[1], on_block], "scratch slot/block", on_block),
             ([good[0], SeqContext(3, 1, 0, 2, (7,)), good[2]], "scratch slot/block", None),
             ([good[0], good[1], SeqContext(300, 1, 3, 8, (8, 9, 10))], "slot out of range", None),
             ([SeqContext(10, 1, -1, 1, (5, 6))] + good[1:], "slot out of range", None)]
    for seqs, match, named in cases:
        with pytest.raises(ValueError, match=match) as err:
            meta.fill(seqs, 0, 1, num_slots=8)
        bad = named or next(s for s in seqs if s not in good)
        assert str(bad) in str(err.value)
        assert torch.equal(meta.buf, before)
    meta.fill([SeqContext(10, 1, 1, 1, (5, 6)), SeqContext(3, 1, 2, 2, (7,))], 0, 1)  # no num_slots: no check


def test_refills_rewrite_only_changed_rows_and_still_match_the_reference():
    """Step after step, fill rewrites a row's table only when its sequence brings a different table object
    (SequenceSlots.table keeps one tuple per unchanged table): over a random walk of sequences that keep,
    grow or swap their tables, change rows (finishing, joining, reordering), fill fewer rows than before and
    change the scratch block, the packed buffer equals the row-by-row reference after every step."""
    rng = random.Random(11)
    meta = DecodeMetadata(8, 2048, 256, 128, (4, 128), "cpu")  # 8 blocks per table
    blocks = iter(range(10, 10_000))
    live = {}  # id -> [position, table tuple]
    next_id = 0
    scratch_block = 1
    for step in range(60):
        while len(live) < rng.randrange(0, 9):
            pos = rng.randrange(0, 1500)
            live[next_id] = [pos, tuple(next(blocks) for _ in range(pos // 256 + 1))]
            next_id += 1
        for key in list(live):
            if rng.random() < 0.1:
                del live[key]  # finished
                continue
            pos, table = live[key]
            pos += 1
            if len(table) <= pos // 256:  # a new block: a new tuple (the pool's cache rebuilds it)
                table = table + (next(blocks),)
            elif rng.random() < 0.05:
                table = tuple(table)[:-1] + (next(blocks),) if len(table) > pos // 256 + 1 else table
            live[key] = [pos, table]
            if pos >= 2000:
                del live[key]
        order = list(live)
        if rng.random() < 0.3:
            rng.shuffle(order)
        if step == 40:
            scratch_block = 2  # the remembered rows were written for another scratch block: all rewritten
        seqs = [SeqContext(live[k][0], 1, k % 7 + 1, k % 7 + 1, live[k][1]) for k in order]
        meta.fill(seqs, 0, scratch_block, num_slots=16)
        assert torch.equal(meta.host, _reference(meta, seqs, 0, scratch_block)), step


def test_an_unchanged_row_is_not_rewritten():
    """The point of the row memory: the same table object again leaves its columns alone (a poisoned column
    survives), a different object with the same values is written again."""
    meta = DecodeMetadata(2, 1024, 256, 128, (4,), "cpu")
    table = (5, 6)
    meta.fill([SeqContext(10, 1, 1, 1, table)], 0, 1)
    meta.host[0, TABLE + 3] = -7  # only a rewrite puts the first block back here
    meta.fill([SeqContext(11, 1, 1, 1, table)], 0, 1)
    assert meta.host[0, TABLE + 3] == -7 and meta.host[0, POS] == 11
    meta.fill([SeqContext(12, 1, 1, 1, tuple([5, 6]))], 0, 1)
    assert meta.host[0, TABLE:].tolist() == [5, 6, 5, 5]
