"""The flat sparse attention with the sink at prefill shapes: the Triton form (kernels/triton/sparse_attn.py) against
the warpgroup-MMA CUDA form (kernels/cuda/sparse_attn_wgmma.cu), on the device machine.

Index rows as an 8k prefill of V4-Flash's slice builds them (H=64, d=512): the causal window of 128 (valid
positions first, from max(0, t - 127), then -1) over the chunk's own kv rows, then the compressed entries a token
sees: ratio 4, the indexer's top 512 of the (t + 1) // 4 visible ones (all of them, then -1, while fewer are
visible; K = 640); ratio 128, every visible entry ascending (K = 192). Plus a crossover sweep over T at K = 640
with random rows.
Reported: median ms (`do_bench`), the MMA work both forms issue (4 T H K d over the padded K, TFLOP/s), the useful
work (valid indices only), and the bytes gathered (T K d 2, from L2: the pool is ~10 MB). The two forms' outputs
are compared (rel_err), and the CUDA form's serialized build (PIPELINED_QK 0: ptxas issues its S wgmmas one at a time,
advisory C7515) is timed and compared to the default build's bits.
    python benchmarks/bench_sparse_attn_prefill.py [--t 8192] [--sweep 16 32 64 128 256 512 1024]
Must not: be imported by the package.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from deepinfer.kernels.cuda import sparse_attn_wgmma as wg
from deepinfer.kernels.triton import sparse_attn
from deepinfer.kernels.triton.fp8_gemm import sm_count

H, D, WIN, TOPK = 64, 512, 128, 512


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def prefill_rows(T: int, ratio: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """(idx [T, K] int32 into a pool of T window rows + T // ratio compressed rows, pool rows)."""
    dev = "cuda"
    pos = torch.arange(T, device=dev)
    # model/extend_metadata.py's window part: positions from max(0, t - 127) up, -1 past t (valid ones first)
    win = (pos - WIN + 1).clamp(min=0)[:, None] + torch.arange(WIN, device=dev)[None, :]
    win = torch.where(win <= pos[:, None], win, -1)
    n_ent = T // ratio
    visible = (pos + 1) // ratio
    if ratio == 4:
        score = torch.rand(T, n_ent, generator=g, device=dev)
        score = torch.where(torch.arange(n_ent, device=dev)[None, :] < visible[:, None], score, -1.0)
        top = score.topk(min(TOPK, n_ent), dim=1)
        sel = torch.where(top.values >= 0, top.indices, -1)
    else:
        j = torch.arange(n_ent, device=dev)[None, :].expand(T, -1)
        sel = torch.where(j < visible[:, None], j, -1)
    comp = torch.where(sel >= 0, sel + T, -1)
    return torch.cat([win, comp], dim=1).to(torch.int32).contiguous(), T + n_ent


def time_pair(q, kv, sink, idx, label: str) -> str:
    T, K = idx.shape
    scale = D**-0.5
    out_t = torch.empty_like(q)
    out_w = torch.empty_like(q)
    tri = lambda: sparse_attn.sparse_attn_sink_triton(q, kv, sink, idx, scale, out=out_t)  # noqa: E731
    sms = sm_count(q.device)
    def cuda_form(pipelined: bool):
        return lambda: wg.sparse_attn_wgmma(q, kv, sink, idx, scale, float("-inf"), out_w, sms, pipelined=pipelined)

    cud, ser = cuda_form(True), cuda_form(False)
    tri()
    serial = ser().clone()
    same = torch.equal(serial, cud())  # the serialized build against the default: the same bits
    a, b = out_t.double(), out_w.double()
    err = ((a - b).norm() / a.norm()).item()
    ms_t, ms_w, ms_s = bench(tri), bench(cud), bench(ser)
    mma = 4.0 * T * H * K * D
    useful = 4.0 * H * D * (idx >= 0).sum().item()
    gathered = T * K * D * 2
    return (f"{label:<34} triton {ms_t * 1e3:9.1f} us ({mma / ms_t / 1e9:6.1f} TFLOP/s)  wgmma {ms_w * 1e3:9.1f} us "
            f"({mma / ms_w / 1e9:6.1f} TFLOP/s, useful {useful / ms_w / 1e9:6.1f}, "
            f"gathered {gathered / ms_w / 1e6:6.0f}"
            f" GB/s)  x{ms_t / ms_w:4.2f}  rel_err {err:.1e}  serialized build {ms_s * 1e3:9.1f} us "
            f"({mma / ms_s / 1e9:6.1f} TFLOP/s, x{ms_t / ms_s:4.2f}, same bits {same})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--sweep", type=int, nargs="*", default=[16, 32, 64, 128, 256, 512, 1024])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    sink = torch.randn(H, generator=g, device="cuda")
    for ratio in (4, 128):
        idx, n = prefill_rows(args.t, ratio, g)
        q = torch.randn(args.t, H, D, generator=g, device="cuda").bfloat16()
        kv = torch.randn(n, D, generator=g, device="cuda").bfloat16()
        print(time_pair(q, kv, sink, idx, f"prefill T={args.t} ratio {ratio} K={idx.shape[1]}"), flush=True)
    kv = torch.randn(20000, D, generator=g, device="cuda").bfloat16()
    for T in args.sweep:
        q = torch.randn(T, H, D, generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, kv.shape[0], (T, WIN + TOPK), generator=g, device="cuda", dtype=torch.int32)
        print(time_pair(q, kv, sink, idx, f"random rows T={T} K={WIN + TOPK}"), flush=True)


if __name__ == "__main__":
    main()
