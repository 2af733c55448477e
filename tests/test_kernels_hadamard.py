"""The Triton `hadamard32` (deepinfer/kernels/triton/hadamard.py) against its torch twin
`official.hadamard32`: under the Triton interpreter on CPU (a fresh process, with the GPU's fp32 -> bf16
rounding restored by `GPU_ROUNDINGS`), on cuda (-m gpu) at V4's shapes, non-contiguous inputs and CUDA
graph replay; and its twin fallback (other dtypes, CPU tensors) is the twin exactly.
Bounds: rel_err <= 2e-3 (tests/test_kernels_attn.py's kernel-vs-twin bound for bf16 outputs); the kernel's
fp32 sums differ from the twin's GEMM only in order, then both round to bf16 once, so nearly every element
is the same bits and the rest one bf16 ulp away (except where the sum cancels to near zero: there the
fp32 order difference is absolute, not relative, and is bounded absolutely)."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_ran_ok, run_interpreted
from deepinfer.kernels import official

BF16 = torch.bfloat16
BF16_BOUND = 2e-3
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and signed zeros included)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def _kernel():
    pytest.importorskip("triton")  # CI has no triton: skip cleanly
    from deepinfer.kernels.triton import hadamard

    return hadamard


# ------------------------------------------------------------------------------ CPU: the twin fallback
@pytest.mark.parametrize("shape", [(5, 128), (3, 4, 128), (2, 64), (1, 256), (4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fallback_is_the_twin_on_cpu(shape, dtype, monkeypatch):
    """Off the interpreter a CPU tensor (any dtype) goes to the twin: the same bits."""
    hadamard = _kernel()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])).to(dtype)
    assert _same(hadamard.hadamard32(x), official.hadamard32(x))


@pytest.mark.parametrize("shape", [(4, 3), (2, 96), (5, 0), ()])
def test_rejects_a_last_dim_that_is_not_a_power_of_two(shape):
    hadamard = _kernel()
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard32(torch.zeros(shape, dtype=BF16))


def test_registration():
    hadamard = _kernel()
    assert hadamard.REGISTRATIONS == {"hadamard32": hadamard.hadamard32}


# ------------------------------------------------------------------------- Triton, interpreter on CPU
_INTERPRET_CHECK = """
from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter
exec(GPU_ROUNDINGS)
import torch

from test_kernels_hadamard import BF16_BOUND, _rel, _same
from deepinfer.kernels import official
from deepinfer.kernels.triton import hadamard

g = torch.Generator().manual_seed(0)
for shape in [(5, 128), (3, 4, 128), (2, 64), (1, 256), (130, 16), (3, 32), (0, 128)]:
    x = torch.randn(*shape, generator=g).bfloat16()
    got, want = hadamard.hadamard32(x), official.hadamard32(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape, (shape, got.dtype, got.shape)
    if x.numel():
        assert _rel(got, want) <= BF16_BOUND, (shape, _rel(got, want))
        same = float((got.view(torch.int16) == want.view(torch.int16)).float().mean())
        assert same >= 0.95, (shape, same)
base = torch.randn(3, 4, 256, generator=g).bfloat16()
tall = torch.randn(3, 128, 4, generator=g).bfloat16()
for x in (base[..., :128], tall.transpose(1, 2)):  # a row stride of 256; a column stride of 4 (copied)
    assert not x.is_contiguous()
    assert _same(hadamard.hadamard32(x), hadamard.hadamard32(x.contiguous())), tuple(x.stride())
x = torch.randn(3, 4, 128, generator=g)
assert _same(hadamard.hadamard32(x), official.hadamard32(x))  # float32: the twin
x = torch.randn(3, 1024, generator=g).bfloat16()
assert _same(hadamard.hadamard32(x), official.hadamard32(x))  # d > 256: the twin
print("ok")
"""


def test_triton_hadamard32_under_the_interpreter():
    """The kernel vs the twin on CPU bf16 inputs (TRITON_INTERPRET=1 in a fresh process: read at import)."""
    pytest.importorskip("triton")
    res = run_interpreted(_INTERPRET_CHECK, timeout=600)
    assert_ran_ok(res)


# ---------------------------------------------------------------------------------------------- cuda
def _check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """rel_err <= 2e-3, >= 99% the same bits, <= 1 bf16 ulp per element of the same sign; where the sum
    cancels (|want| < 2**-7 rms) the fp32 order difference may exceed one ulp of the tiny result, so there
    the bound is absolute (2**-12 rms: above d * 2**-24 * sum|x| * d**-0.5 for these random inputs)."""
    assert got.shape == want.shape and got.dtype == want.dtype == BF16 and bool(torch.isfinite(got).all())
    assert _rel(got, want) <= BF16_BOUND
    rms = float(want.double().pow(2).mean().sqrt())
    small = want.float().abs() < 2**-7 * rms
    same_sign = torch.signbit(got) == torch.signbit(want)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert bool((same_sign | small).all()) and int(ulps[~small].max()) <= 1
    if bool(small.any()):
        assert float((got.float() - want.float())[small].abs().max()) <= 2**-12 * rms
    assert float((got.view(torch.int16) == want.view(torch.int16)).float().mean()) >= 0.99


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 64, 128), (1, 64, 128), (300, 128), (7, 256), (33, 16), (5, 3, 64)])
def test_triton_hadamard32_matches_the_twin(shape):
    hadamard = _kernel()
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(*shape, generator=g).bfloat16().cuda()
    _check_close(hadamard.hadamard32(x), official.hadamard32(x))


@gpu
@needs_cuda
def test_triton_hadamard32_non_contiguous_input():
    """A row stride wider than d (the viewable slice) and a column stride != 1 (copied first): the bits of
    the contiguous copy's result."""
    hadamard = _kernel()
    g = torch.Generator().manual_seed(1)
    base = torch.randn(257, 64, 256, generator=g).bfloat16().cuda()
    tall = torch.randn(257, 128, 64, generator=g).bfloat16().cuda()
    for x in (base[..., :128], base[..., 128:], tall.transpose(1, 2)):
        assert not x.is_contiguous()
        got = hadamard.hadamard32(x)
        assert got.is_contiguous() and _same(got, hadamard.hadamard32(x.contiguous()))
        _check_close(got, official.hadamard32(x))


@gpu
@needs_cuda
def test_triton_hadamard32_in_a_cuda_graph():
    """Captured once (after a warm-up call: compilation and the cached H happen outside the capture),
    replayed on new data: the eager call's bits."""
    hadamard = _kernel()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, 128, generator=g).bfloat16().cuda()
    hadamard.hadamard32(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hadamard.hadamard32(x)
    fresh = torch.randn(300, 64, 128, generator=g).bfloat16().cuda()
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert _same(out, hadamard.hadamard32(fresh))
    _check_close(out, official.hadamard32(fresh))
