"""The shared experts' SwiGLU op `swiglu_bf16` (official numerics: fp32 clamps and silu * up on the bf16 GEMM
outputs, one bf16 rounding).

CPU: the twin is exactly the torch ops the engine ran before the op existed (bit for bit).
Triton (interpreter on CPU, and -m gpu on cuda, fresh random inputs): within one bf16 ulp of the twin and
>= 99% of the elements the same bits (silu's exp and division are Triton's, not libm's: see the module).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import assert_ran_ok, run_interpreted
from deepinfer import kernels
from deepinfer.kernels import official

BF16 = torch.bfloat16


def _old_inline(gate, up, limit, weight):
    """What model/moe.py computed before: upcasts, clamps, silu * up, weight, bf16."""
    gate, up = gate.to(torch.float32), up.to(torch.float32)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = weight * h
    return h.to(BF16)


def _inputs(t, n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(t, n, generator=g) * 6).to(BF16)  # beyond the limit 10 at times: the clamps act
    up = (torch.randn(t, n, generator=g) * 6).to(BF16)
    w = torch.rand(t, 1, generator=g)
    return gate.to(device), up.to(device), w.to(device)


@pytest.mark.parametrize("limit", [0.0, 10.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_twin_is_the_inline_torch_ops(limit, weighted):
    gate, up, w = _inputs(9, 256, 1)
    w = w if weighted else None
    assert torch.equal(official.swiglu_bf16(gate, up, limit, w), _old_inline(gate, up, limit, w))
    assert kernels.get("swiglu_bf16") is official.swiglu_bf16


_CLOSE = """
def close(got, want, what):
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, what
    both = torch.isfinite(want)
    assert bool(torch.equal(both, torch.isfinite(got))), what
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()[both]
    same = float((ulps == 0).float().mean())
    assert int(ulps.max()) <= 1 and same >= 0.99, (what, int(ulps.max()), same)
    return same
"""

_INTERPRET_CHECK = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch
from test_kernels_swiglu import _CLOSE, _inputs
from deepinfer.kernels import official
from deepinfer.kernels.triton import swiglu
exec(_CLOSE)
for t, n, limit, weighted in [(3, 256, 10.0, False), (2, 300, 0.0, True), (1, 2048, 10.0, True)]:
    gate, up, w = _inputs(t, n, t + n)
    w = w if weighted else None
    close(swiglu.swiglu_bf16(gate, up, limit, w), official.swiglu_bf16(gate, up, limit, w), (t, n, limit, weighted))
try:
    swiglu.swiglu_bf16(*_inputs(2, 8, 0)[:2], 10.0, torch.ones(3, 1))
    raise SystemExit("a weight of the wrong length was accepted")
except ValueError as err:
    assert "weight" in str(err)
print("ok")
"""


def test_triton_under_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=600)
    assert_ran_ok(res)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 37, 8192])
@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_triton_matches_the_twin_on_cuda(t, limit):
    """V4-Flash's shared expert (N = 2048) at decode and prefill sizes, with and without a routing weight."""
    from deepinfer.kernels.triton import swiglu

    ns: dict = {"torch": torch}
    exec(_CLOSE, ns)
    gate, up, w = _inputs(t, 2048, t, "cuda")
    for weight in (None, w):
        got = swiglu.swiglu_bf16(gate, up, limit, weight)
        same = ns["close"](got, official.swiglu_bf16(gate, up, limit, weight), (t, limit, weight is None))
        print(f"swiglu_bf16 T={t} limit={limit} weighted={weight is not None}: {same:.4%} identical")
    # a strided gate/up (the halves of one [T, 2N] GEMM output) gives the same bits as contiguous copies
    both = torch.cat([gate, up], dim=1)
    assert torch.equal(swiglu.swiglu_bf16(both[:, :2048], both[:, 2048:], limit),
                       swiglu.swiglu_bf16(gate.contiguous(), up.contiguous(), limit))
