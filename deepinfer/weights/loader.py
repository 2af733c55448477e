"""Load a checkpoint's tensors by name, whole, after checking them against the config.

Owns: `load_tensors(dir_or_reader, cfg, names=None)` -> `LoadedWeights` (a dict name -> tensor, as
stored: FP8/E8M0/packed FP4 stay quantised). For converted `model{rank}-mp{n}` files it reassembles the
full tensor: slices concatenated along the schema's shard_dim in rank order, routed experts taken from
their owning rank, replicated tensors from rank 0. Converted `wo_a` stays the bf16 that convert.py
wrote and has no `.scale`; such names are listed in `LoadedWeights.dequantised`.

Must not: dequantise, cast or re-layout tensors (consumers do that with `formats`), or hold more than
the requested tensors plus one tensor's slices in memory.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.config import ModelConfig
from deepinfer.weights.check import check_checkpoint
from deepinfer.weights.convert import expert_owner, is_wo_a, official_key_dim, routed_expert_index
from deepinfer.weights.reader import CheckpointError, CheckpointReader
from deepinfer.weights.schema import expected_tensors, skipped_prefixes

log = logging.getLogger(__name__)


def is_mapped_table(name: str) -> bool:
    """Tensors too large to read whole: the engram hash tables and their scales."""
    return ".engram.embed." in name


class LoadedWeights(dict[str, torch.Tensor]):
    """name -> full tensor, plus where it came from.

    `dequantised`: weights stored dequantised without a scale (converted wo_a, bf16) — a consumer that
    would look for `<name>.scale` must use the tensor as is. `expert_dtype`: "fp4" or "fp8" for
    converted files (None for HF, whose experts follow cfg.expert_dtype).
    """

    def __init__(self, source_format: str, mp: int, expert_dtype: str | None = None) -> None:
        super().__init__()
        self.source_format = source_format
        self.mp = mp
        self.expert_dtype = expert_dtype
        self.dequantised: set[str] = set()


def load_tensors(
    dir_or_reader: str | Path | CheckpointReader,
    cfg: ModelConfig,
    names: list[str] | None = None,
    progress: bool = True,
    check: bool = True,
    include_mtp: bool = True,
) -> LoadedWeights:
    """Read `names` (default: every tensor in the checkpoint) as full tensors, one at a time.

    With `check`, `check_checkpoint` runs first (headers only) and any problem raises CheckpointError.
    The progress bar is shown only when `progress` and stderr is a terminal.
    """
    reader = dir_or_reader if isinstance(dir_or_reader, CheckpointReader) else CheckpointReader(dir_or_reader)
    expert_dtype = None
    if check:
        report = check_checkpoint(reader, cfg, include_mtp=include_mtp)
        report.raise_if_failed()
        expert_dtype = report.expert_dtype
    skipped = skipped_prefixes(cfg)
    if names is None:  # everything the language model uses; e.g. V4.1's vision tower stays on disk
        wanted = [n for n in reader.names() if not (skipped and n.startswith(skipped))]
        left = len(reader.names()) - len(wanted)
        if left:
            log.warning("%s: skipped %d tensors DeepInfer does not use (%s)", reader.dir, left, ", ".join(skipped))
    else:
        wanted = list(names)
    unknown = [n for n in wanted if n not in reader]
    if unknown:
        shown = ", ".join(unknown[:20]) + (f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
        raise CheckpointError(f"{reader.dir}: unknown tensor(s) requested: {shown}")

    out = LoadedWeights(reader.format, reader.mp, expert_dtype)
    table = expected_tensors(cfg, include_mtp=True) if reader.format == "mp" else {}
    show = progress and sys.stderr.isatty()
    for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not show):
        if reader.format == "hf":
            # V4.1's engram tables (~183 GiB in the real model) stay memory-mapped: rows are paged in on use
            out[name] = reader.get_mapped(name) if is_mapped_table(name) else reader.get(name)
            continue
        out[name] = _assemble(reader, cfg, table, name)
        if is_wo_a(name) and name.endswith(".weight") and out[name].dtype == torch.bfloat16:
            out.dequantised.add(name)
        if out.expert_dtype is None and routed_expert_index(name) is not None and name.endswith(".weight"):
            out.expert_dtype = "fp8" if out[name].dtype == torch.float8_e4m3fn else "fp4"
    return out


def _assemble(reader: CheckpointReader, cfg: ModelConfig, table: dict, name: str) -> torch.Tensor:
    """One full tensor from the rank files of a converted checkpoint."""
    ranks = reader.ranks_of(name)
    expert = routed_expert_index(name)
    if expert is not None:
        owner = expert_owner(expert, cfg.n_routed_experts, reader.mp)
        if owner not in ranks:
            raise CheckpointError(f"{reader.files[owner]}: routed expert tensor {name} is not on its owner rank")
        return reader.get(name, owner)
    dim = table[name].shard_dim if name in table else official_key_dim(name)
    if dim is None:
        return reader.get(name, ranks[0])
    if ranks != list(range(reader.mp)):
        missing = [str(reader.files[r]) for r in range(reader.mp) if r not in ranks]
        raise CheckpointError(f"sharded tensor {name} is missing from {', '.join(missing)}")
    parts = [reader.get(name, r) for r in range(reader.mp)]
    if parts[0].element_size() == 1:
        # concatenate 1-byte formats (fp8, e8m0, packed fp4) as raw bytes: exact and dtype-agnostic
        return torch.cat([p.view(torch.uint8) for p in parts], dim=dim).view(parts[0].dtype)
    return torch.cat(parts, dim=dim)
