"""Write tensors as an HF-style sharded safetensors checkpoint.

Owns: `write_checkpoint(dir, tensors)` -> `model-0000i-of-0000n.safetensors` shards plus
`model.safetensors.index.json` (`metadata.total_size`, `weight_map` name -> shard). Used by the
synthetic-checkpoint generator (`tiny.py`) and tests. Packed FP4 is stored as int8, as in the official HF
files (the float4_e2m1fn_x2 view is what convert.py produces, not what the HF release holds).

Must not: decide which tensors a model has or how they are quantised (`schema.py`, `formats.py`);
delete files it did not write.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.weights.reader import INDEX_FILE, CheckpointError

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # the HF releases use shards of a few GB


def shard_name(i: int, n: int) -> str:
    """HF shard file name, 1-based: shard_name(0, 3) == 'model-00001-of-00003.safetensors'."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _as_stored(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name} is a {type(t).__name__}, not a torch.Tensor")
    t = t.detach().to("cpu")
    if t.dtype == torch.float4_e2m1fn_x2:
        t = t.view(torch.int8)  # same bytes; HF files declare packed FP4 as I8
    t = t.contiguous()
    # safetensors refuses tensors that share storage (e.g. slices of one buffer): give slices their own
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def write_checkpoint(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write `tensors` into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own).

    Tensors are packed into shards in the dict's order (deterministic for a deterministic dict); the
    index lists names sorted. Files are written under a temporary name and renamed, so an interrupted
    write never leaves a shard that looks complete. Returns the shard paths.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not tensors:
        raise ValueError("write_checkpoint needs at least one tensor")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)

    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes

    n = len(groups)
    weight_map: dict[str, str] = {}
    total = 0
    written: list[Path] = []
    for i, group in enumerate(groups):
        fname = shard_name(i, n)
        stored = {name: _as_stored(name, tensors[name]) for name in group}
        total += sum(t.numel() * t.element_size() for t in stored.values())
        target = root / fname
        tmp = root / (fname + ".tmp")
        try:
            save_file(stored, str(tmp), metadata={"format": "pt", **(metadata or {})})
        except Exception as e:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"{target}: cannot write shard: {e}") from None
        os.replace(tmp, target)
        written.append(target)
        weight_map.update({name: fname for name in group})

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = root / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, root / INDEX_FILE)
    return written
