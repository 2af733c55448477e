"""bf16-weight matmuls with fp32 sums at batched decode (9..256 rows): ops "linear_f32" / "blinear" as a
swap-AB tensor-core GEMM, the weight rows as the MMA's M and the step's tokens as its N.

Why: these are the compressors' stacked wkv / wgate, the MoE gate and the indexer's weights_proj (0.5-16 MB
of bf16 weights each). cuBLAS runs them at 128 rows as a split-K GEMM plus a `splitKreduce` launch, 6-10 us
each (H200, `decode_anatomy.py --ops`: [128, 4096] x [4096, 256] 6.7 us, x [4096, 2048] 10.3 us), against
0.5-4 us of weight reads at the copy rate. Here a program owns BW weight rows, all of a block of BT tokens
and a K_CHUNK of K; the tokens' operand is re-read from L2 by every row block, the weight once.
Numerics: bf16 x bf16 products are exact in fp32 and the MMA accumulates in fp32, as cuBLAS's bf16 GEMM with
fp32 output does: the official fp32 matmul of the bf16 values up to the fp32 summation order. Split-K writes
fp32 partials that `fp8_gemm._partials_then_sum` adds in a fixed order (deterministic; blinear rounds to
bf16 there, once).
`takes(m, n, k)` says which calls it runs (`bf16_gemv` sends them here, the GEMV keeps M <= 8, cuBLAS the
rest: the LM head, M > 256); DEEPINFER_LINEAR_F32_FORM=cublas keeps cuBLAS (A/B).
Must not: be imported off CUDA (imports triton); sync with the host (CUDA graphs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels.triton.act_quant import interpreting
from deepinfer.kernels.triton.fp8_gemm import _partials_then_sum, sm_count

BF16, F32 = torch.bfloat16, torch.float32
MIN_M, MAX_M = 9, 256  # rows this form takes (the GEMV takes M <= 8 where it is faster; see bf16_gemv)
MAX_N = 16384  # weights up to 16384 rows (the LM head, 129,280 rows, streams at the copy rate on cuBLAS)
BW = 64  # weight rows per program: wgmma's M
PROGRAMS_PER_SM = 2


@triton.jit
def _bf16_swap_kernel(w_ptr, x_ptr, out_ptr, M, N, K, stride_wn, stride_xm, stride_os, stride_om,
                      K_CHUNK: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      INTERPRET: tl.constexpr):
    """out[split, t, n] = sum over k in split's K_CHUNK of x[t, k] * w[n, k] (fp32), for BW rows n x BT tokens."""
    rows = tl.program_id(0) * BW + tl.arange(0, BW)
    toks = tl.program_id(1) * BT + tl.arange(0, BT)
    split = tl.program_id(2)
    r_ok = rows < N
    t_ok = toks < M
    acc = tl.zeros((BW, BT), tl.float32)
    k_lo = split * K_CHUNK
    for k0 in range(0, K_CHUNK, BK):
        ks = k_lo + k0 + tl.arange(0, BK)
        k_ok = ks < K
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        x = tl.load(x_ptr + toks.to(tl.int64)[None, :] * stride_xm + ks[:, None], mask=k_ok[:, None] & t_ok[None, :],
                    other=0.0)
        if INTERPRET:  # the CPU interpreter's bf16 dot is wrong; fp32 operands give the same exact products
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w, x, acc)
    dest = out_ptr + split.to(tl.int64) * stride_os + toks.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & t_ok[None, :])


def takes(m: int, n: int, k: int) -> bool:
    """Whether a call of m rows on an [n, k] bf16 weight runs here (else cuBLAS)."""
    return (env.linear_f32_form() == "auto" and MIN_M <= m <= MAX_M and 0 < n <= MAX_N and k % 64 == 0
            and k >= 256)


def plan(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """Tiles: BT tokens per program (16..128, the smallest power of two holding m, else 128-token blocks),
    BK 128 (64 where K_CHUNK is smaller), and splits of K until ~PROGRAMS_PER_SM programs per SM, with K_CHUNK
    >= 256 and the fp32 partials (splits x m x n x 4 bytes) at most the weight's own bytes."""
    bt = min(128, max(16, triton.next_power_of_2(m)))
    base = triton.cdiv(n, BW) * triton.cdiv(m, bt)
    splits = max(1, min(round(PROGRAMS_PER_SM * sms / base), k // 256, max(1, k // (2 * m))))
    cfg = dict(BT=bt, BK=128, SPLITS=splits, num_warps=4, num_stages=3)
    cfg.update(config or {})
    chunk = triton.cdiv(triton.cdiv(k, cfg["SPLITS"]), cfg["BK"]) * cfg["BK"]
    if chunk < cfg["BK"] or cfg["BK"] % 16 or cfg["BT"] < 16:
        raise ValueError(f"bf16 swap linear: bad tiles {cfg} for m={m} n={n} k={k}")
    cfg["K_CHUNK"], cfg["SPLITS"] = chunk, triton.cdiv(k, chunk)
    return cfg


def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """x bf16 [M, K] (unit column stride), w bf16 [N, K] contiguous -> out_dtype (fp32 or bf16) [M, N]."""
    M, K = x.shape
    N = w.shape[0]
    if x.dtype != BF16 or w.dtype != BF16 or x.stride(1) != 1 or w.stride(1) != 1 or w.shape[1] != K:
        raise ValueError(f"bf16 swap linear: wants bf16 x [M, K] and w [N, K] with unit column strides, got "
                         f"x {x.dtype} {tuple(x.shape)} {tuple(x.stride())}, w {w.dtype} {tuple(w.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = plan(M, N, K, sm_count(x.device), config)

    def launch(dest: torch.Tensor) -> torch.Tensor:
        stride_os = dest.stride(0) if dest.dim() == 3 else 0
        stride_om = dest.stride(-2)
        _bf16_swap_kernel[(triton.cdiv(N, BW), triton.cdiv(M, cfg["BT"]), cfg["SPLITS"])](
            w, x, dest, M, N, K, w.stride(0), x.stride(0), stride_os, stride_om, K_CHUNK=cfg["K_CHUNK"], BW=BW,
            BT=cfg["BT"], BK=cfg["BK"], INTERPRET=interpreting(), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return dest

    return _partials_then_sum(launch, cfg["SPLITS"], out)
