"""`kernels.triton.launch.fast_launch`: a launched Triton kernel's later calls skip the JIT's dispatch, and
must never reuse a compiled kernel for arguments the JIT would have compiled differently.

CPU: the binding of positional, keyword and default arguments and the specialisation key (alignment, int
== 1 / % 16 / range, dtype, constexpr values, options).
GPU (-m gpu): a test kernel over fresh random inputs against torch for every specialisation that matters
(misaligned pointers after aligned ones, n = 1 / 16 / 17, dtypes, constexprs, a callable grid), cache hits
counted; and registered ops bit-identical with the fast path on and off."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from deepinfer.kernels.triton import launch  # noqa: E402
from deepinfer.kernels.triton.launch import FastLaunch, _spec, fast_launch  # noqa: E402


@fast_launch
@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = alpha * x + y
    if ADD_ONE:
        r += 1.0
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=m)


def test_binding_fills_defaults_and_separates_options():
    k = _axpy_kernel
    assert isinstance(k, FastLaunch)
    vals, options = k._bind((1, 2, 3, 4, 0.5), {"BLOCK": 64, "num_warps": 2})
    assert vals == [1, 2, 3, 4, 0.5, 64, False] and options == (("num_warps", 2),)
    vals, options = k._bind((1, 2, 3, 4, 0.5, 64, True), {})
    assert vals[-1] is True and options == ()
    assert k._bind((1, 2, 3, 4, 0.5), {}) is None  # BLOCK has no default: the JIT reports it
    assert k._bind((1, 2, 3, 4, 0.5, 64, True, 9), {}) is None


def test_specialisation_key_is_at_least_as_fine_as_tritons():
    assert _spec(1) != _spec(2) and _spec(16) != _spec(17) and _spec(32) == _spec(48)
    assert _spec(2**31) != _spec(2**31 - 16) and _spec(2**63) != _spec(2**63 - 16)
    assert _spec(True) != _spec(1) and _spec(0.5) == _spec(2.0) and _spec(None) is type(None)
    t = torch.zeros(8, dtype=torch.float32)
    assert _spec(t) == (torch.float32, True) and _spec(t[1:]) == (torch.float32, False)
    assert _spec(t.to(torch.bfloat16)) != _spec(t)
    assert _spec((1, 2)) is launch._MISSING  # anything else: the JIT every time


def test_equal_keys_mean_equal_triton_specialisations():
    """Soundness against Triton itself: whenever two arguments get the same key here, Triton's own
    specialiser (the native one the JIT's binder calls, with the CUDA backend) gives them the same
    specialisation, so a cached kernel is never launched with an argument it was not compiled for."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
            2**63 - 16, 2**63, 2**63 + 16, -(2**31), -(2**31) - 16]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[8:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.bfloat16)[1:], base.to(torch.int64)]
    values = ints + tensors + [True, False, 0.5, 3.0, None]
    for a in values:
        for b in values:
            if _spec(a) == _spec(b):
                ta = native_specialize_impl(CUDABackend, a, False, True, True)
                tb = native_specialize_impl(CUDABackend, b, False, True, True)
                assert ta == tb, (a, b, ta, tb)


@pytest.mark.gpu
def test_every_specialisation_launches_the_right_kernel(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    g = torch.Generator(device="cuda").manual_seed(0)
    k = _axpy_kernel
    k.kernels.clear()
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 16, 17, 1000):
            for offset in (0, 1):  # offset 1: a pointer off 16-byte alignment
                for add_one in (False, True):
                    cases.append((dtype, n, offset, add_one))
    for rnd in range(2):  # the second round: every key is cached, every launch is a hit
        hits = k.hits
        for dtype, n, offset, add_one in cases:
            x = torch.randn(n + offset, device="cuda", generator=g).to(dtype)[offset:]
            y = torch.randn(n + offset, device="cuda", generator=g).to(dtype)[offset:]
            out = torch.full((n + offset,), float("nan"), device="cuda", dtype=dtype)[offset:]
            # a power of two: alpha * x is exact, so the kernel's fused multiply-add (ptxas contracts
            # alpha * x + y) rounds as torch's two ops do (H200 2026-12-05: a random alpha differed in last bits)
            alpha = 2.0 ** int(torch.randint(-3, 4, (1,), generator=g, device="cuda"))
            if add_one:
                k[(triton.cdiv(n, 64),)](x, y, out, n, alpha, BLOCK=64, ADD_ONE=True, num_warps=2)
            else:  # a callable grid and the default constexpr
                k[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, n, alpha, BLOCK=64)
            ref = (alpha * x.float() + y.float() + (1.0 if add_one else 0.0)).to(dtype)
            assert torch.equal(out, ref), (rnd, dtype, n, offset, add_one)
        if rnd:
            assert k.hits - hits == len(cases)
    assert k.misses <= len(cases)


@pytest.mark.gpu
def test_registered_ops_are_bit_identical_with_and_without_the_fast_path():
    from deepinfer import kernels
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.kernels.triton.act_quant import act_quant

    register_cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(37, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(37, 8, 512, device="cuda", generator=g).to(torch.bfloat16)
    calls = [
        lambda: kernels.get("rms_norm_bf16", "cuda")(x, w, 1e-6),
        lambda: kernels.get("rms_norm_bf16", "cuda")(x[1:], w, 1e-6),
        lambda: kernels.get("head_rms_norm", "cuda")(q, 1e-6),
        lambda: act_quant(x, 128),
        lambda: act_quant(x[:, :2048], 128, perm32=True),
    ]
    was = launch.ENABLED
    try:
        for call in calls:
            launch.ENABLED = False
            ref = call()
            launch.ENABLED = True
            for _ in range(2):  # a miss (compiled / cached by the JIT) then a hit
                got = call()
                ref_t = ref if isinstance(ref, tuple) else (ref,)
                got_t = got if isinstance(got, tuple) else (got,)
                assert all(torch.equal(a, b) for a, b in zip(ref_t, got_t))
    finally:
        launch.ENABLED = was
