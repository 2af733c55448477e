"""`Sampler`: logits rows -> tokens, with the logprobs of exactly the logits that were sampled.

Per row: greedy (argmax of the raw logits) when temperature < 1e-5; otherwise logits / T, then min-p,
top-k, top-p (filters.py), softmax, and the exponential race argmax(probs / Exp(1)) — the official
reference's draw, so a batch of one with the same seeded generator picks the same token as the official
`generate.py`. Each row draws its noise from its own `torch.Generator` (seeded from the request's seed),
so a seeded request's tokens do not depend on which other requests share the batch or their order.

Logprobs mode (like vLLM's `logprobs_mode`):
- "raw_logprobs" (default, as vLLM): log_softmax of the raw logits row, before temperature and filters —
  the model's own distribution; independent of sampling settings.
- "processed_logprobs": log_softmax of the temperature-scaled, filtered row the token was drawn from
  (greedy rows: the raw row), i.e. the distribution actually sampled.
Ranks are 1-based (1 = the best token by that distribution); top logprobs are sorted descending and
computed for the largest `logprobs` any row asked for (`num_top_logprobs` says how many each row wants).

Devices: everything runs on the logits' device, and the generators must live there too. So a CUDA engine
samples on the GPU: at batch 128 over the 129,280-token vocabulary, copying the logits to the H200's host
and sampling there took 83.5 ms (greedy) and 844 ms (top-p) a step, on the GPU 0.34 and 3.96 ms
(`benchmarks/bench_sampling.py`, BENCHMARKS.md); the model's whole decode step is ~6 ms. The generators
come from `make_generator(seed, device)`. The output rows are returned on the host, where the scheduler
and the outputs read them. A seeded request's draws depend on the generator's device (CPU and CUDA
generators are different streams), as in torch and vLLM.

A CUDA step whose rows are all greedy and ask no top logprobs takes op `greedy_sample` (one read of each
fp32 row for the token, its raw logprob and rank: H200 b128 41 us against the general path's 276 us; the
same tokens and ranks, the logprob within 2e-6; DEEPINFER_FUSED_GREEDY=0 keeps the general path).

Must not: map rows to requests (the caller passes rows in its own order), or verify drafts (spec/).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer import env, kernels
from deepinfer.devices import host_to_device
from deepinfer.sampling.filters import apply_filters
from deepinfer.sampling.logprobs import TokenLogprobs, gather_logprobs, log_softmax
from deepinfer.sampling.params import SamplingParams

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator: seeded when the request has a seed; None = the global RNG."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _small_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-row parameter tensor on `device` (through pinned memory: `torch.tensor(..., device="cuda")`
    would wait for every kernel queued before it)."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


@dataclass(frozen=True)
class SamplerOutput(TokenLogprobs):
    num_top_logprobs: tuple[int, ...] = ()  # per row: how many top logprobs its request asked for


class Sampler:
    def __init__(self, logprobs_mode: LogprobsMode = "raw_logprobs") -> None:
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None] | None = None, to_host: bool = True) -> SamplerOutput:
        """`logits` [N, V] float; `params[i]` and `generators[i]` belong to row i (generators may be None).
        to_host=False leaves the rows on the logits' device (the asynchronous engine copies them later with
        `TokenLogprobs.to_host_async`, after it has queued the next step)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or not logits.is_floating_point():
            raise ValueError(f"logits must be float [N, V] with N = {len(params)} params, got "
                             f"{tuple(logits.shape)} {logits.dtype}")
        if generators is not None and len(generators) != len(params):
            raise ValueError(f"{len(generators)} generators for {len(params)} rows")
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        num_top = tuple(p.logprobs or 0 for p in params)
        fused = (kernels.find("greedy_sample", "cuda") if logits.is_cuda and logits.dtype == torch.float32
                 and env.fused_greedy_enabled() else None)
        if fused is not None and not any(num_top) and all(p.greedy for p in params):
            # every row greedy, no top logprobs: token, raw logprob and rank from one read of each row (the
            # general path below writes and re-reads [N, V] fp32 four times); the same tokens, the logprobs
            # up to the fp32 sum's order (kernels/triton/greedy.py)
            tok, lp, ranks = fused(logits)
            out = SamplerOutput(tok, lp, ranks, tok.new_empty((len(params), 0)), lp.new_empty((len(params), 0)),
                                num_top)
            return out.to("cpu") if to_host else out
        raw_logprobs = log_softmax(logits)  # [N, V]
        token_ids = logits.argmax(dim=-1)  # greedy rows keep this; random rows are overwritten
        logprobs = raw_logprobs

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = _small_tensor(random_rows, logits.device)
            scaled = self._filtered(logits[rows], [params[i] for i in random_rows])  # [R, V]
            probs = scaled.softmax(dim=-1)
            noise = self._noise(probs, [generators[i] if generators else None for i in random_rows])
            # masked tokens have prob 0; keep them below every live token even if a noise draw is 0
            scores = (probs / noise).masked_fill(probs <= 0, -1.0)
            token_ids = token_ids.index_copy(0, rows, scores.argmax(dim=-1))
            if self.logprobs_mode == "processed_logprobs":
                logprobs = raw_logprobs.index_copy(0, rows, torch.log_softmax(scaled, dim=-1))

        out = gather_logprobs(logprobs, token_ids, max(num_top, default=0))
        # the tokens go to the scheduler and the logprobs to the outputs, both on the host: the [N, V] work
        # above stays on the logits' device, and only these [N] / [N, k] rows cross (see the module doc)
        out = SamplerOutput(out.token_ids, out.logprobs, out.ranks, out.top_ids, out.top_logprobs, num_top)
        return out.to("cpu") if to_host else out

    @staticmethod
    def _filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature-scaled and filtered rows (filters skipped entirely when no row uses them)."""
        dev, dt = logits.device, logits.dtype
        temps = _small_tensor([p.temperature for p in params], dev, dt)
        scaled = logits / temps.unsqueeze(-1)
        top_k = top_p = min_p = None
        if any(p.top_k_or_off for p in params):
            top_k = _small_tensor([p.top_k_or_off for p in params], dev, torch.long)
        if any(p.top_p < 1 for p in params):
            top_p = _small_tensor([p.top_p for p in params], dev, dt)
        if any(p.min_p > 0 for p in params):
            min_p = _small_tensor([p.min_p for p in params], dev, dt)
        return apply_filters(scaled, top_k, top_p, min_p)

    @staticmethod
    def _noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) noise [R, V]: each seeded row from its own generator (one full row per draw, so the
        stream a request consumes does not depend on the batch); unseeded rows from the global RNG."""
        noise = torch.empty_like(probs)
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if unseeded:
            noise.index_copy_(0, _small_tensor(unseeded, probs.device),
                              torch.empty((len(unseeded), probs.shape[1]), device=probs.device,
                                          dtype=probs.dtype).exponential_(1))
        for row, gen in zip(noise.unbind(0), generators):  # (the row views made at once: ~30% less host time)
            if gen is not None:
                row.exponential_(1, generator=gen)
        return noise
