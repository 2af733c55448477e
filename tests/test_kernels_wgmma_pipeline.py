"""What ptxas does to the warpgroup-MMA kernels' pipelines, read offline (NVRTC's ptxas log and the sm_90a SASS;
skipped without NVRTC or Triton's cuobjdump, like tests/test_kernels_pdl_sass.py).

ptxas serializes a kernel's wgmma.mma_async (each waits for the one before: advisory C7515) when a non-wgmma
instruction writes an accumulator register while a wgmma stage is open. The sparse attention did that until
2026-12-07: the compiler zeroed its output accumulators after an item's first S was issued. Its default build
(PIPELINED_QK 1) pins the zeroing before it, and its 32 S wgmmas a block are issued back to back: the same bits,
14% faster at the 8k prefill's ratio-4 call on an H200 (2024 -> 1782 us). PIPELINED_QK 0 keeps the serialized
build, so the detector's test below has a case that must fail.
"""
from __future__ import annotations

import pytest

from deepinfer.kernels.cuda import runtime, sparse_attn_wgmma

from test_cuda_runtime import need_nvrtc
from test_kernels_pdl_sass import _sass_tools


def _advisories(defines: dict, source: str = sparse_attn_wgmma.SOURCE) -> list[str]:
    need_nvrtc()
    opts = tuple(f"-D{k}={v}" for k, v in defines.items())
    return runtime.ptxas_advisories(runtime.read_source(source), source, "sm_90a", opts)


def test_pipelined_build_keeps_the_wgmma_pipeline():
    defines = sparse_attn_wgmma.defines(pipelined=True)
    assert _advisories(defines) == []
    tools = _sass_tools()
    cubin = runtime.compile_cubin(runtime.read_source(sparse_attn_wgmma.SOURCE), sparse_attn_wgmma.SOURCE, "sm_90a",
                                  tuple(f"-D{k}={v}" for k, v in defines.items()))
    lines = [line.split("*/")[1].strip() for _, _, line in tools.instructions(tools.cuobjdump(cubin, "-sass"))]
    s_wgmmas = [i for i, line in enumerate(lines) if line.startswith("HGMMA.64x32x16")]
    between = lines[s_wgmmas[0]:s_wgmmas[31] + 1]  # a block's S: 32 wgmmas (descriptor arithmetic between them)
    assert not [line for line in between if line.startswith("WARPGROUP.DEPBAR")], "a wait inside S's wgmmas"


def test_qnorm_build_keeps_the_wgmma_pipeline_without_spills():
    """The build that norms and rotates the raw queries in shared memory (QNORM, op sparse_attn_sink_qnorm): its
    pass runs beside the pinned output accumulators; ptxas keeps the pipeline and spills nothing."""
    need_nvrtc()
    opts = tuple(f"-D{k}={v}" for k, v in sparse_attn_wgmma.defines(qnorm=True).items())
    src = runtime.read_source(sparse_attn_wgmma.SOURCE)
    assert _advisories(sparse_attn_wgmma.defines(qnorm=True)) == []
    log = runtime.compile_with_log(src, sparse_attn_wgmma.SOURCE, "sm_90a", (*opts, "--ptxas-options=-v"))[1]
    spills = [line for line in log.splitlines() if "spill" in line]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in line for line in spills), spills


def test_the_serialization_is_detected():
    """The serialized build (PIPELINED_QK 0): ptxas's advisory names the serialization."""
    found = _advisories(sparse_attn_wgmma.defines(pipelined=False))
    assert any("C7515" in line and "serialized" in line for line in found), found


@pytest.mark.parametrize("gated", [0, 1])
def test_expert_gemm_without_a_producer_warp_keeps_the_wgmma_pipeline(gated):
    """The prefill experts' 4-warpgroup tiles: with a producer warp the CTA's 17 warps put 5 on one of the SM's
    4 schedulers, whose quarter of the register file caps a thread at 96 registers, and ptxas serializes the
    wgmmas (C7511); with thread 0 as the producer (16 warps, 128 registers) it does not."""
    from deepinfer.kernels.cuda import fp4_moe_wgmma
    from deepinfer.kernels.triton.fp4_moe import WGMMA_TILES

    for producer_warp, serialized in ((1, True), (0, False)):
        defines = {**fp4_moe_wgmma.tiles(dict(WGMMA_TILES, PRODUCER_WARP=producer_warp)), "GATED": gated, "OUT_F32": 0}
        found = _advisories(defines, fp4_moe_wgmma.SOURCE)
        assert any("C7511" in line for line in found) == serialized, (producer_warp, found)


def test_two_fragment_buffers_keep_the_wgmma_pipeline():
    """FRAG_BUFS 2 issues a stage's wgmmas while the previous stage's run: an accumulator pin there (an asm "+f" on
    them, a non-wgmma definition inside an open stage) made ptxas serialize every wgmma (C7515). The kernel pins
    the accumulators only where no wgmma is in flight."""
    from deepinfer.kernels.cuda import fp4_moe_wgmma

    for gated in (0, 1):
        defines = {**fp4_moe_wgmma.tiles(dict(BT=64, CWG=2, STAGES=4, FRAG_BUFS=2, HALVES=0)), "GATED": gated,
                   "OUT_F32": 0}
        assert _advisories(defines, fp4_moe_wgmma.SOURCE) == []


def test_advisories_script_lists_the_launchers_plans():
    """scripts/wgmma_advisories.py: one plan a label, each a build the launchers pick; its verdict on the sparse
    attention's default build is a register count and no advisory (the test above's build)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "wgmma_advisories.py"
    spec = importlib.util.spec_from_file_location("wgmma_advisories", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    plans = script.plans()
    labels = [label for label, _, _ in plans]
    assert len(labels) == len(set(labels)) >= 12
    assert {"fp4_moe_wgmma many w13", "sparse_attn_wgmma default"} <= set(labels)
    need_nvrtc()
    used, advisories = script.verdict(sparse_attn_wgmma.SOURCE, sparse_attn_wgmma.defines())
    assert "registers" in used and advisories == []
