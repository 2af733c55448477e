"""The engine's own parameter preparation from checkpoint tensors (`weights.load_tensors`).

Owns: dequantising FP8 block-scaled and packed-FP4 weights with `formats` and casting to the compute dtype
(exact numerics: float64). `wo_a` is used as the bf16 VALUE of its dequantised weight (what the official
convert.py stores); converted checkpoints that already hold that bf16 (`raw.dequantised`) are used as is.
Official numerics (`numerics="official"`): every weight as its exact fp32 value (wo_a as the fp32 of its
bf16 value), the embedding in bf16 (the official activations); `dtype` is then ignored.
Must not: import the reference oracle, or keep scale tensors (they are consumed here).
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer import formats
from deepinfer.config import ModelConfig

_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def _dequant(name: str, w: torch.Tensor, scale: torch.Tensor | None, cfg: ModelConfig) -> torch.Tensor:
    if scale is None:
        return w.to(torch.float32)
    if w.dtype == torch.float8_e4m3fn:
        return formats.dequant_fp8_blocks(w, scale, cfg.weight_block)
    if w.dtype in _FP4_DTYPES:
        return formats.dequant_fp4(w, scale)
    raise ValueError(f"{name}: unsupported quantised weight dtype {w.dtype}")


def prepare_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype = torch.float64,
                   skip_mtp: bool = True, numerics: str = "exact") -> dict[str, torch.Tensor]:
    """name -> compute-ready tensor (scales consumed). skip_mtp: the backbone forward does not need MTP."""
    if numerics not in ("exact", "official"):
        raise ValueError(f"unknown numerics {numerics!r}")
    if numerics == "official":
        dtype = torch.float32
    dequantised = getattr(raw, "dequantised", set())
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".scale") or (skip_mtp and name.startswith("mtp.")) or ".engram." in name:
            continue
        if name.endswith("tid2eid"):
            out[name] = t.to(torch.int64)
            continue
        scale = None
        if name.endswith(".weight") and name not in dequantised:
            scale = raw.get(name[: -len(".weight")] + ".scale")
        w = _dequant(name, t, scale, cfg)
        if name.endswith("attn.wo_a.weight"):
            w = w.to(torch.bfloat16)  # exact: E4M3 x pow2 fits bf16; matches the official conversion
        if numerics == "official" and name == "embed.weight":
            out[name] = w.to(torch.bfloat16)
            continue
        out[name] = w.to(dtype)
    return out
