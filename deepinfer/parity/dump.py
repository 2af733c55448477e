"""`--dump DIR`: the tensors a parity command compared, written for offline inspection, one file per
process so ranks of a torchrun job (and repeated runs) never overwrite each other:
`DIR/rank{r}-pid{p}-{command}-{side}.pt` (a dict name -> tensor, loadable with `torch.load`).

The rank is torch.distributed's when it is initialised, else the RANK environment variable, else 0.
Must not: decide what is compared (the command modules) or write anywhere but DIR.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): torch.distributed when initialised, else RANK / WORLD_SIZE, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise ValueError(f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                         "are not integers") from None


def dump_path(out_dir: str | Path, command: str, side: str) -> Path:
    for part in (command, side):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", part):
            raise ValueError(f"dump name part {part!r} must be letters, digits, '_', '.' or '-'")
    rank, _ = rank_and_world()
    return Path(out_dir) / f"rank{rank}-pid{os.getpid()}-{command}-{side}.pt"


def write_dump(out_dir: str | Path, command: str, side: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = dump_path(out_dir, command, side)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in tensors.items()}, path)
    return path
