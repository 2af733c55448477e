"""`compress_decode_step`: one decode token per row through one KV compressor (state scatter, block pooling,
overlap shift, bf16 round, RMSNorm, bf16 round) as one op: the torch twin (`kernels/official_fused.py`,
registered for every device) and the Triton kernel (`kernels/triton/compress_decode.py`, cuda).

CPU: the twin reproduces the torch ops `decode_attention._compress_step` ran before the op existed (copied
below as `_old_step`) bit for bit: states, and the entries of every row that completes its block (rows that
complete nothing: the twin returns 0, the old code returned a pooling of the partial block that was never
stored); both overlap modes, ratios 4 and 128, partially complete batches, batch padding in a shared scratch
slot, slots and positions as strided columns (as `DecodeMetadata` hands them over). The kernel also takes kv
and gate as strided rows (the column halves of the stacked compressor GEMM, `compressor.project`): the
same bits as contiguous inputs, under the interpreter.
CPU under TRITON_INTERPRET=1 (a fresh process, Triton 3.6's interpreter rounding fixed as in
test_kernels_fp8_linear): the kernel == the twin on tiny shapes, states bit for bit (the kernel moves
values and adds ape in fp32: exact), incomplete rows exactly 0, entries within ULPS bf16 ulps (measured: 0).
Why not bit for bit: the pooling's exp and sums are fp32 in another order, and where that flips the bf16
rounding of one pooled value (1 ulp, up to 2^-7 relative) the normed bf16 output moves by up to ~3 of its
own ulps (a different binade).
GPU (-m gpu, fresh random inputs each run, V4-Flash sizes: B in 1, 8, 128; main w 512 and indexer w 128 at
ratio 4 with overlap, main w 512 at ratio 128): states bit for bit vs the twin on cuda; entries within ULPS
bf16 ulps and rel_err <= 1e-3 (1 ulp everywhere would be ~4e-3) of the twin and of the old cuda path (Triton
compress_pool + rms_norm, the same pooling formula); incomplete rows exactly 0; CUDA-graph replay == eager
bit for bit. The -m gpu tests passed on the H200, 2026-12-01.
"""
from __future__ import annotations


import pytest
import torch

from interpreted import assert_ran_ok, run_interpreted
from deepinfer import kernels
from deepinfer.kernels import official_fused, torch_ops

F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-6
ULPS = 3  # bound on any entry, bf16 ulps (see the module docstring)


def _old_step(kv_w, gate_w, ape, state_kv, state_score, xf, slots, pos, complete, norm_w, eps, overlap):
    """decode_attention._compress_step at fa49f0a, up to `entries` (CPU registry = torch_ops)."""
    r = state_kv.shape[1] // (2 if overlap else 1)
    off = r if overlap else 0
    phase = pos % r
    row = phase + off
    kv = xf @ kv_w.T
    score = xf @ gate_w.T + ape[phase]
    state_kv[slots, row] = kv
    state_score[slots, row] = score
    kv_s, sc_s = state_kv[slots], state_score[slots]
    if overlap:
        w = kv_s.shape[-1] // 2
        kv_p = torch.cat([kv_s[:, :r, :w], kv_s[:, r:, w:]], dim=1)
        sc_p = torch.cat([sc_s[:, :r, :w], sc_s[:, r:, w:]], dim=1)
        done = complete.view(-1, 1, 1)
        state_kv[slots, :r] = torch.where(done, kv_s[:, r:], kv_s[:, :r])
        state_score[slots, :r] = torch.where(done, sc_s[:, r:], sc_s[:, :r])
    else:
        kv_p, sc_p = kv_s, sc_s
    pooled = torch_ops.compress_pool(kv_p, sc_p, False).to(BF16).to(F32)
    return torch_ops.rms_norm(pooled, norm_w, eps).to(BF16)


def make_case(B: int, r: int, w: int, overlap: bool, seed: int, device="cpu", n_pad: int = 0, dim: int = 48):
    """Random compressor inputs for B rows (the last n_pad rows: batch padding at position 0 in the scratch
    slot S - 1, identical inputs). About half the real rows complete their block; overlap rows in their
    first block see a fresh previous block (kv 0, score -inf). Slots and positions are strided columns."""
    g = torch.Generator().manual_seed(seed)
    c = 2 if overlap else 1
    n_real = B - n_pad
    S = n_real + 4  # spare slots that no row uses (must stay untouched) + the scratch slot
    state_kv = torch.randn(S, c * r, c * w, generator=g)
    state_score = torch.randn(S, c * r, c * w, generator=g) * 2
    pos = torch.randint(0, 6 * r, (B,), generator=g)
    pos[: n_real: 2] = (pos[: n_real: 2] // r) * r + r - 1  # every other real row completes
    if n_real > 1:
        pos[1] = 2  # a row in its first block (r > 2)
    slots = torch.cat([torch.randperm(S - 1, generator=g)[:n_real], torch.full((n_pad,), S - 1)])
    pos[n_real:] = 0
    if overlap:
        first = (pos < r) & (torch.arange(B) < n_real)
        state_kv[slots[first], :r] = 0.0
        state_score[slots[first], :r] = float("-inf")
    meta = torch.zeros(B, 3, dtype=torch.long)
    meta[:, 0], meta[:, 2] = pos, slots
    xf = torch.randn(B, dim, generator=g)
    if n_pad:
        xf[n_real:] = xf[-1:].clone()  # padding rows: the same token, so their order of writes does not matter
    case = dict(kv_w=torch.randn(c * w, dim, generator=g) / dim**0.5,
                gate_w=torch.randn(c * w, dim, generator=g) * (3 / dim**0.5),
                ape=torch.randn(r, c * w, generator=g), state_kv=state_kv, state_score=state_score, xf=xf,
                meta=meta, norm_w=torch.rand(w, generator=g) + 0.5)
    case = {k: v.to(device) for k, v in case.items()}
    case["pos"], case["slots"] = case["meta"][:, 0], case["meta"][:, 2]
    case["complete"] = (case["pos"] + 1) % r == 0
    case["kv"], case["gate"] = case["xf"] @ case["kv_w"].T, case["xf"] @ case["gate_w"].T  # once per case
    case["overlap"] = overlap
    return case


def run_op(op, case, states=None):
    """op on a copy of the case's states -> (entries, state_kv, state_score)."""
    skv, ssc = states or (case["state_kv"].clone(), case["state_score"].clone())
    out = op(case["kv"], case["gate"], case["ape"], skv, ssc, case["slots"], case["pos"], case["complete"],
             case["norm_w"], EPS, case["overlap"])
    return out, skv, ssc


def run_old(case):
    skv, ssc = case["state_kv"].clone(), case["state_score"].clone()
    out = _old_step(case["kv_w"], case["gate_w"], case["ape"], skv, ssc, case["xf"], case["slots"], case["pos"],
                    case["complete"], case["norm_w"], EPS, case["overlap"])
    return out, skv, ssc


def ordered(v: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in value order: differences are ulp distances."""
    b = v.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


CASES = [(4, 16, True), (4, 128, True), (8, 24, False), (128, 32, False), (128, 512, False), (4, 512, True)]


# ---------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("r,w,overlap", CASES)
@pytest.mark.parametrize("B,n_pad", [(1, 0), (7, 0), (9, 3)])
def test_twin_is_the_old_decode_compressor_bit_for_bit(r, w, overlap, B, n_pad):
    case = make_case(B, r, w, overlap, seed=B * 100 + r + w, n_pad=n_pad)
    got, skv, ssc = run_op(official_fused.compress_decode_step, case)
    want, okv, osc = run_old(case)
    assert torch.equal(skv, okv) and torch.equal(ssc, osc)
    done = case["complete"]
    assert bool(done.any()) and got.dtype == BF16 and got.shape == want.shape
    assert torch.equal(got[done], want[done])
    assert bool((got[~done] == 0).all())
    unused = [s for s in range(skv.shape[0]) if s not in set(case["slots"].tolist())]
    assert unused and torch.equal(skv[unused], case["state_kv"][unused])  # only the batch's slots are written


def test_twin_is_the_registered_cpu_op_and_rejects_bad_shapes():
    assert kernels.get("compress_decode_step") is official_fused.compress_decode_step
    assert kernels.get("compress_decode_step", "cpu") is official_fused.compress_decode_step
    case = make_case(3, 4, 16, True, seed=1)
    with pytest.raises(ValueError, match="compress_decode_step"):
        run_op(official_fused.compress_decode_step, dict(case, ape=case["ape"][:3]))
    with pytest.raises(ValueError, match="compress_decode_step"):
        run_op(official_fused.compress_decode_step, dict(case, overlap=False))


# ---------------------------------------------------------------------------------- interpreter (CPU)
_INTERPRET_CHECK = '''
import torch

import test_kernels_compress_decode as t
from deepinfer.kernels.official_fused import compress_decode_step as twin
from deepinfer.kernels.triton.compress_decode import compress_decode_step as kern

worst = 0
for r, w, overlap in [(4, 16, True), (4, 24, True), (8, 24, False), (128, 96, False)]:
    for B, n_pad in [(1, 0), (6, 0), (8, 3)]:
        case = t.make_case(B, r, w, overlap, seed=B * 10 + r + w, n_pad=n_pad)
        got, skv, ssc = t.run_op(kern, case)
        want, okv, osc = t.run_op(twin, case)
        assert torch.equal(skv, okv) and torch.equal(ssc, osc), (r, w, overlap, B)
        done = case["complete"]
        assert bool((got[~done] == 0).all()) and not bool(got.isnan().any()), (r, w, overlap, B)
        u = t.ulps(got[done], want[done])
        worst = max(worst, u)
        print(f"r={r} w={w} overlap={overlap} B={B} pad={n_pad}: entries max {u} bf16 ulps")
        assert u <= t.ULPS, (r, w, overlap, B, u)
        # kv and gate as the column halves of one [B, 2 c w] GEMM output (the stacked compressor weight):
        # the strided rows give the same bits as contiguous ones
        both = torch.cat([case["kv"], case["gate"]], dim=1)
        cw = case["kv"].shape[1]
        strided = dict(case, kv=both[:, :cw], gate=both[:, cw:])
        assert strided["kv"].stride(0) == 2 * cw
        got_s, skv_s, ssc_s = t.run_op(kern, strided)
        assert torch.equal(got_s, got) and torch.equal(skv_s, skv) and torch.equal(ssc_s, ssc), (r, w, B)
print(f"worst {worst} ulps")
print("ok")
'''


def store_case(case, w: int, rope: int = 64, seed: int = 0):
    """compress_decode_store's extra inputs for a make_case case: V4's packed layout at head dim w (E4M3 per 64
    + the raw bf16 rope tail), a cache of random bytes, distinct cache rows for the real rows (padding: one
    scratch row), the blocks' first positions and their RoPE frequencies."""
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout
    from deepinfer.kernels import official

    layout = get_layout("v4_fp8_ds_mla", SimpleNamespace(head_dim=w, rope_head_dim=rope, index_head_dim=64))
    dev = case["kv"].device
    B = case["kv"].shape[0]
    g = torch.Generator().manual_seed(seed)
    store = torch.randint(0, 256, (B + 6, layout.bytes_per_token), generator=g, dtype=torch.uint8).to(dev)
    rows = torch.randperm(B + 5, generator=g)[:B].to(dev)
    r = case["ape"].shape[0]
    block_pos = (case["pos"] // r) * r
    freqs = official.rope_freqs32(rope, 65536, 160000.0, 16.0, 32, 1).to(dev)
    return layout, store, rows, block_pos, freqs


def run_store(op, case, extra, table=None):
    """op (compress_decode_store) on copies of the case's states and cache -> (cache bytes, state_kv, state_score)."""
    layout, store, rows, block_pos, freqs = extra
    skv, ssc, st = case["state_kv"].clone(), case["state_score"].clone(), store.clone()
    op(case["kv"], case["gate"], case["ape"], skv, ssc, case["slots"], case["pos"], case["complete"], case["norm_w"],
       EPS, case["overlap"], block_pos, freqs, table, layout, st, rows)
    return st, skv, ssc


def test_store_twin_is_the_three_ops():
    """compress_decode_store's twin: the step, rope32 of the entries at their blocks' first positions, their bytes
    into the cache rows where complete: the ops the decode step ran one by one; other rows keep their bytes."""
    from deepinfer.kernels import official

    for r, w, overlap in [(4, 128, True), (8, 256, False)]:
        case = make_case(7, r, w, overlap, seed=r + w, n_pad=2)
        extra = store_case(case, w)
        layout, store, rows, block_pos, freqs = extra
        got, skv, ssc = run_store(official_fused.compress_decode_store, case, extra)
        entries, okv, osc = run_op(official_fused.compress_decode_step, case)
        want = store.clone()
        official_fused.kv_encode_into(layout, official.rope32(entries, block_pos, freqs), want, rows,
                                      case["complete"])
        assert torch.equal(got, want) and torch.equal(skv, okv) and torch.equal(ssc, osc)
        untouched = torch.ones(store.shape[0], dtype=torch.bool)
        untouched[rows[case["complete"]]] = False
        assert torch.equal(got[untouched], store[untouched])
        assert not torch.equal(got[~untouched], store[~untouched])
    assert kernels.get("compress_decode_store", "cpu") is official_fused.compress_decode_store


_STORE_CHECK = '''
import os
import torch

import test_kernels_compress_decode as t
from deepinfer.kernels.triton.compress_decode import _store_fits, compress_decode_store as kern
from deepinfer.kernels.triton.rope import rope_table32

for r, w, overlap in [(4, 128, True), (8, 256, False), (128, 128, False)]:
    for B, n_pad in [(1, 0), (6, 0), (8, 3)]:
        case = t.make_case(B, r, w, overlap, seed=B * 7 + r + w, n_pad=n_pad)
        extra = t.store_case(case, w, seed=B)
        assert _store_fits(extra[0], w, extra[4].shape[0])  # the fused form runs below, not its fallback
        os.environ["DEEPINFER_COMPRESS_STORE"] = "apart"
        want, okv, osc = t.run_store(kern, case, extra)
        os.environ["DEEPINFER_COMPRESS_STORE"] = "fused"
        got, skv, ssc = t.run_store(kern, case, extra)
        table = rope_table32(extra[3], extra[4])
        got_t, _, _ = t.run_store(kern, case, extra, table=table)
        assert torch.equal(skv, okv) and torch.equal(ssc, osc), (r, w, overlap, B)
        assert torch.equal(got, want), (r, w, overlap, B, (got != want).nonzero()[:8].tolist())
        assert torch.equal(got_t, got), (r, w, B)
        print(f"r={r} w={w} overlap={overlap} B={B} pad={n_pad}: cache bytes and states bit for bit "
              f"({int(case['complete'].sum())} rows stored)")
print("ok")
'''


def test_store_fused_is_the_three_launches_under_the_interpreter():
    """DEEPINFER_COMPRESS_STORE=fused (one launch: the RoPE and the packed store in the compressor kernel's
    epilogue) == the three Triton launches (compress_decode_step, rope32, kv_encode_into): the cache's bytes and
    the states bit for bit (the epilogue repeats their arithmetic on the same bf16 entries), ratios 4 with
    overlap and 8 / 128 without, scale blocks 1 and 3, batch padding."""
    pytest.importorskip("triton")
    from interpreted import GPU_ROUNDINGS

    res = run_interpreted(GPU_ROUNDINGS + _STORE_CHECK, timeout=600)
    print(res.stdout[-3000:])
    assert_ran_ok(res)


def test_store_env_choice(monkeypatch):
    from deepinfer import env

    assert env.compress_store_fused()  # the default since the fortieth session's H100 runs
    monkeypatch.setenv("DEEPINFER_COMPRESS_STORE", "Apart")
    assert not env.compress_store_fused()
    monkeypatch.setenv("DEEPINFER_COMPRESS_STORE", "one")
    with pytest.raises(ValueError, match="DEEPINFER_COMPRESS_STORE='one'"):
        env.compress_store_fused()


def test_triton_kernel_is_the_twin_under_the_interpreter():
    """A fresh process (the flag is read at import), with the interpreter's bf16 rounding fixed."""
    pytest.importorskip("triton")
    from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter

    res = run_interpreted(GPU_ROUNDINGS + _INTERPRET_CHECK, timeout=600)
    print(res.stdout[-3000:])
    assert_ran_ok(res)


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = [(4, 512, True), (4, 128, True), (128, 512, False)]  # V4-Flash: main / indexer at ratio 4, main at 128


def _old_cuda_path(case):
    """What the cuda decode path ran before the fused op: the torch data movement + Triton compress_pool and
    rms_norm (entries only)."""
    from deepinfer.kernels.triton.compress_pool import compress_pool
    from deepinfer.kernels.triton.norm_hc import rms_norm

    skv, ssc = case["state_kv"].clone(), case["state_score"].clone()
    r, overlap, slots = case["ape"].shape[0], case["overlap"], case["slots"]
    phase = case["pos"] % r
    row = phase + (r if overlap else 0)
    skv[slots, row] = case["kv"]
    ssc[slots, row] = case["gate"] + case["ape"][phase]
    kv_s, sc_s = skv[slots], ssc[slots]
    if overlap:
        w = kv_s.shape[-1] // 2
        kv_s = torch.cat([kv_s[:, :r, :w], kv_s[:, r:, w:]], dim=1)
        sc_s = torch.cat([sc_s[:, :r, :w], sc_s[:, r:, w:]], dim=1)
    pooled = compress_pool(kv_s, sc_s, False).to(BF16).to(F32)
    return rms_norm(pooled, case["norm_w"], EPS).to(BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("r,w,overlap", GPU_CASES)
@pytest.mark.parametrize("B", [1, 8, 128])
def test_triton_kernel_matches_the_twin_on_gpu(r, w, overlap, B):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton.compress_decode import compress_decode_step as kern

    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run (printed for a rerun)
    n_pad = B // 8
    case = make_case(B, r, w, overlap, seed=seed, device="cuda", n_pad=n_pad, dim=4096)
    got, skv, ssc = run_op(kern, case)
    want, okv, osc = run_op(official_fused.compress_decode_step, case)
    old = _old_cuda_path(case)
    torch.cuda.synchronize()
    assert torch.equal(skv, okv) and torch.equal(ssc, osc), seed
    done = case["complete"]
    assert bool((got[~done] == 0).all()) and not bool(got.isnan().any()), seed
    u, e = ulps(got[done], want[done]), rel_err(got[done], want[done])
    u_old, e_old = ulps(got[done], old[done]), rel_err(got[done], old[done])
    print(f"r={r} w={w} B={B} seed={seed}: vs twin {u} ulps rel_err {e:.1e}; vs old cuda path {u_old} ulps "
          f"rel_err {e_old:.1e}")
    assert u <= ULPS and e <= 1e-3 and u_old <= ULPS and e_old <= 1e-3, seed

    # CUDA graph: capture once, replay on the same inputs == eager, bit for bit (states and entries)
    kv, gate = case["kv"], case["gate"]
    gkv, gsc = case["state_kv"].clone(), case["state_score"].clone()
    args = (kv, gate, case["ape"], gkv, gsc, case["slots"], case["pos"], case["complete"], case["norm_w"], EPS,
            overlap)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kern(*args)  # warm-up (compiles) on scratch copies of the states
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = kern(*args)
    gkv.copy_(case["state_kv"])  # the capture's run did not execute; the warm-up's did: fresh states
    gsc.copy_(case["state_score"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, got) and torch.equal(gkv, skv) and torch.equal(gsc, ssc), seed


@pytest.mark.gpu
@pytest.mark.parametrize("r,w,overlap", [(4, 512, True), (128, 512, False)])  # V4-Flash's two KV compressors
@pytest.mark.parametrize("B", [1, 8, 128])
def test_store_fused_matches_the_three_launches_on_gpu(r, w, overlap, B, monkeypatch):
    """DEEPINFER_COMPRESS_STORE=fused against the three launches at V4-Flash's sizes, fresh inputs: the same
    cache bytes and states (the same arithmetic on the same bf16 entries), eager and replayed from a graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton.compress_decode import compress_decode_store as kern
    from deepinfer.kernels.triton.rope import rope_table32

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    case = make_case(B, r, w, overlap, seed=seed, device="cuda", n_pad=B // 8, dim=4096)
    extra = store_case(case, w, seed=seed)
    table = rope_table32(extra[3], extra[4])
    monkeypatch.setenv("DEEPINFER_COMPRESS_STORE", "apart")
    want, okv, osc = run_store(kern, case, extra, table)
    monkeypatch.setenv("DEEPINFER_COMPRESS_STORE", "fused")
    got, skv, ssc = run_store(kern, case, extra, table)
    torch.cuda.synchronize()
    differ = (got != want).any(dim=1).sum().item()
    print(f"r={r} w={w} B={B} seed={seed}: {differ} cache rows differ; states equal "
          f"{torch.equal(skv, okv) and torch.equal(ssc, osc)}")
    assert torch.equal(skv, okv) and torch.equal(ssc, osc) and torch.equal(got, want), seed
    layout, store, rows, block_pos, freqs = extra
    gkv, gsc, gst = case["state_kv"].clone(), case["state_score"].clone(), store.clone()
    args = (case["kv"], case["gate"], case["ape"], gkv, gsc, case["slots"], case["pos"], case["complete"],
            case["norm_w"], EPS, overlap, block_pos, freqs, table, layout, gst, rows)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kern(*args)  # warm-up (compiles) on the copies, refreshed below
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(*args)
    gkv.copy_(case["state_kv"])
    gsc.copy_(case["state_score"])
    gst.copy_(store)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gst, got) and torch.equal(gkv, skv) and torch.equal(gsc, ssc), seed

