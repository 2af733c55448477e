"""Comparison metrics between an engine tensor and its reference: cosine, relative error, norm ratio,
max abs error, and top-k / margin facts of logits rows. Pure functions, float64 inside."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Diff:
    cos: float
    rel_err: float
    norm_ratio: float  # |engine| / |reference|
    max_abs: float
    bit_exact: bool

    def as_dict(self) -> dict:
        return {"cos": self.cos, "rel_err": self.rel_err, "norm_ratio": self.norm_ratio, "max_abs": self.max_abs,
                "bit_exact": self.bit_exact}


def diff(engine: torch.Tensor, reference: torch.Tensor) -> Diff:
    if engine.shape != reference.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine.shape)} vs reference {tuple(reference.shape)}")
    a, b = engine.detach().double().flatten(), reference.detach().double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    cos = float(a @ b / (na * nb)) if na and nb else float(na == nb)
    rel = float((a - b).norm() / nb) if nb else float((a - b).norm())
    exact = engine.dtype == reference.dtype and torch.equal(engine, reference)
    return Diff(cos, rel, na / nb if nb else float("inf") if na else 1.0, float((a - b).abs().max()) if a.numel()
                else 0.0, exact)


def top1_margin(logits: torch.Tensor) -> tuple[int, float]:
    """(argmax, top-1 minus top-2 logit) of one logits row."""
    values, indices = logits.double().topk(2)
    return int(indices[0]), float(values[0] - values[1])
