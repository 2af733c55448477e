"""Running a test script through Triton's interpreter: a fresh Python with TRITON_INTERPRET=1 (the Triton
kernels then run on CPU tensors), the repository and tests/ importable. A fresh process because the
interpreter is chosen when triton is imported. Callers skip first when triton is missing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
