"""Running a test script through Triton's interpreter: a fresh Python with TRITON_INTERPRET=1 (the Triton
kernels then run on CPU tensors), the repository and tests/ importable; or the same compiled for the GPU. A fresh process because the
interpreter is chosen when triton is imported. Callers skip first when triton is missing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def run_interpreted(script: str, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *argv], env=_env(TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=timeout)


def run_compiled(script: str, directory: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """The same kind of script compiled for the GPU (no interpreter), from a file in `directory`: Triton's
    jit reads a kernel's source from its file, which `python -c` does not have."""
    path = directory / "script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], env=_env(), capture_output=True, text=True, timeout=timeout)
