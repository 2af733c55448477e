"""`deepinfer parity drift`: the seed's prefill-vs-decode table (H20 plan P4.2) as a command.

The reference prefills the context and decodes greedily for N steps; the engine is fed the SAME tokens
(teacher forcing on the reference's choices), so at every position both sides see identical inputs.
Per position: top-1 on both sides, both top-1 margins, delta margin, flip. Verdict per flip: the noise is
the measured std of delta margin over the run; a flip where the reference's own margin is below
NOISE_MULTIPLE x that std is "noise at an undecided position", otherwise a "defect" (the seed's '**'
vs '北京' was a flip at margin 1.64 under noise std 1.63: noise, not a bug).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from deepinfer.parity.compare import top1_margin
from deepinfer.parity.next_token import EngineSession
from deepinfer.parity.report import Report
from deepinfer.parity.backends import RefSpec, make_reference

NOISE_MULTIPLE = 2.0


def run_drift(model_dir: str | Path, ids: list[int], steps: int = 16, numerics: str = "exact",
              ref: RefSpec = RefSpec()) -> Report:
    if not ids or steps <= 0:
        raise ValueError("drift needs context ids and steps > 0")
    total = len(ids) + steps
    spec, ref = ref, make_reference(ref, model_dir, numerics, total + 1)
    eng = EngineSession(model_dir, numerics, total + 1)
    ref_logits = [ref.forward(torch.tensor([ids]), 0)[0]]
    eng_logits = [eng.extend(list(ids))]
    for step in range(steps - 1):
        tok = int(ref_logits[-1].argmax())  # the reference's greedy choice feeds both sides
        pos = len(ids) + step
        ref_logits.append(ref.forward(torch.tensor([[tok]]), pos)[0])
        eng_logits.append(eng.extend([tok]))
    rows, deltas = [], []
    for i, (e, r) in enumerate(zip(eng_logits, ref_logits)):
        (e1, em), (r1, rm) = top1_margin(e), top1_margin(r)
        deltas.append(em - rm)
        rows.append({"position": len(ids) - 1 + i, "engine_top1": e1, "ref_top1": r1, "engine_margin": em,
                     "ref_margin": rm, "delta_margin": em - rm, "flip": e1 != r1})
    noise = statistics.pstdev(deltas) if len(deltas) > 1 else abs(deltas[0])
    report = Report("drift", ["position", "engine_top1", "ref_top1", "engine_margin", "ref_margin", "delta_margin",
                              "flip", "judgement"],
                    meta={"model": str(model_dir), "numerics": numerics, "reference": spec.label, "noise_std": noise,
                          "mean_delta": statistics.fmean(deltas), "max_abs_delta": max(abs(d) for d in deltas)})
    for row in rows:
        if row["flip"]:
            undecided = row["ref_margin"] < NOISE_MULTIPLE * noise
            row["judgement"] = "noise at an undecided position" if undecided else "defect"
            if not undecided:
                report.defects.append(f"position {row['position']}: flip at reference margin {row['ref_margin']:.3f}"
                                      f" > {NOISE_MULTIPLE} x noise std {noise:.3g}")
        else:
            row["judgement"] = ""
        report.rows.append(row)
    flips = sum(r["flip"] for r in rows)
    report.verdict = (f"{len(rows)} positions, {flips} flip(s), delta-margin mean {report.meta['mean_delta']:.3g} "
                      f"std {noise:.3g}: " + ("no defect" if report.ok else f"{len(report.defects)} defect(s)"))
    return report
