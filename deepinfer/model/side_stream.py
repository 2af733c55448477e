"""Side CUDA streams per device for work that does not depend on the main chain of a layer.

Why: at decode most of a layer's kernels are latency-bound (a few µs each, a few CTAs), and the chain runs
them one after the other while most SMs idle. Work that the chain does not need until later can run on a
side stream at the same time: the shared expert beside the gate, routing and routed experts; the
compressors and the indexer beside the query path. Same kernels, same inputs, same results: only the
order in which independent kernels run changes (no kernel here reads another's output without a join).

Use:
    with forked(device) as branch:   # branch None: run inline (CPU, disabled, or already on the side stream)
        with on_side(branch):
            s = work(x)              # queued on the side stream, after everything queued on main so far
        ...main-chain work...
        join(branch)                 # main waits for the side's work; s may be read from here on
    # leaving the block joins too (a no-op once joined; on an error, main never runs ahead of the side)

Memory: a tensor made on the side stream and read on main after `join` is freed to the side stream's pool
when Python drops it; the side stream reuses it only after its next fork, which main queues after every
read queued so far, so no reuse can overtake a read. Inputs made on main (x) must stay referenced until
`join` (the callers keep them in local variables) so that main cannot reuse them under the side's reads.
CUDA-graph capture: the fork (`wait_stream` on the capturing stream) pulls the side stream into the
capture and the join returns it, so one graph holds both streams (as SGLang's shared-expert overlap).
DEEPINFER_SIDE_STREAMS=0 runs everything inline (the A/B baseline).

Lanes: `forked(device, lane)` forks side stream number `lane` (0 .. LANES - 1), so several independent
chains can run beside main and beside each other (the decode attention's compressors and indexer, see
model/decode_attention.py). One lane hands a result to another with `mark` (an event after the lane's work
so far) and `wait_mark` (the other lane's later work waits for it); nothing else orders lanes against each
other. The memory rule above holds lane to lane: a tensor one lane makes and another reads must stay
referenced until main has joined the reader (the next fork of the maker's lane is queued after that join).
Must not: be used around collectives (the ranks' streams would order them differently).
"""
from __future__ import annotations

import contextlib
from typing import Callable, TypeVar

import torch

from deepinfer import env

T = TypeVar("T")
LANES = 3  # side streams per device
_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device index, lane) -> stream


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side(device: torch.device, lane: int = 0) -> torch.cuda.Stream:
    if not 0 <= lane < LANES:
        raise ValueError(f"side stream lane {lane} out of range 0..{LANES - 1}")
    key = (_index(device), lane)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key[0])
    return _SIDE[key]


class Branch:
    """Side stream `lane`, forked from the device's current stream at construction."""

    def __init__(self, device: torch.device, lane: int = 0) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = _side(device, lane)
        self.side.wait_stream(self.main)  # the side's work starts after everything queued on main so far
        self.joined = False


def beside(device: torch.device | str, lane: int = 0) -> Branch | None:
    """Fork the device's side stream `lane` here, or None where work must run inline: not CUDA, disabled by
    DEEPINFER_SIDE_STREAMS=0, or the current stream is already a side stream (a nested fork)."""
    device = torch.device(device)
    if device.type != "cuda" or not env.side_streams_enabled():
        return None
    current, index = torch.cuda.current_stream(device), _index(device)
    if any(current == s for (i, _), s in _SIDE.items() if i == index):
        return None
    return Branch(device, lane)


@contextlib.contextmanager
def on_side(branch: Branch | None):
    """Queue the block's work on the branch's side stream (inline when branch is None)."""
    if branch is None:
        yield
        return
    if branch.joined:
        raise RuntimeError("on_side: this branch was already joined; fork a new one with beside()")
    with torch.cuda.stream(branch.side):
        yield


@contextlib.contextmanager
def forked(device: torch.device | str, lane: int = 0):
    """`beside(device, lane)` for the block, joined when the block ends however it ends (an early return, an
    error): main never runs ahead of reads the side stream may still make of main's tensors."""
    branch = beside(device, lane)
    try:
        yield branch
    finally:
        join(branch)


def mark(branch: Branch | None) -> torch.cuda.Event | None:
    """An event after everything queued on the branch's side stream so far (None for an inline branch):
    what another lane's `wait_mark` waits for."""
    if branch is None:
        return None
    event = torch.cuda.Event()
    event.record(branch.side)
    return event


def wait_mark(branch: Branch | None, event: torch.cuda.Event | None) -> None:
    """Work queued on the branch's side stream from here on waits for `event` (another lane's `mark`).
    Inline branches need no wait: their work runs in program order."""
    if branch is None or event is None:
        return
    if branch.joined:
        raise RuntimeError("wait_mark: this branch was already joined; fork a new one with beside()")
    branch.side.wait_event(event)


def side_work(branch: Branch | None, work: Callable[[], T], later: bool = False) -> Callable[[], T]:
    """`work()` queued on the branch's side stream now, or (later) at the first call of the returned getter,
    which gives its result either way: main-chain work the caller queues in between then starts first in a
    replayed graph (the MoE layers' routing before their shared expert, env.route_first_enabled)."""
    def run() -> T:
        with on_side(branch):
            return work()

    if not later:
        result = run()
        return lambda: result
    done: list = []

    def get() -> T:
        if not done:
            done.append(run())
        return done[0]
    return get


def join(branch: Branch | None) -> None:
    """Main waits for everything queued on the side stream so far (nothing for an inline branch)."""
    if branch is not None and not branch.joined:
        branch.main.wait_stream(branch.side)
        branch.joined = True
