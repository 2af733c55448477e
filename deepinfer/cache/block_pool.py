"""Accounting of the paged KV cache: which block, ring slot and compressor-state slot each sequence owns.

Owns: `BlockPool` — a fixed set of `num_blocks` blocks of `block_size` token positions with reference
counts and a FIFO free list, plus two small fixed pools of per-sequence resources (`max_num_seqs` each):
a window-ring slot (V4 keeps the last `window_size` tokens of every layer in a ring, spec §4.1) and a
compressor-state slot (the fp32 partial block each compressor carries between calls). `SequenceSlots`
is one sequence's record: its block table and its two fixed slots.

Why blocks count TOKENS of the sequence, not cache entries: V4 stores one compressed (and indexer) entry
per r tokens with r = 4 or 128 depending on the layer, so a block of `block_size` positions holds
`block_size // r` entries of each compressed layer. The pool stays generic; the engine maps layers onto
blocks (choose `block_size` as a multiple of every compression ratio so an entry never straddles blocks).

Must not: touch tensors or import any tensor library (a test checks) — the scheduler uses this on the CPU,
and it must stay cheap and exact. All accounting errors raise `BlockPoolError`; the pool never silently
repairs state. After every sequence is freed (finished, failed or aborted) the pool is full again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class BlockPoolError(RuntimeError):
    """Misuse of the pool: unknown or duplicate sequence, double free, or not enough free resources."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class SequenceSlots:
    """One sequence's cache resources. `block_table[i]` holds token positions [i*bs, (i+1)*bs)."""

    seq_id: str
    block_size: int
    window_slot: int  # index into the engine's window rings: one ring of window_size per layer
    state_slot: int  # index into the engine's compressor partial-block states
    block_table: list[int] = field(default_factory=list)  # append-only (the pool grows it, never rewrites it)
    num_tokens: int = 0  # token positions the table must cover; len(block_table) == cdiv(num_tokens, bs)
    _table: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    @property
    def table(self) -> tuple[int, ...]:
        """`block_table` as a tuple, rebuilt only when the table has grown. The pool only ever appends to a
        table (a fork starts a fresh list), so an unchanged length is an unchanged table: a decode step
        reads each running sequence's table without copying it (a per-step copy grew with the context),
        and the same tuple object step after step tells `DecodeMetadata.fill` that a row is unchanged."""
        t = self._table
        if len(t) != len(self.block_table):
            t = self._table = tuple(self.block_table)
        return t

    def slot(self, position: int) -> int:
        """Flat cache slot of a token position (block id * block_size + offset): the engine's slot_mapping."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside the {self.num_tokens} allocated for {self.seq_id!r}")
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size


class _SlotPool:
    """A free list of small integer ids [0, size) with ownership checks (rings and compressor states)."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    def take(self) -> int:
        if not self._free:
            raise BlockPoolError(f"no free {self.name} slot (all {self.size} in use)")
        slot = self._free.popleft()
        self._used.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if slot not in self._used:
            raise BlockPoolError(f"{self.name} slot {slot} is not in use (double free?)")
        self._used.remove(slot)
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a slot is twice on the free list"
        assert not free & self._used, f"{self.name}: a slot is both free and used"
        assert free | self._used == set(range(self.size)), f"{self.name}: slots lost or invented"


class BlockPool:
    """Paged blocks with reference counts + per-sequence ring and compressor-state slots."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: a freed block is reused last
        self._seqs: dict[str, SequenceSlots] = {}
        self._window_slots = _SlotPool("window-ring", max_num_seqs)
        self._state_slots = _SlotPool("compressor-state", max_num_seqs)

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 (empty) .. 1.0 (full)."""
        return self.num_used / self.num_blocks

    @property
    def num_free_seq_slots(self) -> int:
        # both fixed pools move together (taken and returned per sequence)
        return min(self._window_slots.num_free, self._state_slots.num_free)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def slots(self, seq_id: str) -> SequenceSlots:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise BlockPoolError(f"unknown sequence {seq_id!r}") from None

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """New blocks needed for `seq_id` to cover `num_tokens` positions in total (0 if already covered)."""
        have = len(self._seqs[seq_id].block_table) if seq_id in self._seqs else 0
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate_for(self, seq_id: str, num_tokens: int) -> bool:
        """Whether `allocate_for(seq_id, num_tokens)` would succeed (a new sequence also needs its slots)."""
        return self._can_cover(seq_id, self.blocks_needed(seq_id, num_tokens))

    def _can_cover(self, seq_id: str, need: int) -> bool:
        """Whether `need` new blocks for `seq_id` are free, and its slots when it is a new sequence."""
        return (seq_id in self._seqs or self.num_free_seq_slots > 0) and self.can_allocate(need)

    # ---- mutation ------------------------------------------------------------------------------------
    def allocate_for(self, seq_id: str, num_tokens: int) -> SequenceSlots:
        """Grow `seq_id`'s table to cover `num_tokens` positions in total; creates the sequence (taking a
        ring and a compressor-state slot) on first use. Never shrinks. All-or-nothing on failure."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        need = self.blocks_needed(seq_id, num_tokens)  # (once: this runs for every sequence of every step)
        if not self._can_cover(seq_id, need):
            raise BlockPoolError(
                f"cannot cover {num_tokens} tokens for {seq_id!r}: need {need} "
                f"blocks, {self.num_free} free; {self.num_free_seq_slots} sequence slots free")
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = SequenceSlots(seq_id, self.block_size, self._window_slots.take(), self._state_slots.take())
            self._seqs[seq_id] = seq
        for _ in range(need):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"block {block} on the free list with refs"
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        seq.num_tokens = max(seq.num_tokens, num_tokens)
        return seq

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> SequenceSlots:
        """Start `child_id` sharing the parent's blocks of its first `num_tokens` positions (refcount + 1).

        Only whole blocks are shared (`num_tokens` a multiple of block_size), because both sequences would
        write into a shared partial block. The child gets fresh ring and compressor-state slots: the engine
        must fill them (V4's window and partial compressor block are per sequence and not paged)."""
        if child_id in self._seqs:
            raise BlockPoolError(f"sequence {child_id!r} already exists")
        parent = self.slots(parent_id)
        if num_tokens % self.block_size or not 0 <= num_tokens <= len(parent.block_table) * self.block_size:
            raise BlockPoolError(f"fork of {num_tokens} tokens: must be whole blocks within the parent's table")
        if self.num_free_seq_slots == 0:
            raise BlockPoolError(f"no free sequence slot to fork {child_id!r}")
        child = SequenceSlots(child_id, self.block_size, self._window_slots.take(), self._state_slots.take())
        child.block_table = parent.block_table[: num_tokens // self.block_size]
        child.num_tokens = num_tokens
        for block in child.block_table:
            self._ref_counts[block] += 1
        self._seqs[child_id] = child
        return child

    def free(self, seq_id: str) -> None:
        """Return everything `seq_id` holds; a block goes back to the free list when its last owner leaves."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise BlockPoolError(f"free of unknown sequence {seq_id!r} (double free?)")
        for block in reversed(seq.block_table):
            if self._ref_counts[block] <= 0:
                raise BlockPoolError(f"block {block} of {seq_id!r} has no references left")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        self._window_slots.give_back(seq.window_slot)
        self._state_slots.give_back(seq.state_slot)

    # ---- checks --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the accounting is inconsistent (tests call this after every step)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        owners = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(seq.block_table) == cdiv(seq.num_tokens, self.block_size), f"{seq.seq_id}: table size"
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.seq_id}: a block twice in a table"
            assert len(seq._table) != len(seq.block_table) or seq._table == tuple(seq.block_table), \
                f"{seq.seq_id}: block_table rewritten in place (it is append-only; the cached tuple is stale)"
            for block in seq.block_table:
                owners[block] += 1
        for block in range(self.num_blocks):
            assert owners[block] == self._ref_counts[block], f"block {block}: refcount != number of tables"
            assert (block in free) == (owners[block] == 0), f"block {block}: free-list membership wrong"
        assert self.num_free + self.num_used == self.num_blocks
        self._window_slots.check()
        self._state_slots.check()
        for slots, attr in ((self._window_slots, "window_slot"), (self._state_slots, "state_slot")):
            taken = [getattr(s, attr) for s in self._seqs.values()]
            assert sorted(taken) == sorted(slots._used), f"{slots.name}: slots and sequences disagree"
