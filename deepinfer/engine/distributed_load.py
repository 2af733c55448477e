"""One rank's checkpoint tensors, read a layer at a time and sliced at once (`shard_checkpoint`'s rules), so
a rank's host memory peaks at its own share plus one layer's full tensors, never the whole checkpoint.

Works on HF shards and on official converted `model{rank}-mp{n}.safetensors` files alike (the loader
reassembles each converted tensor from the rank files, then the slicing rules cut this rank's part, so
any tp / ep works with any mp, including the replicated indexer that convert.py split by head). Routed
experts another rank owns are never read. Engram tables stay memory-mapped (rows are paged in on use).
Must not: dequantise or cast (`prepare_params` does), or decide the split (`deepinfer.distributed` does).
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from deepinfer.config import ModelConfig
from deepinfer.distributed import ParallelConfig
from deepinfer.distributed.sharding import shard_tensor
from deepinfer.weights import load_tensors
from deepinfer.weights.check import check_checkpoint
from deepinfer.weights.loader import LoadedWeights, is_mapped_table
from deepinfer.weights.reader import CheckpointReader
from deepinfer.weights.schema import skipped_prefixes

_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


def _wanted(reader: CheckpointReader, cfg: ModelConfig, pc: ParallelConfig) -> list[str]:
    skipped = skipped_prefixes(cfg)
    names = []
    for n in reader.names():
        if skipped and n.startswith(skipped):
            continue
        m = _EXPERT.match(n)
        if m and not pc.owns_expert(int(m.group(1)), cfg.n_routed_experts):
            continue  # another rank's expert: not even read
        names.append(n)
    return names


def load_rank_tensors(model_dir: str | Path, cfg: ModelConfig, pc: ParallelConfig) -> LoadedWeights:
    """This rank's slices of every tensor the model uses (same type and flags as `load_tensors`)."""
    pc.check_model(cfg)
    reader = CheckpointReader(model_dir)
    report = check_checkpoint(reader, cfg)
    report.raise_if_failed()
    groups: dict[str, list[str]] = defaultdict(list)  # one layer (or the top-level tensors) per read
    for n in _wanted(reader, cfg, pc):
        m = _LAYER.match(n)
        groups[m.group(0) if m else ""].append(n)
    out = LoadedWeights(reader.format, reader.mp, report.expert_dtype)
    for names in groups.values():
        full = load_tensors(reader, cfg, names=names, progress=False, check=False)
        out.dequantised |= full.dequantised
        out.expert_dtype = out.expert_dtype or full.expert_dtype
        for n in names:
            t = full.pop(n)
            part = shard_tensor(n, t, cfg, pc)
            if part is None:
                continue
            if part is not t and part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() \
                    and not is_mapped_table(n):
                part = part.clone()  # a view would keep the whole tensor alive
            out[n] = part
    return out
