"""kernels/triton/attn_norm_rope.py against its twins (`official_fused.qkv_norm_rope_store`,
`official_fused.head_rms_norm_rope`: the decode attention's ops one by one), on fresh random inputs at
V4-Flash's shapes (q LoRA 1024, kv 512 = 448 FP8 channels + a 64-channel RoPE tail, 64 heads of 512) and small
ones, under the Triton interpreter and on the GPU (-m gpu).
Bounds, against the separate Triton ops the decode path ran before: the normed bf16 values within one bf16
ulp (an RMSNorm's fp32 sum of squares is summed in the kernel's order; the same bits under the interpreter),
the ring rows' bytes nearly all equal and what they decode to within one E4M3 step (a one-ulp input can round
to the neighbouring code); against the torch twins (another summation order) within bf16 / E4M3 rounding;
the ring rows not named untouched; and the check fails when the kernel stores the wrong rows or skips RoPE."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_check_failed, assert_ran_ok, run_check

CASES = [  # (B, q_lora_rank, heads, head_dim, rope_dim)
    (1, 1024, 64, 512, 64),
    (5, 1024, 64, 512, 64),
    (3, 128, 4, 128, 64),
]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in bf16 ulps between two bf16 tensors of finite values."""
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude to a monotone integer line
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _inputs(case, device, seed):
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout
    from deepinfer.kernels import official

    B, nq, H, d, rd = case
    g = torch.Generator().manual_seed(seed)
    q_lora = (torch.randn(B, nq, generator=g) * 3).bfloat16()
    stacked = torch.randn(B, nq + d, generator=g).bfloat16()  # the stacked projection's [q_lora | kv] rows
    stacked[:, :nq] = q_lora  # q_lora and kv below are strided views of it, as `stacked.pair` returns them
    qw = (1 + 0.1 * torch.randn(nq, generator=g)).bfloat16()
    kvw = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    pos = torch.randint(0, 100_000, (B,), generator=g)
    freqs = official.rope_freqs32(rd, 65536, 160000.0, 16.0, 32, 1)
    layout = get_layout("v4_fp8_ds_mla", SimpleNamespace(head_dim=d, rope_head_dim=rd, index_head_dim=128))
    n_rows = 4 * B + 3
    store = torch.randint(0, 256, (n_rows, layout.bytes_per_token), generator=g, dtype=torch.uint8)
    rows = torch.randperm(n_rows, generator=g)[:B]
    q = torch.randn(B, H, d, generator=g).bfloat16()
    mv = lambda t: t.to(device)  # noqa: E731
    return (mv(stacked[:, :nq]), mv(stacked)[:, nq:], mv(qw), mv(kvw), mv(pos), mv(freqs), layout, mv(store),
            mv(rows), mv(q))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(device: str, plant: str = "") -> None:
    """plant: "rows" stores the kernel's ring rows one row off, "rope" skips its RoPE (the check must fail).
    The reference for the bits: the separate Triton ops the decode path ran before (equal here under the
    interpreter; on the GPU an RMSNorm's sum of squares may round another way); the twins (torch on the CPU,
    another summation order) within bf16 / E4M3 rounding."""
    from deepinfer.kernels import official_fused
    from deepinfer.kernels.triton import attn_norm_rope as k, kv_pack, norm_hc, rope

    cpu = lambda t: t.to("cpu")  # noqa: E731
    for i, case in enumerate(CASES):
        q_lora, kv, qw, kvw, pos, freqs, layout, store, rows, q = _inputs(case, device, 100 + i)
        eps = 1e-6
        twin_store = cpu(store).clone()
        twin_qr = official_fused.qkv_norm_rope_store(cpu(q_lora), cpu(kv), cpu(qw), cpu(kvw), eps, cpu(pos),
                                                     cpu(freqs), None, layout, twin_store, cpu(rows))
        ops_store = store.clone()  # the separate Triton ops
        ops_qr = norm_hc.rms_norm_bf16(q_lora, qw, eps)
        table = rope.rope_table32(pos, freqs)
        kv_pack.kv_encode_into(layout, rope.rope32(norm_hc.rms_norm_bf16(kv, kvw, eps), pos, freqs, table=table,
                                                   inplace=True), ops_store, rows)
        got_store = store.clone()
        got_rows = (rows + 1) % store.shape[0] if plant == "rows" else rows
        got_freqs = torch.zeros_like(freqs) if plant == "rope" else freqs
        got_qr = k.qkv_norm_rope_store(q_lora, kv, qw, kvw, eps, pos, got_freqs, None, layout, got_store, got_rows)
        got_qr, got_store, ops_qr, ops_store = cpu(got_qr), cpu(got_store), cpu(ops_qr), cpu(ops_store)
        assert got_qr.dtype == torch.bfloat16 and _ulps(got_qr, ops_qr) <= 1 and _ulps(got_qr, twin_qr) <= 1, case
        others = torch.ones(store.shape[0], dtype=torch.bool)
        others[cpu(rows)] = False
        assert torch.equal(got_store[others], cpu(store)[others]), ("rows not named changed", case)
        r = cpu(rows)
        same = (got_store[r] == ops_store[r]).float().mean().item()
        dec_got, dec_ops = layout.load(got_store[r]).float(), layout.load(ops_store[r]).float()
        step = dec_ops.abs() / 8 + dec_ops.abs().amax() * 2**-12  # one E4M3 step (3 mantissa bits), a floor
        assert same >= 0.99 and bool(((dec_got - dec_ops).abs() <= step).all()), ("ring rows", case, same)
        # the twin sums the squares in torch's order (on the GPU a one-ulp norm can move an E4M3 code or a
        # block scale) and rotates by torch.polar's table; equal here at these shapes (the interpreter rounds
        # as the GPU does, GPU_ROUNDINGS)
        dec_twin = layout.load(twin_store[r]).float()
        q_dim = layout.quant_dim
        assert _rel(dec_got[:, :q_dim], dec_twin[:, :q_dim]) <= 0.05, ("FP8 channels vs the twin", case)
        assert _rel(dec_got[:, q_dim:], dec_twin[:, q_dim:]) <= 0.01, ("rope tail vs the twin", case)

        ops_q = cpu(rope.rope32(norm_hc.head_rms_norm(q, eps), pos, freqs, table=table, inplace=True))
        got_q = cpu(k.head_rms_norm_rope(q, eps, pos, got_freqs, None))
        buf = torch.full_like(q, float("nan"))  # out=: written there, the same bits
        into = k.head_rms_norm_rope(q, eps, pos, got_freqs, None, out=buf)
        assert into.data_ptr() == buf.data_ptr() and torch.equal(cpu(buf), got_q), ("head norm + rope out=", case)
        assert got_q.shape == q.shape and _ulps(got_q, ops_q) <= 2, ("head norm + rope", case)
        assert (got_q != ops_q).float().mean().item() <= 0.01, ("head norm + rope: bits", case)
        twin_q = official_fused.head_rms_norm_rope(cpu(q), eps, cpu(pos), cpu(freqs), None)
        # the twin: torch's bf16 ops and torch.polar's table (measured here: equal at V4-Flash's shapes, 4.5e-3 at
        # the small one, whose 128-channel heads are half rope)
        assert _rel(got_q, twin_q) <= 1e-2, ("head norm + rope vs the twin", case)

    # DEEPINFER_ATTN_FUSIONS=0: the separate kernels, the same results (bit for bit under the interpreter)
    import os

    os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"
    try:
        off_store = store.clone()
        off_qr = k.qkv_norm_rope_store(q_lora, kv, qw, kvw, eps, pos, freqs, None, layout, off_store, rows)
        off_q = k.head_rms_norm_rope(q, eps, pos, freqs, None)
    finally:
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
    on_store = store.clone()
    on_qr = k.qkv_norm_rope_store(q_lora, kv, qw, kvw, eps, pos, freqs, None, layout, on_store, rows)
    on_q = k.head_rms_norm_rope(q, eps, pos, freqs, None)
    if device == "cpu":
        assert torch.equal(off_qr, on_qr) and torch.equal(off_store, on_store) and torch.equal(off_q, on_q)
    else:
        assert _ulps(cpu(off_qr), cpu(on_qr)) <= 1 and _ulps(cpu(off_q), cpu(on_q)) <= 2
    with pytest.raises(ValueError, match="weights"):
        k.qkv_norm_rope_store(q_lora, kv, qw[:-1], kvw, eps, pos, freqs, None, layout, store.clone(), rows)
    with pytest.raises(ValueError, match="head_rms_norm_rope"):
        k.head_rms_norm_rope(q, eps, pos.repeat(2), freqs, None)
    with pytest.raises(ValueError, match="head_rms_norm_rope: out must be"):
        k.head_rms_norm_rope(q, eps, pos, freqs, None, out=q[:1].clone())


def _interpreted(plant: str = ""):
    return run_check("test_kernels_attn_norm_rope", f"_check('cpu', {plant!r})", timeout=600)


def test_attn_norm_rope_ops_are_their_twins_under_the_interpreter():
    res = _interpreted()
    assert_ran_ok(res)


@pytest.mark.parametrize("plant", ["rows", "rope"])
def test_the_check_catches_a_planted_bug(plant):
    res = _interpreted(plant)
    assert_check_failed(res)


@pytest.mark.gpu
def test_attn_norm_rope_ops_are_their_twins_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    _check("cuda")


def test_head_rms_norm_rope_twin_writes_into_out():
    from deepinfer.kernels import official_fused

    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=g).bfloat16()
    pos, freqs = torch.arange(5), torch.rand(8, generator=g)
    ref = official_fused.head_rms_norm_rope(q, 1e-6, pos, freqs, None)
    buf = torch.full((7, 4, 64), float("nan"), dtype=torch.bfloat16)
    got = official_fused.head_rms_norm_rope(q, 1e-6, pos, freqs, None, out=buf[:5])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:5], ref) and bool(buf[5:].isnan().all())
    with pytest.raises(ValueError, match="head_rms_norm_rope: out must be"):
        official_fused.head_rms_norm_rope(q, 1e-6, pos, freqs, None, out=buf)
