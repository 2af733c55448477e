"""Kernels of the fast decode step that are not GEMMs or attention, against their torch twins in
`kernels/official_fused.py`: the V4 MoE gate (`moe_gate_sqrtsoftplus`: sqrt-softplus, biased top-k,
renormalise, scale in one Triton kernel; the twin is exactly `V4MoE.route`'s sequence of torch ops), the hash
layers' gate (`moe_gate_hash_sqrtsoftplus`: the token id's table row, its experts' scores renormalised) and the
indexer q's FP4 fake quantisation (`fp4_fake_quant`) and the FP4 index-key codec (`fp4_kv_encode` /
`fp4_kv_decode` vs `KVLayout.store` / `.load`; the decode of V4.1's E4M3-scaled latents too), bit for bit: also checked under TRITON_INTERPRET on the CPU
when triton is installed, since their GPU tests have not run yet.

CPU: the twin equals the route's formula written out, and rejects bad shapes. GPU (-m gpu): the Triton
kernel vs the twin on fresh random logits at decode and prefill row counts: same experts in the same
order, weights within a few ulp (the renormalising sum is a tree sum there, sequential in torch).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.official_fused import moe_gate_sqrtsoftplus


def _route_written_out(logits, bias, k, scale):
    scores = F.softplus(logits).sqrt()
    idx = torch.argsort(scores + bias, dim=-1, descending=True, stable=True)[:, :k]
    w = scores.gather(1, idx)
    return w / w.sum(-1, keepdim=True) * scale, idx


def test_gate_twin_is_the_route_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 64, generator=g) * 6
    logits[0, :3] = torch.tensor([25.0, -40.0, 0.0])  # softplus threshold, underflow, zero
    bias = torch.randn(64, generator=g) * 0.3
    w, idx = moe_gate_sqrtsoftplus(logits, bias, 6, 2.5)
    w_ref, idx_ref = _route_written_out(logits, bias, 6, 2.5)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.sum(-1), torch.full((7,), 2.5), rtol=1e-6, atol=0)


def test_hash_gate_twin_is_the_route_formula():
    """The hash layers' gate: the table row's experts in its order, their sqrt-softplus scores renormalised
    and scaled (V4MoE.route's lines for a hash layer), for int32 and int64 tables."""
    from deepinfer.kernels.official_fused import moe_gate_hash_sqrtsoftplus

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 64, generator=g) * 6
    logits[0, :3] = torch.tensor([25.0, -40.0, 0.0])
    table = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(100)])
    ids = torch.tensor([0, 99, 7, 7, 42])
    logits[0, table[0, 0]] = 25.0  # a picked logit past the softplus threshold
    for tab in (table, table.int()):
        w, idx = moe_gate_hash_sqrtsoftplus(logits, tab, ids, 2.5)
        scores = F.softplus(logits).sqrt()
        want = scores.gather(1, table[ids])
        assert idx.dtype == torch.int64 and torch.equal(idx, table[ids])
        assert torch.equal(w, want / want.sum(-1, keepdim=True) * 2.5)
    with pytest.raises(ValueError, match="ids \\[T\\]"):
        moe_gate_hash_sqrtsoftplus(logits, table, ids[:3], 1.0)
    with pytest.raises(ValueError, match="integer tid2eid"):
        moe_gate_hash_sqrtsoftplus(logits, table.float(), ids, 1.0)


def test_gate_twin_with_norm_eps_is_the_v41_route():
    """norm_eps=1e-20 (V4.1's renormalisation, spec §10.4) is exactly V41MoE.route's torch ops, and it matters
    only where the k weights sum to ~1e-20 (every logit far below 0); norm_eps=0 is the V4 formula's bits."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 32, generator=g) * 6
    logits[1] = -120.0 - torch.rand(32, generator=g)  # softplus underflows to 0: the 1e-20 keeps 0 / 0 away
    bias = torch.randn(32, generator=g) * 0.3
    w, idx = moe_gate_sqrtsoftplus(logits, bias, 4, 1.5, 1e-20)
    scores = F.softplus(logits).sqrt()
    ref_idx = (scores + bias).topk(4, dim=-1).indices
    ref_w = scores.gather(1, ref_idx)
    ref_w = ref_w / (ref_w.sum(dim=-1, keepdim=True) + 1e-20) * 1.5
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    assert torch.equal(w[1], torch.zeros(4))
    w4, _ = moe_gate_sqrtsoftplus(logits, bias, 4, 1.5)  # V4's formula (no eps): 0 / 0 there
    assert bool(w4[1].isnan().all()) and torch.equal(w4[0], w[0])


def test_gate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="topk"):
        moe_gate_sqrtsoftplus(torch.zeros(2, 8), torch.zeros(8), 9, 1.0)
    with pytest.raises(ValueError, match="bias"):
        moe_gate_sqrtsoftplus(torch.zeros(2, 8), torch.zeros(7), 2, 1.0)


def _gate_inputs(T, E, gen, device="cpu"):
    """Logits with the softplus threshold and underflow in row 0, and a bias that makes many biased scores
    negative in the later rows (the packed top-k key flips negative floats' bits: their order must hold)."""
    logits = torch.randn(T, E, generator=gen) * 4
    logits[0, :2] = torch.tensor([30.0, -50.0])
    bias = torch.randn(E, generator=gen) * 0.2
    if T > 1:
        logits[1:] -= 8.0  # sqrt-softplus scores ~0.02 or less, below the bias's spread
        bias = bias * 5 - 1.0
    return logits.to(device), bias.to(device)


_GATE_INTERPRET = """
import os
import torch
from deepinfer.kernels.official_fused import moe_gate_sqrtsoftplus as twin
from deepinfer.kernels.triton.moe_gate import moe_gate_sqrtsoftplus as gate
from test_kernels_decode import _gate_inputs
for T, E, k in ((1, 256, 6), (3, 256, 6), (3, 384, 8), (2, 100, 7), (3, 8, 2), (2, 64, 4)):
    logits, bias = _gate_inputs(T, E, torch.Generator().manual_seed(T * 1000 + E))
    tie = [1, 2, 3, E - 1]  # the last row's top: equal logits and bias, taken lowest expert first
    logits[-1, tie] = 25.0
    bias[tie] = bias[1] + 1.0
    for eps in (0.0, 1e-20):
        got = {}
        for packed in ("0", "1"):
            os.environ["DEEPINFER_GATE_PACKED_KEY"] = packed
            got[packed] = gate(logits, bias, k, 1.5, eps)
        assert torch.equal(got["0"][0], got["1"][0]) and torch.equal(got["0"][1], got["1"][1]), (T, E, k, eps)
        w, idx = got["1"]
        assert idx[-1, :4].tolist() == tie[:k], (T, E, k, idx)
        if T > 1:  # the other rows against the twin (whose torch.topk orders ties its own way)
            w_ref, idx_ref = twin(logits[:-1], bias, k, 1.5, eps)
            assert idx.dtype == torch.int64 and torch.equal(idx[:-1], idx_ref), (T, E, k, idx, idx_ref)
            torch.testing.assert_close(w[:-1], w_ref, rtol=2e-6, atol=0)
"""


def test_gate_triton_under_the_interpreter():
    """The Triton gate's two top-k forms (three reductions a round; one max of a packed key a round,
    DEEPINFER_GATE_PACKED_KEY=1) bit-identical to each other, ties included, and against the twin."""
    from interpreted import GPU_ROUNDINGS, assert_ran_ok, run_interpreted

    pytest.importorskip("triton")
    assert_ran_ok(run_interpreted(GPU_ROUNDINGS + _GATE_INTERPRET + "print('ok')", timeout=600))


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (8, 256, 6), (128, 256, 6), (3, 8, 2), (5, 384, 8)])
@pytest.mark.parametrize("packed", ["0", "1"])
def test_gate_triton_matches_its_twin(T, E, k, packed, monkeypatch):
    from deepinfer.kernels.triton.moe_gate import moe_gate_sqrtsoftplus as gate_triton

    monkeypatch.setenv("DEEPINFER_GATE_PACKED_KEY", packed)  # both top-k forms

    logits, bias = _gate_inputs(T, E, torch.Generator().manual_seed(T * 1000 + E), "cuda")
    w, idx = gate_triton(logits, bias, k, 1.5)
    w_ref, idx_ref = moe_gate_sqrtsoftplus(logits, bias, k, 1.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=0)
    logits[-1] = -120.0  # V4.1's renormalisation (norm_eps): the 1e-20 dominates this row's sum
    w, idx = gate_triton(logits, bias, k, 1.5, 1e-20)
    w_ref, idx_ref = moe_gate_sqrtsoftplus(logits, bias, k, 1.5, 1e-20)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="fp32"):
        gate_triton(logits.half(), bias, k, 1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (128, 256, 6), (5, 384, 8)])
def test_hash_gate_triton_matches_its_twin(T, E, k):
    from deepinfer.kernels.official_fused import moe_gate_hash_sqrtsoftplus as twin
    from deepinfer.kernels.triton.moe_gate import moe_gate_hash_sqrtsoftplus as gate_triton

    g = torch.Generator(device="cuda").manual_seed(T * 1000 + E)
    logits = torch.randn(T, E, device="cuda", generator=g) * 4
    table = torch.argsort(torch.rand(1000, E, device="cuda", generator=g), dim=-1)[:, :k].int()
    ids = torch.randint(0, 1000, (T,), device="cuda", generator=g)
    logits[0, table[ids[0], 0]] = 30.0  # past the softplus threshold
    w, idx = gate_triton(logits, table, ids, 1.5)
    w_ref, idx_ref = twin(logits, table, ids, 1.5)
    assert idx.dtype == torch.int64 and torch.equal(idx, idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=0)


# ------------------------------------------------------------------------------------- FP4 fake quant
def _fp4_inputs(gen: torch.Generator, shape, scale, device="cpu") -> torch.Tensor:
    """Random bf16 values plus every E2M1 midpoint (ties to the even code), signed zeros, tiny values and an
    all-zero block (the amax floor)."""
    x = (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)
    flat = x.view(-1)
    flat[:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).to(torch.bfloat16)
    flat[32:40] = torch.tensor([-0.25, -0.0, 0.0, -1e-30, 1e-30, -5.0, -3.5, -6.0]).to(torch.bfloat16)
    flat[64:96] = 0
    return x.to(device)


def _check_fp4_codec(device: str, subnormal_scales: bool = True) -> None:
    """fp4_kv_encode / fp4_kv_decode == KVLayout.store / .load of both index-key layouts: bytes equal; decoded
    bits equal (random bytes too, with scale bytes 0xFF = NaN: NaN where the codec's is, and 0 = 2**-127;
    scale bytes below 2 (subnormal products, never written by the encoder) only on the GPU: the interpreter
    flushes subnormals)."""
    from deepinfer.cache.layouts import get_layout
    from deepinfer.config import ModelConfig
    from deepinfer.kernels.triton.fp4_quant import fp4_kv_decode, fp4_kv_encode
    from deepinfer.tiny import default_model_dir

    cfg = ModelConfig.from_checkpoint(default_model_dir("v4", seed=0))
    g = torch.Generator().manual_seed(11)
    for name in ("v4_index_fp4", "v41_index_fp4"):
        lay = get_layout(name, cfg)
        for shape, scale in [((3, 5, lay.dim), 1.0), ((4, lay.dim), 1e-3), ((2, lay.dim), 30.0)]:
            x = _fp4_inputs(g, shape, scale, device)
            for v in (x, x.float() * 1.37):  # wider input: rounded to bf16 first, as store does
                assert torch.equal(fp4_kv_encode(lay, v), lay.store(v)), (name, shape, v.dtype)
            rnd = torch.randint(0, 256, (*shape[:-1], lay.bytes_per_token), generator=g, dtype=torch.uint8)
            rnd[..., lay.value_bytes] = 0
            if not subnormal_scales:  # scale bytes >= 2: every decoded value is a normal number
                rnd[..., lay.value_bytes:] = rnd[..., lay.value_bytes:].clamp(min=2)
            rnd[..., lay.value_bytes + 1] = 0xFF
            for packed in (lay.store(x), rnd.to(device)):
                got, ref = fp4_kv_decode(lay, packed), lay.load(packed)
                assert torch.equal(got.isnan(), ref.isnan()), name
                same = got.view(torch.int16) == ref.view(torch.int16)
                assert bool((same | ref.isnan()).all()), name
    # V4.1's latents (E4M3 scale bytes per 16): decode only; every scale byte, E4M3 NaN (0x7F / 0xFF) and -0
    # (0x80) among them, with random value bytes, and the codec's own bytes of real values
    lat = get_layout("v41_latent_fp4", cfg)
    rnd = torch.randint(0, 256, (256, lat.bytes_per_token), generator=g, dtype=torch.uint8)
    rnd[:, lat.value_bytes] = torch.arange(256, dtype=torch.uint8)
    for packed in (rnd.to(device), lat.store(_fp4_inputs(g, (6, lat.dim), 2.0, device))):
        got, ref = fp4_kv_decode(lat, packed), lat.load(packed)
        assert torch.equal(got.isnan(), ref.isnan())
        assert bool(((got.view(torch.int16) == ref.view(torch.int16)) | ref.isnan()).all())
    # the rows form (kv_decode_rows on cuda): rows of a store read where they are, -1 reading row 0
    from deepinfer.kernels.official_fused import kv_decode_rows
    for lay in (lat, get_layout("v41_index_fp4", cfg)):
        store = lay.store(_fp4_inputs(g, (37, lay.dim), 1.0, device))
        rows = torch.randint(-1, 37, (3, 21), generator=g).to(device)
        got, ref = fp4_kv_decode(lay, store, rows), kv_decode_rows(lay, store, rows)
        assert got.shape == (3, 21, lay.dim) and torch.equal(got.view(torch.int16), ref.view(torch.int16)), lay.name
    with pytest.raises(ValueError, match="not supported"):
        fp4_kv_encode(get_layout("v4_fp8_ds_mla", cfg), torch.zeros(1, cfg.head_dim, device=device))
    with pytest.raises(ValueError, match="not supported"):
        fp4_kv_encode(lat, torch.zeros(1, lat.dim, device=device))  # (its encode stays on the torch codec)


_INTERPRET_CHECK = """
import torch

from deepinfer.kernels.triton.fp4_quant import fp4_fake_quant
from deepinfer.kernels.official_fused import fp4_fake_quant as twin
import test_kernels_decode as t
g = torch.Generator().manual_seed(5)
for shape, scale in [((2, 4, 128), 1.0), ((3, 64), 1e-3), ((1, 96), 40.0)]:
    x = t._fp4_inputs(g, shape, scale)
    for v in (x, x.float()):
        a, b = fp4_fake_quant(v), twin(v)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (shape, v.dtype)
t._check_fp4_codec("cpu", subnormal_scales=False)
from deepinfer.kernels.triton.moe_gate import moe_gate_hash_sqrtsoftplus as hash_gate
from deepinfer.kernels.official_fused import moe_gate_hash_sqrtsoftplus as hash_twin
logits = torch.randn(9, 256, generator=g) * 4
logits[0, :2] = torch.tensor([30.0, -50.0])
table = torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(50)]).int()
table[3, :2] = torch.tensor([0, 1])  # token 3 picks the threshold / underflow logits of row 0
ids = torch.tensor([3, 0, 49, 7, 7, 12, 3, 40, 1])
(w, idx), (w_ref, idx_ref) = hash_gate(logits, table, ids, 1.5), hash_twin(logits, table, ids, 1.5)
assert idx.dtype == torch.int64 and torch.equal(idx, idx_ref)
torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=0)
print("ok")
"""


def test_fp4_triton_kernels_are_their_twins_under_the_interpreter():
    """fp4_fake_quant, the FP4 index-key codec and the hash layers' gate run by TRITON_INTERPRET on the CPU
    (a fresh process: the flag is read at import)."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    res = run_interpreted(_INTERPRET_CHECK, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,scale", [((1, 64, 128), 1.0), ((128, 64, 128), 3.0), ((5, 96), 1e-4)])
def test_fp4_fake_quant_triton_is_its_twin_bit_for_bit(shape, scale):
    from deepinfer.kernels.official_fused import fp4_fake_quant as twin
    from deepinfer.kernels.triton.fp4_quant import fp4_fake_quant

    x = _fp4_inputs(torch.Generator().manual_seed(sum(shape)), shape, scale, "cuda")
    for v in (x, x.float()):
        got, ref = fp4_fake_quant(v), twin(v)
        assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_fake_quant(x[..., :48])


@pytest.mark.gpu
def test_fp4_index_codec_triton_is_the_layout_codec():
    _check_fp4_codec("cuda")


# ------------------------------------------------------------------------------------- cache writes
def _check_encode_into(device: str) -> None:
    """kv_pack.kv_encode_into == the twin (`store[rows] = where(keep, layout.store(x), store[rows])`) byte for
    byte, for the FP8 layouts (V4's with the bf16 rope tail, V4.1's window) and both FP4 index-key layouts:
    rows in random order over a store of random bytes, keep masks with some rows off, keep None, and the
    bytes of rows not written untouched. Under the interpreter (device "cpu") the reference encodes with
    `kv_pack.kv_encode` (the same kernel without the row indirection): the interpreter's E4M3 cast is not the
    GPU's RNE, so the layout codec is matched on the GPU only (test_kernels_attn.py's codec test)."""
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout
    from deepinfer.kernels.official_fused import kv_encode_into as twin
    from deepinfer.kernels.triton.kv_pack import kv_encode, kv_encode_into

    if device == "cpu":
        def twin(lay, x, store, rows, keep):  # noqa: F811 (the interpreter's reference, see above)
            enc = kv_encode(lay, x)
            store[rows] = enc if keep is None else torch.where(keep.unsqueeze(1), enc, store[rows])

    cfg = SimpleNamespace(head_dim=512, rope_head_dim=64, index_head_dim=128)
    g = torch.Generator().manual_seed(21)
    for name in ("v4_fp8_ds_mla", "v41_window_fp8", "v4_index_fp4", "v41_index_fp4"):
        lay = get_layout(name, cfg)
        for t, keep_p in ((7, 0.5), (1, 1.0), (33, None)):
            x = (torch.randn(t, lay.dim, generator=g) * 3).to(torch.bfloat16).to(device)
            store = torch.randint(0, 256, (64, lay.bytes_per_token), generator=g, dtype=torch.uint8).to(device)
            rows = torch.randperm(64, generator=g)[:t].to(device)
            keep = None if keep_p is None else (torch.rand(t, generator=g) < keep_p).to(device)
            want, got = store.clone(), store.clone()
            twin(lay, x, want, rows, keep)
            kv_encode_into(lay, x, got, rows, keep)
            assert torch.equal(got, want), (name, t, keep_p)
    lay = get_layout("v4_fp8_ds_mla", cfg)
    x = torch.zeros(2, lay.dim, dtype=torch.bfloat16, device=device)
    store = torch.zeros(4, lay.bytes_per_token, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="keep must be bool"):
        kv_encode_into(lay, x, store, rows[:2], torch.ones(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="store must be uint8"):
        kv_encode_into(lay, x, store[:, :10], rows[:2])


def test_encode_into_twin_is_encode_then_masked_scatter():
    """The CPU op is the twin itself; its checks name what was wrong."""
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout
    from deepinfer.kernels.official_fused import kv_encode_into as twin

    lay = get_layout("v4_fp8_ds_mla", SimpleNamespace(head_dim=512, rope_head_dim=64, index_head_dim=128))
    x = torch.randn(3, lay.dim).to(torch.bfloat16)
    store = torch.zeros(8, lay.bytes_per_token, dtype=torch.uint8)
    twin(lay, x, store, torch.tensor([5, 1, 2]), torch.tensor([True, False, True]))
    enc = lay.store(x)
    assert torch.equal(store[5], enc[0]) and torch.equal(store[2], enc[2])
    assert not store[1].any() and not store[[0, 3, 4, 6, 7]].any()
    with pytest.raises(ValueError, match="rows must be int"):
        twin(lay, x, store, torch.tensor([5.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"takes x \[T, 512\]"):
        twin(lay, x[:, :100], store, torch.tensor([5, 1, 2]))


# ------------------------------------------------------------------------------------- decode rows
def _check_decode_rows(device: str) -> None:
    """kernels/triton/decode_rows.py == the twin (`kernels.decode_rows.decode_rows_torch`), every output equal
    (int64 rows, bool masks): random positions (0, block edges, the last one), random block tables, V4's
    ratios {4, 128} with the 128-token window, odd sizes (a 7-token window, 16-token blocks, one ratio, no
    ratio: window-only), entry counts past one program step (E = 2048)."""
    from deepinfer.kernels.decode_rows import decode_rows_torch
    from deepinfer.kernels.triton.decode_rows import decode_rows

    g = torch.Generator().manual_seed(5)
    for bsz, window, block, ctx, ratios in ((5, 128, 128, 1024, (4, 128)), (1, 128, 128, 8192, (4, 128)),
                                            (33, 7, 16, 256, (4,)), (3, 128, 128, 512, ())):
        blocks = -(-ctx // block)
        buf = torch.zeros(bsz, 3 + blocks, dtype=torch.long)
        buf[:, 0] = torch.randint(0, ctx, (bsz,), generator=g)
        buf[0, 0] = 0
        buf[-1, 0] = ctx - 1
        if bsz > 2:
            buf[1, 0] = block - 1
        buf[:, 1] = torch.randint(0, 9, (bsz,), generator=g)
        buf[:, 2] = torch.randint(0, 9, (bsz,), generator=g)
        buf[:, 3:] = torch.randint(0, 500, (bsz, blocks), generator=g)
        buf = buf.to(device)
        want = decode_rows_torch(buf, window, block, ctx, ratios)
        got = decode_rows(buf, window, block, ctx, ratios)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (bsz, window, ratios)
        assert len(got[2]) == len(want[2]) == len(ratios)
        for r, a, b in zip(ratios, got[2], want[2]):
            for name, x, y in zip(("entry", "visible", "hidden", "complete", "new_row", "block_pos"), a, b):
                assert x.dtype == y.dtype and torch.equal(x, y), (r, name, bsz, window)
    with pytest.raises(ValueError, match="table columns"):
        decode_rows(torch.zeros(2, 4, dtype=torch.long, device=device), 128, 128, 1024, (4,))


def _check_select_rows(device: str) -> None:
    """kernels/triton/decode_rows.py decode_select_rows == its twin (int64 rows, equal): picks below, at and past
    each row's visible count (a query that sees fewer entries than k), a strided top-k view as torch.sort's
    slice gives it, K past one program step (512 picks of 2048 entries), a single row, and bad input."""
    from deepinfer.kernels.decode_rows import decode_select_rows_torch
    from deepinfer.kernels.triton.decode_rows import decode_select_rows

    g = torch.Generator().manual_seed(11)
    for bsz, w, e, k in ((4, 128, 64, 64), (3, 7, 2048, 512), (1, 128, 300, 17), (33, 16, 40, 40)):
        window = torch.randint(-1, 5000, (bsz, w), generator=g)
        entry = torch.randint(0, 9000, (bsz, e), generator=g)
        visible = torch.randint(0, e + 1, (bsz,), generator=g)
        visible[0] = 0  # sees no entry: every pick is -1
        visible[-1] = e
        top = torch.stack([torch.randperm(e, generator=g) for _ in range(bsz)])[:, :k]  # a strided view
        args = [t.to(device) for t in (window, top, visible, entry)]
        want = decode_select_rows_torch(*args, 4096)
        got = decode_select_rows(*args, 4096)
        assert got.dtype == torch.int64 and torch.equal(got, want), (bsz, w, e, k)
        assert bsz == 1 or torch.all(got[0, w:] == -1)
    import os  # DEEPINFER_ATTN_FUSIONS=0: the torch ops (the twin)

    os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"
    try:
        assert torch.equal(decode_select_rows(*args, 4096), want)
    finally:
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
    with pytest.raises(ValueError, match="int64"):
        decode_select_rows(*[t.to(device) for t in (window, top.int(), visible, entry)], 0)
    with pytest.raises(ValueError, match="batch sizes differ"):
        decode_select_rows(*[t.to(device) for t in (window[:1], top, visible, entry)], 0)


# the decode step's Triton ops against their twins: under the interpreter (a fresh process: the flag is read at
# import) and on the GPU, by the same checks
DECODE_STEP_CHECKS = ["_check_encode_into", "_check_decode_rows", "_check_select_rows"]


@pytest.mark.parametrize("check", DECODE_STEP_CHECKS)
def test_decode_step_triton_ops_are_their_twins_under_the_interpreter(check):
    from interpreted import assert_ran_ok, run_check

    assert_ran_ok(run_check("test_kernels_decode", f"{check}('cpu')", roundings=False, timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("check", DECODE_STEP_CHECKS)
def test_decode_step_triton_ops_are_their_twins(check):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    globals()[check]("cuda")
