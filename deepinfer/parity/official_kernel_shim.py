"""A stand-in for the official `inference/kernel.py` (TileLang, CUDA only) on machines without it: the
same function names and signatures, computed with our torch emulation of the kernels' numerics
(`formats` for the quantisers, `kernels.official` for the sparse-attention kernel). Also stands in for
`fast_hadamard_transform`, which the official `rotate_activation` imports.

`parity --ref official:PATH` installs `kernel_module()` as `sys.modules["kernel"]` only while the
official model.py is imported and run (see `official_ref.py`), so the official code runs unmodified.

Must not: change the official code's rounding points (each function rounds exactly where the TileLang
kernel does: fp32 inside, output in the dtype the kernel writes), or be used by the engine.
"""
from __future__ import annotations

import types

import torch

from deepinfer import formats
from deepinfer.kernels.official import hadamard32, sparse_attn_sink_official

# Every name the official model.py imports from kernel.py (V4-Flash, V4-Pro; spec §8).
KERNEL_NAMES = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn")
ACT_GROUP = 128  # the GEMM kernels' activation scale group along K
FP4_WEIGHT_GROUP = 32  # fp4_gemm's weight scale group along K


def _scales(x: torch.Tensor, block: int, max_value: float, floor: float, pow2: bool) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """(x in fp32 blocks [..., n, block], fp32 scale [..., n, 1]) as the TileLang quant kernels compute them."""
    xb = x.to(torch.float32).unflatten(-1, (-1, block))
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=floor)
    if pow2:  # fast_round_scale: exponent bits of amax * fp32(1/max), +1 if any mantissa bit is set
        return xb, formats.pow2_ceil_scale(amax, max_value)
    return xb, amax * torch.tensor(1.0 / max_value, dtype=torch.float32)


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None,
              scale_dtype: torch.dtype = torch.float32, inplace: bool = False):
    """FP8 E4M3 block quantisation; inplace=True writes the fake-quantised values back into x."""
    if x.shape[-1] % block_size:
        raise ValueError(f"act_quant: last dim {x.shape[-1]} is not a multiple of block_size {block_size}")
    xb, s = _scales(x, block_size, formats.FP8_MAX, formats.FP8_AMAX_FLOOR, scale_fmt is not None)
    q = (xb / s).clamp(-formats.FP8_MAX, formats.FP8_MAX).to(torch.float8_e4m3fn)
    if inplace:
        x.copy_((q.to(torch.float32) * s).flatten(-2).to(x.dtype))
        return x
    s = s.squeeze(-1)
    return q.flatten(-2), formats.float_to_e8m0(s) if scale_dtype == torch.float8_e8m0fnu else s


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    """FP4 E2M1 block quantisation with E8M0 scales; inplace=True writes the fake-quantised values back."""
    if x.shape[-1] % block_size:
        raise ValueError(f"fp4_act_quant: last dim {x.shape[-1]} is not a multiple of block_size {block_size}")
    if inplace:
        x.copy_(formats.fp4_fake_quant(x, block_size))
        return x
    codes, s = formats.fp4_act_quant(x, block_size)
    return formats.pack_fp4(codes).view(torch.float4_e2m1fn_x2), formats.float_to_e8m0(s)


def _act_values(a: torch.Tensor, a_s: torch.Tensor) -> torch.Tensor:
    k = a.shape[-1]
    values = a.reshape(-1, k).to(torch.float32).unflatten(-1, (-1, ACT_GROUP))
    return (values * formats.scale_to_float(a_s).reshape(values.shape[0], -1, 1)).flatten(-2)


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T for FP8 A (per-128 scales along K) and FP8 B (128x128 block scales); fp32
    accumulation, output in the default dtype (bf16 under generate.py)."""
    w = formats.dequant_fp8_blocks(b, b_s, ACT_GROUP)
    c = _act_values(a, a_s) @ w.T
    return c.reshape(*a.shape[:-1], b.shape[0]).to(torch.get_default_dtype())


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """C = A @ B^T for FP8 A and packed FP4 B [N, K/2] with E8M0 scales per 32 along K (the row)."""
    w = formats.dequant_fp4(b, b_s, FP4_WEIGHT_GROUP)
    c = _act_values(a, a_s) @ w.T
    return c.reshape(*a.shape[:-1], b.shape[0]).to(torch.get_default_dtype())


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float) -> torch.Tensor:
    """q [b, m, h, d] bf16, kv [b, n, d] bf16, attn_sink [h] fp32, topk_idxs [b, m, k] (-1: skip) -> [b, m, h, d]:
    the kernel's online softmax over blocks of 64 indices, one batch row at a time."""
    return torch.stack([sparse_attn_sink_official(q[i], kv[i], attn_sink, topk_idxs[i], softmax_scale)
                        for i in range(q.shape[0])])


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int = 4,
                      sinkhorn_iters: int = 20, eps: float = 1e-6):
    """mixes [b, s, (2+hc)*hc] fp32 -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc], all fp32."""
    hc = hc_mult
    m = mixes.to(torch.float32)
    pre = torch.sigmoid(m[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = m[..., 2 * hc :].unflatten(-1, (hc, hc)) * hc_scale[2] + hc_base[2 * hc :].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fast_hadamard_transform.hadamard_transform for the scale the official code passes (d**-0.5)."""
    if abs(scale - x.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"hadamard_transform shim supports scale=d**-0.5 only, got {scale}")
    return hadamard32(x)


def kernel_module() -> types.ModuleType:
    """A module object that can stand in for the official kernel.py."""
    mod = types.ModuleType("kernel", "deepinfer's torch stand-in for the official TileLang kernel.py")
    for name in KERNEL_NAMES + ("hadamard_transform",):
        setattr(mod, name, globals()[name])
    mod.DEEPINFER_SHIM = True
    return mod


def hadamard_module() -> types.ModuleType:
    mod = types.ModuleType("fast_hadamard_transform", "deepinfer's torch stand-in for fast_hadamard_transform")
    mod.hadamard_transform = hadamard_transform
    mod.DEEPINFER_SHIM = True
    return mod
