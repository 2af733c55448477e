"""Programmatic dependent launch (kernels/triton/pdl.py, cuda/pdl_common.cuh): a kernel launched with PDL
starts while the previous kernel still runs, so it must wait (pdl_enter) before it touches memory an earlier
kernel writes. These tests hold the rule for every kernel that takes part, and the launcher to it.

CPU: every launched Triton kernel (`@fast_launch`) has the `PDL` constexpr as its last parameter, default
False, and calls `pdl_enter(PDL)` as its first statement; every CUDA kernel file calls pdl_enter() and its
launcher asks for PDL; the checker itself fails on planted violations; FastLaunch passes `PDL=True` and
`launch_pdl=True` together, only to kernels with the parameter, and neither when PDL is off.
GPU (-m gpu): a chain of the real decode ops (Triton and CUDA kernels, eager and CUDA-graph replays)
bit-identical with PDL on and off, over many replays (a missing wait shows as a race)."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

import deepinfer.kernels.triton as triton_pkg  # noqa: E402
from deepinfer.kernels.triton import launch  # noqa: E402
from deepinfer.kernels.triton.launch import FastLaunch  # noqa: E402

CUDA_DIR = Path(__file__).resolve().parents[1] / "deepinfer/kernels/cuda"


def pdl_rule_violation(source: str) -> str | None:
    """Why a launched kernel's source breaks the PDL rule, or None: last parameter `PDL: tl.constexpr =
    False`, and `pdl_enter(PDL)` its first statement (after a docstring)."""
    fn = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(fn, ast.FunctionDef):
        return "not a function"
    args = fn.args.args
    if not args or args[-1].arg != "PDL":
        return "PDL is not the last parameter"
    if ast.unparse(args[-1].annotation) != "tl.constexpr":
        return "PDL is not a tl.constexpr"
    if not fn.args.defaults or ast.unparse(fn.args.defaults[-1]) != "False":
        return "PDL does not default to False"
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body or ast.unparse(body[0]) != "pdl_enter(PDL)":
        return "the first statement is not pdl_enter(PDL)"
    return None


def launched_kernels() -> list[tuple[str, FastLaunch]]:
    found = []
    for info in pkgutil.iter_modules(triton_pkg.__path__):
        module = importlib.import_module(f"deepinfer.kernels.triton.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, FastLaunch) and obj.fn.__module__ == module.__name__:
                found.append((f"{info.name}.{name}", obj))
    return found


def test_every_launched_triton_kernel_waits_first():
    kernels = launched_kernels()
    assert len(kernels) >= 45  # every module's kernels were found (53 on 2026-12-06)
    bad = {name: why for name, k in kernels if (why := pdl_rule_violation(inspect.getsource(k.fn.fn)))}
    assert not bad, bad
    assert all(k.pdl for _, k in kernels)


def test_checker_finds_planted_violations():
    good = '''
    def k(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """doc"""
        pdl_enter(PDL)
        tl.store(x_ptr, 1)
    '''
    assert pdl_rule_violation(good) is None
    late = good.replace("        pdl_enter(PDL)\n        tl.store(x_ptr, 1)", "        tl.store(x_ptr, 1)\n        pdl_enter(PDL)")
    assert pdl_rule_violation(late) == "the first statement is not pdl_enter(PDL)"
    early_exit = good.replace("        pdl_enter(PDL)\n", "        if n == 0:\n            return\n        pdl_enter(PDL)\n")
    assert pdl_rule_violation(early_exit) == "the first statement is not pdl_enter(PDL)"
    assert pdl_rule_violation(good.replace(", PDL: tl.constexpr = False", "")) == "PDL is not the last parameter"
    assert pdl_rule_violation(good.replace("= False", "= True")) == "PDL does not default to False"
    assert pdl_rule_violation(good.replace("PDL: tl.constexpr", "PDL: int")) == "PDL is not a tl.constexpr"


def test_every_cuda_kernel_enters_and_is_launched_with_pdl():
    """Each extern "C" kernel calls pdl_enter() once; before it only its weights' loads (fp8_linear_mma's
    first register stages) or none; each CudaKernel(...) of the package asks for pdl."""
    for cu in sorted(CUDA_DIR.glob("*.cu")):
        src = cu.read_text()
        kernels = re.split(r'extern "C" __global__', src)[1:]
        assert kernels, cu.name
        for body in kernels:
            head = body.split("pdl_enter();", 1)
            assert len(head) == 2, f"{cu.name}: a kernel without pdl_enter()"
            before = head[0].split("{", 1)[1] if "{" in head[0] else ""
            # nothing before the wait stores to global memory or reads the activations / routing
            for forbidden in ("quantise_chunk", "sorted_slots[", "block_expert[", "out[", "->", "atomic"):
                assert forbidden not in before, f"{cu.name}: {forbidden!r} before pdl_enter()"
    for py in sorted(set(CUDA_DIR.glob("*.py")) - {CUDA_DIR / "runtime.py", CUDA_DIR / "__init__.py"}):
        src = py.read_text()
        assert src.count("CudaKernel(") == src.count("pdl=True)"), py.name


class _Recorder:
    """Stands in for the JIT function: records what a launch would have been given."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@triton.jit
def _with_pdl(x_ptr, BLOCK: triton.language.constexpr, PDL: triton.language.constexpr = False):
    triton.language.store(x_ptr, 1)


@triton.jit
def _without_pdl(x_ptr, BLOCK: triton.language.constexpr):
    triton.language.store(x_ptr, 1)


def test_fast_launch_passes_pdl_and_its_attribute_together(monkeypatch):
    """(On the JIT's path, which needs no GPU here: the cached path takes the same kwargs, added before the
    two part.)"""
    from deepinfer.kernels.cuda import runtime

    monkeypatch.setattr(launch, "ENABLED", False)
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "griddepcontrol_device", lambda index: True)
    with_pdl, without = FastLaunch(_with_pdl), FastLaunch(_without_pdl)
    assert with_pdl.pdl and not without.pdl
    for k in (with_pdl, without):
        k.fn = _Recorder()
    monkeypatch.setattr(runtime, "PDL_ENABLED", True)
    with_pdl[(1,)](torch.zeros(1), BLOCK=4)
    without[(1,)](torch.zeros(1), BLOCK=4)
    assert with_pdl.fn.calls[-1][2] == {"BLOCK": 4, "PDL": True, "launch_pdl": True}
    assert without.fn.calls[-1][2] == {"BLOCK": 4}
    with_pdl[(1,)](torch.zeros(1), BLOCK=4, PDL=False)  # the caller's own choice stands (no attribute added)
    assert with_pdl.fn.calls[-1][2] == {"BLOCK": 4, "PDL": False}
    monkeypatch.setattr(runtime, "PDL_ENABLED", False)
    with_pdl[(1,)](torch.zeros(1), BLOCK=4)
    assert with_pdl.fn.calls[-1][2] == {"BLOCK": 4}
    monkeypatch.setattr(runtime, "PDL_ENABLED", True)
    monkeypatch.setattr(runtime, "griddepcontrol_device", lambda index: False)  # before sm_90: no griddepcontrol
    with_pdl[(1,)](torch.zeros(1), BLOCK=4)
    assert with_pdl.fn.calls[-1][2] == {"BLOCK": 4}


def test_launch_attribute_has_the_drivers_layout():
    """CUlaunchAttribute (cuda.h, CUDA 12): a 4-byte id padded to 8, then a 64-byte value union whose first
    int is programmaticStreamSerializationAllowed; CUlaunchConfig's attrs pointer and count after the stream."""
    import ctypes

    from deepinfer.kernels.cuda import runtime

    assert ctypes.sizeof(runtime._LaunchAttribute) == 72
    assert runtime._LaunchAttribute.value.offset == 8
    assert runtime.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert runtime._LaunchConfig.attrs.offset == 40 and runtime._LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(runtime._LaunchConfig) == 56
