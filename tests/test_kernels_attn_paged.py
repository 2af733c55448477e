"""Sparse attention over the stored caches (op `sparse_attn_sink_paged`, the batched decode step's attention).

CPU: the twin (`official_fused.sparse_attn_sink_paged`: gather the named ring / compressed rows, the layout's
decode, the official sparse attention) is bit for bit the attention over a decoded pool that the decode step
ran before (pool = decoded ring rows, then decoded compressed rows, indices into it), for the FP8 layout and
for bf16 caches; and the row mapping is checked against rows written by hand.
Interpreter (fresh process, TRITON_INTERPRET=1): the Triton kernel that decodes the packed FP8 entries in
registers, against the Triton pool kernel on the same rows decoded by the layout (bit for bit there) and
against the twin (rel_err <= 2e-3: fp32 summation order flips a bf16 rounding now and then), for V4's
layout (E4M3 + bf16 rope tail + E8M0 per 64, running max from -inf) and V4.1's window layout (E4M3 + E8M0
per 32, no tail, from -1e30); the index row split over programs and merged (flash-decoding, also with a
split whose columns are all -1) against the twin at the same bound.
GPU (-m gpu): the same at real shapes (H=64, d=512, batch 1/32/128, 128 window + 512 selected rows); against
the pool kernel within 5e-4 (H200: a few elements differ by a rounding, the printed share).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.cache.layouts import get_layout
from deepinfer.kernels import official
from deepinfer.kernels.official_fused import paged_rows, sparse_attn_sink_paged


def _cfg(d: int, rope: int) -> SimpleNamespace:
    return SimpleNamespace(head_dim=d, rope_head_dim=rope, index_head_dim=64)


def _case(g, layout, T, H, d, slots, win, n_comp, K_sel, device="cpu"):
    """Random stored caches in `layout` (None: bf16 values) and index rows: the window part names ring rows
    (slot * win + column), the selection compressed rows (n_ring + row), with -1 holes."""
    def store(n):
        x = (torch.randn(n, d, generator=g) * 3).bfloat16()
        return x if layout is None else layout.store(x)

    ring = store(slots * win).unflatten(0, (slots, win))
    comp = store(n_comp)
    n_ring = slots * win
    slot = torch.randint(0, slots, (T, 1), generator=g)
    w_idx = slot * win + torch.randperm(win, generator=g)[:win].expand(T, win)
    c_idx = n_ring + torch.randint(0, n_comp, (T, K_sel), generator=g)
    idx = torch.cat([w_idx, c_idx], dim=1)
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.25, -1, idx)
    idx[:, 0] = w_idx[:, 0]  # at least one valid row per query
    q = torch.randn(T, H, d, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    return [t.to(device) for t in (q, ring, comp, sink, idx)]


def _pool_reference(q, ring, comp, layout, sink, idx, scale):
    """What the decode step did before: decode the ring and the compressed rows into one pool, attend over it."""
    def load(x):
        return x if layout is None else layout.load(x)

    pool = torch.cat([load(ring.flatten(0, 1)), load(comp)])
    return official.sparse_attn_sink_official(q, pool, sink, idx, scale)


@pytest.mark.parametrize("name", ["v4_fp8_ds_mla", "v41_window_fp8", None])
def test_twin_is_the_decoded_pool_attention_bit_for_bit(name):
    g = torch.Generator().manual_seed(7)
    d = 256
    layout = None if name is None else get_layout(name, _cfg(d, 64))
    q, ring, comp, sink, idx = _case(g, layout, T=5, H=4, d=d, slots=3, win=16, n_comp=40, K_sel=70)
    got = sparse_attn_sink_paged(q, ring, comp, layout, sink, idx, d**-0.5)
    ref = _pool_reference(q, ring, comp, layout, sink, idx, d**-0.5)
    assert torch.equal(got, ref)


def test_rows_map_ring_then_compressed():
    ring = torch.arange(2 * 3 * 2).view(2, 3, 2)  # slots 2, window 3, width 2: flat rows 0..5
    comp = 100 + torch.arange(4 * 2).view(4, 2)
    idx = torch.tensor([[0, 5, 6, -1], [9, 3, -1, 7]])
    got = paged_rows(ring, comp, idx)
    assert got[0].tolist() == [[0, 1], [10, 11], [100, 101], [0, 1]]  # -1 reads row 0 (masked later)
    assert got[1].tolist() == [[106, 107], [6, 7], [0, 1], [102, 103]]
    assert paged_rows(ring, None, idx[:, :2].clamp(max=5)).shape == (2, 2, 2)  # window-only layer
    with pytest.raises(ValueError, match="differ"):
        paged_rows(ring, comp[:, :1], idx)


def test_window_only_layer():
    g = torch.Generator().manual_seed(3)
    layout = get_layout("v4_fp8_ds_mla", _cfg(256, 64))
    q, ring, _, sink, idx = _case(g, layout, T=3, H=4, d=256, slots=2, win=16, n_comp=1, K_sel=0)
    got = sparse_attn_sink_paged(q, ring, None, layout, sink, idx, 0.1)
    assert torch.equal(got, _pool_reference(q, ring, ring.new_zeros(0, ring.shape[-1]), layout, sink, idx, 0.1))


def test_combine_heads_rule():
    from deepinfer.kernels.triton.sparse_attn_paged import combine_heads

    assert combine_heads(1, 64) == 2 and combine_heads(8, 64) == 2  # 32 / 256 programs
    assert combine_heads(16, 64) == 4 and combine_heads(32, 64) == 8  # 256 programs each
    assert combine_heads(1, 8) == 2  # few heads: the fewest a program


def test_split_plan_rules():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.sparse_attn_paged import SPLIT_MAX_T, split_plan

    for H in (8, 16, 64, 128):
        for T in (1, 2, 4, 8, 16, 32, 63, 64, 128):
            for K in (1, 64, 65, 192, 640, 1152, 2176):
                heads, chunk = split_plan(T, K, H)
                assert heads in (16, 32, 64) and chunk % 64 == 0, (H, T, K, heads, chunk)
                if chunk:
                    splits = -(-K // chunk)
                    assert T < (SPLIT_MAX_T if H > 16 else 2 * SPLIT_MAX_T) and splits > 1 and (splits - 1) * chunk < K, (H, T, K, chunk)
                    assert chunk * splits - K < chunk  # the last split holds at least one real column
    assert split_plan(1, 640, 64) == (16, 64)  # one row: every block its own program
    assert split_plan(8, 640, 64) == (64, 128)  # a 16-head grid would pass a wave: all heads, 2 blocks
    assert split_plan(32, 192, 64)[1] == 0 and split_plan(128, 640, 64)[1] == 0
    assert split_plan(32, 640, 8) == (16, 64)  # 8 heads (8-way TP): no repeated decode, 320 programs
    assert split_plan(64, 640, 8) == (16, 128) and split_plan(128, 640, 8)[1] == 0


_SCRIPT = r"""
import sys
import torch
from test_kernels_attn_paged import _case, _cfg
from deepinfer.cache.layouts import get_layout
from deepinfer.kernels.official_fused import paged_rows, sparse_attn_sink_paged
from deepinfer.kernels.triton.sparse_attn import sparse_attn_sink_triton
from deepinfer.kernels.triton.sparse_attn_paged import sparse_attn_sink_paged_triton, split_plan

device = sys.argv[1]
# (layout, d, rope dims, T, H, window, selected)
cases = [("v4_fp8_ds_mla", 256, 64, 3, 4, 16, 70), ("v41_window_fp8", 128, 0, 2, 8, 16, 70)]
if device == "cuda":
    cases = [("v4_fp8_ds_mla", 512, 64, T, 64, 128, k) for T, k in ((1, 64), (1, 512), (32, 512), (128, 512))]
    cases.append(("v41_window_fp8", 512, 0, 4, 64, 128, 64))
rel = lambda a, b: ((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm()).item()
for name, d, rope, T, H, win, k_sel in cases:
    layout = get_layout(name, _cfg(d, rope))
    initial_max = -1e30 if name.startswith("v41") else float("-inf")
    g = torch.Generator().manual_seed(T + d + k_sel)
    q, ring, comp, sink, idx = _case(g, layout, T, H, d, slots=T + 2, win=win, n_comp=3 * k_sel, K_sel=k_sel,
                                     device=device)
    scale = d ** -0.5
    got = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max, chunk=0)
    # the pool kernel on the same rows decoded by the layout: the same online softmax over the same bf16
    # values; on the GPU a few roundings differ (other warp layouts: the row sums run in another order)
    pool = layout.load(paged_rows(ring, comp, idx)).reshape(-1, d)
    pool_idx = torch.where(idx >= 0, torch.arange(idx.numel(), device=device).view(idx.shape), -1)
    same = sparse_attn_sink_triton(q, pool, sink, pool_idx, scale, initial_max)
    differ = (got != same).float().mean().item()
    assert rel(got, same) <= (0 if device == "cpu" else 5e-4), (name, T, rel(got, same), differ)
    ref = sparse_attn_sink_paged(q.cpu(), ring.cpu(), comp.cpu(), layout, sink.cpu(), idx.cpu(), scale, initial_max)
    err = rel(got, ref)
    assert err <= 2e-3, (name, T, err)
    print(f"{name} T={T} H={H} d={d} K={idx.shape[1]}: vs the pool kernel rel_err {rel(got, same):.2e} ({100 * differ:.3f}% of "
          f"elements differ), vs the twin {err:.2e}")
    # the index row split over programs (flash-decoding) and merged: P is rounded to bf16 against each
    # split's running max, so the bits move; judged against the twin as the unsplit kernel. The second
    # row set makes a whole split's columns -1 (its state must add nothing, also from V4's -inf start).
    dead = idx.clone()
    dead[:, 64:128] = -1
    for rows, label in ((idx, "split"), (dead, "dead split")):
        ref = sparse_attn_sink_paged(q.cpu(), ring.cpu(), comp.cpu(), layout, sink.cpu(), rows.cpu(), scale,
                                     initial_max)
        errs = []
        for chunk in (64, None):  # None: the default rule (which may not split)
            out = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, rows, scale, initial_max, chunk=chunk)
            assert torch.isfinite(out).all(), (name, T, label, chunk)
            errs.append(rel(out, ref))
            assert errs[-1] <= 2e-3, (name, T, label, chunk, errs[-1])
        print(f"  {label}: vs the twin {errs[0]:.2e} (64 columns per split), {errs[1]:.2e} (default plan: "
              f"(heads, columns) = {split_plan(T, rows.shape[1], H)}, 0 columns = no split)")
    # the combine's heads per program (`combine_heads`) move no bit: each head's merge is its own
    import deepinfer.kernels.triton.sparse_attn_paged as sap
    chosen = sap.combine_heads
    outs = []
    for bh in (2, 4, 8):
        sap.combine_heads = lambda T, H, bh=bh: bh
        outs.append(sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max, chunk=64))
    sap.combine_heads = chosen
    assert all(torch.equal(o, outs[0]) for o in outs), (name, T, "combine heads per program moved bits")
    if rope:  # the inverse RoPE of the output in the epilogue (op sparse_attn_sink_paged_rope) == the kernel's
        # output rotated back by rope32 with the same table, unsplit and split (the combine's epilogue)
        from deepinfer.kernels import official
        from deepinfer.kernels.triton import rope as triton_rope
        from deepinfer.kernels.triton.sparse_attn_paged import sparse_attn_sink_paged_rope

        pos = torch.randint(0, 200_000, (T,), generator=g).to(device)
        freqs = official.rope_freqs32(rope, 65536, 160000.0, 16.0, 32, 1).to(device)
        table = triton_rope.rope_table32(pos, freqs)
        for chunk in (0, 64):
            plain = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max, chunk=chunk)
            want = triton_rope.rope32(plain, pos, freqs, True, table=table)
            fused = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max, chunk=chunk,
                                                  rope_table=table)
            assert torch.equal(fused, want) if device == "cpu" else rel(fused, want) <= 1e-3, (name, T, chunk)
            assert (fused != want).float().mean().item() <= 0.01, (name, T, chunk)
            assert not torch.equal(fused, plain), (name, T, chunk)  # the tail did rotate
        assert torch.equal(sparse_attn_sink_paged_rope(q, ring, comp, layout, sink, idx, scale, pos, freqs, None),
                           sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, rope_table=table))
        import os  # DEEPINFER_ATTN_FUSIONS=0: the attention, then rope32
        os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"
        off = sparse_attn_sink_paged_rope(q, ring, comp, layout, sink, idx, scale, pos, freqs, None)
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
        plain = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale)
        assert torch.equal(off, triton_rope.rope32(plain, pos, freqs, True, table=table))
        twin = official.rope32(sparse_attn_sink_paged(q.cpu(), ring.cpu(), comp.cpu(), layout, sink.cpu(), idx.cpu(),
                                                      scale), pos.cpu(), freqs.cpu(), True)
        print(f"  with the inverse RoPE: vs the twin {rel(fused, twin):.2e}")
        assert rel(fused, twin) <= 1e-2, (name, T)
        # the raw query normed per head and rotated on the kernel's q load (q_norm_eps) == head_rms_norm_rope's
        # launch, then the kernel: the same arithmetic; on the GPU the sum of squares runs over another tile
        # layout, so a row's bf16 mean may round the other way now and then (norm_hc.head_rms_norm's note)
        from deepinfer.kernels import official_fused
        from deepinfer.kernels.triton.attn_norm_rope import head_rms_norm_rope
        eps = 1e-6
        raw = (q.float() * 5.0).bfloat16()  # a projection's scale: the norm must move it
        normed = head_rms_norm_rope(raw, eps, pos, freqs, table)
        for chunk in (0, 64):
            want = sparse_attn_sink_paged_triton(normed, ring, comp, layout, sink, idx, scale, initial_max,
                                                 chunk=chunk, rope_table=table)
            got_n = sparse_attn_sink_paged_triton(raw, ring, comp, layout, sink, idx, scale, initial_max,
                                                  chunk=chunk, rope_table=table, q_norm_eps=eps)
            differ = (got_n != want).float().mean().item()
            print(f"  q normed and rotated in the kernel, chunk {chunk}: vs head_rms_norm_rope's launch rel_err "
                  f"{rel(got_n, want):.2e} ({100 * differ:.3f}% of elements differ)")
            assert torch.equal(got_n, want) if device == "cpu" else rel(got_n, want) <= 1e-3, (name, T, chunk)
            assert differ <= 0.01, (name, T, chunk)
        os.environ["DEEPINFER_ATTN_QNORM"] = "launch"  # head_rms_norm_rope's own launch, then the kernel
        launched = sparse_attn_sink_paged_rope(raw, ring, comp, layout, sink, idx, scale, pos, freqs, None,
                                               q_norm_eps=eps)
        assert torch.equal(launched, sparse_attn_sink_paged_triton(normed, ring, comp, layout, sink, idx, scale,
                                                                   rope_table=table))
        os.environ["DEEPINFER_ATTN_QNORM"] = "kernel"  # (the default)
        op_n = sparse_attn_sink_paged_rope(raw, ring, comp, layout, sink, idx, scale, pos, freqs, None, q_norm_eps=eps)
        assert torch.equal(op_n, sparse_attn_sink_paged_triton(raw, ring, comp, layout, sink, idx, scale,
                                                               rope_table=table, q_norm_eps=eps))
        os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"  # the norm, the attention, the inverse RoPE: three launches
        off_n = sparse_attn_sink_paged_rope(raw, ring, comp, layout, sink, idx, scale, pos, freqs, None, q_norm_eps=eps)
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
        del os.environ["DEEPINFER_ATTN_QNORM"]
        if device == "cpu":  # (off: head_rms_norm's own kernel and rope32: another tile on the GPU)
            assert torch.equal(off_n, sparse_attn_sink_paged_rope(head_rms_norm_rope(raw, eps, pos, freqs, table),
                                                                  ring, comp, layout, sink, idx, scale, pos, freqs,
                                                                  None))
        else:
            assert rel(off_n, op_n) <= 1e-3, (name, T)
        twin_n = official_fused.sparse_attn_sink_paged_rope(raw.cpu(), ring.cpu(), comp.cpu(), layout, sink.cpu(),
                                                            idx.cpu(), scale, pos.cpu(), freqs.cpu(), None,
                                                            q_norm_eps=eps)
        print(f"  q normed in the kernel: vs the twin {rel(op_n, twin_n):.2e}")
        assert rel(op_n, twin_n) <= 1e-2, (name, T)
        try:
            sparse_attn_sink_paged_triton(raw, ring, comp, layout, sink, idx, scale, q_norm_eps=eps)
            raise AssertionError("q_norm_eps without a rope_table ran")
        except ValueError as e:
            assert "q_norm_eps needs the rope_table" in str(e), e
    # caches the kernel does not decode (bf16 values) go through gather + the pool kernel: its bits
    got_bf16 = sparse_attn_sink_paged_triton(q, layout.load(ring), layout.load(comp), None, sink, idx, scale,
                                             initial_max)
    assert torch.equal(got_bf16, same), name
    if device == "cpu":  # the default plan splits these rows; DEEPINFER_DECODE_ATTN_SPLIT=off keeps them whole
        import os
        heads, cols = split_plan(T, idx.shape[1], H)
        assert cols, (T, idx.shape[1], H)
        split = sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max, block_h=heads,
                                              chunk=cols)
        assert torch.equal(sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max), split)
        os.environ["DEEPINFER_DECODE_ATTN_SPLIT"] = "off"
        assert torch.equal(sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, scale, initial_max), got)
        del os.environ["DEEPINFER_DECODE_ATTN_SPLIT"]
print("ok")
"""


def test_paged_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    from interpreted import assert_ran_ok, run_interpreted

    from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter

    res = run_interpreted(GPU_ROUNDINGS + _SCRIPT, "cpu", timeout=600)
    assert_ran_ok(res)


@pytest.mark.gpu
def test_paged_kernel_on_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from interpreted import assert_ran_ok, run_compiled

    res = run_compiled(_SCRIPT.replace("device = sys.argv[1]", "device = 'cuda'"), tmp_path)
    print(res.stdout)
    assert_ran_ok(res)


def test_split_env_choice(monkeypatch):
    from deepinfer import env

    assert env.decode_attn_split() == "auto"
    monkeypatch.setenv("DEEPINFER_DECODE_ATTN_SPLIT", "OFF")
    assert env.decode_attn_split() == "off"
    monkeypatch.setenv("DEEPINFER_DECODE_ATTN_SPLIT", "never")
    with pytest.raises(ValueError, match="DEEPINFER_DECODE_ATTN_SPLIT='never'"):
        env.decode_attn_split()


def test_qnorm_env_choice(monkeypatch):
    from deepinfer import env

    assert env.attn_qnorm_in_kernel()  # the default since the fortieth session's H100 runs
    monkeypatch.setenv("DEEPINFER_ATTN_QNORM", "Launch")
    assert not env.attn_qnorm_in_kernel()
    monkeypatch.setenv("DEEPINFER_ATTN_QNORM", "kernel")
    assert env.attn_qnorm_in_kernel()
    monkeypatch.setenv("DEEPINFER_ATTN_QNORM", "fused")
    with pytest.raises(ValueError, match="DEEPINFER_ATTN_QNORM='fused'"):
        env.attn_qnorm_in_kernel()
