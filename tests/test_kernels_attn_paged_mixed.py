"""Op "sparse_attn_sink_paged_mixed" (kernels/triton/sparse_attn_paged_mixed.py: V4.1's decode attention over
the FP8 window ring and the FP4 latents, decoded in registers) against its twin (each part gathered and decoded
by its layout into a pool, then the official kernel's math): unsplit bit for bit with the pool kernel over that
pool (the same rows, order and tiles; under the interpreter, whose dots are fp32, the twin's bits; on the GPU
the twin's within 1e-3), split (flash-decoding) within 5e-3 rel_err; a window-only row set; ring widths that are not whole
64-column blocks take the twin's path. Under the interpreter on the CPU (d = 64) and on the GPU at V4.1-Flash
dims (H = 64, d = 512, a 128-row window, 512 picks). A planted bug (the nibbles of a byte swapped) is caught."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_check_failed, assert_ran_ok, run_check


def _layouts(d: int):
    from deepinfer.cache.layouts import get_layout
    from types import SimpleNamespace

    cfg = SimpleNamespace(head_dim=d, rope_head_dim=d // 8, index_head_dim=d // 4)
    return get_layout("v41_window_fp8", cfg), get_layout("v41_latent_fp4", cfg)


def _inputs(T, H, d, slots, win, n_comp, picks, device, seed):
    g = torch.Generator().manual_seed(seed)
    wl, ll = _layouts(d)
    ring = wl.store(torch.randn(slots * win, d, generator=g)).view(slots, win, -1)
    comp = ll.store(torch.randn(n_comp, d, generator=g))
    q = torch.randn(T, H, d, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    n_ring = slots * win
    ring_idx = torch.randint(0, n_ring, (T, win), generator=g)
    ring_idx[:, : win // 3] = -1  # a short sequence's unfilled slots (the official order puts them first)
    comp_idx = torch.randint(0, n_comp, (T, picks), generator=g) + n_ring
    comp_idx[:, -picks // 4:] = -1  # fewer picks than top-k
    comp_idx[0] = -1  # a row that sees no compressed entry
    idx = torch.cat([ring_idx, comp_idx], dim=1)
    return [t.to(device) for t in (q, ring, comp, sink, idx)] + [wl, ll]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _check(device: str, d: int, H: int, win: int, picks: int, plant: str = "") -> None:
    from deepinfer.kernels.official_fused import sparse_attn_sink_paged_mixed as twin
    from deepinfer.kernels.triton import sparse_attn_paged_mixed as mixed
    from deepinfer.kernels.triton.sparse_attn import sparse_attn_sink_triton

    for T, seed in ((1, 3), (5, 4)):
        q, ring, comp, sink, idx, wl, ll = _inputs(T, H, d, 3, win, 50, picks, device, seed)
        scale = d**-0.5
        ref = twin(q.cpu(), ring.cpu(), wl, comp.cpu(), ll, sink.cpu(), idx.cpu(), scale, win, -1e30)
        if plant == "nibbles":  # the kernel reads channel 2j from the high nibble: the check must fail
            comp = comp.clone()
            b = comp[:, : ll.value_bytes]
            comp[:, : ll.value_bytes] = (b >> 4) | (b << 4)
        got = mixed.sparse_attn_sink_paged_mixed(q, ring, wl, comp, ll, sink, idx, scale, win, -1e30, chunk=0)
        if device == "cpu":  # the interpreter's fp32 dots: the twin's bits
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (T, "unsplit")
        else:  # the pool kernel's tiles and bf16 MMAs over the twin's decoded pool: its bits; the twin's within
            # the MMA's summation order
            pool = torch.cat([wl.load(ring.flatten(0, 1)[idx[:, :win].clamp(min=0)]),
                              ll.load(comp[(idx[:, win:] - ring.shape[0] * ring.shape[1]).clamp(min=0)])], dim=1)
            cols = torch.arange(idx.numel(), device=device).view(idx.shape)
            from deepinfer.kernels.triton.sparse_attn import _block_h
            want = sparse_attn_sink_triton(q, pool.flatten(0, 1), sink, torch.where(idx >= 0, cols, -1), scale, -1e30,
                                           block_h=_block_h(T, H), num_warps=8, num_stages=1)  # (the same launch)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, "unsplit vs the pool kernel")
            assert _rel(got, ref) <= 1e-3, (T, "unsplit vs the twin", _rel(got, ref))
        split = mixed.sparse_attn_sink_paged_mixed(q, ring, wl, comp, ll, sink, idx, scale, win, -1e30, chunk=64)
        assert _rel(split, ref) <= 5e-3, (T, "split", _rel(split, ref))
        # window-only: the ring columns alone
        ref_w = twin(q.cpu(), ring.cpu(), wl, None, None, sink.cpu(), idx[:, :win].cpu(), scale, win, -1e30)
        got_w = mixed.sparse_attn_sink_paged_mixed(q, ring, wl, None, None, sink, idx[:, :win].contiguous(), scale,
                                                   win, -1e30, chunk=0)
        if device == "cpu":
            assert torch.equal(got_w.view(torch.int16), ref_w.view(torch.int16)), (T, "window only")
        else:
            assert _rel(got_w, ref_w) <= 1e-3, (T, "window only", _rel(got_w, ref_w))
    assert not mixed.fused(wl, ll, d, 16)  # a 16-row window: the twin's path (the tiny checkpoints)
    with pytest.raises(ValueError, match="ring_cols"):
        mixed.sparse_attn_sink_paged_mixed(q, ring, wl, comp, ll, sink, idx, scale, idx.shape[1] + 1)


def _interpreted(plant: str = ""):
    return run_check("test_kernels_attn_paged_mixed", f"_check('cpu', 64, 16, 64, 128, {plant!r})", timeout=900)


def test_mixed_paged_attention_under_the_interpreter():
    res = _interpreted()
    assert_ran_ok(res)


def test_the_check_catches_swapped_nibbles():
    res = _interpreted("nibbles")
    assert_check_failed(res)


@pytest.mark.gpu
def test_mixed_paged_attention_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda", 512, 64, 128, 512)
