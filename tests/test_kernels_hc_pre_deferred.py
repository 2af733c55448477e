"""Op "hc_pre_deferred_fused" (kernels/triton/norm_hc.py: V4.1's hc_pre, which collapses with the previous
sublayer's pre and returns its own) against its twin (the separate torch ops V41Block ran) and against
`hc_pre_fused` (the V4 op on the same two launches): under the interpreter and on the GPU, post and comb are
hc_pre_fused's bit for bit, and y collapsed with the op's own pre is hc_pre_fused's y bit for bit (the same
arithmetic; only where the collapse's weights come from differs); y, pre, post, comb within the twin's bounds
for a random pre_mix (the fp32 mix sums in another order). A planted bug (the collapse with the wrong pre)
is caught. Decode and prefill sizes at small D."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_check_failed, assert_ran_ok, run_check

CASES = [(1, 256), (3, 128), (40, 64)]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(device: str, plant: str = "") -> None:
    from deepinfer.kernels import official_fused
    from deepinfer.kernels.triton import norm_hc

    hc = 4
    for i, (T, D) in enumerate(CASES):
        g = torch.Generator().manual_seed(60 + i)
        n = (2 + hc) * hc
        x = (torch.randn(T, hc, D, generator=g) * 2).bfloat16()
        pre_mix = torch.rand(T, hc, generator=g) + 0.1
        fn = torch.randn(n, hc * D, generator=g) * (hc * D) ** -0.5
        scale, base, nw = torch.rand(3, generator=g) + 0.5, torch.randn(n, generator=g), torch.rand(D, generator=g) + 0.5
        args = [t.to(device) for t in (fn, scale, base, nw)] + [hc, 20, 1e-6, 1e-20]
        xd, pd = x.to(device), pre_mix.to(device)
        got = norm_hc.hc_pre_deferred_fused(xd, pd.flip(1) if plant == "pre" else pd, *args)
        twin = official_fused.hc_pre_deferred_fused(x, pre_mix, *[a.cpu() if torch.is_tensor(a) else a for a in args])
        for name, a, b, bound in zip(("y", "pre", "post", "comb"), got, twin, (2e-3, 1e-5, 1e-5, 1e-4)):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, T, D)
            assert _rel(a, b) <= bound, (name, T, D, _rel(a, b))
        y4, post4, comb4 = norm_hc.hc_pre_fused(xd, *args)
        assert torch.equal(got[2], post4) and torch.equal(got[3], comb4), (T, D)
        own = norm_hc.hc_pre_deferred_fused(xd, got[1], *args)  # collapsed with its own pre: hc_pre_fused's y
        assert torch.equal(own[0], y4) and torch.equal(own[1], got[1]), (T, D)


def _interpreted(plant: str = ""):
    return run_check("test_kernels_hc_pre_deferred", f"_check('cpu', {plant!r})", timeout=900)


def test_hc_pre_deferred_under_the_interpreter():
    res = _interpreted()
    assert_ran_ok(res)


def test_the_check_catches_a_collapse_with_the_wrong_pre():
    res = _interpreted("pre")
    assert_check_failed(res)


def test_the_twin_is_the_separate_ops():
    """The twin is V41Block's former separate ops exactly (mixes, Sinkhorn, collapse with the given pre, norm)."""
    from deepinfer.kernels import official_fused, torch_ops

    g = torch.Generator().manual_seed(7)
    T, hc, D = 5, 4, 64
    x = torch.randn(T, hc, D, generator=g).bfloat16()
    pre_mix = torch.rand(T, hc, generator=g)
    fn, scale = torch.randn(24, hc * D, generator=g) * 0.05, torch.rand(3, generator=g)
    base, nw = torch.randn(24, generator=g), torch.rand(D, generator=g)
    y, pre, post, comb = official_fused.hc_pre_deferred_fused(x, pre_mix, fn, scale, base, nw, hc, 20, 1e-6, 1e-20)
    xf = x.float()
    want = torch_ops.hc_split_sinkhorn(torch_ops.hc_mix(xf, fn, 1e-20), scale, base, hc, 20, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip((pre, post, comb), want))
    want_y = torch_ops.rms_norm(torch_ops.hc_collapse(xf, pre_mix).bfloat16().float(), nw, 1e-20).bfloat16()
    assert torch.equal(y, want_y)
    with pytest.raises(ValueError, match="pre_mix"):
        official_fused.hc_pre_deferred_fused(x, pre_mix[:, :2], fn, scale, base, nw, hc, 20, 1e-6, 1e-20)


@pytest.mark.gpu
def test_hc_pre_deferred_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda")
