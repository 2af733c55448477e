"""Op `topk_positions(scores [R, E], k) -> int64 [R, min(k, E)]`: each row's stable top-k in position order,
the CUDA twin of `torch_ops.topk_positions` (= `stable_topk(scores, k).sort().values`); and op
`stable_topk(scores, k)`: the same picks in score order (descending, ties toward the lower position), the CUDA
twin of `torch_ops.stable_topk` (a stable sort of the whole row, then its first k).

Why: V4.1 attends its compressed picks in position order (`V41Attention._select`, the decode path's
`_select`) and keeps candidate blocks as a mask, so it never needs the picks in score order. The twin sorts
every row twice on the GPU (a stable radix sort of the scores, then one of the k picks): at batch 1 those
sorts were ~117 us of a 1.9 ms V4.1-Flash slice step (H100, 2026-12-06). A selection needs no sort:
* the scores' bf16 bits become 16-bit keys ordered as torch orders the values (-0.0 equal to +0.0, NaN above
  +inf, every NaN equal);
* two histogram passes find the k-th largest key: its high byte from the 256 high-byte counts, then its low
  byte from the counts of the keys sharing that high byte (`_kth_bin`);
* a last pass keeps, in position order, every key above that threshold and the first (k - those) keys equal
  to it: the stable sort's tie rule (ties toward the lower position) gives exactly these.
One program per row streams the row three times in BLOCK chunks (any E; at decode the row is a few KB, L2).
Only bf16 rows run here (the indexer's scores); other dtypes go to the twin.
`stable_topk` (V4's index rows, which its attention walks in score order, so the order is in the output's
last bits) runs the same three passes, then reads its k picks back and orders them by one bitonic sort of
64-bit keys (the 16-bit value key above the position's complement: larger values first, equal values by
the lower position first), the order torch's stable descending sort gives them. At decode this replaces a
radix sort of the whole row and its key and index kernels (2026-12-07: ~3-5 us of each indexer layer's
b1 critical path on the H100, the thirty-fourth session's timeline).
Must not: reorder ties differently from `torch_ops.stable_topk` (the index order is visible in attention's
last bits), import the model.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.kernels import torch_ops
from deepinfer.kernels.triton.launch import fast_launch
from deepinfer.kernels.triton.pdl import pdl_enter

BLOCK = 1024  # keys per chunk of a pass


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _order_keys(x):
    """bf16 values -> int32 keys in [0, 65536), ordered as torch.sort orders the values: -0.0 == +0.0, every
    NaN equal and above +inf. Positive bit patterns get the top bit set; negative ones are complemented."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 sorts as +0.0
    bits = tl.where(x != x, 0x7FC0, bits)  # NaN: one value, above +inf (0x7F80)
    return tl.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000)


@triton.jit
def _kth_bin(hist, k, bins):
    """hist [256] counts of one byte of the keys -> (b, above): b = the byte of the k-th largest key (the
    largest b whose keys at or above it number >= k), above = how many keys lie in bins above b."""
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_or_above >= k, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    return b, above


@triton.jit
def _select_in_position_order(src, dst, E, k, BLOCK: tl.constexpr):
    """Row src's k largest keys (ties toward the lower position) -> their positions at dst[0:k], ascending."""
    bins = tl.arange(0, 256)
    hist = tl.zeros((256,), tl.int32)
    for start in range(0, E, BLOCK):  # pass 1: the high bytes
        offs = start + tl.arange(0, BLOCK)
        inside = offs < E
        key = _order_keys(tl.load(src + offs, mask=inside, other=0.0))
        hist += tl.histogram(key >> 8, 256, mask=inside)
    hi, above_hi = _kth_bin(hist, k, bins)
    hist = tl.zeros((256,), tl.int32)
    for start in range(0, E, BLOCK):  # pass 2: the low bytes of the keys in the threshold's high byte
        offs = start + tl.arange(0, BLOCK)
        inside = offs < E
        key = _order_keys(tl.load(src + offs, mask=inside, other=0.0))
        hist += tl.histogram(key & 0xFF, 256, mask=inside & ((key >> 8) == hi))
    lo, above_lo = _kth_bin(hist, k - above_hi, bins)
    threshold = hi * 256 + lo
    ties = k - above_hi - above_lo  # keys equal to the threshold that are kept: the first `ties` of them
    taken = 0
    seen = 0
    for start in range(0, E, BLOCK):  # pass 3: the picks in position order
        offs = start + tl.arange(0, BLOCK)
        inside = offs < E
        key = _order_keys(tl.load(src + offs, mask=inside, other=0.0))
        eq = (inside & (key == threshold)).to(tl.int32)
        tie_rank = seen + tl.cumsum(eq, axis=0) - eq
        keep = (inside & (key > threshold)) | ((eq == 1) & (tie_rank < ties))
        kept = keep.to(tl.int32)
        slot = taken + tl.cumsum(kept, axis=0) - kept
        tl.store(dst + slot, offs.to(tl.int64), mask=keep)
        taken += tl.sum(kept, axis=0)
        seen += tl.sum(eq, axis=0)


@fast_launch
@triton.jit
def _topk_positions_kernel(s_ptr, out_ptr, E, k, stride_s, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    _select_in_position_order(s_ptr + row * stride_s, out_ptr + row * stride_o, E, k, BLOCK)


POSITION_MASK = 0x7FFFFFFF  # a position's complement in the sort key's low 32 bits (positions < 2^31)
STABLE_TOPK_MAX_K = 4096  # the picks' sort holds its keys in one program's registers; larger k: the twin
STABLE_TOPK_MAX_ROWS = 256  # decode-sized calls (one row a sequence: timed at b1 / b32 on the H100); a prefill's
# thousands of rows keep the twin's sort until the kernel is timed there (pending_device_runs.sh s46c).
# DEEPINFER_STABLE_TOPK=torch: the twin always; =kernel: the kernel at any row count (A/B runs)


def _use_stable_topk_kernel(rows: int, k: int) -> bool:
    mode = os.environ.get("DEEPINFER_STABLE_TOPK", "auto")
    if mode == "torch" or k > STABLE_TOPK_MAX_K:
        return False
    return mode == "kernel" or rows <= STABLE_TOPK_MAX_ROWS


@triton.jit
def _stable_picks(src, dst, E, k, BLOCK: tl.constexpr, KP: tl.constexpr):
    """`_select_in_position_order` into dst (scratch), then the k picks read back (this program wrote them: the
    barrier makes its threads' stores visible to each other) and sorted by (value key descending, position
    ascending) -> (positions [KP] in that order, valid [KP]). The caller's stores to dst must follow a barrier
    (every thread has read its picks before any is overwritten)."""
    _select_in_position_order(src, dst, E, k, BLOCK)
    tl.debug_barrier()
    i = tl.arange(0, KP)
    valid = i < k
    pos = tl.load(dst + i, mask=valid, other=0)
    key = _order_keys(tl.load(src + pos, mask=valid, other=0.0)).to(tl.int64)
    packed = tl.where(valid, (key << 32) | (0x7FFFFFFF - pos), -1)  # -1: below every pick
    return 0x7FFFFFFF - (tl.sort(packed, descending=True) & 0xFFFFFFFF), valid


@fast_launch
@triton.jit
def _stable_topk_kernel(s_ptr, out_ptr, E, k, stride_s, stride_o, BLOCK: tl.constexpr, KP: tl.constexpr,
                        PDL: tl.constexpr = False):
    """`_stable_picks` of a row, stored as they come."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    dst = out_ptr + row * stride_o
    top, valid = _stable_picks(s_ptr + row * stride_s, dst, E, k, BLOCK, KP)
    tl.debug_barrier()  # every thread has read its picks before any is overwritten
    tl.store(dst + tl.arange(0, KP), top, mask=valid)


@fast_launch
@triton.jit
def _stable_topk_rows_kernel(s_ptr, win_ptr, vis_ptr, entry_ptr, out_ptr, E, k, W, n_ring, stride_s, stride_w,
                             stride_e, stride_o, BLOCK: tl.constexpr, KP: tl.constexpr, WP: tl.constexpr,
                             PDL: tl.constexpr = False):
    """`_stable_topk_kernel` whose sorted picks become the attention's index rows in place
    (`decode_rows._select_rows_kernel`'s mapping): out[b] = the row's W window rows, then per pick top (in
    stable descending order) entry_rows[b, top] + n_ring, or -1 at or past visible[b]. The picks are selected
    into the row's tail out[b, W:] (scratch until the mapped rows overwrite them)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    out = out_ptr + row * stride_o
    dst = out + W
    top, valid = _stable_picks(s_ptr + row * stride_s, dst, E, k, BLOCK, KP)
    hid = top >= tl.load(vis_ptr + row)
    chosen = tl.load(entry_ptr + row * stride_e + tl.where(hid, 0, top), mask=valid, other=0)
    tl.debug_barrier()  # every thread has read its picks before any is overwritten
    tl.store(dst + tl.arange(0, KP), tl.where(hid, -1, chosen + n_ring), mask=valid)
    j = tl.arange(0, WP)
    ok = j < W
    tl.store(out + j, tl.load(win_ptr + row * stride_w + j, mask=ok, other=0), mask=ok)


def _per_row(op: str, scores: torch.Tensor, k: int, kernel_takes, launch) -> torch.Tensor | None:
    """Both ops' shared launcher: scores [..., E] -> int64 [..., min(k, E)] by `launch(rows, out, E, k)` (one
    program a row), or None where the twin must answer: not bf16, not on CUDA (or the interpreter), a 0-d
    tensor, or `kernel_takes(rows, min(k, E))` says no."""
    if k < 0:
        raise ValueError(f"{op}: k must be >= 0, got {k}")
    on_device = scores.is_cuda or _interpreting()
    if scores.dtype != torch.bfloat16 or not on_device or scores.dim() == 0:
        return None
    E = scores.shape[-1]
    k = min(k, E)
    if not kernel_takes(scores.numel() // max(1, E), k):
        return None
    if k == 0 or scores.numel() == 0:  # no entries yet (a sequence shorter than its ratio) or no rows
        return torch.empty((*scores.shape[:-1], k), dtype=torch.int64, device=scores.device)
    rows = scores.reshape(-1, E)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], k), dtype=torch.int64, device=scores.device)
    launch(rows, out, E, k)
    return out.view(*scores.shape[:-1], k)


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., E] -> int64 [..., min(k, E)]: the positions of each row's k largest (ties toward the lower
    position, NaN largest) in ascending order. bf16 CUDA rows run the kernel, the rest the twin."""
    def launch(rows, out, E, k):
        _topk_positions_kernel[(rows.shape[0],)](rows, out, E, k, rows.stride(0), out.stride(0), BLOCK=BLOCK,
                                                 num_warps=4)

    got = _per_row("topk_positions", scores, k, lambda rows, k: True, launch)
    return torch_ops.topk_positions(scores, k) if got is None else got


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., E] -> int64 [..., min(k, E)]: the positions of each row's k largest in descending order
    of value, equal values toward the lower position (NaN largest, -0.0 == +0.0): `torch_ops.stable_topk`'s
    indices. bf16 CUDA rows run the kernel (up to STABLE_TOPK_MAX_ROWS rows a call unless
    DEEPINFER_STABLE_TOPK says otherwise; E < 2^31), the rest the twin."""
    def launch(rows, out, E, k):
        _stable_topk_kernel[(rows.shape[0],)](rows, out, E, k, rows.stride(0), out.stride(0), BLOCK=BLOCK,
                                              KP=max(2, triton.next_power_of_2(k)), num_warps=4)

    got = _per_row("stable_topk", scores, k, lambda rows, kk: scores.shape[-1] <= POSITION_MASK
                   and _use_stable_topk_kernel(rows, kk), launch)
    return torch_ops.stable_topk(scores, k) if got is None else got


def stable_topk_rows(scores: torch.Tensor, k: int, window_rows: torch.Tensor, visible: torch.Tensor,
                     entry_rows: torch.Tensor, n_ring: int) -> torch.Tensor:
    """Same contract as `kernels.decode_rows.stable_topk_rows_torch` (scores [B, E]; int64 rows). With
    DEEPINFER_TOPK_ROWS=fused, where `stable_topk`'s kernel takes the call and the rows are int64 with unit
    column strides: one launch (`_stable_topk_rows_kernel`), where `stable_topk` and `decode_select_rows` were two
    on an indexer layer's selection lane (the default); else those two ops (DEEPINFER_TOPK_ROWS=apart)."""
    from deepinfer import kernels
    from deepinfer.env import topk_rows_fused

    B = scores.shape[0] if scores.dim() == 2 else -1
    E = scores.shape[-1] if scores.dim() else 0
    kk = min(k, E)
    fused = (topk_rows_fused() and scores.dim() == 2 and scores.dtype == torch.bfloat16
             and (scores.is_cuda or _interpreting()) and 0 < kk and E <= POSITION_MASK
             and _use_stable_topk_kernel(B, kk) and entry_rows.shape[1] >= 1
             and all(t.dtype == torch.int64 and t.shape[0] == B for t in (window_rows, visible, entry_rows))
             and window_rows.dim() == 2 and entry_rows.dim() == 2 and visible.dim() == 1
             and (window_rows.shape[1] <= 1 or window_rows.stride(1) == 1)
             and (entry_rows.shape[1] <= 1 or entry_rows.stride(1) == 1))
    dev = scores.device.type if not _interpreting() else "cuda"
    if not fused:
        top = kernels.get("stable_topk", dev)(scores, k)
        return kernels.get("decode_select_rows", dev)(window_rows, top, visible, entry_rows, n_ring)
    W = window_rows.shape[1]  # (a negative k took the two ops above, which name it)
    rows = scores if scores.stride(-1) == 1 else scores.contiguous()
    out = torch.empty(B, W + kk, dtype=torch.int64, device=scores.device)
    if B:
        _stable_topk_rows_kernel[(B,)](rows, window_rows, visible.contiguous(), entry_rows, out, E, kk, W,
                                       int(n_ring), rows.stride(0), window_rows.stride(0), entry_rows.stride(0),
                                       out.stride(0), BLOCK=BLOCK, KP=max(2, triton.next_power_of_2(kk)),
                                       WP=max(2, triton.next_power_of_2(W)), num_warps=4)
    return out


REGISTRATIONS = {"topk_positions": topk_positions, "stable_topk": stable_topk, "stable_topk_rows": stable_topk_rows}
