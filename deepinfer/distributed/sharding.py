"""Per-rank slicing of a checkpoint's tensors (as stored: FP8 weights with their 128x128 / 32x32 block
scales, packed FP4 experts, bf16 tables), so the model code stays parallel-agnostic: a rank simply gets
fewer heads, groups, vocabulary rows, experts or engram rows, and reads its local sizes off the shapes.

Rules (tp = tensor-parallel size, t = tp rank; everything not listed is replicated):
* `embed.weight`, `head.weight`: rows split in tp equal slices (vocab-parallel embedding and head).
* `layers.*.attn.wq_b`, `attn_sink`: rows by query head (H/tp heads per rank).
* grouped output projection (o_groups G, o_lora_rank R): if G % tp == 0, `wo_a` rows by group (G/tp
  groups per rank) and `wo_b` columns by the same groups (row-parallel). If tp > G (the official code
  caps there: `n_local_groups = G // tp` would be 0), the tp/G ranks sharing group g each hold g's `wo_a`
  rows restricted to the input columns of THEIR heads, and g's `wo_b` columns whole: every rank's
  `wo_b(wo_a_part(o_part))` is a partial sum and the attention all-reduce adds them up exactly (both maps
  are linear), so no extra collective is needed.
* routed experts `layers.*.ffn.experts.{e}.*`: kept only on the rank owning e (ParallelConfig.owns_expert).
* V4.1 engram tables `layers.*.engram.embed.{weight,scale}`: rows split ceil(rows/tp) per rank.
* Deliberately replicated: the lightning indexer (its head-partial scores would need an all-reduce whose
  summation order can reorder near-tied top-k picks against world size 1), wq_a/wkv/compressors/norms/
  hc/gate/shared experts (as convert.py), and every `mtp.*` tensor.
A weight's `.scale` companion is sliced by the same rows/columns divided by the block size; a slice that
does not fall on block boundaries raises (it would need re-quantisation).
Must not: dequantise or cast (the model's `prepare_params` does), or import torch.distributed.
"""
from __future__ import annotations

import copy
import re
from typing import Mapping

import torch

from deepinfer.config import ModelConfig
from deepinfer.distributed.parallel_config import ParallelConfig

_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_ATTN = re.compile(r"^layers\.\d+\.attn\.(wq_b|attn_sink|wo_a|wo_b)\.(weight|scale)$|^layers\.\d+\.attn\.attn_sink$")
_ENGRAM = re.compile(r"^layers\.(\d+)\.engram\.embed\.(weight|scale)$")


def _span(name: str, t: torch.Tensor, dim: int, start: int, end: int, full: int) -> torch.Tensor:
    """Rows/cols [start, end) of a tensor whose logical size along `dim` is `full` (a block scale has
    full/block entries there: the bounds are divided by the block, which must divide them)."""
    size = t.shape[dim]
    if size != full:
        block = full // size
        if size * block != full or start % block or end % block:
            raise ValueError(f"{name}: slice [{start}, {end}) of {full} does not fall on its {block}-wide scale "
                             f"blocks; this tensor-parallel split needs a re-quantised checkpoint")
        start, end = start // block, end // block
    return t.narrow(dim, start, end - start).contiguous()


def _even(name: str, t: torch.Tensor, dim: int, parts: int, index: int, full: int) -> torch.Tensor:
    if full % parts:
        raise ValueError(f"{name}: size {full} along dim {dim} is not divisible by {parts}")
    step = full // parts
    return _span(name, t, dim, index * step, (index + 1) * step, full)


def _attention(name: str, kind: str, t: torch.Tensor, cfg: ModelConfig, pc: ParallelConfig) -> torch.Tensor:
    tp, tr = pc.tp, pc.tp_rank
    H, hd, G, R = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    if kind in ("wq_b", "attn_sink"):
        return _even(name, t, 0, tp, tr, H * hd if kind == "wq_b" else H)
    in_per_group = H * hd // G
    if G % tp == 0:  # whole groups per rank
        if kind == "wo_a":
            return _even(name, t, 0, tp, tr, G * R)
        return _even(name, t, 1, tp, tr, G * R)
    share = tp // G  # ranks per group (ParallelConfig.check_model made sure tp % G == 0)
    g, j = tr // share, tr % share
    if kind == "wo_a":
        rows = _span(name, t, 0, g * R, (g + 1) * R, G * R)
        return _even(name, rows, 1, share, j, in_per_group)
    return _span(name, t, 1, g * R, (g + 1) * R, G * R)


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, pc: ParallelConfig) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor `name` (None: the rank holds none of it)."""
    if name in ("embed.weight", "head.weight"):
        return _even(name, t, 0, pc.tp, pc.tp_rank, cfg.vocab_size)
    m = _EXPERT.match(name)
    if m:
        return t if pc.owns_expert(int(m.group(1)), cfg.n_routed_experts) else None
    m = _ATTN.match(name)
    if m and pc.tp > 1:
        kind = m.group(1) or "attn_sink"
        return _attention(name, kind, t, cfg, pc)
    m = _ENGRAM.match(name)
    if m and pc.tp > 1:
        total = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(int(m.group(1)))]
        start, end = pc.engram_rows(total)
        return t[start:end]
    return t


def shard_checkpoint(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, pc: ParallelConfig):
    """A copy of `raw` (same type and attributes, e.g. LoadedWeights.dequantised) with this rank's slices."""
    pc.check_model(cfg)
    if pc.world_size == 1:
        return raw
    out = copy.copy(raw)
    out.clear()
    for name, t in raw.items():
        part = shard_tensor(name, t, cfg, pc)
        if part is not None:
            out[name] = part
    return out
