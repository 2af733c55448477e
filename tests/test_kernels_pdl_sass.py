"""The programmatic-dependent-launch rule on the CUDA kernels AS COMPILED (sm_90 SASS: NVRTC, then the
cuobjdump Triton ships; skipped where either is missing). tests/test_kernels_pdl.py checks the sources, but
ptxas schedules: before griddepcontrol.wait (SASS ACQBULK) a kernel may read only memory no kernel just wrote
and may write nothing, so no store, atomic or reduction may come before ACQBULK in any build of the package's
kernels (their default tiles and the forms the ops launch). Planted: a store moved above pdl_enter() is found.
(ptxas also moves loads the source places before pdl_enter() below the wait: fp8_linear_mma's first weight
stages compile to ACQBULK first. Keeping them above it, by an L2 prefetch between, was measured slower on an
H100, 2026-12-07; BENCHMARKS.md "thirty-fifth session".)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from deepinfer.kernels.cuda import runtime

from test_cuda_runtime import need_nvrtc

WRITES = ("STG", "ST.", "STS", "STL", "ATOM", "RED")


def _builds() -> list[tuple[str, dict]]:
    from deepinfer.kernels.cuda import fp4_moe_mma, fp4_moe_tma, fp8_linear_mma, sparse_attn_wgmma

    lin = dict(fp8_linear_mma.DEFAULT_TILES)
    return [
        ("fp8_linear_mma.cu", dict(lin, SPLIT_OUT=1)),  # split-K partials
        ("fp8_linear_mma.cu", dict(lin, SPLIT_OUT=0, CLUSTER_SPLIT=2)),  # the cluster sum
        ("fp8_linear_mma.cu", dict(lin, SPLIT_OUT=0, RAW_ACT=1, GROUP_ROWS=1024)),  # wo_a's grouped form
        ("fp4_moe_mma.cu", dict(fp4_moe_mma.DEFAULT_TILES, MT=1, KSTEP=256)),  # the b1 tiles
        ("fp4_moe_mma.cu", dict(fp4_moe_mma.DEFAULT_TILES, ASYNC=1, STAGES=4)),
        ("fp4_moe_tma.cu", dict(fp4_moe_tma.DEFAULT_TILES)),
        ("sparse_attn_wgmma.cu", dict(STAGES=sparse_attn_wgmma.STAGES, MN_SWAP=0)),
    ]


def _sass_tools():
    """scripts/sass_sm90.py (its cuobjdump and SASS parser); skips without triton or its cuobjdump."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sass_sm90

    if not os.path.exists(sass_sm90.CUOBJDUMP):
        pytest.skip("Triton's cuobjdump is not installed here")
    return sass_sm90


def sass_ops(source_text: str, name: str, defines: dict) -> list[str]:
    """The opcodes (with modifiers) of the compiled kernel in address order."""
    need_nvrtc()
    tools = _sass_tools()
    cubin = runtime.compile_cubin(source_text, name, "sm_90a", tuple(f"-D{k}={v}" for k, v in defines.items()))
    return [op for _, op, _ in tools.instructions(tools.cuobjdump(cubin, "-sass"))]


def writes_before_the_wait(ops: list[str]) -> list[str]:
    """The store / atomic / reduction opcodes before the first ACQBULK (all of them if there is none)."""
    end = ops.index("ACQBULK") if "ACQBULK" in ops else len(ops)
    return [op for op in ops[:end] if op.startswith(WRITES)]


BUILDS = _builds()


@pytest.mark.parametrize("source,defines", BUILDS, ids=[f"{s[:-3]}-{i}" for i, (s, _) in enumerate(BUILDS)])
def test_no_build_writes_before_its_pdl_wait(source, defines):
    ops = sass_ops(runtime.read_source(source), source, defines)
    assert "ACQBULK" in ops, (source, defines, "no griddepcontrol.wait")
    assert writes_before_the_wait(ops) == [], (source, defines)


def test_a_store_before_the_wait_is_found():
    text = runtime.read_source("fp8_linear_mma.cu")
    assert text.count("    pdl_enter();\n") == 1
    planted = text.replace("    pdl_enter();\n", "    ((float*)out)[threadIdx.x] = 1.f;\n    pdl_enter();\n")
    source, defines = BUILDS[0]
    assert writes_before_the_wait(sass_ops(planted, source, defines))
