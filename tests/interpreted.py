"""Running a test script through Triton's interpreter: a fresh Python with TRITON_INTERPRET=1 (the Triton
kernels then run on CPU tensors), the repository and tests/ importable; or the same compiled for the GPU. A fresh process because the
interpreter is chosen when triton is imported. Callers skip first when triton is missing.

Also `GPU_ROUNDINGS`, the source a script runs first to make Triton 3.6's interpreter round as the GPU does
(test-only patches): a dot of bf16 operands multiplies their raw uint16 bit patterns; fp32 -> bf16 casts
truncate; fp32 -> E4M3 "rtne" rounds ties up and drops the mantissa carry (31.0 -> 16.0); and (with numpy 2)
a loop bound that is a runtime int fails to convert. And the two verdicts every interpreter test gives:
`assert_ran_ok` (exit 0, "ok" printed last) and `assert_check_failed` (a planted bug: the check's assertion
fired)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


GPU_ROUNDINGS = '''
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interp

_dot, _convert = _interp.InterpreterBuilder.create_dot, _interp._convert_float


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    def f32(t):  # bf16 is stored as raw uint16 bits: np.matmul would multiply the bit patterns
        if t.dtype.scalar == tl.bfloat16:
            return _interp.TensorHandle(_convert(t.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
        return t
    return _dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)


def _convert_float(data, src, dst, rounding_mode):
    if src == tl.float32 and dst in (tl.bfloat16, tl.float8e4nv):  # round to nearest even, as the GPU does
        t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        if dst == tl.bfloat16:
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return _convert(data, src, dst, rounding_mode)


_patch_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):  # a runtime int is a 1-element array there; numpy 2 refuses int() of it
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interp.InterpreterBuilder.create_dot = _create_dot
_interp._convert_float = _convert_float
_interp._patch_lang_tensor = _patch_lang_tensor
'''


def assert_ran_ok(res: subprocess.CompletedProcess) -> None:
    """The script exited 0 and printed "ok" last (its output's tails as the message otherwise)."""
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]


def assert_check_failed(res: subprocess.CompletedProcess) -> None:
    """A check run with a planted bug: it must fail on its own assertion (not on anything else)."""
    assert res.returncode != 0 and "AssertionError" in res.stderr, res.stdout[-2000:] + res.stderr[-3000:]


def run_interpreted(script: str, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *argv], env=_env(TRITON_INTERPRET="1"), capture_output=True,
                          text=True, timeout=timeout)


def run_check(module: str, call: str, roundings: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`t.<call>` of test module `module` (imported as t) under the interpreter, then "ok" printed: the shape of
    most interpreter tests (`GPU_ROUNDINGS` first unless roundings is False). Skips the test without triton."""
    import pytest

    pytest.importorskip("triton")
    script = f"import {module} as t\nt.{call}\nprint('ok')"
    return run_interpreted((GPU_ROUNDINGS if roundings else "") + script, timeout=timeout)


def run_compiled(script: str, directory: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """The same kind of script compiled for the GPU (no interpreter), from a file in `directory`: Triton's
    jit reads a kernel's source from its file, which `python -c` does not have."""
    path = directory / "script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], env=_env(), capture_output=True, text=True, timeout=timeout)
