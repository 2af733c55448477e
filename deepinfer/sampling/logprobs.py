"""Logprobs of chosen tokens, their ranks and the top alternatives; and prompt logprobs.

Everything here is a pure function of a logits tensor that the caller also used (or will use) to pick
tokens — never of a copy re-derived elsewhere: the seed shipped token_logprobs that were all 0.0 because
the values were not carried from the sampling logits to the output (H20 plan P5).

Must not: sample, or return placeholder values (a missing logprob is an error, not 0.0).
"""
from __future__ import annotations

from collections.abc import Sequence
import functools
from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    token_ids: torch.Tensor  # [N] long: the chosen (or target) token of each row
    logprobs: torch.Tensor  # [N] its log-probability
    ranks: torch.Tensor  # [N] long: 1 + number of tokens with a strictly higher logprob (1 = best)
    top_ids: torch.Tensor  # [N, k] long, sorted by logprob descending (k may be 0)
    top_logprobs: torch.Tensor  # [N, k]

    def to(self, device: torch.device | str):
        """The same rows with every tensor on `device` (the engine reads rows on the host: one copy per
        tensor per step, not one per row)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def to_host_async(self):
        """(copy, event): the rows copied to pinned host memory without waiting for the device, and the
        CUDA event to synchronise on before reading them (None: already on the host). Queued right after
        sampling, the copy does not wait for work queued later (a blocking `.to("cpu")` would)."""
        if self.token_ids.device.type == "cpu":
            return self, None
        moved = {f.name: getattr(self, f.name).to("cpu", non_blocking=True) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.token_ids.device))
        return replace(self, **moved), event

    @functools.cached_property
    def lists(self) -> tuple[list, list, list, list, list]:
        """The rows as Python lists (token ids, logprobs, ranks, top ids, top logprobs), converted once:
        reading a tensor element by element costs microseconds per element, and the engine reads every row
        of every step (a batch of 128 spent milliseconds of host time a step that way)."""
        return (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(), self.top_ids.tolist(),
                self.top_logprobs.tolist())

    def row(self, i: int, num_top: int | None = None) -> tuple[int, float, int, list[tuple[int, float]]]:
        """(token id, logprob, rank, [(top id, top logprob), ...]) of row i, with num_top alternatives."""
        k = self.top_ids.shape[1] if num_top is None else num_top
        if k > self.top_ids.shape[1]:
            raise ValueError(f"row {i}: {k} top logprobs asked, {self.top_ids.shape[1]} computed")
        ids, lps, ranks, top_ids, top_lps = self.lists
        return ids[i], lps[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k]))


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, at least in fp32 (half-precision logprobs lose the tail)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Chosen-token logprob, rank and the `num_top` best alternatives of each row of `logprobs` [N, V]."""
    if logprobs.dim() != 2 or token_ids.shape != logprobs.shape[:1]:
        raise ValueError(f"logprobs [N, V] and token_ids [N] expected, got {tuple(logprobs.shape)}, "
                         f"{tuple(token_ids.shape)}")
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    chosen = logprobs.gather(1, token_ids.unsqueeze(-1)).squeeze(-1)  # [N]
    ranks = (logprobs > chosen.unsqueeze(-1)).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1, sorted=True)
    else:
        top_logprobs = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = token_ids.new_empty((logprobs.shape[0], 0))
    return TokenLogprobs(token_ids, chosen, ranks, top_ids, top_logprobs)


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int] | torch.Tensor, start: int = 0,
                    num_top: int = 0) -> TokenLogprobs:
    """Logprob of each next prompt token under the logits of the position before it.

    `logits` [L, V] are the rows of prompt positions start .. start+L-1 (one prefill chunk, or the whole
    prompt with start=0). Row j predicts prompt token start+j+1; a row whose next token lies past the
    prompt (the last prompt position predicts the first generated token) is dropped. The result covers
    prompt tokens start+1 .. — the first prompt token has no logprob (nothing precedes it). Raw logprobs.
    """
    ids = torch.as_tensor(prompt_token_ids, dtype=torch.long)
    if logits.dim() != 2 or not 0 <= start < len(ids) or start + logits.shape[0] > len(ids):
        raise ValueError(f"logits of {tuple(logits.shape)} at start {start} do not fit a prompt of {len(ids)} tokens")
    targets = ids[start + 1 : start + 1 + logits.shape[0]]  # [L'] with L' = L or L - 1
    rows = logits[: targets.shape[0]]
    return gather_logprobs(log_softmax(rows), targets.to(logits.device), num_top)
