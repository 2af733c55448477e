"""Op "hc_post_pre_fused" (kernels/triton/norm_hc.py: a sublayer's hc_post made inside the next sublayer's mix
kernel) against the two ops it replaces (`hc_post_fused` then `hc_pre_fused` with the fused kernel's split
plan): bit for bit under the interpreter (the same arithmetic per element, the same mix tiles); on the GPU
the new residual streams within one bf16 ulp (hc_post's sum over j may round differently with FMAs) and
y / post / comb within the twin's bounds; with DEEPINFER_ATTN_FUSIONS=0 the two separate ops; a planted bug
(a wrong stream index) caught. Decode sizes (T=1, 3, 16: the fused kernel) and past them (T=20: the two
ops) at small D."""
from __future__ import annotations

import os

import pytest
import torch

from interpreted import assert_check_failed, assert_ran_ok, run_check

CASES = [(1, 256), (3, 128), (16, 64), (20, 256)]


def _inputs(T, D, device, seed, hc=4):
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    f = (torch.randn(T, D, generator=g) * 2).bfloat16()
    r = (torch.randn(T, hc, D, generator=g) * 2).bfloat16()
    post = torch.rand(T, hc, generator=g) * 2
    comb = torch.softmax(torch.randn(T, hc, hc, generator=g), dim=-1)
    fn = torch.randn(n, hc * D, generator=g) * (hc * D) ** -0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(n, generator=g)
    nw = torch.rand(D, generator=g) + 0.5
    return [t.to(device) for t in (f, r, post, comb, fn, scale, base, nw)]


def _ulps(a, b):
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(device: str, plant: str = "") -> None:
    from deepinfer.kernels import official_fused
    from deepinfer.kernels.triton import norm_hc

    for i, (T, D) in enumerate(CASES):
        f, r, post, comb, fn, scale, base, nw = _inputs(T, D, device, 40 + i)
        hc_args = (fn, scale, base, nw, 4, 20, 1e-6, 1e-6)
        got = norm_hc.hc_post_pre_fused(f, r, post, comb if plant != "stream" else comb.transpose(1, 2), *hc_args)
        x = norm_hc.hc_post_fused(f, r, post, comb)
        # the fused kernel's own split plan up to POST_MIX_MAX_T tokens (the split partials' sum order is the plan's)
        plan = {**norm_hc.POST_MIX_PLAN, "SPLITS": 4 * D // 64} if T <= norm_hc.POST_MIX_MAX_T else None
        want = (x,) + tuple(norm_hc.hc_pre_fused(x, *hc_args, config=plan))
        names = ("x", "y", "post", "comb")
        for name, a, b in zip(names, got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, T, D)
            if device == "cpu":
                assert torch.equal(a, b), (name, T, D)
            elif a.dtype == torch.bfloat16:
                assert _ulps(a, b) <= 1 and (a != b).float().mean().item() <= 0.01, (name, T, D)
            else:
                assert _rel(a, b) <= 1e-5, (name, T, D)
        twin = official_fused.hc_post_pre_fused(*[t.cpu() for t in (f, r, post, comb)],
                                                *[t.cpu() if torch.is_tensor(t) else t for t in hc_args])
        for name, a, b, bound in zip(names, got, twin, (2e-3, 2e-3, 1e-4, 1e-4)):
            assert _rel(a, b) <= bound, (name, T, D, _rel(a, b))
    os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"
    try:
        off = norm_hc.hc_post_pre_fused(f, r, post, comb, *hc_args)
    finally:
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
    x = norm_hc.hc_post_fused(f, r, post, comb)  # off: the two ops with their default plans
    assert all(torch.equal(a, b) for a, b in zip(off, (x,) + tuple(norm_hc.hc_pre_fused(x, *hc_args))))


def test_the_plan_switch_reaches_the_post_mix_plan(monkeypatch):
    """DEEPINFER_HC_POST_MIX (A/B runs of the decode plan): its keys on top of POST_MIX_PLAN, a call's config on
    top of them; malformed values and unknown keys refused by name. (No kernel runs: the plan is built first.)"""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton import norm_hc

    plans = []
    monkeypatch.setattr(norm_hc, "_check_hc_pre", lambda *a: (_ for _ in ()).throw(RuntimeError("stop")))
    real = norm_hc.mix_plan
    monkeypatch.setattr(norm_hc, "mix_plan", lambda *a: plans.append(real(*a)) or plans[-1])
    f, r, post, comb, fn, scale, base, nw = _inputs(1, 256, "cpu", 1)
    args = (f, r, post, comb, fn, scale, base, nw, 4, 20, 1e-6, 1e-6)
    monkeypatch.setenv("DEEPINFER_HC_POST_MIX", "num_stages:3;num_warps:2")
    for config in (None, {"num_warps": 8}):
        with pytest.raises(RuntimeError, match="stop"):
            norm_hc.hc_post_pre_fused(*args, config=config)
    assert (plans[0]["num_stages"], plans[0]["num_warps"], plans[0]["BLOCK_K"]) == (3, 2, 64)
    assert (plans[1]["num_stages"], plans[1]["num_warps"]) == (3, 8)
    monkeypatch.setenv("DEEPINFER_HC_POST_MIX", "num_stages=3")
    with pytest.raises(ValueError, match="DEEPINFER_HC_POST_MIX"):
        norm_hc.hc_post_pre_fused(*args)
    monkeypatch.setenv("DEEPINFER_HC_POST_MIX", "stages:3")
    with pytest.raises(ValueError, match="unknown config keys"):
        norm_hc.hc_post_pre_fused(*args)


def _interpreted(plant: str = ""):
    return run_check("test_kernels_hc_post_pre", f"_check('cpu', {plant!r})", timeout=900)


def test_hc_post_pre_is_the_two_ops_under_the_interpreter():
    res = _interpreted()
    assert_ran_ok(res)


def test_the_check_catches_a_planted_bug():
    res = _interpreted("stream")
    assert_check_failed(res)


@pytest.mark.gpu
def test_hc_post_pre_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda")
