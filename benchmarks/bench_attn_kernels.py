"""Timing of the attention-side Triton kernels on the device machine (H200), printed as one table.

Owns: sparse_attn_sink at decode (T = 1, 32, 128) and prefill (T = 8192) on the real shape (H=64 heads per
rank, d=512, K=640 = window 128 + top-512), each head-block width, against the minimum bytes it must move
(q + every gathered kv row + out) and its MMA flops (QK and PV: 4*T*H*K*d); plus hc_pre_fused, rope32 and the
indexer at a prefill and a decode shape, and the batched decode's indexer scores from the packed FP4 cache
(fused vs gather + decode + torch). Gathered rows come from a 1M-row pool at random, and each timed call
cycles through enough index sets to outrun the 50 MB L2, so the numbers are HBM numbers, not cache numbers.
Plus a sweep of hc_pre's mix kernel launch plans (`norm_hc.mix_plan`) at T = 1, 128, 8192
(`--hc-mix` and `--indexer-paged` run only that part).
Must not: be imported by the package (a script: `python benchmarks/bench_attn_kernels.py`).
"""
from __future__ import annotations

import inspect
import itertools
import math
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepinfer.kernels import official, official_fused, torch_ops  # noqa: E402
from deepinfer.kernels.triton import compress_pool, indexer, kv_pack, norm_hc, rope, sparse_attn  # noqa: E402
from timing import graph_replay_ms  # noqa: E402

L2_BYTES = 50 * 2**20


def bench(fn, rep_ms: int = 200) -> float:
    """Median milliseconds (CUDA events) after warm-up."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def rows_for(label: str, ms: float, nbytes: float, flops: float) -> str:
    return f"{label:<48} {ms * 1e3:10.1f} us {nbytes / ms / 1e6:9.0f} GB/s {flops / ms / 1e9:8.1f} TFLOP/s"


def bench_sparse_attn(lines: list[str]) -> None:
    H, d, K, N = 64, 512, 640, 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(N, d, generator=g, device="cuda").bfloat16()
    sink = torch.randn(H, generator=g, device="cuda")
    for T in (1, 32, 128, 8192):
        q = torch.randn(T, H, d, generator=g, device="cuda").bfloat16()
        per_call = T * K * d * 2 + 2 * T * H * d * 2 + T * K * 4
        n_sets = max(2, min(64, math.ceil(4 * L2_BYTES / per_call)))
        idx_sets = [torch.randint(0, N, (T, K), generator=g, device="cuda", dtype=torch.int32) for _ in range(n_sets)]
        flops = 4 * T * H * K * d
        auto = sparse_attn._block_h(T, H)
        # (block_h, num_warps, num_stages); None = the launcher's default
        configs = [(None, None, 2), (16 if auto == 64 else 64, None, 2)]
        configs += [(auto, w, st) for w, st in ((4 if auto == 16 else 8, 1), (4 if auto == 16 else 8, 3),
                                                 (8 if auto == 16 else 16, 2))]
        for bh, w, st in configs:
            it = itertools.cycle(idx_sets)
            ms = bench(lambda: sparse_attn.sparse_attn_sink_triton(q, kv, sink, next(it), d**-0.5, block_h=bh,
                                                                   num_warps=w, num_stages=st))
            label = "default" if bh is None else f"bh={bh} warps={w} stages={st}"
            lines.append(rows_for(f"sparse_attn T={T} K={K} {label}", ms, per_call, flops))
        if T <= 32:  # the torch twin, for scale
            it = itertools.cycle(idx_sets)
            ms = bench(lambda: official.sparse_attn_sink_official(q, kv, sink, next(it), d**-0.5), rep_ms=100)
            lines.append(rows_for(f"  torch official twin T={T}", ms, per_call, flops))


def bench_others(lines: list[str]) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    D, hc = 4096, 4
    for T in (1, 8192):
        x = torch.randn(T, hc, D, generator=g, device="cuda").bfloat16()
        fn = torch.randn(24, hc * D, generator=g, device="cuda") * 0.01
        scale, base = torch.rand(3, device="cuda"), torch.randn(24, device="cuda")
        nw = torch.rand(D, device="cuda")
        args = (x, fn, scale, base, nw, hc, 20, 1e-6, 1e-6)
        nbytes = x.numel() * 2 + fn.numel() * 4 + T * D * 2
        lines.append(rows_for(f"hc_pre_fused T={T} D={D}", bench(lambda: norm_hc.hc_pre_fused(*args)), nbytes,
                              2 * T * 24 * hc * D))
        lines.append(rows_for(f"  torch twin T={T}", bench(lambda: official_fused.hc_pre_fused(*args)), nbytes,
                              2 * T * 24 * hc * D))
        f = torch.randn(T, D, generator=g, device="cuda").bfloat16()
        post, comb = torch.rand(T, hc, device="cuda"), torch.rand(T, hc, hc, device="cuda")
        nbytes = (T * D + 2 * T * hc * D) * 2
        lines.append(rows_for(f"hc_post_fused T={T} D={D}", bench(lambda: norm_hc.hc_post_fused(f, x, post, comb)),
                              nbytes, 0))
    freqs = official.rope_freqs32(64, 65536, 160000.0, 16.0, 32, 1).cuda()
    for T in (1, 8192):
        q = torch.randn(T, 64, 512, generator=g, device="cuda").bfloat16()
        pos = torch.arange(T, device="cuda")
        lines.append(rows_for(f"rope32 q T={T} [64,512]", bench(lambda: rope.rope32(q, pos, freqs)), 2 * q.numel() * 2, 0))
        lines.append(rows_for(f"  torch twin T={T}", bench(lambda: official.rope32(q, pos, freqs)), 2 * q.numel() * 2, 0))


def bench_indexer(lines: list[str]) -> None:
    """The prefill / extend indexer scores (`indexer_scores_bf16`) without and with a prefill's visible counts,
    and the stable top-k after them."""
    g = torch.Generator(device="cuda").manual_seed(2)
    for T, E in ((1, 65536), (32, 65536), (8192, 2048)):
        q = torch.randn(T, 64, 128, generator=g, device="cuda").bfloat16()
        w = torch.randn(T, 64, generator=g, device="cuda").bfloat16()
        keys = torch.randn(E, 128, generator=g, device="cuda").bfloat16()
        nbytes = q.numel() * 2 + keys.numel() * 2 + T * E * 2
        flops = 2 * T * 64 * E * 128
        lines.append(rows_for(f"indexer_scores T={T} E={E}", bench(lambda: indexer.indexer_scores_bf16(q, w, keys)),
                              nbytes, flops))
        # a prefill's causal counts (ratio 4: token t sees (t + 1) // 4 entries; FLOPs of the visible entries),
        # where the op takes them (not the kernel before 2026-12-06, which this script also times)
        if T > 1 and "visible" in inspect.signature(indexer.indexer_scores_bf16).parameters:
            vis = (torch.arange(T, device="cuda") + 1) // 4 if T >= 4 * E else torch.randint(0, E + 1, (T,), device="cuda")
            lines.append(rows_for(f"indexer_scores T={T} E={E} visible", bench(
                lambda: indexer.indexer_scores_bf16(q, w, keys, vis)), nbytes, 2 * int(vis.sum()) * 64 * 128))
        s = indexer.indexer_scores_bf16(q, w, keys)
        k = min(512, E)
        lines.append(rows_for(f"  stable_topk (torch stable sort) k={k}", bench(lambda: torch_ops.stable_topk(s, k)),
                              s.numel() * 2, 0))


# hc_pre's mix kernel plans to sweep per T (None = mix_plan's default; keys as mix_plan's config)
HC_MIX_CONFIGS = {
    1: [None, dict(SPLITS=64), dict(SPLITS=128), dict(SPLITS=64, BLOCK_K=64), dict(SPLITS=128, BLOCK_K=64),
        dict(SPLITS=256, BLOCK_K=64), dict(SPLITS=128, num_warps=2)],
    8: [None, dict(SPLITS=64), dict(SPLITS=128), dict(SPLITS=128, BLOCK_K=64)],
    128: [None, dict(SPLITS=64), dict(SPLITS=128), dict(BLOCK_T=32, SPLITS=64)],
    8192: [None, dict(SPLITS=8), dict(num_stages=3)],
}


def bench_hc_mix(lines: list[str]) -> None:
    """hc_pre's mix kernel alone (`norm_hc.hc_mix_partials`) and the whole op under each plan of
    HC_MIX_CONFIGS, D=4096 (x [T, 16384] bf16, fn [24, 16384] fp32 = 1.5 MB). Each row is the median of
    graph replays of `calls` back-to-back calls (no Python launch gaps) over as many fn copies, enough to
    outrun the L2 where one fn would stay in it (a decode step reads each layer's fn once); x stays (it was
    just written by the previous layer, except at 8192 tokens, 268 MB). Bytes: x + fn + partials written."""
    g = torch.Generator(device="cuda").manual_seed(3)
    D, hc = 4096, 4
    for T, configs in HC_MIX_CONFIGS.items():
        x = torch.randn(T, hc, D, generator=g, device="cuda").bfloat16()
        x2 = x.view(T, hc * D)
        calls = 1 if x.numel() * 2 > 2 * L2_BYTES else 64
        fns = [torch.randn(24, hc * D, generator=g, device="cuda") * 0.01 for _ in range(calls)]
        scale, base = torch.rand(3, device="cuda"), torch.randn(24, device="cuda")
        nw = torch.rand(D, device="cuda")
        for config in configs:
            plan = norm_hc.mix_plan(T, hc * D, config)
            nbytes = x.numel() * 2 + fns[0].numel() * 4 + plan["SPLITS"] * T * 25 * 4
            ms = graph_replay_ms(lambda: [norm_hc.hc_mix_partials(x2, f, plan) for f in fns]) / calls
            whole = graph_replay_ms(lambda: [norm_hc.hc_pre_fused(x, f, scale, base, nw, hc, 20, 1e-6, 1e-6,
                                                                  config=config) for f in fns]) / calls
            shown = {k: v for k, v in plan.items() if k != "K_CHUNK"}
            lines.append(rows_for(f"hc_mix T={T} {'default' if config is None else 'config'}", ms, nbytes,
                                  2 * T * 24 * hc * D) + f"  whole op {whole * 1e3:8.1f} us  {shown}")


def bench_cache_side(lines: list[str]) -> None:
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout

    g = torch.Generator(device="cuda").manual_seed(2)
    layout = get_layout("v4_fp8_ds_mla", SimpleNamespace(head_dim=512, rope_head_dim=64, index_head_dim=128))
    for T in (1, 8192):
        x = torch.randn(T, 512, generator=g, device="cuda").bfloat16()
        packed = layout.store(x)
        nbytes = T * (1024 + layout.bytes_per_token)
        lines.append(rows_for(f"kv_encode v4_fp8_ds_mla T={T}", bench(lambda: kv_pack.kv_encode(layout, x)), nbytes, 0))
        lines.append(rows_for("  torch layout.store", bench(lambda: layout.store(x)), nbytes, 0))
        lines.append(rows_for(f"kv_decode v4_fp8_ds_mla T={T}", bench(lambda: kv_pack.kv_decode(layout, packed)),
                              nbytes, 0))
        lines.append(rows_for("  torch layout.load", bench(lambda: layout.load(packed)), nbytes, 0))
    for n, r, w, ov in ((2048, 4, 512, True), (64, 128, 512, False)):
        c = 2 if ov else 1
        kv = torch.randn(n + ov, r, c * w, generator=g, device="cuda")
        sc = torch.randn(n + ov, r, c * w, generator=g, device="cuda")
        nbytes = 2 * kv.numel() * 4 + n * w * 4
        lines.append(rows_for(f"compress_pool n={n} r={r}", bench(lambda: compress_pool.compress_pool(kv, sc, ov)),
                              nbytes, 0))
        lines.append(rows_for("  torch twin", bench(lambda: torch_ops.compress_pool(kv, sc, ov)), nbytes, 0))


def bench_indexer_paged(lines: list[str]) -> None:
    """The batched decode step's indexer scores on the real shape (h=64, d=128, v4_index_fp4: 68 bytes an entry):
    the fused `indexer_scores_paged_bf16` against the composition it replaces (gather, kv_decode, the torch
    `indexer_scores_batched_bf16`, mask). GB/s counts the packed bytes the entries occupy (B * E * 68), read once.
    Every entry visible (the fused op skips hidden entries' bytes, so a bucket of short sequences is cheaper);
    rows paged as the cache lays them out (32 entries of a 128-token block contiguous, blocks at random)."""
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout

    g = torch.Generator(device="cuda").manual_seed(3)
    layout = get_layout("v4_index_fp4", SimpleNamespace(head_dim=512, rope_head_dim=64, index_head_dim=128))
    h, d, epb, n_blocks = 64, 128, 32, 1 << 17  # a pool of 4M entries (272 MB)
    store = layout.store(torch.randn(n_blocks * epb, d, generator=g, device="cuda"))
    for B in (1, 32, 128):
        q = torch.randn(B, h, d, generator=g, device="cuda").bfloat16()
        w = (torch.randn(B, h, generator=g, device="cuda") * 0.1).bfloat16()
        for E in (64, 1024, 16384):
            nbytes = B * E * layout.bytes_per_token
            n_sets = max(2, min(64, math.ceil(4 * L2_BYTES / nbytes)))
            j = torch.arange(E, device="cuda")
            n_tab = -(-E // epb)  # blocks per sequence
            tables = [torch.randint(0, n_blocks, (B, n_tab), generator=g, device="cuda") for _ in range(n_sets)]
            row_sets = [t[:, j // epb] * epb + j % epb for t in tables]
            hidden = torch.zeros(B, E, dtype=torch.bool, device="cuda")
            flops = 2 * B * h * E * d
            it = itertools.cycle(row_sets)
            ms = bench(lambda: indexer.indexer_scores_paged_bf16(q, w, store, next(it), hidden, layout))
            lines.append(rows_for(f"indexer_scores_paged B={B} E={E}", ms, nbytes, flops))

            def composed(rows):
                keys = kv_pack.kv_decode(layout, store[rows])
                return official.indexer_scores_batched_bf16(q, w, keys).masked_fill(hidden, float("-inf"))

            it = itertools.cycle(row_sets)
            ms = bench(lambda: composed(next(it)), rep_ms=100)
            lines.append(rows_for("  gather + kv_decode + torch scores", ms, nbytes, flops))


class _PrintingList(list):
    """Prints each row as it is measured, so a failure later in the script loses none of them."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def main() -> None:
    torch.set_num_threads(1)
    lines = _PrintingList()
    lines.append(f"device: {torch.cuda.get_device_name()}")
    only = {a[2:] for a in sys.argv[1:] if a.startswith("--")}  # --hc-mix / --indexer(-paged): those alone
    if not only:
        bench_sparse_attn(lines)
        bench_others(lines)
        bench_cache_side(lines)
    if not only or "indexer" in only:
        bench_indexer(lines)
    if not only or "indexer-paged" in only:
        bench_indexer_paged(lines)
    if not only or "hc-mix" in only:
        bench_hc_mix(lines)


if __name__ == "__main__":
    main()
