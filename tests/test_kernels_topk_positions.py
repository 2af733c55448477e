"""Op "topk_positions" (kernels/triton/topk_positions.py: a row's stable top-k in position order by two histogram
passes and a compaction, no sort) against its twin (`torch_ops.topk_positions` = `stable_topk(...).sort()`),
and op "stable_topk" (the same selection, then the k picks sorted by value descending, ties by position)
against `torch_ops.stable_topk` (a stable sort of the whole row), index for index: under the interpreter on
the CPU and on the GPU (`-m gpu`, fresh random rows).

The rows are built to break a wrong selection: heavy exact ties at and around the threshold (relu zeros,
a few repeated values), -0.0 beside +0.0 (torch orders them equal), -inf (hidden entries), NaN (torch sorts
it above +inf), rows whose k-th value sits in a high byte shared with many others, E around the chunk size
(1023 / 1024 / 1025 / 2500 and 65536 on the GPU), k from 1 to E and above it (min(k, E) columns).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import torch_ops
from interpreted import assert_ran_ok, run_check

CASES = [(1, 7, 3), (3, 1023, 512), (2, 1024, 1024), (2, 1025, 1), (2, 2500, 512), (4, 64, 65), (5, 300, 17)]


def rows(r: int, e: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """bf16 [r, e]: row 0 mixed (random, zeros, -0.0, -inf, two NaN), row 1 few distinct values (ties at
    every threshold), the rest random with relu zeros."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(r, e, generator=g)
    s[:, ::3] = 0.0
    s = s.bfloat16()
    s[0, 1::7] = -0.0
    s[0, 2::11] = float("-inf")
    if e > 20:
        s[0, 5] = s[0, 17] = float("nan")
    if r > 1:
        s[1] = torch.randint(0, 4, (e,), generator=g).bfloat16() * 0.25
    return s.to(device)


def _check(device: str) -> None:
    from deepinfer.kernels.triton.topk_positions import stable_topk, topk_positions

    for i, (r, e, k) in enumerate(CASES):
        s = rows(r, e, 80 + i, device)
        got, want = topk_positions(s, k), torch_ops.topk_positions(s.cpu(), k)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), (r, e, k)
        got, want = stable_topk(s, k), torch_ops.stable_topk(s.cpu(), k)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), ("stable_topk", r, e, k)
    same = torch.full((2, 40), 0.5, dtype=torch.bfloat16, device=device)  # every value tied: the first k positions
    assert torch.equal(topk_positions(same, 9).cpu(), torch.arange(9).expand(2, 9))
    assert torch.equal(stable_topk(same, 9).cpu(), torch.arange(9).expand(2, 9))
    for shape, k in (((3, 0), 5), ((0, 7), 3), ((2, 5), 0)):  # no entries yet, no rows, k = 0: empty, as the twin
        empty = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        for op, twin in ((topk_positions, torch_ops.topk_positions), (stable_topk, torch_ops.stable_topk)):
            got, want = op(empty, k), twin(empty.cpu(), k)
            assert got.shape == want.shape and got.dtype == torch.int64, (shape, k, got.shape, want.shape)


def _check_rows(device: str) -> None:
    """stable_topk_rows with DEEPINFER_TOPK_ROWS=fused (one kernel) == the two launches (stable_topk, then
    decode_select_rows) == the twin, integers equal: ties, NaN, -inf; picks below, at and past visible (a row
    that sees no entry, one that sees all); k past E; windows of 7 and 128 rows."""
    import os

    from deepinfer import kernels
    from deepinfer.kernels.decode_rows import stable_topk_rows_torch
    from deepinfer.kernels.triton.topk_positions import stable_topk_rows

    g = torch.Generator().manual_seed(5)
    for i, (r, e, k, w) in enumerate([(3, 1023, 512, 128), (4, 64, 65, 7), (2, 300, 17, 128), (1, 2500, 512, 16)]):
        s = rows(r, e, 90 + i, device)
        window = torch.randint(-1, 5000, (r, w), generator=g).to(device)
        entry = torch.randint(0, 9000, (r, e), generator=g).to(device)
        visible = torch.randint(0, e + 1, (r,), generator=g)
        visible[0] = 0
        visible[-1] = e
        visible = visible.to(device)
        want = stable_topk_rows_torch(s.cpu(), k, window.cpu(), visible.cpu(), entry.cpu(), 4096)
        os.environ["DEEPINFER_TOPK_ROWS"] = "apart"
        apart = stable_topk_rows(s, k, window, visible, entry, 4096)  # two launches
        os.environ["DEEPINFER_TOPK_ROWS"] = "fused"  # (the default)
        saved = dict(kernels._REGISTRY)

        def apart_op(*a, **kw):
            raise AssertionError("the fused form took the two launches")
        kernels.register("decode_select_rows", apart_op, device="cuda")
        try:
            fused = stable_topk_rows(s, k, window, visible, entry, 4096)
        finally:
            del os.environ["DEEPINFER_TOPK_ROWS"]
            kernels._REGISTRY.clear()
            kernels._REGISTRY.update(saved)
        assert apart.dtype == fused.dtype == torch.int64, (r, e, k)
        assert torch.equal(apart.cpu(), want) and torch.equal(fused.cpu(), want), (r, e, k, w)
        assert r == 1 or torch.all(fused[0, w:] == -1)


def test_stable_topk_rows_twin_is_the_two_ops():
    from deepinfer import kernels
    from deepinfer.kernels.decode_rows import decode_select_rows_torch, stable_topk_rows_torch

    s = rows(3, 200, 4)
    window = torch.randint(-1, 500, (3, 16))
    entry = torch.randint(0, 900, (3, 200))
    visible = torch.tensor([0, 57, 200])
    want = decode_select_rows_torch(window, torch_ops.stable_topk(s, 64), visible, entry, 128)
    assert torch.equal(stable_topk_rows_torch(s, 64, window, visible, entry, 128), want)
    assert kernels.get("stable_topk_rows", "cpu") is stable_topk_rows_torch


def test_stable_topk_rows_under_the_interpreter():
    assert_ran_ok(run_check("test_kernels_topk_positions", "_check_rows('cpu')"))


def test_topk_rows_env_choice(monkeypatch):
    from deepinfer import env

    assert env.topk_rows_fused()  # the default since the fortieth session's H100 runs
    monkeypatch.setenv("DEEPINFER_TOPK_ROWS", "APART")
    assert not env.topk_rows_fused()
    monkeypatch.setenv("DEEPINFER_TOPK_ROWS", "kernel")
    with pytest.raises(ValueError, match="DEEPINFER_TOPK_ROWS='kernel'"):
        env.topk_rows_fused()


def test_twin_is_the_stable_top_k_in_position_order():
    s = torch.tensor([[0.5, 2.0, 0.5, -1.0, 2.0, 0.5]]).bfloat16()
    assert torch_ops.topk_positions(s, 4).tolist() == [[0, 1, 2, 4]]  # 2.0, 2.0, then the first two 0.5 ties


def test_twin_stable_topk_orders_by_value_then_position():
    s = torch.tensor([[0.5, 2.0, 0.5, -1.0, 2.0, 0.5, float("nan"), -0.0, 0.0]]).bfloat16()
    assert torch_ops.stable_topk(s, 6).tolist() == [[6, 1, 4, 0, 2, 5]]  # NaN first, ties by position
    assert torch_ops.stable_topk(s, 9).tolist()[0][-3:] == [7, 8, 3]  # -0.0 and +0.0 equal: by position


def test_off_device_rows_and_other_dtypes_take_the_twin():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.topk_positions import stable_topk, topk_positions

    s = rows(3, 100, 1)
    assert torch.equal(topk_positions(s, 10), torch_ops.topk_positions(s, 10))
    assert torch.equal(topk_positions(s.float(), 10), torch_ops.topk_positions(s.float(), 10))
    assert torch.equal(stable_topk(s, 10), torch_ops.stable_topk(s, 10))
    assert torch.equal(stable_topk(s.float(), 10), torch_ops.stable_topk(s.float(), 10))
    with pytest.raises(ValueError, match="k must be >= 0"):
        topk_positions(s, -1)
    with pytest.raises(ValueError, match="k must be >= 0"):
        stable_topk(s, -1)


def test_stable_topk_kernel_rule(monkeypatch):
    """Which stable_topk calls take the kernel: decode-sized row counts (up to STABLE_TOPK_MAX_ROWS) by default,
    every count with DEEPINFER_STABLE_TOPK=kernel, none with =torch; never k past STABLE_TOPK_MAX_K."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.topk_positions import (STABLE_TOPK_MAX_K, STABLE_TOPK_MAX_ROWS,
                                                         _use_stable_topk_kernel)

    monkeypatch.delenv("DEEPINFER_STABLE_TOPK", raising=False)
    assert _use_stable_topk_kernel(1, 512) and _use_stable_topk_kernel(STABLE_TOPK_MAX_ROWS, 512)
    assert not _use_stable_topk_kernel(STABLE_TOPK_MAX_ROWS + 1, 512)  # a prefill: the twin's sort
    assert not _use_stable_topk_kernel(1, STABLE_TOPK_MAX_K + 1)
    monkeypatch.setenv("DEEPINFER_STABLE_TOPK", "kernel")
    assert _use_stable_topk_kernel(8192, 512) and not _use_stable_topk_kernel(1, STABLE_TOPK_MAX_K + 1)
    monkeypatch.setenv("DEEPINFER_STABLE_TOPK", "torch")
    assert not _use_stable_topk_kernel(1, 512)


def test_topk_positions_under_the_interpreter():
    assert_ran_ok(run_check("test_kernels_topk_positions", "_check('cpu')"))


@pytest.mark.gpu
def test_topk_positions_on_the_gpu():
    """The cases above, then decode-sized rows (batch 1..64, E up to 65536: a 128K context at ratio 2, k 512)
    from fresh seeds, and a leading batch dim (the varlen path's [S, E])."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton.topk_positions import topk_positions

    _check("cuda")
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    from deepinfer.kernels.triton.topk_positions import stable_topk

    for i, (r, e) in enumerate([(1, 1024), (8, 4096), (64, 1024), (1, 65536), (4, 65536)]):
        s = rows(r, e, seed + i, "cuda")
        for k in (1, 512, e):
            assert torch.equal(topk_positions(s, k).cpu(), torch_ops.topk_positions(s.cpu(), k)), (seed, r, e, k)
            if k <= 4096:  # the sort of the picks holds up to a few thousand keys in one program's registers
                assert torch.equal(stable_topk(s, k).cpu(), torch_ops.stable_topk(s, k).cpu()), (seed, r, e, k)
    _check_rows("cuda")
    s = rows(6, 3000, seed, "cuda").view(2, 3, 3000)
    assert torch.equal(topk_positions(s, 512).cpu(), torch_ops.topk_positions(s.cpu(), 512))
    assert torch.equal(stable_topk(s, 512).cpu(), torch_ops.stable_topk(s, 512).cpu())  # the CUDA sort's order
