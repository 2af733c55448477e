"""`deepinfer parity kv`: store -> load round trip of every KV layout (rel_err, cos against the raw
input) and bit-exactness against the oracle's fake-quantised values for the same input tensors.

An exact layout that is not bit-exact is a defect (e.g. a scale byte decoded as the wrong type, the
seed's ue8m0-on-SM90 failures); the seed's own per-128 layouts are reported as lossy by design.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer import formats
from deepinfer.cache.layouts import LAYOUTS, get_layout
from deepinfer.config import ModelConfig
from deepinfer.parity.compare import diff
from deepinfer.parity.report import Report


def oracle_cached_value(name: str, x: torch.Tensor, rope_dim: int) -> torch.Tensor | None:
    """What the oracle holds in its cache for input x (bf16), or None for layouts it never uses."""
    x = x.to(torch.bfloat16)
    if name == "v4_fp8_ds_mla":
        nope = x.shape[-1] - rope_dim
        return torch.cat([formats.fp8_fake_quant(x[..., :nope], 64), x[..., nope:]], dim=-1)
    if name in ("v4_index_fp4", "v41_index_fp4"):
        return formats.fp4_fake_quant(x, 32)
    if name == "v41_window_fp8":
        return formats.fp8_fake_quant(x, 32)
    if name == "v41_latent_fp4":
        return formats.fp4_fake_quant(x, 16, e4m3_scale=True)
    if name in ("bf16", "bf16_index"):
        return x
    return None


def sample_input(dim: int, tokens: int, seed: int) -> torch.Tensor:
    """Random rows whose magnitude varies per block of 16 channels (1e-2 .. 1e2): every scale path runs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    mag = torch.exp(torch.empty(tokens, dim // 16, 1).uniform_(-4.6, 4.6, generator=g))
    return (x.view(tokens, dim // 16, 16) * mag).view(tokens, dim)


def run_kv(model_dir: str | Path, layouts: list[str] | None = None, tokens: int = 257, seed: int = 0) -> Report:
    cfg = ModelConfig.from_checkpoint(model_dir)
    names = layouts or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    report = Report("kv", ["layout", "bytes/token", "rel_err", "cos", "bit_exact_vs_oracle", "note"],
                    meta={"model": str(model_dir), "tokens": tokens})
    for i, name in enumerate(names):
        layout = get_layout(name, cfg)
        x = sample_input(layout.dim, tokens, seed + i).to(torch.bfloat16)
        loaded = layout.load(layout.store(x))
        d = diff(loaded.float(), x.float())
        oracle = oracle_cached_value(name, x, cfg.rope_head_dim)
        exact = None if oracle is None else torch.equal(loaded.view(torch.int16), oracle.view(torch.int16))
        note = "" if exact is not False else "NOT the oracle's cached values"
        if oracle is None:
            note = "lossy comparison layout (re-quantises the oracle's values)"
        if layout.exact and exact is False:
            report.defects.append(f"{name}: store->load differs from the oracle's fake-quantised values "
                                  f"({int((loaded.view(torch.int16) != oracle.view(torch.int16)).sum())} of "
                                  f"{loaded.numel()} values)")
        report.rows.append({"layout": name, "bytes/token": layout.bytes_per_token, "rel_err": d.rel_err,
                            "cos": d.cos, "bit_exact_vs_oracle": "n/a" if exact is None else exact, "note": note})
    report.verdict = "no defect" if report.ok else f"{len(report.defects)} layout(s) not bit-exact"
    return report
