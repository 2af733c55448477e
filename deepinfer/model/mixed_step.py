"""A step that mixes decoding sequences (one new token each) with prefills / extends, split in two: the
decode rows through the batched decode path (`DecodeRunner`: its CUDA graph on cuda), only the other
sequences through the extend path.

Why: the extend path's compressors, indexer selection and metadata walk the step's sequences one by one
(each sequence's compressed entries are its own), so every decoding sequence in an extend step adds its
own host work to every layer. On the tiny checkpoint one step of N decoding sequences beside one 256-token
prefill took 1,029 torch calls at N = 1, 3,339 at N = 16 and 10,731 at N = 64
(`benchmarks/count_prefill_ops.py --mixed N`): ~145 calls per decoding sequence there, ~1,500 on
V4-Flash's 43 layers, at tens of microseconds of host time each on CUDA. With continuous batching such a
step happens whenever a prompt arrives while others decode. Split, it costs one decode step (a graph
replay) plus the new prompts' own extend, whatever the batch: 1,379 calls at N = 1, 16 and 64 on the
CPU, where the decode part runs eagerly; one graph replay on CUDA. SGLang keeps prefill and decode batches
apart by default for the same reason. The runner splits on CUDA (`env.split_mixed_steps`, "auto"); on the
CPU the extend path's math for a few more rows is cheaper than a second forward.

The same math per row: each sequence's cache state is its own, so which forward computes a row changes
only the kernels' shapes (the decode path is within 1e-6 of the extend path on the CPU twins,
tests/test_engine_fast_decode.py; tests/test_mixed_step.py checks the split against the whole step).
Must not: take a step that wants every row's logits (prompt logprobs, drafts) or a debug tap: the decode
path returns one row per sequence and runs no tap.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext, SeqContext


def can_split(ctx: ForwardContext) -> bool:
    """A step with both decode rows and other sequences, one logits row per sequence wanted."""
    n_dec = sum(1 for s in ctx.seqs if s.num_new == 1)
    return not ctx.all_logits and 0 < n_dec < len(ctx.seqs)


def forward_split(extend: Callable[[torch.Tensor, ForwardContext], torch.Tensor],
                  decode: Callable[[torch.Tensor, Sequence[SeqContext]], torch.Tensor],
                  ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Logits [num_seqs, V] of a mixed step in `ctx.seqs` order (each sequence's last token's row):
    `decode(ids, seqs)` for the sequences with one new token, `extend(ids, ctx)` for the rest."""
    if not can_split(ctx):
        raise ValueError("forward_split needs decode rows and other sequences, one logits row each")
    seqs, cu = ctx.seqs, ctx.cu_tokens
    dec = [i for i, s in enumerate(seqs) if s.num_new == 1]
    ext = [i for i, s in enumerate(seqs) if s.num_new != 1]
    in_order = dec == list(range(len(dec)))  # decode rows first: running requests are scheduled first
    if in_order:
        dec_ids, ext_ids = ids[: len(dec)], ids[len(dec):]
    else:  # one gather of the flat ids: the decode rows' tokens, then the others' in their order
        rows = [cu[i] for i in dec] + [t for i in ext for t in range(cu[i], cu[i + 1])]
        picked = ids[host_to_device(torch.tensor(rows, dtype=torch.long), ids.device)]
        dec_ids, ext_ids = picked[: len(dec)], picked[len(dec):]
    dec_logits = decode(dec_ids, [seqs[i] for i in dec])
    ext_logits = extend(ext_ids, ForwardContext(tuple(seqs[i] for i in ext)))
    both = torch.cat([dec_logits, ext_logits])  # (a copy: the decode rows may be a graph's output buffer)
    if in_order:
        return both
    out = torch.empty_like(both)
    out[host_to_device(torch.tensor(dec + ext, dtype=torch.long), both.device)] = both
    return out
