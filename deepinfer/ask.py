"""`deepinfer ask`: the seed's ref_next_token.py as a product — prompt -> ids -> oracle generate -> a report
with the completion, the generated ids and, per step, the top-K tokens with logits and the top-1 margin.

Part of the cli layer (it may import `reference`; library code must not import this module).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.reference import load_reference
from deepinfer.reference.generate import generate
from deepinfer.tokenizer import Tokenizer


@dataclass
class Step:
    token: int
    top: list[tuple[int, float]]  # (token id, logit), best first
    margin: float  # top-1 minus top-2 logit


@dataclass
class AskReport:
    model: str
    numerics: str
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    steps: list[Step] = field(default_factory=list)
    finish_reason: str = "length"
    token_text: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "model": self.model, "numerics": self.numerics, "prompt_ids": self.prompt_ids, "tokens": self.tokens,
            "text": self.text, "finish_reason": self.finish_reason,
            "steps": [{"token": s.token, "margin": s.margin, "top": [[t, v] for t, v in s.top]} for s in self.steps],
        }


def ask(
    model_dir: str | Path, prompt: str | None = None, ids: list[int] | None = None, chat: bool = True,
    thinking: bool = False, max_tokens: int = 16, top: int = 5, numerics: str = "official",
    revision: str = "current", temperature: float = 0.0, seed: int = 33377335,
) -> AskReport:
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens must be positive, got {max_tokens}")
    if top <= 1:
        raise ValueError(f"--top must be at least 2 (the margin needs two tokens), got {top}")
    tok = Tokenizer.from_checkpoint(model_dir)
    if ids is None:
        if prompt is None:
            raise ValueError("give a prompt or ids")
        ids = tok.apply_chat([{"role": "user", "content": prompt}], thinking=thinking) if chat else tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    model = load_reference(model_dir, numerics=numerics, revision=revision, max_batch_size=1,
                           max_seq_len=len(ids) + max_tokens)
    gen = generate(model, [ids], max_tokens, eos_id=tok.eos_id, temperature=temperature, seed=seed)[0]
    report = AskReport(str(model_dir), numerics, list(ids), gen.tokens, tok.decode(gen.tokens),
                       finish_reason=gen.finish_reason)
    for token, logits in zip(gen.tokens, gen.step_logits):
        values, indices = logits.float().topk(top)
        report.steps.append(Step(token, list(zip(indices.tolist(), values.tolist())), float(values[0] - values[1])))
    seen = {t for s in report.steps for t, _ in s.top}
    report.token_text = {t: tok.decode([t]) for t in seen}
    return report


def format_report(r: AskReport) -> str:
    lines = [
        f"model: {r.model}  numerics: {r.numerics}",
        f"prompt ids ({len(r.prompt_ids)}): {r.prompt_ids}",
        f"completion: {r.text!r}",
        f"generated ids: {r.tokens}  (finish: {r.finish_reason})",
        "",
        f"{'step':>4}  {'token':>7}  {'margin':>7}  top-{len(r.steps[0].top) if r.steps else 0}",
    ]
    for i, s in enumerate(r.steps):
        tops = "  ".join(f"{t}:{r.token_text.get(t, '')!r}={v:.3f}" for t, v in s.top)
        lines.append(f"{i:>4}  {s.token:>7}  {s.margin:>7.3f}  {tops}")
    return "\n".join(lines)


__all__ = ["ask", "format_report", "AskReport"]
