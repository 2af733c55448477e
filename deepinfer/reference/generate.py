"""The official generate loop over the oracle (spec §7.2): right-padded batch, prefill of the shortest
prompt at position 0, then one token per step with prompt tokens forced where a sequence is still inside
its prompt; greedy argmax at temperature 0, else the official exponential-race categorical sampling.
Returns the generated ids and the logits of every step, so callers can show top-k and margins.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.reference.v4 import V4Model


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated ids (EOS included when produced)
    step_logits: list[torch.Tensor] = field(default_factory=list)  # fp32/fp64 [vocab] per generated token
    finish_reason: str = "length"  # "stop" when EOS was produced


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Official sampling: probs = softmax(logits / max(T, 1e-5)); argmax(probs / Exp(1) noise)."""
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)


def generate(
    model: V4Model, prompts: list[list[int]], max_new_tokens: int, eos_id: int = 1, temperature: float = 0.0,
    seed: int = 33377335,
) -> list[Generation]:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    B = len(prompts)
    lens = [len(p) for p in prompts]
    total = min(model.max_seq_len, max(lens) + max_new_tokens)
    if max(lens) >= total:
        raise ValueError(f"prompt of {max(lens)} tokens leaves no room within max_seq_len {model.max_seq_len}")
    tokens = torch.full((B, total), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    in_prompt = tokens != -1
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    outs = [Generation(prompt=list(p)) for p in prompts]
    finished = torch.zeros(B, dtype=torch.bool)
    prev = 0
    for cur in range(min(lens), total):
        logits = model.forward(tokens[:, prev:cur], prev)
        nxt = sample(logits, temperature, generator) if temperature > 0 else logits.argmax(dim=-1)
        nxt = torch.where(in_prompt[:, cur], tokens[:, cur], nxt)
        tokens[:, cur] = nxt
        for i in range(B):
            if in_prompt[i, cur] or finished[i] or len(outs[i].tokens) >= max_new_tokens:
                continue
            outs[i].tokens.append(int(nxt[i]))
            outs[i].step_logits.append(logits[i])
            if int(nxt[i]) == eos_id:
                outs[i].finish_reason = "stop"
        finished |= ~in_prompt[:, cur] & (nxt == eos_id)
        prev = cur
        if bool(finished.all()):
            break
    return outs
