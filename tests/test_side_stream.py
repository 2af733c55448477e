"""`model/side_stream.py`: where a fork runs inline, the branch's contract, and (GPU) that work on the side
stream is ordered after main's work before the fork and before main's work after the join.
The engine-level check (graph replay with side streams == eager without them, bit for bit) is in
tests/test_engine_fast_decode.py."""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import side_stream
from deepinfer.model.side_stream import beside, forked, join, mark, on_side, wait_mark


def test_cpu_and_disabled_forks_run_inline(monkeypatch):
    assert beside("cpu") is None
    with on_side(None):  # an inline branch: the block runs where it is
        x = torch.ones(3) * 2
    join(None)
    assert x.sum().item() == 6
    assert mark(None) is None
    wait_mark(None, None)  # inline lanes run in program order: nothing to wait for
    monkeypatch.setenv("DEEPINFER_SIDE_STREAMS", "0")
    assert beside(torch.device("cuda", 0)) is None  # disabled before any CUDA call: no device needed
    assert beside(torch.device("cuda", 0), lane=2) is None


@pytest.mark.gpu
def test_side_stream_orders_against_main():
    dev = torch.device("cuda")
    branch = beside(dev)
    assert branch is not None and branch.side != branch.main
    # main: a long chain of writes into a; the side must see its final value (ordered after the fork)
    a = torch.zeros(1 << 22, device=dev)
    for _ in range(50):
        a.add_(1.0)
    branch = beside(dev)
    with on_side(branch):
        assert torch.cuda.current_stream(dev) == branch.side
        assert beside(dev) is None  # nested: inline on the side stream
        b = a * 2  # reads a after main's 50 adds
        for _ in range(50):
            b.add_(1.0)
    join(branch)
    c = b + 0  # main, after the join: sees the side's 50 adds
    assert torch.cuda.current_stream(dev) == branch.main
    assert torch.all(c == 150.0)
    with pytest.raises(RuntimeError, match="already joined"):
        with on_side(branch):
            pass
    assert (torch.cuda.current_device(), 0) in side_stream._SIDE
    assert all(i == torch.cuda.current_device() and 0 <= lane < side_stream.LANES for i, lane in side_stream._SIDE)


@pytest.mark.gpu
def test_side_stream_is_captured_in_a_cuda_graph():
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev)
    side_stream_out = {}

    def step():
        branch = beside(dev)
        with on_side(branch):
            s = (x * 3).sin()
        m = (x * 2).cos()
        join(branch)
        side_stream_out["y"] = m + s
        return side_stream_out["y"]

    ref = step().clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s0 = torch.cuda.Stream()
    s0.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s0):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s0)
    with torch.cuda.graph(g):
        out = step()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (x * 2).cos() + (x * 3).sin())
    assert not torch.equal(out, ref)


def test_forked_is_inline_on_cpu():
    with side_stream.forked("cpu") as branch:
        assert branch is None


@pytest.mark.gpu
def test_forked_joins_when_the_block_ends_even_on_an_error():
    dev = torch.device("cuda")
    with pytest.raises(ValueError, match="planted"):
        with side_stream.forked(dev) as branch:
            with on_side(branch):
                torch.ones(4, device=dev).add_(1)
            raise ValueError("planted")
    assert branch.joined and torch.cuda.current_stream(dev) == branch.main


@pytest.mark.gpu
def test_lanes_run_beside_each_other_and_hand_over_by_marks():
    """Three lanes forked at one point: each is ordered after main's work before the fork; a lane that
    waits on another's mark sees that lane's writes up to the mark (and not necessarily later ones); main
    sees every lane's work after the joins; a nested fork from a lane runs inline."""
    dev = torch.device("cuda")
    a = torch.zeros(1 << 22, device=dev)
    for _ in range(20):
        a.add_(1.0)  # main: 20
    with forked(dev, 0) as l0, forked(dev, 1) as l1, forked(dev, 2) as l2:
        assert len({l0.side, l1.side, l2.side, l0.main}) == 4
        with on_side(l0):
            b = a * 2  # 40, after main's adds
            for _ in range(30):
                b.add_(1.0)  # 70
        ready = mark(l0)
        with on_side(l1):
            assert beside(dev, 2) is None  # nested: inline on lane 1
            c = a + 5  # 25
            for _ in range(30):
                c.mul_(1.0)  # a long chain on lane 1 beside lane 0's
        c_ready = mark(l1)
        with on_side(l2):
            wait_mark(l2, ready)
            wait_mark(l2, c_ready)
            d = b + c  # 95: lane 0's b and lane 1's c, each after its mark
    assert torch.all(b == 70.0) and torch.all(c == 25.0) and torch.all(d == 95.0)
    with pytest.raises(RuntimeError, match="already joined"):
        wait_mark(l2, ready)


def test_side_work_now_or_at_its_first_read():
    """side_work: queued at once (later False) or at the getter's first call (later True: the caller's work in
    between is queued first), run once either way, its result from every call."""
    from deepinfer.model.side_stream import side_work

    calls = []
    for later in (False, True):
        calls.clear()
        get = side_work(None, lambda: calls.append("work") or len(calls), later=later)
        calls.append("between")
        assert get() == get() == (2 if later else 1)
        assert calls == (["between", "work"] if later else ["work", "between"])
