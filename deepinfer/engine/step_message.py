"""The step rank 0 broadcasts to the other ranks of a parallel group, with block tables sent as changes.

Why: every step names each sequence's block table, and a table grows with the context (one entry per
`block_size` tokens: 1,024 at 128K tokens with 128-token blocks). Pickling the whole tables of a batch-128
step every step costs milliseconds on rank 0 and again on every worker, growing with the context (the
host-work rule of docs/ARCHITECTURE.md). A worker keeps the table it last received per state slot; rank 0
sends a table only when it changed, and then only the blocks it gained when the new table extends the
old one (tables are append-only while a sequence lives; a reused slot or a preempted sequence sends its
whole new table).

`StepEncoder` (rank 0) and `StepDecoder` (each worker) must see every step message, in order: a message
that is encoded must be broadcast (the parallel runner encodes right before its broadcast, and any failure
there ends the group).
Must not: know the model or the scheduler; it moves `SeqContext`s.
"""
from __future__ import annotations

from collections.abc import Sequence

from deepinfer.model.context import SeqContext

_SAME, _TAIL, _WHOLE = 0, 1, 2


class StepEncoder:
    """Rank 0: (number of token ids, seqs, all_logits) -> a compact picklable message (the ids themselves
    follow as a tensor broadcast: they may still be on their way from the device, asynchronous scheduling)."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, ...]] = {}  # state slot -> the table the workers hold for it

    def encode(self, num_ids: int, seqs: Sequence[SeqContext], all_logits: bool) -> tuple:
        rows = []
        for s in seqs:
            table, held = s.block_table, self._sent.get(s.state_slot)
            if held is table:  # the scheduler hands out one tuple per unchanged table: the common case
                rows.append((s.start_pos, s.num_new, s.window_slot, s.state_slot, _SAME, None))
                continue
            n = len(held) if held is not None else -1
            if 0 <= n <= len(table) and table[:n] == held:
                rows.append((s.start_pos, s.num_new, s.window_slot, s.state_slot, _TAIL, table[n:]))
            else:
                rows.append((s.start_pos, s.num_new, s.window_slot, s.state_slot, _WHOLE, table))
            self._sent[s.state_slot] = table
        return num_ids, rows, all_logits


class StepDecoder:
    """A worker: the message -> (number of ids, seqs, all_logits), with the tables it holds brought up to date."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[int, ...]] = {}

    def decode(self, message: tuple) -> tuple[int, tuple[SeqContext, ...], bool]:
        num_ids, rows, all_logits = message
        seqs = []
        for start, num_new, window_slot, state_slot, kind, payload in rows:
            if kind == _SAME:
                table = self._tables[state_slot]
            elif kind == _TAIL:
                table = self._tables[state_slot] + payload
            else:
                table = payload
            self._tables[state_slot] = table
            seqs.append(SeqContext(start, num_new, window_slot, state_slot, table))
        return num_ids, tuple(seqs), all_logits
