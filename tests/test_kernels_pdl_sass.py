"""The programmatic-dependent-launch prologue of the CUDA decode kernels AS COMPILED (sm_90 SASS: NVRTC, then
the cuobjdump Triton ships; skipped where either is missing). Two findings of 2026-12-07 make the source-level
check of tests/test_kernels_pdl.py not enough:
* ptxas hoists griddepcontrol.wait (SASS ACQBULK) above independent loads written before it: fp8_linear_mma's
  "first weight stages before the wait" compiled to ACQBULK first. A memory instruction between them (an L2
  prefetch, pdl_common.cuh `prefetch_l2`, SASS UBLKPF: the whole slice, PREFETCH 1, or one line already
  loaded, PREFETCH 2 / EARLY's "pin") keeps the order: those builds must show the weight loads (LDG ... .NA,
  no L1 allocation: weights only) and a prefetch BEFORE ACQBULK.
* Before the wait a kernel may read only memory no kernel just wrote and may write nothing: no store, atomic
  or reduction before ACQBULK in any build; a build without PREFETCH / EARLY reads nothing before it.
Planted: a store moved above pdl_enter() is found.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

from deepinfer.kernels.cuda import runtime

_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
WRITES = ("STG", "ST.", "STS", "ATOM", "RED", "STL")  # STS: shared (harmless, but nothing does it before)

# (source, defines, early): early builds load weights and prefetch them before the wait
BUILDS = [
    ("fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=1, PREFETCH=1), True),
    ("fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=1, PREFETCH=2), True),
    ("fp8_linear_mma.cu", dict(MT=2, WARPS=4, STAGES=2, SPLIT_OUT=1, PREFETCH=2), True),
    ("fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=0, CLUSTER_SPLIT=2, PREFETCH=2), True),
    ("fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=0, RAW_ACT=1, GROUP_ROWS=1024, PREFETCH=2), True),
    ("fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=1, PREFETCH=0), False),
    ("fp4_moe_mma.cu", dict(MT=1, WARPS=4, STAGES=2, KSTEP=256, EARLY=1), True),
    ("fp4_moe_mma.cu", dict(MT=1, WARPS=4, STAGES=2, KSTEP=256, EARLY=1, PREFETCH=1), True),
    ("fp4_moe_mma.cu", dict(MT=2, WARPS=4, STAGES=4, KSTEP=128, EARLY=1), True),
    ("fp4_moe_mma.cu", dict(MT=1, WARPS=4, STAGES=2, KSTEP=256, EARLY=0), False),
]


def _cuobjdump() -> str:
    triton = pytest.importorskip("triton")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("Triton's cuobjdump is not installed here")
    return tool


def sass_ops(source_text: str, name: str, defines: dict) -> list[str]:
    """The opcodes (with modifiers) of the compiled kernel in address order."""
    try:
        runtime.nvrtc_version()
    except runtime.CudaRuntimeError as err:
        pytest.skip(f"no NVRTC here: {err}")
    tool = _cuobjdump()
    cubin = runtime.compile_cubin(source_text, name, "sm_90a", tuple(f"-D{k}={v}" for k, v in defines.items()))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return [m.group(3) for m in map(_OP.search, text.splitlines()) if m]


def prologue_problem(ops: list[str], early: bool) -> str | None:
    """What is wrong with the instructions before the first ACQBULK (None: nothing)."""
    if "ACQBULK" not in ops:
        return "no griddepcontrol.wait (ACQBULK)"
    before = ops[: ops.index("ACQBULK")]
    writes = [op for op in before if op.startswith(WRITES)]
    if writes:
        return f"writes before the wait: {writes}"
    loads = [op for op in before if op.startswith("LDG")]
    if not early:
        return f"loads before the wait: {loads}" if loads else None
    if not any(op.startswith("LDG") and ".NA" in op for op in before):
        return "no weight load (LDG .NA) before the wait"
    if "UBLKPF.L2" not in before:
        return "no L2 prefetch (UBLKPF.L2) before the wait"
    return None


@pytest.mark.parametrize("source,defines,early", BUILDS, ids=[f"{s[:-3]}-{'-'.join(f'{k}{v}' for k, v in d.items())}"
                                                               for s, d, _ in BUILDS])
def test_the_compiled_prologue_keeps_the_pdl_rule_and_the_early_loads(source, defines, early):
    ops = sass_ops(runtime.read_source(source), source, defines)
    assert prologue_problem(ops, early) is None, (source, defines, prologue_problem(ops, early))


def test_a_store_before_the_wait_is_found():
    text = runtime.read_source("fp8_linear_mma.cu")
    anchor = "    pdl_enter();\n    for (int i = 0; i < steps; i += STAGES) {"
    assert anchor in text
    planted = text.replace(anchor, "    ((float*)out)[threadIdx.x] = 1.f;\n" + anchor)
    ops = sass_ops(planted, "fp8_linear_mma.cu", dict(MT=1, WARPS=8, STAGES=2, SPLIT_OUT=1, PREFETCH=2))
    assert prologue_problem(ops, True).startswith("writes before the wait")
