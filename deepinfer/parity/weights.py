"""`deepinfer parity weights`: every quantised tensor as the engine will use it (its own parameter
preparation) vs the official decoding (`official_decode.py`): cos, rel_err, max abs error per tensor.
A mismatching FP4 expert is also tested against the seed's P3 signature (scale expanded along the wrong
axis) so the report names the mistake, not just the tensor.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.params import prepare_params
from deepinfer.parity.compare import diff
from deepinfer.parity.official_decode import official_fp4, official_fp8, seed_p3_fp4
from deepinfer.parity.report import Report
from deepinfer.weights import CheckpointReader

TOLERANCE = 1e-6  # both sides are exact decodings: anything above rounding noise is a layout defect


def run_weights(model_dir: str | Path, pattern: str | None = None) -> Report:
    cfg = ModelConfig.from_checkpoint(model_dir)
    reader = CheckpointReader(model_dir)
    names = sorted(n for n in reader.names() if n.endswith(".weight") and n[: -len("weight")] + "scale" in reader)
    names = [n for n in names if ".engram.embed." not in n]  # the engram tables are row-gathered, not decoded
    if pattern:
        names = [n for n in names if re.search(pattern, n)]
    report = Report("weights", ["tensor", "kind", "shape", "cos", "rel_err", "max_abs", "note"],
                    meta={"model": str(model_dir), "tolerance": TOLERANCE})
    for name in names:
        w, s = reader.get(name), reader.get(name[: -len("weight")] + "scale")
        engine = prepare_params({name: w, name[: -len("weight")] + "scale": s}, cfg, torch.float64,
                                skip_mtp=False)[name]
        fp8 = w.dtype == torch.float8_e4m3fn
        official = official_fp8(w, s, cfg.weight_block) if fp8 else official_fp4(w, s)
        if name.endswith("attn.wo_a.weight"):
            official = official.to(torch.bfloat16).to(torch.float64)  # what convert.py stores
        d = diff(engine, official)
        note = ""
        if d.rel_err > TOLERANCE:
            if not fp8 and diff(engine, seed_p3_fp4(w, s)).rel_err <= TOLERANCE:
                note = "FP4 scale expanded along the wrong axis (seed P3): expand [out, in/32] along in only"
            else:
                note = "engine decoding differs from the official one"
            report.defects.append(f"{name}: {note} (rel_err {d.rel_err:.3g}, cos {d.cos:.6f})")
        report.rows.append({"tensor": name, "kind": "fp8" if fp8 else "fp4", "shape": list(w.shape), "cos": d.cos,
                            "rel_err": d.rel_err, "max_abs": d.max_abs, "note": note})
    worst = max((r["rel_err"] for r in report.rows), default=0.0)
    report.verdict = (f"{len(report.rows)} quantised tensors, worst rel_err {worst:.3g}: "
                      + ("no defect" if report.ok else f"{len(report.defects)} defect(s)"))
    return report
