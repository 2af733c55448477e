"""`deepinfer parity layers`: for every layer and sublayer (attention, FFN, engram) the cos, rel_err and
norm ratio of the FULL 4-stream residual state (never a sublayer output: with hc_mult=4 a sublayer's
output alone says little — the seed's first cos=0.02 came from that), engine vs reference, on identical
tokens, and the first point where they diverge beyond the noise floor.

The floor is measured, not assumed: the reference is run a second time with last-bit perturbations of its
embedding output (one ulp, random sign, in 10% of the elements) and the rel_err that this alone causes at
each sublayer is that sublayer's floor. Every figure is reported as a multiple of it; a point diverges
when it exceeds DIVERGE_MULTIPLE x floor. Only the real request is recorded: the engine session runs one
sequence with no warm-up, its tap receives that sequence's rows only, and a tap call from any other
forward is refused (`_record_engine`). The reference is any backend of `backends.py` (`--ref`): the oracle,
the official inference/ code (residuals captured by hooks on its Blocks) or transformers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.parity.backends import RefSpec, make_reference
from deepinfer.parity.compare import diff
from deepinfer.parity.dump import write_dump
from deepinfer.parity.next_token import EngineSession
from deepinfer.parity.report import Report

DIVERGE_MULTIPLE = 10.0
PERTURBED_FRACTION = 0.1


def perturb_last_bit(e: torch.Tensor, seed: int) -> torch.Tensor:
    """One ulp up or down (random sign) in PERTURBED_FRACTION of the elements of an embedding output."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(e.shape, generator=g) < PERTURBED_FRACTION
    up = torch.rand(e.shape, generator=g) < 0.5
    target = torch.where(up, torch.full_like(e, float("inf")), torch.full_like(e, float("-inf")))
    return torch.where(pick, torch.nextafter(e, target.to(e.device)), e)


def _record_reference(model, ids: list[int], perturb_seed: int | None) -> dict[str, torch.Tensor]:
    states: dict[str, torch.Tensor] = {}
    model.tap = lambda name, x: states.__setitem__(name, x[0].detach().clone().cpu())
    if perturb_seed is not None:
        model.embed_transform = lambda e: perturb_last_bit(e, perturb_seed)
    model.forward(torch.tensor([ids]), 0)
    model.tap = None
    return states


def _record_engine(session: EngineSession, ids: list[int]) -> dict[str, torch.Tensor]:
    """The engine's state per point for this one request. Every call of the tap is kept: a point tapped
    more than once, or with rows that are not this request's, means another forward (a warm-up or
    profile run on the tapped instance: the seed's dump from the warm-up) reached the tap, and the
    comparison would be against the wrong tensors, so it is refused."""
    calls: dict[str, list[tuple[int, torch.Tensor]]] = {}
    session.runner.model.tap = lambda name, x, seq: calls.setdefault(name, []).append((seq, x.detach().clone()))
    try:
        session.extend(list(ids))
    finally:
        session.runner.model.tap = None
    for name, got in calls.items():
        shapes = [(seq, tuple(x.shape)) for seq, x in got]
        if len(got) != 1 or got[0][0] != 0 or got[0][1].shape[0] != len(ids):
            raise ValueError(f"the engine tap at {name!r} saw {len(got)} call(s) with (sequence, shape) {shapes} "
                             f"during one request of {len(ids)} tokens: a forward other than this request (a "
                             "warm-up or profile run on the tapped model instance?) reached the tap")
    return {name: got[0][1] for name, got in calls.items()}


def run_layers(model_dir: str | Path, ids: list[int], numerics: str = "exact", ref: RefSpec = RefSpec(),
               dump: str | Path | None = None) -> Report:
    """`dump`: also write both sides' recorded states to this directory (see dump.py)."""
    if not ids:
        raise ValueError("--ids is empty")
    n = len(ids) + 1

    def reference():
        return make_reference(ref, model_dir, numerics, n)

    clean = _record_reference(reference(), ids, None)
    noisy = _record_reference(reference(), ids, perturb_seed=1234)
    session = EngineSession(model_dir, numerics, n)
    engine = _record_engine(session, ids)
    report = Report("layers", ["point", "cos", "rel_err", "norm_ratio", "floor", "x_floor", "diverged"],
                    meta={"model": str(model_dir), "numerics": numerics, "ids": list(ids), "reference": ref.label,
                          "diverge_multiple": DIVERGE_MULTIPLE})
    if dump is not None:
        report.meta["dumps"] = [str(write_dump(dump, "layers", "engine", engine)),
                                str(write_dump(dump, "layers", "reference", clean))]
    first = None
    for name, state in clean.items():
        if name not in engine:
            continue  # e.g. the reference's "final" hidden (compare logits with next-token)
        got = engine[name]
        if got.shape != state.shape:
            raise ValueError(f"{name}: engine state {tuple(got.shape)} vs reference {tuple(state.shape)}: both sides "
                             "must record the full residual state of the same positions")
        d = diff(got.double(), state.double())
        tiny = torch.finfo(state.dtype).eps * 1e-3  # only guards against an exactly-zero floor
        floor = max(diff(noisy[name].double(), state.double()).rel_err, tiny)
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
