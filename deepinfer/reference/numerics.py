"""Numerics policies of the oracle: `official` (emulates the official kernels bit for bit where it can)
and `exact` (the model's math in float64, no quantisation of activations or caches).

Owns: which dtype activations live in, where results are rounded, how a quantised linear is applied,
and the fake-quantisation of cached keys. The model code in `reference/` calls only these hooks, so the
two policies share one implementation of the architecture.

`official` (spec §2, §6): activations bf16; GEMMs with FP8/FP4 weights quantise their input to FP8 with
power-of-two scales per `act_block` and accumulate in fp32 (emulated as exact dequantisation + fp32
matmul; only the fp32 summation order differs from the GPU), output rounded to bf16; bf16 weights are
used as bf16 values with fp32 accumulation. The V4-Flash `revision` picks the initial (`initial`: window
and compressed KV FP8 fake-quant is a no-op, shared expert unclamped) or the current (`current`) release.

`exact`: every weight dequantised exactly to float64 and every activation float64, no rounding, no
activation or KV quantisation. Prefill and decode then agree to ~1e-12, which makes the sharp tests
(prefill/decode equivalence, causality, engine vs oracle) meaningful: in official numerics a last-bit
difference is amplified to percent-level logit differences within a layer or two (chaotic quantisation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer import formats

NUMERICS = ("official", "exact")
REVISIONS = ("current", "initial")


@dataclass(frozen=True)
class Numerics:
    mode: str = "official"
    revision: str = "current"  # V4-Flash release whose kernels are emulated (spec §11); ignored by v41
    act_block: int = 128  # activation quantisation block before FP8/FP4 GEMMs

    def __post_init__(self) -> None:
        if self.mode not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.mode!r}")
        if self.revision not in REVISIONS:
            raise ValueError(f"revision must be one of {REVISIONS}, got {self.revision!r}")

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def act(self) -> torch.dtype:
        """dtype of activations between modules (bf16 in the official code)."""
        return torch.float64 if self.exact else torch.bfloat16

    @property
    def acc(self) -> torch.dtype:
        """dtype of 'fp32' computations of the official code (norms, mixes, softmax, gate, RoPE)."""
        return torch.float64 if self.exact else torch.float32

    @property
    def complex(self) -> torch.dtype:
        return torch.complex128 if self.exact else torch.complex64

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """Storage form of an (already dequantised, exact-in-fp32) weight."""
        return w.to(self.acc)

    # ------------------------------------------------------------------ linears
    def qlinear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Linear with an FP8/FP4 weight (dequantised into `w`): act_quant(x) @ w.T -> bf16."""
        if self.exact:
            return x.to(torch.float64) @ w.T
        xq = formats.act_quant_dequant(x, self.act_block)
        return (xq @ w.T).to(torch.bfloat16)

    def blinear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Linear with a bf16 weight on bf16 input (F.linear in bf16: fp32 accumulate, bf16 out)."""
        if self.exact:
            return x.to(torch.float64) @ w.T
        return (x.to(torch.float32) @ w.T).to(torch.bfloat16)

    def flinear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Linear computed in fp32 on fp32 input (compressor wkv/wgate, gate, hc mixes, head)."""
        return x.to(self.acc) @ w.T

    # ------------------------------------------------------------------ fake quantisation of caches
    def kv_fp8(self, x: torch.Tensor, block: int, revision_dependent: bool = True) -> torch.Tensor:
        """FP8 E4M3 fake-quant of cached KV channels (act_quant inplace, pow2 scale per `block`).

        The initial V4-Flash kernel cast to bf16 instead of E4M3, making this a no-op (spec §6.1, §11).
        """
        if self.exact:
            return x
        if revision_dependent and self.revision == "initial":
            return x
        return formats.fp8_fake_quant(x, block)

    def fp4(self, x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
        """FP4 E2M1 fake-quant (indexer q and keys; V4.1 latents with E4M3 scales)."""
        if self.exact:
            return x
        return formats.fp4_fake_quant(x, block, e4m3_scale)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Cast to the activation dtype (the official code's `.to(bf16)` / `type_as(x)`)."""
        return x.to(self.act)
