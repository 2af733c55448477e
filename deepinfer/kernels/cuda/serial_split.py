"""Serial split-K, the launchers' half (fp8_linear_mma.cu / fp8_linear_wgmma.cu SERIAL_SPLIT): every split CTA
of an output tile writes its fp32 partial to out[z] and counts itself in counters[tile]; the tile's last CTA
adds the partials in the fixed order z = 0, 1, ..., S - 1 into the bf16 output `fin` and puts the counter
back to 0. The same bits as fp32 partials + fp8_gemm._split_sum_kernel, one launch fewer.
Owns the check of (out, fin, counters) that both launchers share; the counters themselves are the weight's
(fp8_gemm.serial_counters). Must not: import triton.
"""
from __future__ import annotations

import torch


def problems(out: torch.Tensor, split: int, fin: torch.Tensor | None, counters: torch.Tensor | None,
             tiles: int) -> list[str]:
    """What is wrong with a serial split launch's fin and counters (empty: nothing; fin None: a launch without
    the serial split, which must pass no counters either). out: the fp32 partials [S, M, N]; tiles: the
    launch's output tiles (one counter each)."""
    if fin is None:
        return ["counters without fin: the serial split needs both"] if counters is not None else []
    found = []
    m, n = out.shape[-2], out.shape[-1]
    if out.dim() != 3 or split < 2:
        found.append(f"fin (the serial split's output) needs fp32 partials out [S >= 2, M, N], got {out.dtype} "
                     f"{tuple(out.shape)}")
    if fin.dtype != torch.bfloat16 or tuple(fin.shape) != (m, n) or fin.stride(-1) != 1:
        found.append(f"fin must be bf16 [{m}, {n}] with unit column stride, got {fin.dtype} {tuple(fin.shape)} "
                     f"strides {fin.stride()}")
    if (counters is None or counters.dtype != torch.int32 or not counters.is_contiguous()
            or counters.numel() < tiles or counters.device != fin.device):
        found.append(f"counters must be contiguous int32 with >= {tiles} entries on {fin.device}, got "
                     + ("None" if counters is None else f"{counters.dtype} {tuple(counters.shape)} on {counters.device}"))
    if fin.device != out.device:
        found.append(f"fin on {fin.device} but out on {out.device}")
    return found
