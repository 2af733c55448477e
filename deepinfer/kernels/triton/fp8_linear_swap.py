"""fp8_linear's "swap" form for batched decode (17..256 rows): the weights are the wgmma's A operand.

The "bf16" form (`fp8_gemm._fp8_linear_kernel`) puts the tokens on the MMA's M side and the weight tile,
converted from E4M3 x scale to bf16 in registers, on its B side. On Hopper wgmma's B operand must come from
shared memory, so every converted weight tile goes registers -> shared -> tensor cores, and with 17..256
tokens the M side is mostly one or two 64-row tiles: each weight is converted once per token tile.
Here the roles swap: out^T [weights, tokens] = W [weights, K] x X^T [K, tokens]. The converted weight tile
stays in registers as wgmma's A operand (the "RS" form: `HGMMA.64xNx16.F32.BF16 R.., R.., gdesc` in the
SASS, checked with scripts/sass_sm90.py), the activation tile is the B operand straight from shared memory
(async copies, pipelined), and the tokens are wgmma's N (16..256), so one CTA reads a weight tile once for
all of the step's tokens.

Math: the same exact products as the "bf16" form (E4M3 x pow2 block scale and act_quant's q x s are exact
in bf16) accumulated in fp32; only the fp32 summation order differs from the torch twin
(`quant_weights.fp8_linear_torch`) and from the other forms. Split-K and its ordered fp32 sum are
`fp8_gemm`'s (`_split_k`, `_split_sum_kernel`); the activation is quantised inside the kernel
(FUSED_ACT, per act_block of each token) or by one act_quant pass before it.
Where the wgmma CUDA kernel can run (sm_90 with NVRTC) `fp8_linear` takes it instead for 17..256 rows
(kernels/cuda/fp8_linear_wgmma.cu: the same roles, TMA-fed and warp-specialised, 13-27% faster over a layer); this form
stays the fallback there and the A/B baseline (DEEPINFER_LINEAR_BATCH_FORM=swap).
Must not: be imported without triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kernels.triton.act_quant import quantise_rows
from deepinfer.kernels.triton.launch import cdiv, fast_launch, next_power_of_2
from deepinfer.kernels.triton.pdl import pdl_enter

MAX_TOKENS_TILE = 128  # wgmma N of one tile; more rows take several token tiles


@fast_launch
@triton.jit
def _fp8_linear_swap_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N,
                            stride_xm, stride_wn, stride_wsn, stride_om, stride_os, K: tl.constexpr,
                            WBLOCK: tl.constexpr, CHUNK: tl.constexpr, KB: tl.constexpr,
                            A_DEQUANT: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT_OUT: tl.constexpr,
                            BW: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (weight tile, token tile; split): acc[BW weights, BT tokens] over K range
    [split * K_SPLIT, (split + 1) * K_SPLIT). A_DEQUANT: x holds act_quant's exact q * s in bf16; else x is
    the raw bf16 activation, quantised here per CHUNK of each token. Token tiles vary fastest, so the
    programs sharing a weight tile run together and the weight is read from HBM once."""
    pdl_enter(PDL)
    tiles_t = tl.cdiv(M, BT)
    pid_w = tl.program_id(0) // tiles_t
    pid_t = tl.program_id(0) % tiles_t
    offs_n = pid_w * BW + tl.arange(0, BW)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, KB)
    n_ok = offs_n < N
    t_ok = offs_t < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BW, KB], K contiguous
    ws_ptrs = ws_ptr + (offs_n // WBLOCK)[:, None] * stride_wsn + tl.arange(0, KB // WBLOCK)[None, :]
    x_ptrs = x_ptr + offs_t[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [KB, BT] = X^T
    if SPLIT_OUT:
        k_lo = tl.program_id(1) * K_SPLIT
    else:
        k_lo = 0
    acc = tl.zeros((BW, BT), dtype=tl.float32)
    for k_step in range(0, K_SPLIT, KB):  # constant trip count (k_lo is added to the offsets)
        k0 = k_lo + k_step
        # weight: E4M3 x its pow2 block scale, exact in bf16; stays in registers (wgmma's A operand)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0).to(tl.float32)
        w_scale = tl.load(ws_ptrs + k0 // WBLOCK, mask=n_ok[:, None], other=0.0)  # [BW, KB / WBLOCK]
        w_val = tl.reshape(tl.reshape(w, (BW, KB // WBLOCK, WBLOCK)) * w_scale[:, :, None], (BW, KB))
        if A_DEQUANT:
            x_val = tl.load(x_ptrs + k0, mask=t_ok[None, :], other=0.0)
        else:  # act_quant per CHUNK of each token (a column of X^T), then its exact q * s in bf16
            a = tl.trans(tl.load(x_ptrs + k0, mask=t_ok[None, :], other=0.0).to(tl.float32))  # [BT, KB]
            a_q, a_scale = quantise_rows(tl.reshape(a, (BT * (KB // CHUNK), CHUNK)))
            x_val = tl.trans(tl.reshape(a_q.to(tl.float32) * a_scale[:, None], (BT, KB)).to(tl.bfloat16))
        acc = tl.dot(w_val.to(tl.bfloat16), x_val, acc)  # exact products, fp32 accumulation
    mask = n_ok[:, None] & t_ok[None, :]
    if SPLIT_OUT:  # the fp32 partial of this K range into workspace[split] (summed in order by fp8_gemm)
        ptrs = out_ptr + tl.program_id(1).to(tl.int64) * stride_os + offs_t[None, :].to(tl.int64) * stride_om \
            + offs_n[:, None]
        tl.store(ptrs, acc, mask=mask)
    else:
        ptrs = out_ptr + offs_t[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=mask)


# The H200 sweep (2026-12-03, scripts/bench_gemm_kernels.py --batch-swap,
# results/fp8_linear_swap_sweep_h200_2026-12-03_s11.log; CUDA-graph replay, us, the V4-Flash layer's shapes):
#                     M=32: bf16 / swap    M=64             M=128            M=256
#   wq_b  32768x1024        28.9 / 26.7     48.7 / 27.9      36.8 / 33.1      63.7 / 57.4
#   wo_b  4096x8192         32.2 / 30.5     51.5 / 33.5      39.3 / 36.0      62.2 / 57.1
#   w1    2048x4096         15.1 / 16.2     19.7 / 17.6      24.0 / 22.0      33.0 / 29.8
#   w2    4096x2048         14.8 / 14.9     20.0 / 16.3      20.4 / 18.9      33.4 / 25.5
#   index wq_b 8192x1024    15.1 / 14.9     17.6 / 13.9      22.1 / 17.0      36.3 / 26.6
#   wq_a  1024x4096         12.4 / 13.3     15.4 / 16.4      19.7 / 21.1      26.3 / 29.8
#   wkv   512x4096          11.6 / 12.9     14.6 / 16.3      19.9 / 21.1      26.1 / 30.0
# (swap: the tiles below). The swap form wins where the weight is large for the rows; its limit is the
# activation operand, BT x 256 bytes per 128 K (bf16) against the weight tile's BW x 128, which every weight
# tile's CTA reads through L2 and shared memory: with 128 tokens that is 4x (BW 64) the weight's bytes. The
# in-kernel act_quant (FUSED_ACT) costs more here than in the bf16 form (the token tile is transposed through
# shared memory): 1.3-2x slower at M=64..256, so the swap form always quantises in one pass first.
SWAP_MIN_WORK = {32: 32 << 20, 256: 8 << 20}  # rows up to (key): the smallest N*K weight that takes swap


def takes(m: int, n: int, k: int) -> bool:
    """Whether the sweep above measured the swap form faster for M rows of an N x K weight (17..256 rows)."""
    if m < 17 or m > 256:
        return False
    return n * k >= (SWAP_MIN_WORK[32] if m <= 32 else SWAP_MIN_WORK[256])


def tiles(m: int, n: int, k: int) -> dict:
    """Swap tiles (the sweep above): the step's tokens in one tile up to 64 rows (wgmma N: a power of two
    from 16), 64 weight rows per CTA (one warpgroup), 4 stages; above 64 rows the large weights (N*K >= 32M:
    wq_b, wo_b) take 128 tokens x 128 weight rows (two warpgroups, 3 stages), the others 64 x 64."""
    bt = max(16, next_power_of_2(m))
    if bt <= 64:
        return dict(BW=64, BT=bt, num_warps=4, num_stages=4, FUSED_ACT=False)
    if n * k >= (32 << 20):
        return dict(BW=128, BT=MAX_TOKENS_TILE, num_warps=8, num_stages=3, FUSED_ACT=False)
    return dict(BW=64, BT=64, num_warps=4, num_stages=4, FUSED_ACT=False)


def launch(x, w, dest, stride_om: int, stride_os: int, m: int, n: int, k: int, kb: int, split: int,
           fused: bool, cfg: dict) -> None:
    """Run the kernel: x bf16 [M, K] (raw when fused, else act_quant's q * s), w a QuantLinearWeight, dest
    bf16 [M, N] (split == 1) or the fp32 workspace [split, M, N], with its row and split strides."""
    grid = (cdiv(n, cfg["BW"]) * cdiv(m, cfg["BT"]), split)
    _fp8_linear_swap_kernel[grid](x, w.data, w.scale, dest, m, n, x.stride(0), w.data.stride(0),
                                  w.scale.stride(0), stride_om, stride_os, K=k, WBLOCK=w.block,
                                  CHUNK=w.act_block, KB=kb, A_DEQUANT=not fused, K_SPLIT=k // split,
                                  SPLIT_OUT=split > 1, **cfg)
