"""Per-batch forward state: which sequences are in the flat token batch and where their caches live.

Owns: `SeqContext` (one sequence: start position, number of new tokens, window-ring slot, compressor-state
slot, block table), `ForwardContext` (the batch, derived token positions and row offsets) and the
`forward_context(ctx)` context manager that makes it visible to the layers (a ContextVar: no module
global set/reset pairs, safe across threads). Must not: touch cache tensors or model weights.
"""
from __future__ import annotations

import contextlib
import copy
import contextvars
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

from deepinfer.devices import host_to_device


@dataclass(frozen=True)
class SeqContext:
    """One sequence of the batch: it extends its cached state [0, start_pos) by `num_new` tokens."""

    start_pos: int
    num_new: int
    window_slot: int
    state_slot: int
    block_table: tuple[int, ...] = ()  # block i holds token positions [i*block_size, (i+1)*block_size)

    def __post_init__(self) -> None:
        if self.start_pos < 0 or self.num_new <= 0:
            raise ValueError(f"need start_pos >= 0 and num_new > 0, got {self.start_pos}, {self.num_new}")
        bt = self.block_table
        # normalised to a tuple of Python ints; a tuple that already starts with one is taken as it is (the
        # scheduler's tables are lists of ints: this runs for every sequence of every step, and converting
        # each entry cost 0.67 ms per b128 step with 64-block tables, more than the graph's host work)
        if type(bt) is not tuple or (bt and type(bt[0]) is not int):
            object.__setattr__(self, "block_table", tuple(map(int, bt)))

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_new

    @classmethod
    def from_slots(cls, slots, start_pos: int, num_new: int) -> "SeqContext":
        """From a `cache.block_pool.SequenceSlots` (duck-typed: no import of the pool needed), with its cached
        `table` tuple (no per-step copy of a table that grows with the context)."""
        return cls(start_pos, num_new, slots.window_slot, slots.state_slot, slots.table)


@dataclass(frozen=True)
class ForwardContext:
    """A varlen batch: the flat token tensor holds seqs[0]'s new tokens, then seqs[1]'s, ...

    all_logits=False: the model returns the logits of each sequence's LAST new token ([num_seqs, V]);
    True: of every token ([num_tokens, V]).
    """

    seqs: tuple[SeqContext, ...]
    all_logits: bool = False
    cu_tokens: tuple[int, ...] = field(init=False)  # row offsets: seq i owns rows [cu[i], cu[i+1])
    positions: torch.Tensor = field(init=False)  # [num_tokens] int64 absolute positions

    def __post_init__(self) -> None:
        seqs = tuple(self.seqs)
        if not seqs:
            raise ValueError("empty batch")
        if len({s.window_slot for s in seqs}) != len(seqs) or len({s.state_slot for s in seqs}) != len(seqs):
            raise ValueError("two sequences of one batch share a window or state slot")
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        counts = np.fromiter((s.num_new for s in seqs), dtype=np.int64, count=len(seqs))
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        # token t of sequence i sits at start_i + (t - cu_i): one vectorised build (a torch.arange per
        # sequence and a cat took 0.46 ms per batch-128 step on the CPU machine, this ~0.05 ms)
        pos = torch.from_numpy(np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(starts - cu[:-1], counts))
        cu = cu.tolist()
        object.__setattr__(self, "seqs", seqs)
        object.__setattr__(self, "cu_tokens", tuple(cu))
        object.__setattr__(self, "positions", pos)

    @property
    def num_tokens(self) -> int:
        return self.cu_tokens[-1]

    def rows(self, i: int) -> slice:
        return slice(self.cu_tokens[i], self.cu_tokens[i + 1])

    def logit_rows(self) -> torch.Tensor:
        """Rows of the flat batch whose logits are returned (row i of the result = this row)."""
        if self.all_logits:
            return torch.arange(self.num_tokens)
        return torch.tensor([c - 1 for c in self.cu_tokens[1:]])

    def on(self, device: torch.device | str) -> "ForwardContext":
        """The same batch with its per-token tensors (positions) on `device`: one host-to-device copy per
        step instead of one per layer."""
        if self.positions.device == torch.device(device):
            return self
        moved = copy.copy(self)
        object.__setattr__(moved, "positions", host_to_device(self.positions, device))
        return moved

    @classmethod
    def build(cls, seqs: Sequence[SeqContext], all_logits: bool = False) -> "ForwardContext":
        return cls(tuple(seqs), all_logits)


def resolve_device(device: str | torch.device) -> torch.device:
    """An engine's torch device; "cuda" means the current CUDA device, with its index (params, caches and the
    model compare devices, and `torch.device("cuda") != torch.device("cuda", 0)`)."""
    d = torch.device(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"EngineConfig(device={str(device)!r}) but torch sees no CUDA device")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("deepinfer_forward_ctx", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current batch for the duration of the block (nesting restores the outer one)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("no ForwardContext: call the model inside `with forward_context(ctx):`")
    return ctx


def check_batch(token_ids: torch.Tensor, ctx: ForwardContext, cfg, cache) -> None:
    """Clear errors for a malformed batch: flat ids of the right count in the vocabulary, slots in range,
    block tables covering every position whose compressed entries the step writes."""
    if token_ids.dim() != 1 or token_ids.shape[0] != ctx.num_tokens:
        raise ValueError(f"token_ids must be flat [{ctx.num_tokens}], got {tuple(token_ids.shape)}")
    if token_ids.device.type == "cpu":
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= cfg.vocab_size:
            raise ValueError("token id outside the vocabulary")
    elif token_ids.numel():  # device ids (benchmarks, drafters): checked on the device, no host sync
        ok = ((token_ids >= 0) & (token_ids < cfg.vocab_size)).all()
        torch._assert_async(ok, "token id outside the vocabulary")
    for s in ctx.seqs:
        if not (0 <= s.window_slot < cache.max_num_seqs and 0 <= s.state_slot < cache.max_num_seqs):
            raise ValueError(f"slot out of range in {s}")
        if len(s.block_table) * cache.block_size < s.end_pos and any(s.end_pos // r for r in cfg.compress_ratios if r):
            raise ValueError(f"block table of {len(s.block_table)} blocks does not cover position {s.end_pos - 1}")
