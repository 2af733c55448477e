"""Attention-side kernels against their torch twins on fresh random inputs.

GPU tests (`-m gpu`, the device machine): the Triton kernels of `deepinfer/kernels/triton/{sparse_attn,
norm_hc,rope,indexer}.py` vs `kernels.official` / `official_fused` / `torch_ops` at decode and prefill shapes,
tiny and real head counts and dims. Bounds (rel_err = |out - ref| / |ref|, Frobenius): the kernels follow the
twins' rounding points, so they differ only by fp32 summation order, which flips a bf16 rounding now and then:
bf16 outputs <= 2e-3 (one bf16 ulp is 3.9e-3 relative at worst), fp32 outputs <= 1e-5. The sparse attention
is also held against float64 math (torch_ops.sparse_attn_sink) at the bf16 level, 1e-2.
hc_pre_fused also runs on the CPU under TRITON_INTERPRET (a fresh process) at small shapes, and its mix
kernel's products are checked exact (one-hot rows) there and on the GPU.
Also: the stable top-k (torch_ops.stable_topk, a stable sort) keeps ties toward the lower index on CUDA,
where no Triton kernel replaces it (measured slower alternatives; see kernels/triton/indexer.py).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import official, official_fused, torch_ops

BF16_BOUND, F32_BOUND, EXACT_BOUND = 2e-3, 1e-5, 1e-2

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    a, b = out.double(), ref.double()
    assert torch.isfinite(a).all(), "non-finite output (an unwritten or NaN element)"
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# ------------------------------------------------------------------------------------------- GPU helpers
def _cuda_kernels():
    from deepinfer.kernels.triton import compress_pool, indexer, kv_pack, norm_hc, rope, sparse_attn

    return sparse_attn, norm_hc, rope, indexer, compress_pool, kv_pack


def _attn_inputs(g, T, H, d, N, K, hole_frac=0.3, empty_tail=False):
    dev = "cuda"
    q = torch.randn(T, H, d, generator=g, device=dev).bfloat16()
    kv = torch.randn(N, d, generator=g, device=dev).bfloat16()
    sink = torch.randn(H, generator=g, device=dev)
    idx = torch.randint(0, N, (T, K), generator=g, device=dev, dtype=torch.int32)
    holes = torch.rand(T, K, generator=g, device=dev) < hole_frac
    idx = torch.where(holes, -1, idx)
    idx[:, 0] = torch.randint(0, N, (T,), generator=g, device=dev, dtype=torch.int32)  # >= 1 valid per row
    if empty_tail and K > 64:
        idx[: T // 2, 64:] = -1  # whole blocks of -1 after a valid first block (short rows in a wide batch)
    return q, kv, sink, idx


# ------------------------------------------------------------------------------------------- sparse attention
@gpu
@needs_cuda
@pytest.mark.parametrize("T,H,d,N,K", [
    (1, 4, 256, 300, 128),  # tiny model, decode
    (5, 8, 256, 500, 200),  # tiny, K not a multiple of 64
    (1, 64, 512, 5000, 640),  # real, decode batch 1
    (32, 64, 512, 20000, 640),  # real, decode batch 32
    (1200, 64, 512, 4000, 640),  # real, prefill
    (300, 4, 256, 2000, 136),  # tiny, prefill
])
def test_sparse_attn_sink_matches_official(T, H, d, N, K):
    sparse_attn, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + K)
    q, kv, sink, idx = _attn_inputs(g, T, H, d, N, K, empty_tail=True)
    scale = d**-0.5
    out = sparse_attn.sparse_attn_sink_official_cuda(q, kv, sink, idx, scale)
    ref = official.sparse_attn_sink_official(q, kv, sink, idx, scale)
    err = rel_err(out, ref)
    exact = torch_ops.sparse_attn_sink(q.double(), kv.double(), sink.double(), idx.long(), scale)
    err_exact = rel_err(out, exact)
    print(f"sparse_attn T={T} H={H} d={d} K={K}: rel_err vs official {err:.2e}, vs float64 {err_exact:.2e}")
    assert err <= BF16_BOUND and err_exact <= EXACT_BOUND


@gpu
@needs_cuda
@pytest.mark.parametrize("block_h", [16, 32, 64])
def test_sparse_attn_sink_every_head_block(block_h):
    """Every head-block width gives the same function (the launcher picks one by T; all must be right)."""
    sparse_attn, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(block_h)
    q, kv, sink, idx = _attn_inputs(g, 40, 64, 512, 3000, 384)
    out = sparse_attn.sparse_attn_sink_triton(q, kv, sink, idx, 512**-0.5, block_h=block_h)
    assert rel_err(out, official.sparse_attn_sink_official(q, kv, sink, idx, 512**-0.5)) <= BF16_BOUND
    # out=: the first rows of a larger buffer (the extend graphs' o), the same bits, the rest untouched
    buf = torch.full((64, 64, 512), 7.0, device="cuda", dtype=torch.bfloat16)
    into = sparse_attn.sparse_attn_sink_triton(q, kv, sink, idx, 512**-0.5, block_h=block_h, out=buf[:40])
    assert into.data_ptr() == buf.data_ptr() and torch.equal(buf[:40], out) and bool((buf[40:] == 7).all())


@gpu
@needs_cuda
def test_sparse_attn_sink_v41_empty_rows_give_zero():
    sparse_attn, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, kv, sink, idx = _attn_inputs(g, 16, 8, 256, 400, 192)
    idx[3] = -1
    idx[9] = -1
    out = sparse_attn.sparse_attn_sink_official_v41_cuda(q, kv, sink, idx, 256**-0.5)
    ref = official.sparse_attn_sink_official_v41(q, kv, sink, idx, 256**-0.5)
    assert out[3].abs().max().item() == 0 and out[9].abs().max().item() == 0
    assert rel_err(out, ref) <= BF16_BOUND


@gpu
@needs_cuda
def test_sparse_attn_sink_rejects_bad_input():
    sparse_attn, *_ = _cuda_kernels()
    q = torch.zeros(2, 4, 256, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(10, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape mismatch"):
        sparse_attn.sparse_attn_sink_triton(q, kv, torch.zeros(5, device="cuda"), torch.zeros(2, 8, device="cuda",
                                                                                             dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="bf16"):
        sparse_attn.sparse_attn_sink_triton(q.float(), kv, torch.zeros(4, device="cuda"),
                                            torch.zeros(2, 8, device="cuda", dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="out must be"):
        sparse_attn.sparse_attn_sink_triton(q, kv, torch.zeros(4, device="cuda"),
                                            torch.zeros(2, 8, device="cuda", dtype=torch.int32), 1.0, out=q[:1])


def test_sparse_attn_twin_writes_into_out():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 64, generator=g).bfloat16()
    kv = torch.randn(30, 64, generator=g).bfloat16()
    sink, idx = torch.randn(4, generator=g), torch.randint(-1, 30, (6, 70), generator=g)
    ref = official.sparse_attn_sink_official(q, kv, sink, idx, 0.125)
    buf = torch.zeros(9, 4, 64, dtype=torch.bfloat16)
    assert official.sparse_attn_sink_official(q, kv, sink, idx, 0.125, out=buf[:6]).data_ptr() == buf.data_ptr()
    assert torch.equal(buf[:6], ref) and not buf[6:].any()
    with pytest.raises(ValueError, match="out must be"):
        official.sparse_attn_sink_official(q, kv, sink, idx, 0.125, out=buf)


# ------------------------------------------------------------------------------------------- RMSNorm / mHC
@gpu
@needs_cuda
@pytest.mark.parametrize("rows,D", [(1, 256), (37, 512), (2000, 4096), (3, 7168)])
def test_rms_norm_matches_torch(rows, D):
    _, norm_hc, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(rows + D)
    x = torch.randn(rows, D, generator=g, device="cuda") * 3
    w = torch.rand(D, generator=g, device="cuda") + 0.5
    err32 = rel_err(norm_hc.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6))
    xb = x.bfloat16()
    errb = rel_err(norm_hc.rms_norm(xb, None, 1e-6), torch_ops.rms_norm(xb.float(), None, 1e-6).bfloat16())
    print(f"rms_norm {rows}x{D}: fp32 {err32:.2e}, bf16 {errb:.2e}")
    assert err32 <= F32_BOUND and errb <= BF16_BOUND
    x64 = x.double()  # exact numerics on a GPU: the torch op, bit for bit
    assert torch.equal(norm_hc.rms_norm(x64, w.double(), 1e-6), torch_ops.rms_norm(x64, w.double(), 1e-6))


def _hc_inputs(g, T, D, hc=4, device="cuda"):
    n = (2 + hc) * hc
    x = (torch.randn(T, hc, D, generator=g, device=device) * 2).bfloat16()
    fn = torch.randn(n, hc * D, generator=g, device=device) * (hc * D) ** -0.5
    scale = torch.rand(3, generator=g, device=device) + 0.5
    base = torch.randn(n, generator=g, device=device)
    nw = torch.rand(D, generator=g, device=device) + 0.5
    return x, fn, scale, base, nw


def _hc_pre_errors(T, D, config=None, device="cuda"):
    """rel_err of norm_hc.hc_pre_fused (launch `config`) against its torch twin: (y, post, comb)."""
    from deepinfer.kernels.triton import norm_hc

    g = torch.Generator(device=device).manual_seed(T + D)
    args = _hc_inputs(g, T, D, device=device)
    y, post, comb = norm_hc.hc_pre_fused(*args, 4, 20, 1e-6, 1e-6, config=config)
    ry, rpost, rcomb = official_fused.hc_pre_fused(*args, 4, 20, 1e-6, 1e-6)
    assert y.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    return rel_err(y, ry), rel_err(post, rpost), rel_err(comb, rcomb)


def _hc_head_error(T, D, device="cuda"):
    """rel_err of norm_hc.hc_head_fused against its twin (the head's collapse: hc pre weights only)."""
    from deepinfer.kernels.triton import norm_hc

    g = torch.Generator(device=device).manual_seed(T * 3 + D)
    x, fn, scale, base, nw = _hc_inputs(g, T, D, device=device)
    hc = x.shape[1]
    fn, scale, base = fn[:hc].contiguous(), scale[:1].contiguous(), base[:hc].contiguous()
    y = norm_hc.hc_head_fused(x, fn, scale, base, nw, 1e-6, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == (T, D)
    try:
        norm_hc.hc_head_fused(x.float(), fn, scale, base, nw, 1e-6, 1e-6)
        raise AssertionError("fp32 streams were accepted")
    except ValueError as err:
        assert "bf16" in str(err)
    return rel_err(y, official_fused.hc_head_fused(x, fn, scale, base, nw, 1e-6, 1e-6))


def _check_hc_mix_exact(device):
    """The mix kernel's fp32 products are exact (fn split into three bf16 parts in the kernel): token t is a
    one-hot row x[t] = 2^e_t at column k_t, so its partials must sum to exactly 2^e_t * fn[:, k_t] and its
    ssq to 4^e_t, for fn values of full 24-bit significands from 2^-90 to 2^90. A dropped or wrong part
    shows in the last bits here (dropping lo moves post / comb only ~1e-6 from the twin, inside the bounds
    of the comparisons). Several launch plans: one split, ragged K (KD = 200 is no multiple of BLOCK_K),
    ragged splits, small tiles."""
    from deepinfer.kernels.triton import norm_hc

    g = torch.Generator().manual_seed(3)
    T, KD, n_out = 40, 200, 24
    sign = torch.randint(0, 2, (n_out, KD), generator=g) * 2.0 - 1
    fn = sign * (1 + torch.rand(n_out, KD, generator=g)) * 2.0 ** torch.randint(-90, 91, (n_out, KD), generator=g)
    cols = torch.randperm(KD, generator=g)[:T]
    pow2 = 2.0 ** torch.randint(-4, 5, (T,), generator=g)
    x = torch.zeros(T, KD)
    x[torch.arange(T), cols] = pow2
    x, fn = x.bfloat16().to(device), fn.to(device)
    want = (fn.double()[:, cols].T * pow2.double().to(device)[:, None])
    for config in (None, dict(BLOCK_T=16, BLOCK_K=32, SPLITS=5), dict(BLOCK_T=32, BLOCK_K=64, SPLITS=2)):
        plan = norm_hc.mix_plan(T, KD, config)
        part, ssq = norm_hc.hc_mix_partials(x, fn, plan)
        assert part.shape == (plan["SPLITS"], T, n_out) and ssq.shape == (plan["SPLITS"], T), plan
        got = part.double().sum(0)  # one nonzero split per token: the double sum is exact
        bad = (got != want).sum().item()
        assert bad == 0, f"{plan}: {bad} of {got.numel()} partial sums are not the exact product"
        assert torch.equal(ssq.double().sum(0), pow2.double().to(device) ** 2), plan


def _check_hc_token_bits_ignore_the_batch(device, D=256, T=70, config=None):
    """A token's y / post / comb are the same bits alone (T = 1) as at any position of a T-token call under
    the same launch plan: a token's split sums and its Sinkhorn chain depend on the plan, never on T."""
    from deepinfer.kernels.triton import norm_hc

    config = config or dict(BLOCK_T=16, BLOCK_K=64, SPLITS=16)
    g = torch.Generator(device=device).manual_seed(11)
    x, *rest = _hc_inputs(g, T, D, device=device)
    y, post, comb = norm_hc.hc_pre_fused(x, *rest, 4, 20, 1e-6, 1e-6, config=config)
    for t in (0, 1, T // 2, T - 1):
        y1, post1, comb1 = norm_hc.hc_pre_fused(x[t:t + 1].contiguous(), *rest, 4, 20, 1e-6, 1e-6, config=config)
        assert torch.equal(y1[0], y[t]) and torch.equal(post1[0], post[t]) and torch.equal(comb1[0], comb[t]), t


_HC_PRE_INTERPRET = """
# the interpreter patched as in test_kernels_fp8_linear: fp32 -> bf16 rounds to nearest even as on the GPU
# (y's bf16 roundings), and a runtime loop bound works under numpy 2
exec(__import__("interpreted").GPU_ROUNDINGS)
import test_kernels_attn as t

t._check_hc_mix_exact("cpu")
t._check_hc_token_bits_ignore_the_batch("cpu")
for T, D, config in [(5, 64, None), (70, 256, None), (5, 48, None),
                     (70, 256, dict(BLOCK_T=32, BLOCK_K=32, SPLITS=3))]:
    e = t._hc_pre_errors(T, D, config, device="cpu")
    print(f"hc_pre T={T} D={D} {config}: y {e[0]:.2e} post {e[1]:.2e} comb {e[2]:.2e}")
    assert e[0] <= t.BF16_BOUND and e[1] <= t.F32_BOUND and e[2] <= t.F32_BOUND, (T, D, config, e)
for T, D in [(3, 64), (70, 256)]:
    e = t._hc_head_error(T, D, device="cpu")
    print(f"hc_head T={T} D={D}: y {e:.2e}")
    assert e <= t.BF16_BOUND, (T, D, e)
print("ok")
"""


def test_hc_pre_fused_matches_twin_under_the_interpreter():
    """norm_hc.hc_pre_fused on CPU tensors through Triton's interpreter (a fresh process: the flag is read at
    import): the mix kernel's products exact, and y / post / comb against the torch twin at small shapes
    (ragged K, several token blocks, a non-default launch plan)."""
    pytest.importorskip("triton")
    from interpreted import assert_ran_ok, run_interpreted

    res = run_interpreted(_HC_PRE_INTERPRET, timeout=600)
    assert_ran_ok(res)


def test_hc_mix_plan():
    """Default launch plans (decode, batched decode, prefill) tile K without an empty split; a config
    overrides; bad configs and an x that is not bf16 name what was wrong."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.norm_hc import hc_pre_fused, mix_plan

    KD = 4 * 4096
    for T in (1, 7, 128, 1500, 8192):
        p = mix_plan(T, KD)
        assert p["K_CHUNK"] % p["BLOCK_K"] == 0 and (p["SPLITS"] - 1) * p["K_CHUNK"] < KD <= p["SPLITS"] * p["K_CHUNK"]
    # a decode token spreads the fn read over 128 splits of one 128-column step (the H200 sweep's best whole
    # op, results/hc_mix_h200_2026-12-05_s18.log); a batched decode too; a prefill keeps ~2 programs an SM
    assert [mix_plan(T, KD)["SPLITS"] for T in (1, 128, 8192)] == [128, 128, 4]
    p = mix_plan(8192, KD, dict(BLOCK_T=64, SPLITS=3, num_stages=2))
    assert (p["BLOCK_T"], p["SPLITS"], p["num_stages"], p["K_CHUNK"]) == (64, 3, 2, 5504)
    with pytest.raises(ValueError, match="BLOCK_N"):
        mix_plan(1, KD, dict(BLOCK_N=64))
    with pytest.raises(ValueError, match="BLOCK_K=48"):
        mix_plan(1, KD, dict(BLOCK_K=48))
    with pytest.raises(ValueError, match="SPLITS=0"):
        mix_plan(1, KD, dict(SPLITS=0))
    x, *rest = _hc_inputs(torch.Generator().manual_seed(0), 2, 64, device="cpu")
    with pytest.raises(ValueError, match="torch.float32"):
        hc_pre_fused(x.float(), *rest, 4, 20, 1e-6, 1e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("T,D,config", [(70, 256, None), (600, 4096, dict(BLOCK_T=64, BLOCK_K=128, SPLITS=4)),
                                        (20, 4096, dict(BLOCK_T=16, BLOCK_K=128, SPLITS=128))])
def test_hc_pre_token_bits_ignore_the_batch(T, D, config):
    _check_hc_token_bits_ignore_the_batch("cuda", D, T, config)


@gpu
@needs_cuda
@pytest.mark.parametrize("T,D,config", [
    (1, 256, None), (7, 256, None), (32, 4096, None), (1500, 4096, None), (8192, 4096, None),
    (1, 4096, dict(SPLITS=128, BLOCK_K=64, num_stages=3)),
    (1500, 4096, dict(BLOCK_T=64, BLOCK_K=128, SPLITS=5, num_warps=4, num_stages=3)),
])
def test_hc_pre_fused_matches_twin(T, D, config):
    e = _hc_pre_errors(T, D, config)
    print(f"hc_pre T={T} D={D} {config}: y {e[0]:.2e} post {e[1]:.2e} comb {e[2]:.2e}")
    # the mix GEMM sums 4D products in another order than cuBLAS: fp32-level, amplified a little by Sinkhorn
    assert e[0] <= BF16_BOUND and e[1] <= 1e-4 and e[2] <= 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("T,D", [(1, 4096), (32, 4096), (128, 4096), (300, 256)])
def test_hc_head_fused_matches_twin(T, D):
    e = _hc_head_error(T, D)
    print(f"hc_head T={T} D={D}: y {e:.2e}")
    assert e <= BF16_BOUND


@gpu
@needs_cuda
def test_hc_mix_products_exact_on_tensor_cores():
    _check_hc_mix_exact("cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("T,D", [(1, 256), (64, 4096), (1500, 7168)])
def test_hc_post_matches_torch(T, D):
    _, norm_hc, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    x, *_ = _hc_inputs(g, T, D)
    f = torch.randn(T, D, generator=g, device="cuda").bfloat16()
    post = torch.rand(T, 4, generator=g, device="cuda") * 2
    comb = torch.rand(T, 4, 4, generator=g, device="cuda")
    out = norm_hc.hc_post(f.float(), x.float(), post, comb)
    ref = torch_ops.hc_post(f.float(), x.float(), post, comb)
    e32 = rel_err(out, ref)
    e16 = rel_err(norm_hc.hc_post_fused(f, x, post, comb), official_fused.hc_post_fused(f, x, post, comb))
    print(f"hc_post T={T} D={D}: fp32 {e32:.2e}, bf16 {e16:.2e}")
    assert out.dtype == torch.float32 and e32 <= F32_BOUND and e16 <= BF16_BOUND


# ------------------------------------------------------------------------------------------- RoPE / indexer
@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 64, 512), (2000, 64, 512), (9, 4, 256), (300, 512), (5, 8, 128)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope32_matches_official(shape, inverse):
    _, _, rope, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(shape[0] + inverse)
    freqs = official.rope_freqs32(64, 65536, 160000.0, 16.0, 32, 1).cuda()
    x = torch.randn(*shape, generator=g, device="cuda").bfloat16()
    pos = torch.randint(0, 1_000_000, (shape[0],), generator=g, device="cuda")
    err = rel_err(rope.rope32(x, pos, freqs, inverse), official.rope32(x, pos, freqs, inverse))
    err32 = rel_err(rope.rope32(x.float(), pos, freqs, inverse), official.rope32(x.float(), pos, freqs, inverse))
    print(f"rope32 {shape} inverse={inverse}: bf16 {err:.2e} fp32 {err32:.2e}")
    assert err <= BF16_BOUND and err32 <= F32_BOUND


@gpu
@needs_cuda
@pytest.mark.parametrize("T,h,d,E", [(1, 4, 128, 37), (16, 64, 128, 2048), (1000, 64, 128, 1000), (3, 4, 128, 300)])
def test_indexer_scores_and_topk_match_official(T, h, d, E):
    _, _, _, indexer, *_ = _cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(T + E)
    q = torch.randn(T, h, d, generator=g, device="cuda").bfloat16()
    w = (torch.randn(T, h, generator=g, device="cuda") * 0.1).bfloat16()
    keys = torch.randn(E, d, generator=g, device="cuda").bfloat16()
    out = indexer.indexer_scores_bf16(q, w, keys)
    ref = official.indexer_scores_bf16(q, w, keys)
    err = rel_err(out, ref)
    print(f"indexer_scores T={T} h={h} E={E}: rel_err {err:.2e}, differing {(out != ref).float().mean().item():.2%}")
    assert out.dtype == torch.bfloat16 and err <= BF16_BOUND
    k = min(512, E)
    visible = torch.randint(1, E + 1, (T,), generator=g, device="cuda")
    masked = ref.masked_fill(torch.arange(E, device="cuda")[None, :] >= visible[:, None], float("-inf"))
    masked[:, ::3] = 0.0  # relu zeros: many exact ties
    top = torch_ops.stable_topk(masked, k)  # on CUDA: ties must still go to the lower entry
    assert torch.equal(top.cpu(), torch_ops.stable_topk(masked.cpu(), k))


@gpu
@needs_cuda
@pytest.mark.parametrize("n,r,width,overlap", [(1, 4, 128, True), (2048, 4, 512, True), (1, 128, 512, False),
                                               (64, 128, 512, False), (33, 4, 128, True)])
def test_compress_pool_matches_torch(n, r, width, overlap):
    compress_pool = _cuda_kernels()[4]
    g = torch.Generator(device="cuda").manual_seed(n + r)
    c = 2 if overlap else 1
    nb = n + 1 if overlap else n
    kv = torch.randn(nb, r, c * width, generator=g, device="cuda")
    score = torch.randn(nb, r, c * width, generator=g, device="cuda") * 3
    if overlap:  # the first entry of a sequence: no previous block (kv 0, score -inf), as the fresh state holds
        kv[0], score[0, :, :width] = 0.0, float("-inf")
    err = rel_err(compress_pool.compress_pool(kv, score, overlap), torch_ops.compress_pool(kv, score, overlap))
    print(f"compress_pool n={n} r={r} width={width} overlap={overlap}: rel_err {err:.2e}")
    assert err <= F32_BOUND


@gpu
@needs_cuda
@pytest.mark.parametrize("name,head_dim", [("v4_fp8_ds_mla", 512), ("v4_fp8_ds_mla", 256), ("v41_window_fp8", 512),
                                           ("v4_index_fp4", 512)])
def test_kv_pack_is_the_layout_codec_bit_for_bit(name, head_dim):
    """kv_encode / kv_decode == KVLayout.store / .load, byte for byte and bit for bit (the cached values must
    be the oracle's), over magnitudes from the 1e-4 amax floor to 4e3, zero rows and fp32 input."""
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout

    kv_pack = _cuda_kernels()[5]
    layout = get_layout(name, SimpleNamespace(head_dim=head_dim, rope_head_dim=64, index_head_dim=128))
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    mags = torch.logspace(-6, 3.6, 40, device="cuda").repeat(50).unsqueeze(1)  # 2000 rows
    x = torch.randn(mags.shape[0], layout.dim, generator=g, device="cuda") * mags
    x[0] = 0.0
    for inp in (x.bfloat16(), x):
        packed = kv_pack.kv_encode(layout, inp)
        ref = layout.store(inp)
        assert packed.dtype == torch.uint8 and torch.equal(packed, ref), (packed != ref).nonzero()[:5].tolist()
        assert torch.equal(kv_pack.kv_decode(layout, ref).view(torch.int16), layout.load(ref).view(torch.int16))
    three = x[:12].bfloat16().view(3, 4, layout.dim)  # leading dims are kept
    assert kv_pack.kv_decode(layout, kv_pack.kv_encode(layout, three)).shape == three.shape


@gpu
@needs_cuda
def test_registrations_install_for_cuda(monkeypatch):
    from deepinfer import kernels

    monkeypatch.setattr(kernels, "_REGISTRY", dict(kernels._REGISTRY))  # leave the session's registry as it was
    mods = _cuda_kernels()
    for mod in mods:
        for name, fn in mod.REGISTRATIONS.items():
            kernels.register(name, fn, device="cuda")
            assert kernels.get(name, "cuda") is fn
            assert kernels.get(name, "cpu") is not fn  # the torch twin stays the CPU op
