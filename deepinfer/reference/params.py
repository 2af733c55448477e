"""Turn checkpoint tensors (official on-disk formats) into the oracle's parameters.

Every FP8/FP4 weight is dequantised exactly (E4M3 or E2M1 value x power-of-two scale is exact in fp32)
and stored under its `.weight` name; scales are consumed. `wo_a` is what the official convert.py makes of
it: a bf16 matrix (exact too: E4M3 x pow2 fits bf16). Plain tensors are kept as the reference keeps them:
the embedding in the activation dtype, everything else in the 'fp32' dtype of the numerics policy.
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.reference.numerics import Numerics

_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def dequant_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, cfg: ModelConfig) -> torch.Tensor:
    """The fp32 value of one stored weight (official decoding)."""
    if scale is None:
        return weight.to(torch.float32)
    if weight.dtype == torch.float8_e4m3fn:
        # dense weights and FP4 experts converted to FP8 share the family's tile (128 in V4, 32 in V4.1)
        return formats.dequant_fp8_blocks(weight, scale, cfg.weight_block)
    if weight.dtype in _FP4_DTYPES:
        return formats.dequant_fp4(weight, scale)
    raise ValueError(f"{name}: unsupported quantised weight dtype {weight.dtype}")


def prepare_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, num: Numerics) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if ".engram.embed." in name:  # the hash table stays as stored (memory-mapped); rows dequantised on use
            out[name] = tensor
            continue
        if name.endswith(".scale"):
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if name == "embed.weight":
            out[name] = tensor.to(num.act)
        elif name.endswith("tid2eid"):
            out[name] = tensor.to(torch.int64)
        elif name.endswith("attn.wo_a.weight"):
            out[name] = dequant_weight(name, tensor, scale, cfg).to(torch.bfloat16).to(num.acc)
        else:
            out[name] = dequant_weight(name, tensor, scale, cfg).to(num.acc)
    return out
