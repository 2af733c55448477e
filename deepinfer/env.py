"""Every DEEPINFER_* environment variable, typed, read here and nowhere else."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """DEEPINFER_CACHE_DIR: where the embedded default model is generated (default ~/.cache/deepinfer)."""
    value = os.environ.get("DEEPINFER_CACHE_DIR")
    return Path(value) if value else Path.home() / ".cache" / "deepinfer"


def progress_enabled() -> bool:
    """DEEPINFER_NO_PROGRESS=1 turns progress bars off (they are also off when stderr is not a terminal)."""
    return os.environ.get("DEEPINFER_NO_PROGRESS", "") not in ("1", "true", "yes")


def cuda_graphs_enabled() -> bool:
    """DEEPINFER_CUDA_GRAPHS=0 turns the fast engine's decode CUDA graphs off (EngineConfig(cuda_graphs=False)
    does the same per engine); default on."""
    return os.environ.get("DEEPINFER_CUDA_GRAPHS", "1") not in ("0", "false", "no")
