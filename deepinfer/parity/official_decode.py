"""The official decoding of stored weights, written out on its own (independent of `formats` and of the
engine): what the official kernels multiply. FP8: E4M3 value x 2**(e8m0 - 127) of its [b x b] block.
FP4 experts: E2M1 code value x 2**(e8m0 - 127) of its group of 32 along the ROW (the input axis) — the
layout the seed's P3 broke by expanding the scale along both axes.
"""
from __future__ import annotations

import torch

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=torch.float64)


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    e = scale.view(torch.uint8).to(torch.float64)
    return torch.where(e == 255, torch.nan, torch.exp2(e - 127))


def official_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out_dim, in_dim = weight.shape
    s = _pow2(scale)
    rows = torch.arange(out_dim) // block
    cols = torch.arange(in_dim) // block
    return weight.to(torch.float64) * s[rows][:, cols]


def official_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.long)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # low nibble = even index
    values = _E2M1[codes]
    group = torch.arange(values.shape[1]) // 32
    return values * _pow2(scale)[:, group]


def seed_p3_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The seed's P3 bug, for diagnosis only: the [out, in/32] scale expanded along BOTH axes by 32 and
    cropped, so every output row takes the scales of row // 32."""
    b = packed.view(torch.uint8).to(torch.long)
    values = _E2M1[torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)]
    s = _pow2(scale).repeat_interleave(32, dim=0).repeat_interleave(32, dim=1)[: values.shape[0], : values.shape[1]]
    return values * s
