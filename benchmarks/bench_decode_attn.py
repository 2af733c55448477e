"""The batched decode step's sparse attention at V4-Flash dims (64 heads, d=512, v4_fp8_ds_mla entries of
584 B, a 128-entry window ring per sequence plus K selected compressed entries): the paged op
(`sparse_attn_sink_paged`: one kernel reading the packed entries) against what the step ran before it
(gather the ring rows, decode, gather the compressed rows, decode, concatenate, the pool kernel), both
replayed from CUDA graphs; plus the paged kernel's launch knobs and its index-row splits (`chunk`: index
columns per program, 0 = none; the default is `split_plan`; H=8 is a rank of 8-way tensor parallelism). Bytes = the packed entries the index rows
name (what the attention must read at least), against the copy rate measured in the same run.

    PYTHONPATH=$PWD python benchmarks/bench_decode_attn.py     # writes $OUT/decode_attn.json
    PYTHONPATH=$PWD python benchmarks/bench_decode_attn.py --combine   # the split combine's heads per program
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.cache.layouts import get_layout  # noqa: E402
from deepinfer.kernels.triton.kv_pack import kv_decode  # noqa: E402
from deepinfer.kernels.triton.sparse_attn import sparse_attn_sink_triton  # noqa: E402
from deepinfer.kernels.triton.sparse_attn_paged import sparse_attn_sink_paged_triton  # noqa: E402
import ceilings  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

D, WIN = 512, 128
KNOBS = [dict(chunk=0), dict(), dict(chunk=64), dict(chunk=128), dict(chunk=256), dict(block_h=64, chunk=128)]


def case(B: int, k_sel: int, g: torch.Generator, H: int):
    layout = get_layout("v4_fp8_ds_mla", SimpleNamespace(head_dim=D, rope_head_dim=64, index_head_dim=128))
    slots, n_comp = B + 1, max(4 * k_sel * B, 1024)
    ring = layout.store((torch.randn(slots * WIN, D, device="cuda", generator=g) * 2).bfloat16()).view(slots, WIN, -1)
    comp = layout.store((torch.randn(n_comp, D, device="cuda", generator=g) * 2).bfloat16())
    slot = torch.randperm(slots, device="cuda", generator=g)[:B]
    chosen = torch.randint(0, n_comp, (B, k_sel), device="cuda", generator=g)
    win_rows = slot.unsqueeze(1) * WIN + torch.arange(WIN, device="cuda")
    idx = torch.cat([win_rows, slots * WIN + chosen], dim=1).int()
    pool_idx = torch.arange(B * (WIN + k_sel), device="cuda", dtype=torch.int32).view(B, -1)
    q = torch.randn(B, H, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)

    def before():  # the decode step up to 2026-12-02: gathers, two decode passes, the concatenation, the pool
        pool = torch.cat([kv_decode(layout, ring[slot]), kv_decode(layout, comp[chosen])], dim=1).flatten(0, 1)
        return sparse_attn_sink_triton(q, pool, sink, pool_idx, D**-0.5)

    def paged(**knobs):
        return sparse_attn_sink_paged_triton(q, ring, comp, layout, sink, idx, D**-0.5, **knobs)

    nbytes = B * (WIN + k_sel) * layout.bytes_per_token + 2 * q.numel() * 2
    return before, paged, nbytes


def combine_rows() -> None:
    """The default split plan's attention + combine at small batches with the combine's heads per program
    forced to 8 / 4 / 2 (`sparse_attn_paged.combine_heads`; the same bits whatever the count)."""
    import deepinfer.kernels.triton.sparse_attn_paged as sap

    chosen = sap.combine_heads
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (1, 4, 8, 16, 32):
        _, paged, _ = case(B, 512, g, 64)
        cells = []
        for bh in (8, 4, 2, None):
            sap.combine_heads = chosen if bh is None else (lambda T, H, bh=bh: bh)
            cells.append(f"{'default ' + str(chosen(B, 64)) if bh is None else bh}: "
                         f"{graph_replay_ms(paged) * 1e3:6.1f} us")
        sap.combine_heads = chosen
        print(f"H=64 B={B:3d} K={WIN + 512}: attention + combine, heads per combine program " + ", ".join(cells))


def main() -> None:
    if "--combine" in sys.argv[1:]:
        combine_rows()
        return
    ceiling = ceilings.copy_bandwidth_gbs()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, lines = [], [f"copy ceiling {ceiling:.0f} GB/s"]
    shapes = [(64, B, k) for B in (1, 4, 8, 16, 32, 64, 128) for k in (64, 512, 1024)]
    shapes += [(8, B, k) for B in (1, 8, 32, 64, 128) for k in (512, 1024)]
    for H, B, k_sel in shapes:
        before, paged, nbytes = case(B, k_sel, g, H)
        ref = before()
        entries = [("before: gather+decode+cat+pool", graph_replay_ms(before), 0.0)]
        for knobs in KNOBS:
            try:
                got = paged(**knobs)
            except Exception as err:  # e.g. out of shared memory for a knob set: print, keep going
                lines.append(f"H={H} B={B} K={k_sel} {knobs}: {type(err).__name__}: {str(err)[:120]}")
                continue
            rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            entries.append((f"paged {knobs or 'default'}", graph_replay_ms(lambda: paged(**knobs)), rel))
        for label, ms, rel in entries:
            gbs = nbytes / ms / 1e6
            lines.append(f"H={H:2d} B={B:4d} K={WIN + k_sel:4d} {label:42s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
                         f"{100 * gbs / ceiling:5.1f}% rel_err vs before {rel:.1e}")
            rows.append(dict(H=H, B=B, K=WIN + k_sel, label=label, us=ms * 1e3, gbs=gbs, rel_err=rel))
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "decode_attn.json"), "w") as f:
            json.dump(dict(ceiling_gbs=ceiling, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
