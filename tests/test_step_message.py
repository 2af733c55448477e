"""The parallel runner's step messages (engine/step_message.py): block tables sent as changes.

A random walk of batches, shaped as the scheduler makes them (sequences arrive in free state slots, their
tables grow a block at a time and keep their tuple while unchanged, finish or are preempted and come back
with a new table, slots are reused by other sequences, batches reorder): after the message crosses a
pickle (what `broadcast_object_list` does), the worker's decoded step equals rank 0's, every step; an
unchanged table costs nothing and a grown one only its new blocks, so a message does not grow with the
context."""
from __future__ import annotations

import pickle
import random

import pytest

from deepinfer.engine.step_message import StepDecoder, StepEncoder
from deepinfer.model.context import SeqContext


def test_random_walk_of_steps_decodes_to_the_same_batches():
    rng = random.Random(0)
    enc, dec = StepEncoder(), StepDecoder()
    live: dict[int, list] = {}  # state slot -> [position, table tuple, window slot]
    next_block = 0
    for step in range(600):
        # arrivals into free slots (a slot may come back with a new sequence: a new table)
        for slot in range(8):
            if slot not in live and rng.random() < 0.3:
                n = rng.randrange(1, 4)
                live[slot] = [rng.randrange(0, 64), tuple(range(next_block, next_block + n)), slot]
                next_block += n
        for slot in list(live):
            r = rng.random()
            if r < 0.05:
                del live[slot]  # finished
            elif r < 0.08:  # preempted and recomputed: a shorter, different table, same slot
                live[slot][1] = (next_block,)
                next_block += 1
            elif r < 0.3:  # one more block (a new tuple: the old one is never mutated)
                live[slot][1] = live[slot][1] + (next_block,)
                next_block += 1
            elif r < 0.32:  # an equal table in a new tuple object (content, not identity, decides)
                live[slot][1] = tuple(live[slot][1])
        if not live:
            continue
        slots = list(live)
        rng.shuffle(slots)
        batch = [s for s in slots if rng.random() < 0.8] or slots[:1]
        seqs = tuple(SeqContext(live[s][0], 1, live[s][2], s, live[s][1]) for s in batch)
        for s in batch:
            live[s][0] += 1
        wire = pickle.loads(pickle.dumps(enc.encode(len(seqs), seqs, step % 7 == 0)))
        num_ids, got_seqs, all_logits = dec.decode(wire)
        assert num_ids == len(seqs) and got_seqs == seqs and all_logits == (step % 7 == 0), f"step {step}"


def test_a_message_does_not_grow_with_the_context():
    enc = StepEncoder()
    sizes = []
    tables = {i: tuple(range(i * 2000, i * 2000 + 1000)) for i in range(128)}  # 128K tokens in 128-token blocks
    for step in range(4):
        if step == 2:
            tables[5] = tables[5] + (999_999,)  # one sequence gained a block
        seqs = tuple(SeqContext(128_000 + step, 1, i, i, tables[i]) for i in range(128))
        sizes.append(len(pickle.dumps(enc.encode(128, seqs, False))))
    whole = len(pickle.dumps(tuple(SeqContext(128_000, 1, i, i, tables[i]) for i in range(128))))
    assert sizes[0] > 100_000  # the first step sends every table
    assert sizes[1] < 10_000 and sizes[3] < 10_000, sizes  # then none: ~40 bytes a sequence
    assert sizes[2] < sizes[1] + 64  # and a grown table only its new block
    assert whole > 50 * sizes[1]


def test_a_worker_out_of_step_fails_loudly():
    enc = StepEncoder()
    seqs = (SeqContext(0, 4, 0, 0, (3,)),)
    enc.encode(4, seqs, False)
    late = StepDecoder()  # missed the first message
    with pytest.raises(KeyError):
        late.decode(enc.encode(1, (SeqContext(4, 1, 0, 0, seqs[0].block_table),), False))
