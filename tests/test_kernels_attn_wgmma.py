"""The warpgroup-MMA CUDA form of the sparse attention with the sink (kernels/cuda/sparse_attn_wgmma.cu) against
its twin (kernels.official.sparse_attn_sink_official), float64 math and the Triton form, on fresh random inputs.

GPU tests (`-m gpu`, sm_90): bounds as tests/test_kernels_attn.py's (the forms differ from the twin only by fp32
summation order: bf16 outputs rel_err <= 2e-3 against the twin and the Triton form, <= 1e-2 against float64).
Also: the skipped all-invalid blocks leave the bits unchanged (a row with such blocks inserted gives the same
output to the bit), strided q and an `out` buffer, the dispatch switch, and the layout check that makes the test
able to fail: the transposed operand's descriptor with LBO and SBO exchanged (MN_SWAP) is far off.
CPU: the dispatch's choice without a GPU, and bad input named (the launcher's problems).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import official, torch_ops

BF16_BOUND, EXACT_BOUND = 2e-3, 1e-2

gpu = pytest.mark.gpu


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.double(), ref.double()
    assert torch.isfinite(a).all(), "non-finite output (an unwritten or NaN element)"
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _wgmma():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from deepinfer.kernels.cuda import sparse_attn_wgmma

    if not sparse_attn_wgmma.usable(torch.device("cuda")):
        pytest.skip("NVRTC or the driver is missing")
    return sparse_attn_wgmma


def _inputs(g, T, H, N, K, hole_frac=0.3, empty_tail=False, d=512):
    """Random q / kv / sink and index rows with holes (-1), at least one valid index in the first block of each
    row (the V4 kernel's running max starts at -inf); empty_tail: half the rows end in whole blocks of -1."""
    dev = "cuda"
    q = torch.randn(T, H, d, generator=g, device=dev).bfloat16()
    kv = torch.randn(N, d, generator=g, device=dev).bfloat16()
    sink = torch.randn(H, generator=g, device=dev)
    idx = torch.randint(0, N, (T, K), generator=g, device=dev, dtype=torch.int32)
    idx = torch.where(torch.rand(T, K, generator=g, device=dev) < hole_frac, -1, idx)
    idx[:, 0] = torch.randint(0, N, (T,), generator=g, device=dev, dtype=torch.int32)
    if empty_tail and K > 64:
        idx[: T // 2, 64:] = -1
    return q, kv, sink, idx


def _run(wg, q, kv, sink, idx, initial_max=float("-inf"), mn_swap=0, pipelined=True):
    from deepinfer.kernels.triton.fp8_gemm import sm_count

    out = torch.empty_like(q)
    return wg.sparse_attn_wgmma(q, kv, sink, idx, q.shape[-1] ** -0.5, initial_max, out, sm_count(q.device),
                                mn_swap=mn_swap, pipelined=pipelined)


BUILDS = (True, False)  # the default build and the one ptxas serializes (PIPELINED_QK 0; test_kernels_wgmma_pipeline)


@gpu
@pytest.mark.parametrize("pipelined", BUILDS)
@pytest.mark.parametrize("T,H,N,K,initial_max", [
    (128, 64, 4000, 640, float("-inf")),  # V4-Flash's ratio-4 layers: window 128 + top 512
    (300, 64, 3000, 192, float("-inf")),  # ratio 128: window + 64 entries
    (200, 128, 5000, 200, float("-inf")),  # two head blocks (V4-Pro's 128 heads), K past a whole block
    (257, 64, 2000, 640, -1e30),  # V4.1's running max
    (1, 64, 500, 64, float("-inf")),  # one token, one block
])
def test_wgmma_matches_twin_float64_and_triton(T, H, N, K, initial_max, pipelined):
    wg = _wgmma()
    from deepinfer.kernels.triton import sparse_attn

    g = torch.Generator(device="cuda").manual_seed(T * 7 + K)
    q, kv, sink, idx = _inputs(g, T, H, N, K, empty_tail=True)
    scale = 512**-0.5
    out = _run(wg, q, kv, sink, idx, initial_max, pipelined=pipelined)
    ref = official.sparse_attn_sink_official(q, kv, sink, idx, scale, initial_max)
    exact = torch_ops.sparse_attn_sink(q.double(), kv.double(), sink.double(), idx.long(), scale)
    tri = sparse_attn.sparse_attn_sink_triton(q, kv, sink, idx, scale, initial_max)
    errs = rel_err(out, ref), rel_err(out, exact), rel_err(out, tri)
    print(f"wgmma pipelined={pipelined} T={T} H={H} K={K}: rel_err vs twin {errs[0]:.2e}, float64 {errs[1]:.2e}, "
          f"triton {errs[2]:.2e}")
    assert errs[0] <= BF16_BOUND and errs[1] <= EXACT_BOUND and errs[2] <= BF16_BOUND, errs


@gpu
def test_wgmma_v41_rows_without_an_index_give_zero():
    wg = _wgmma()
    g = torch.Generator(device="cuda").manual_seed(5)
    q, kv, sink, idx = _inputs(g, 130, 64, 900, 192)
    idx[3] = -1
    idx[77] = -1
    out = _run(wg, q, kv, sink, idx, -1e30)
    assert out[3].abs().max().item() == 0 and out[77].abs().max().item() == 0
    assert rel_err(out, official.sparse_attn_sink_official(q, kv, sink, idx, 512**-0.5, -1e30)) <= BF16_BOUND


@gpu
@pytest.mark.parametrize("pipelined", BUILDS)
@pytest.mark.parametrize("initial_max", [float("-inf"), -1e30])
def test_wgmma_skipped_blocks_keep_the_bits(initial_max, pipelined):
    """Whole blocks of -1 inserted after a row's first block (and at its end) are skipped: the output is the same
    to the bit as without them."""
    wg = _wgmma()
    g = torch.Generator(device="cuda").manual_seed(11)
    q, kv, sink, idx = _inputs(g, 150, 64, 3000, 192, hole_frac=0.2)
    holes = torch.full((150, 64), -1, dtype=torch.int32, device="cuda")
    wide = torch.cat([idx[:, :64], holes, holes, idx[:, 64:], holes], dim=1)  # K 192 -> 384
    a = _run(wg, q, kv, sink, idx, initial_max, pipelined=pipelined)
    assert torch.equal(a, _run(wg, q, kv, sink, wide, initial_max, pipelined=pipelined))
    if not pipelined:  # the same math and order as the default build: the same bits
        assert torch.equal(a, _run(wg, q, kv, sink, idx, initial_max))


@gpu
def test_wgmma_strided_q_into_a_buffer():
    wg = _wgmma()
    from deepinfer.kernels.triton import sparse_attn

    g = torch.Generator(device="cuda").manual_seed(3)
    q, kv, sink, idx = _inputs(g, 140, 64, 1500, 640)
    wide_q = torch.zeros(140, 64, 1024, dtype=torch.bfloat16, device="cuda")
    wide_q[:, :, 256:768] = q
    buf = torch.full((150, 64, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    got = sparse_attn.sparse_attn_sink_cuda(wide_q[:, :, 256:768], kv, sink, idx, 512**-0.5, out=buf[:140])
    assert got.data_ptr() == buf.data_ptr() and bool((buf[140:] == 7).all())
    assert torch.equal(buf[:140], _run(wg, q, kv, sink, idx))


@gpu
@pytest.mark.parametrize("pipelined", BUILDS)
def test_wgmma_layout_check_can_fail(pipelined):
    """The transposed V operand's descriptor with its two strides exchanged reads the wrong values: the
    comparison above would catch such a layout error."""
    wg = _wgmma()
    g = torch.Generator(device="cuda").manual_seed(9)
    q, kv, sink, idx = _inputs(g, 128, 64, 2000, 192)
    ref = official.sparse_attn_sink_official(q, kv, sink, idx, 512**-0.5)
    assert rel_err(_run(wg, q, kv, sink, idx, pipelined=pipelined), ref) <= BF16_BOUND
    assert rel_err(_run(wg, q, kv, sink, idx, mn_swap=1, pipelined=pipelined), ref) > 0.1


@gpu
def test_dispatch_switch(monkeypatch):
    wg = _wgmma()
    from deepinfer.kernels.triton import sparse_attn

    calls = []
    real = wg.sparse_attn_wgmma
    monkeypatch.setattr(wg, "sparse_attn_wgmma", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator(device="cuda").manual_seed(1)
    q, kv, sink, idx = _inputs(g, sparse_attn.WGMMA_MIN_TOKENS, 64, 800, 128)
    sparse_attn.sparse_attn_sink_official_cuda(q, kv, sink, idx, 0.05)
    assert len(calls) == 1
    sparse_attn.sparse_attn_sink_official_cuda(q[:5], kv, sink, idx[:5], 0.05)  # a decode-sized call: Triton
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_KERNEL", "triton")
    sparse_attn.sparse_attn_sink_official_cuda(q, kv, sink, idx, 0.05)
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_KERNEL", "wgmma")
    sparse_attn.sparse_attn_sink_official_cuda(q[:5], kv, sink, idx[:5], 0.05)
    assert len(calls) == 2


def _rope_inputs(g, T):
    """Positions of T tokens, V4's query RoPE frequencies (32 pairs) and their rope_table32 [2, T, 32]."""
    from deepinfer.kernels.triton import rope

    pos = torch.randint(0, 60_000, (T,), generator=g, device="cuda")
    freqs = official.rope_freqs32(64, 65536, 160000.0, 16.0, 32, 1).cuda()
    return pos, freqs, rope.rope_table32(pos, freqs)


@gpu
@pytest.mark.parametrize("T,H,K", [(128, 64, 640), (300, 128, 192), (9, 64, 64)])
def test_wgmma_qnorm_is_the_separate_norm_then_the_kernel(T, H, K):
    """QNORM: the raw queries normed and rotated in shared memory == `head_rms_norm_rope`'s launch, then the
    kernel, except where a row's sum of squares (summed in another order) rounds its bf16 mean the other way:
    at most 1% of the outputs differ, rel_err <= 1e-3. Against the twin (op sparse_attn_sink_qnorm's, float32
    torch ops) at the attention's bound. A projection-sized scale (x 5) so the norm moves every value."""
    wg = _wgmma()
    from deepinfer.kernels import official_fused
    from deepinfer.kernels.triton import attn_norm_rope
    from deepinfer.kernels.triton.fp8_gemm import sm_count

    g = torch.Generator(device="cuda").manual_seed(T + K)
    q, kv, sink, idx = _inputs(g, T, H, 3000, K)
    raw = (q.float() * 5).bfloat16()
    pos, freqs, table = _rope_inputs(g, T)
    eps, scale = 1e-6, 512**-0.5
    want = _run(wg, attn_norm_rope.head_rms_norm_rope(raw, eps, pos, freqs, table), kv, sink, idx)
    got = wg.sparse_attn_wgmma(raw, kv, sink, idx, scale, float("-inf"), torch.empty_like(raw), sm_count(raw.device),
                               q_norm=(eps, table))
    differ = (got != want).float().mean().item()
    twin = official_fused.sparse_attn_sink_qnorm(raw, kv, sink, idx, scale, eps, pos, freqs, None)
    print(f"qnorm T={T} H={H} K={K}: vs the separate norm rel_err {rel_err(got, want):.2e} ({100 * differ:.3f}% of "
          f"elements differ), vs the twin {rel_err(got, twin):.2e}")
    assert rel_err(got, want) <= 1e-3 and differ <= 0.01
    assert rel_err(got, twin) <= BF16_BOUND


@gpu
def test_qnorm_op_dispatch(monkeypatch):
    """Op sparse_attn_sink_qnorm: DEEPINFER_ATTN_QNORM=kernel (the default) takes the QNORM build (one launch),
    =launch `head_rms_norm_rope`'s launch then the plain kernel; both the same within the note above."""
    wg = _wgmma()
    from deepinfer.kernels.triton import sparse_attn

    g = torch.Generator(device="cuda").manual_seed(2)
    q, kv, sink, idx = _inputs(g, 64, 64, 900, 192)
    pos, freqs, table = _rope_inputs(g, 64)
    calls = []
    real = wg.sparse_attn_wgmma
    monkeypatch.setattr(wg, "sparse_attn_wgmma", lambda *a, **k: calls.append(k.get("q_norm")) or real(*a, **k))
    monkeypatch.setenv("DEEPINFER_ATTN_QNORM", "launch")
    apart = sparse_attn.sparse_attn_sink_qnorm(q, kv, sink, idx, 0.05, 1e-6, pos, freqs, table)
    monkeypatch.setenv("DEEPINFER_ATTN_QNORM", "kernel")
    fused = sparse_attn.sparse_attn_sink_qnorm(q, kv, sink, idx, 0.05, 1e-6, pos, freqs, None)
    assert calls[0] is None and calls[1] is not None, calls
    assert rel_err(fused, apart) <= 1e-3 and (fused != apart).float().mean().item() <= 0.01


def test_qnorm_twin_is_the_norm_then_the_attention():
    """The CPU twin of op sparse_attn_sink_qnorm is `head_rms_norm_rope`, then the official attention: the ops
    the prefill ran one by one (bit for bit)."""
    from deepinfer.kernels import official_fused

    g = torch.Generator().manual_seed(4)
    T, H, d = 6, 4, 128
    q = (torch.randn(T, H, d, generator=g) * 3).bfloat16()
    kv = torch.randn(40, d, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, 40, (T, 70), generator=g)
    idx[:, 0] = 0
    pos = torch.randint(0, 5000, (T,), generator=g)
    freqs = official.rope_freqs32(32, 65536, 160000.0, 16.0, 32, 1)
    got = official_fused.sparse_attn_sink_qnorm(q, kv, sink, idx, 0.1, 1e-6, pos, freqs, None)
    qn = official_fused.head_rms_norm_rope(q, 1e-6, pos, freqs, None)
    assert torch.equal(got, official.sparse_attn_sink_official(qn, kv, sink, idx, 0.1))
    buf = torch.empty_like(q)
    assert official_fused.sparse_attn_sink_qnorm(q, kv, sink, idx, 0.1, 1e-6, pos, freqs, None, out=buf) is buf
    assert torch.equal(buf, got)


def test_launcher_names_bad_input():
    from deepinfer.kernels.cuda import sparse_attn_wgmma as wg

    q = torch.zeros(4, 48, 256, dtype=torch.bfloat16)
    kv = torch.zeros(10, 256, dtype=torch.bfloat16)
    found = wg.problems(q, kv, torch.zeros(4, 8, dtype=torch.int64), torch.zeros_like(q))
    assert any("head dim 512" in p for p in found) and any("idx must be int32" in p for p in found)
    with pytest.raises(ValueError, match="sparse_attn_wgmma: q"):
        wg.sparse_attn_wgmma(q, kv, torch.zeros(48), torch.zeros(4, 8, dtype=torch.int32), 1.0, 0.0,
                             torch.zeros_like(q), 132)
    good = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    assert wg.problems(good, torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.int32),
                       torch.zeros_like(good)) == []
    with pytest.raises(ValueError, match="q_norm's table must be rope_table32's"):  # named before any launch
        wg.sparse_attn_wgmma(good, torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(64),
                             torch.zeros(4, 8, dtype=torch.int32), 1.0, 0.0, torch.zeros_like(good), 132,
                             q_norm=(1e-6, torch.zeros(2, 4, 16)))


def test_env_switch_is_checked(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_KERNEL", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_ATTN_PREFILL_KERNEL"):
        env.attn_prefill_kernel()
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_KERNEL", "Triton")
    assert env.attn_prefill_kernel() == "triton"
