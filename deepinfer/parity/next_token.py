"""`deepinfer parity next-token`: the engine's next token vs the reference's, with the top-5 logits and
the top-1 margin, for a one-shot prefill and for incremental decode step by step — the seed's
ref_next_token.py / h20_ask.py pair, with both sides fed identical ids at every call.

Judging: exact numerics must agree to rounding noise (rel_err <= 1e-6, same top-1); official numerics
are chaotic, so a flip is a defect only where the reference's own margin is decisive (>= 2 logits, the
engine acceptance threshold); below that it is reported as noise at an undecided position.
"""
from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.config import ModelConfig
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.model.context import ForwardContext, SeqContext
from deepinfer.parity.backends import RefSpec, make_reference
from deepinfer.parity.compare import diff, top1_margin
from deepinfer.parity.report import Report

DECISIVE_MARGIN = 2.0
EXACT_TOLERANCE = 1e-6


class EngineSession:
    """One sequence in the engine model: prefill, then extend token by token (slot 0, blocks 0..)."""

    def __init__(self, model_dir: str | Path, numerics: str, max_len: int) -> None:
        cfg = ModelConfig.from_checkpoint(model_dir)
        block = 128
        blocks = -(-max_len // block)
        self.runner = ModelRunner(EngineConfig(model=str(model_dir), numerics=numerics, max_model_len=blocks * block,
                                               max_num_seqs=1, num_blocks=blocks, block_size=block), cfg)
        self.table = tuple(range(blocks))
        self.pos = 0

    def extend(self, ids: list[int]) -> torch.Tensor:
        ctx = ForwardContext((SeqContext(self.pos, len(ids), 0, 0, self.table),))
        logits = self.runner.model.forward(torch.tensor(ids, dtype=torch.long), ctx)[0]
        self.pos += len(ids)
        return logits


def _top5(logits: torch.Tensor) -> list[list]:
    v, i = logits.double().topk(5)
    return [[int(a), round(float(b), 4)] for a, b in zip(i, v)]


def run_next_token(model_dir: str | Path, ids: list[int], force_ids: list[int] = (), numerics: str = "exact",
                   api_steps: int = 0, ref: RefSpec = RefSpec(), api_speculative: int = 0) -> Report:
    """api_steps > 0 also runs the request through the full engine API beside decoys (see api_path.py);
    that path is always judged against the oracle (it needs every position's logits). api_speculative=k
    runs that path with k MTP drafts per step (the row map under drafting)."""
    if not ids:
        raise ValueError("--ids is empty")
    total = len(ids) + len(force_ids)
    ref_full = make_reference(ref, model_dir, numerics, total + 1)
    ref_step = make_reference(ref, model_dir, numerics, total + 1)
    eng_full, eng_step = EngineSession(model_dir, numerics, total + 1), EngineSession(model_dir, numerics, total + 1)
    report = Report("next-token", ["mode", "position", "engine_top1", "ref_top1", "engine_margin", "ref_margin",
                                   "rel_err", "flip", "engine_top5", "ref_top5"],
                    meta={"model": str(model_dir), "numerics": numerics, "ids": list(ids), "force_ids": list(force_ids),
                          "reference": ref.label})
    seq = list(ids) + list(force_ids)
    pairs = [("prefill", total - 1, eng_full.extend(seq), ref_full.forward(torch.tensor([seq]), 0)[0])]
    pairs.append(("decode", len(ids) - 1, eng_step.extend(list(ids)), ref_step.forward(torch.tensor([ids]), 0)[0]))
    for j, tok in enumerate(force_ids):
        pos = len(ids) + j
        pairs.append(("decode", pos, eng_step.extend([tok]), ref_step.forward(torch.tensor([[tok]]), pos)[0]))
    for mode, pos, eng, ref in pairs:
        (e1, em), (r1, rm) = top1_margin(eng), top1_margin(ref)
        d = diff(eng.double(), ref.double())
        flip = e1 != r1
        report.rows.append({"mode": mode, "position": pos, "engine_top1": e1, "ref_top1": r1, "engine_margin": em,
                            "ref_margin": rm, "rel_err": d.rel_err, "flip": flip, "engine_top5": _top5(eng),
                            "ref_top5": _top5(ref)})
        if numerics == "exact" and (flip or d.rel_err > EXACT_TOLERANCE):
            report.defects.append(f"{mode} position {pos}: rel_err {d.rel_err:.3g}, top-1 {e1} vs {r1} (exact numerics)")
        elif numerics != "exact" and flip and rm >= DECISIVE_MARGIN:
            report.defects.append(f"{mode} position {pos}: top-1 {e1} vs {r1} at reference margin {rm:.3f}")
    if api_steps:
        from deepinfer.parity.api_path import api_rows

        rows, defects = api_rows(model_dir, list(ids), api_steps, numerics, api_speculative)
        report.columns += ["reported_logprob", "ref_logprob"]
        report.rows += rows
        report.defects += defects
    report.verdict = "no defect" if report.ok else f"{len(report.defects)} defect(s)"
    return report
