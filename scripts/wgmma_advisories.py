"""ptxas's verdict on every warpgroup-MMA CUDA kernel's launch plans, read offline (NVRTC, no GPU): registers a
thread, spills, and the "Potential Performance Loss" advisories (C7511-C7515: wgmma.mma_async serialized, each
waiting for the one before). The sparse attention ran serialized for a session before its advisory was read
(2026-12-07); this lists the plans the launchers actually pick, so a change that serializes one shows up here.

    python scripts/wgmma_advisories.py            # every kernel's plans
    python scripts/wgmma_advisories.py fp4_moe    # the kernels whose name contains this

Plans: the prefill experts' two regimes (fp4_moe.WGMMA_TILES / _FEW, gated and plain), the decode linears'
wgmma form at each token tile for a wide (wq_b-like) and an ordinary weight, the prefill FP8 linear's
default, and the sparse attention's default build. (As of 2026-12-07 the experts' and the wide linear's
plans are serialized: see BENCHMARKS.md, "thirty-seventh session", for why that did not bound them.)
"""
from __future__ import annotations

import sys

from deepinfer.kernels.cuda import fp4_moe_wgmma, fp8_linear_prefill, fp8_linear_wgmma, runtime, sparse_attn_wgmma


def plans() -> list[tuple[str, str, dict]]:
    """(label, source, compile-time defines) of each plan the launchers pick."""
    from deepinfer.kernels.triton.fp4_moe import WGMMA_TILES, WGMMA_TILES_FEW

    out = []
    for regime, tiles in (("many", WGMMA_TILES), ("few", WGMMA_TILES_FEW)):
        for gated in (1, 0):
            out.append((f"fp4_moe_wgmma {regime} {'w13' if gated else 'w2'}", fp4_moe_wgmma.SOURCE,
                        {**fp4_moe_wgmma.tiles(tiles), "GATED": gated, "OUT_F32": 0}))
    for shape, (n, k) in (("wide 32768x1024", (32768, 1024)), ("4096x4096", (4096, 4096))):
        for m in (16, 32, 64, 128):
            out.append((f"fp8_linear_wgmma {shape} M={m}", fp8_linear_wgmma.SOURCE,
                        {**fp8_linear_wgmma.tiles(m, None, n, k), "SPLIT_OUT": 0}))
    out.append(("fp8_linear_prefill default", fp8_linear_prefill.SOURCE, fp8_linear_prefill.tiles()))
    out.append(("sparse_attn_wgmma default", sparse_attn_wgmma.SOURCE, sparse_attn_wgmma.defines()))
    return out


def verdict(source: str, defines: dict) -> tuple[str, list[str]]:
    """ptxas's register line and its performance advisories for one build, without the "ptxas info :" prefix."""
    options = tuple(f"-D{k}={v}" for k, v in defines.items())
    used, advisories = runtime.ptxas_report(runtime.read_source(source), source, "sm_90a", options)
    return used.split(": ", 1)[-1], [line.split(": ", 1)[-1] for line in advisories]


def main() -> None:
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    for label, source, defines in plans():
        if want not in label:
            continue
        used, advisories = verdict(source, defines)
        print(f"{label:<40} {used}")
        for line in advisories:
            print(f"    {line}")


if __name__ == "__main__":
    main()
