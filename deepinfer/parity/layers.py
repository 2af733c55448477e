"""`deepinfer parity layers`: for every layer and sublayer (attention, FFN, engram) the cos, rel_err and
norm ratio of the FULL 4-stream residual state (never a sublayer output: with hc_mult=4 a sublayer's
output alone says little — the seed's first cos=0.02 came from that), engine vs reference, on identical
tokens, and the first point where they diverge beyond the noise floor.

The floor is measured, not assumed: the reference is run a second time with last-bit perturbations of its
embedding output (one ulp, random sign, in 10% of the elements) and the rel_err that this alone causes at
each sublayer is that sublayer's floor. Every figure is reported as a multiple of it; a point diverges
when it exceeds DIVERGE_MULTIPLE x floor. Only the real request is recorded: the engine session runs one
sequence with no warm-up, and its tap receives that sequence's rows only.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.parity.compare import diff
from deepinfer.parity.next_token import EngineSession
from deepinfer.parity.report import Report
from deepinfer.reference import load_reference

DIVERGE_MULTIPLE = 10.0
PERTURBED_FRACTION = 0.1


def _record_reference(model, ids: list[int], perturb_seed: int | None) -> dict[str, torch.Tensor]:
    states: dict[str, torch.Tensor] = {}
    model.tap = lambda name, x: states.__setitem__(name, x[0].detach().clone())
    if perturb_seed is not None:
        embed = model.embed

        def perturbed(token_ids):
            e = embed(token_ids)
            g = torch.Generator().manual_seed(perturb_seed)
            pick = torch.rand(e.shape, generator=g) < PERTURBED_FRACTION
            up = torch.rand(e.shape, generator=g) < 0.5
            target = torch.where(up, torch.full_like(e, float("inf")), torch.full_like(e, float("-inf")))
            return torch.where(pick, torch.nextafter(e, target), e)

        model.embed = perturbed
    model.forward(torch.tensor([ids]), 0)
    model.tap = None
    return states


def run_layers(model_dir: str | Path, ids: list[int], numerics: str = "exact") -> Report:
    if not ids:
        raise ValueError("--ids is empty")
    n = len(ids) + 1

    def reference():
        return load_reference(model_dir, numerics=numerics, max_batch_size=1, max_seq_len=n, progress=False)

    clean = _record_reference(reference(), ids, None)
    noisy = _record_reference(reference(), ids, perturb_seed=1234)
    engine: dict[str, torch.Tensor] = {}
    session = EngineSession(model_dir, numerics, n)
    session.runner.model.tap = lambda name, x, seq: engine.__setitem__(name, x.detach().clone())
    session.extend(list(ids))
    report = Report("layers", ["point", "cos", "rel_err", "norm_ratio", "floor", "x_floor", "diverged"],
                    meta={"model": str(model_dir), "numerics": numerics, "ids": list(ids),
                          "diverge_multiple": DIVERGE_MULTIPLE})
    first = None
    for name, ref in clean.items():
        if name not in engine:
            continue  # e.g. the reference's "final" hidden (compare logits with next-token)
        got = engine[name]
        if got.shape != ref.shape:
            raise ValueError(f"{name}: engine state {tuple(got.shape)} vs reference {tuple(ref.shape)}: both sides "
                             "must record the full residual state of the same positions")
        d = diff(got.double(), ref.double())
        tiny = torch.finfo(ref.dtype).eps * 1e-3  # only guards against an exactly-zero floor
        floor = max(diff(noisy[name].double(), ref.double()).rel_err, tiny)
        multiple = d.rel_err / floor
        diverged = multiple > DIVERGE_MULTIPLE
        if diverged and first is None:
            first = name
        report.rows.append({"point": name, "cos": d.cos, "rel_err": d.rel_err, "norm_ratio": d.norm_ratio,
                            "floor": floor, "x_floor": multiple, "diverged": diverged})
    missing = [k for k in clean if k not in engine and k != "final"]
    if missing:
        raise ValueError(f"the engine recorded no state for {missing[:5]}")
    if first is None:
        report.verdict = f"{len(report.rows)} points, none beyond {DIVERGE_MULTIPLE:g}x the measured floor"
    else:
        row = next(r for r in report.rows if r["point"] == first)
        report.verdict = f"first divergence at {first}: rel_err {row['rel_err']:.3g} = {row['x_floor']:.3g}x floor"
        report.defects.append(report.verdict)
        report.meta["first_divergence"] = first
    return report
