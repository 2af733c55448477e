"""Op "indexer_scores_paged_bf16": the batched decode step's indexer scores read straight from the packed FP4
index-key cache. Twin: `kernels/official.py` (gather + `layout.load` + `indexer_scores_batched_bf16` + the
hidden mask, as decode_attention composes them); Triton: `kernels/triton/indexer.py` (gather, E2M1 x E8M0
decode in registers and `_indexer_scores_kernel`'s MMA and epilogue in one kernel).

CPU: the twin against float64 math on a decode written out here (nibble order and scale index taken from the
layout's docs, not its code), within the bf16 rounding points' error (rel_err <= 1e-2), -inf exactly where
hidden; bad arguments raise ValueError naming them, in the twin and the Triton wrapper (no launch).
CPU under TRITON_INTERPRET=1 (a fresh process, with test_kernels_fp8_linear's fixes of Triton 3.6's
interpreter rounding): the kernel against the twin at B=3, h 4/8, d 64/128 (v4_index_fp4 for a 64- or 128-dim
key: 34 / 68 bytes a row), E 70/130 (partial and wholly hidden blocks), rows with repeats, int32 and int64
rows; keys from `layout.store` and random bytes (every code, both zeros; scale bytes 120..134), q plain bf16
and FP4 fake-quantised as the engine's. -inf exactly where hidden in every case. FP4 q: bit for bit (a product
with an FP4 key has <= 4 significant bits, and at these scale spans the fp32 sums are exact in any order). Plain bf16
q: the dot's fp32 sums are rounded, in numpy's order in the kernel and torch's in the twin, and a sum that
lands near a bf16 rounding boundary can flip one head's score by an ulp: measured 2 of 3420 visible scores
(one repeated row, plain q, random-byte keys), asserted rel_err <= 2e-3 and <= 1% of a case's scores.
Planted bugs fail it: the decode's nibbles swapped, 3409 of the 3420 scores differ; scale bytes reversed, 2203.
GPU (-m gpu): V4 shapes (h=64, d=128, B 1/32/128, E 80/4096, a pool of 50k rows): rel_err <= 2e-3 against the
twin (fp32 sums in another order flip a bf16 rounding now and then), -inf positions identical; and each
sequence's row bit-identical to `indexer_scores_bf16` (the per-sequence path's kernel) on that sequence's
decoded keys: the same tile math. H200, 2026-12-02: all six cases rel_err 0 against the twin, every row
bit-identical to the per-sequence kernel (results/gpu_tests_h200_2026-12-02_s3_run1.log).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer import kernels
from deepinfer.cache.layouts import get_layout
from deepinfer.kernels import official
from deepinfer.kernels.official_fused import fp4_fake_quant
from interpreted import run_interpreted

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _layout(d: int, name: str = "v4_index_fp4"):
    return get_layout(name, SimpleNamespace(head_dim=512, rope_head_dim=64, index_head_dim=d))


def _inputs(g: torch.Generator, B: int, h: int, d: int, E: int, n_rows: int, random_bytes: bool = False,
            quant_q: bool = False, rows_dtype=torch.int64, device: str = "cpu"):
    """(q, w, store, entry_rows, hidden, layout) on `device`. The store holds `layout.store` of keys with row
    scales over 2**-6..2**6, or random bytes (scale bytes 120..134: normal, finite values). Rows repeat
    (n_rows < B * E or drawn with replacement); hidden: sequence b sees a prefix of its entries, the last
    sequence none (E - 1 for B = 1) and the middle one ends inside a block."""
    lay = _layout(d)
    if random_bytes:
        store = torch.randint(0, 256, (n_rows, lay.bytes_per_token), generator=g, dtype=torch.uint8)
        store[:, lay.value_bytes:] = torch.randint(120, 135, (n_rows, lay.n_scales), generator=g, dtype=torch.uint8)
    else:
        scale = 2.0 ** torch.randint(-6, 7, (n_rows, 1), generator=g)
        store = lay.store(torch.randn(n_rows, d, generator=g) * scale)
    q = torch.randn(B, h, d, generator=g).bfloat16()
    q = fp4_fake_quant(q, 32) if quant_q else q
    w = (torch.randn(B, h, generator=g) * h**-0.5).bfloat16()
    rows = torch.randint(0, n_rows, (B, E), generator=g).to(rows_dtype)
    visible = torch.randint(1, E + 1, (B,), generator=g)
    visible[-1] = 0 if B > 1 else E - 1
    if B > 2:
        visible[B // 2] = 65  # one visible entry in the second block
    hidden = torch.arange(E)[None, :] >= visible[:, None]
    return tuple(t.to(device) for t in (q, w, store, rows, hidden)) + (lay,)


def _scores_f64(q, w, store, rows, hidden, lay):
    """float64 scores of keys decoded from the documented layout: byte i of an entry holds value 2i in its low
    nibble and 2i + 1 in its high one (E2M1: bit 3 the sign), then one E8M0 byte 2**(b - 127) per 32 values."""
    packed = store[rows.long()].long()  # [B, E, bpt]
    nib = torch.stack([packed[..., : lay.value_bytes] & 15, packed[..., : lay.value_bytes] >> 4], -1).flatten(-2)
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    scale = torch.pow(2.0, (packed[..., lay.value_bytes:] - 127).double())  # [B, E, d / 32]
    keys = table[nib] * scale.repeat_interleave(32, dim=-1)
    s = torch.einsum("bhd,bed->bhe", q.double(), keys).relu() * w.double()[..., None]
    return s.sum(1).masked_fill(hidden, float("-inf"))


def _rel_err(out, ref, hidden) -> float:
    assert torch.equal(out.isinf(), hidden) and torch.equal(ref.isinf(), hidden)
    assert bool(torch.isfinite(out[~hidden]).all())
    a, b = out[~hidden].double(), ref[~hidden].double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("d,random_bytes", [(128, False), (64, False), (128, True)])
def test_twin_is_float64_math_within_bf16(d, random_bytes):
    g = torch.Generator().manual_seed(d + random_bytes)
    args = _inputs(g, 3, 8, d, 130, 90, random_bytes)
    out = official.indexer_scores_paged_bf16(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 130)
    assert _rel_err(out, _scores_f64(*args), args[4]) <= 1e-2
    assert kernels.get("indexer_scores_paged_bf16") is official.indexer_scores_paged_bf16


def _bad_arguments():
    """(argument tuple, message fragment) pairs: each breaks one part of the contract."""
    q, w, store, rows, hidden, lay = _inputs(torch.Generator().manual_seed(0), 2, 4, 128, 70, 40)
    return [
        ((q[0], w, store, rows, hidden, lay), "q \\[B, h, d\\]"),
        ((q, w[:, :3], store, rows, hidden, lay), "weights"),
        ((q, w, store, rows[:1], hidden[:1], lay), "entry_rows and hidden"),
        ((q, w, store, rows, hidden[:, :69], lay), "entry_rows and hidden"),
        ((q, w, store, rows.float(), hidden, lay), "int32/int64"),
        ((q, w, store, rows, hidden.int(), lay), "hidden bool"),
        ((q, w, store[:, :34], rows, hidden, lay), "store must be uint8"),
        ((q, w, store.view(torch.int8), rows, hidden, lay), "store must be uint8"),
        ((q[..., :64], w, store, rows, hidden, lay), "head dim 64"),
    ]


def test_bad_arguments_are_named():
    for args, msg in _bad_arguments():
        with pytest.raises(ValueError, match=msg):
            official.indexer_scores_paged_bf16(*args)


def test_triton_wrapper_checks_and_falls_back_without_a_launch():
    """The Triton wrapper's argument errors, its strided-store error and its fallback to the twin for a layout
    it does not decode (bf16 keys): all raised or answered before any kernel launch, so no GPU is needed."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton import indexer

    assert indexer.REGISTRATIONS["indexer_scores_paged_bf16"] is indexer.indexer_scores_paged_bf16
    for args, msg in _bad_arguments():
        with pytest.raises(ValueError, match=msg):
            indexer.indexer_scores_paged_bf16(*args)
    q, w, store, rows, hidden, lay = _inputs(torch.Generator().manual_seed(1), 2, 4, 128, 70, 40)
    strided = torch.zeros(40, 2 * lay.bytes_per_token, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous bytes"):
        indexer.indexer_scores_paged_bf16(q, w, strided, rows, hidden, lay)
    bf16 = _layout(128, "bf16_index")
    keys = bf16.store(torch.randn(40, 128))
    got = indexer.indexer_scores_paged_bf16(q, w, keys, rows, hidden, bf16)
    assert torch.equal(got, official.indexer_scores_paged_bf16(q, w, keys, rows, hidden, bf16))


_INTERPRET_CHECK = '''
import itertools
import torch
from deepinfer.kernels import official
from deepinfer.kernels.triton.indexer import indexer_scores_paged_bf16
import test_kernels_indexer_paged as t

g = torch.Generator().manual_seed(7)
total = 0
for h, d, E, random_bytes, quant_q in itertools.product((4, 8), (64, 128), (70, 130), (False, True), (False, True)):
    rows_dtype = torch.int32 if h == 4 else torch.int64
    args = t._inputs(g, 3, h, d, E, 100, random_bytes, quant_q, rows_dtype)
    out, ref = indexer_scores_paged_bf16(*args), official.indexer_scores_paged_bf16(*args)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    n = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
    case = f"h={h} d={d} E={E} random_bytes={random_bytes} quant_q={quant_q}"
    assert n == 0 or not quant_q, f"{case}: {n} differ"  # exact fp32 sums: no order can change a bit
    err = t._rel_err(out, ref, args[4])  # -inf exactly where hidden, finite elsewhere
    assert err <= 2e-3 and n <= 0.01 * out.numel(), f"{case}: {n} differ, rel_err {err:.2e}"
    total += n
print("differing", total)
'''


def test_triton_kernel_is_its_twin_under_the_interpreter():
    pytest.importorskip("triton")
    from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter

    res = run_interpreted(GPU_ROUNDINGS + _INTERPRET_CHECK, timeout=600)
    assert res.returncode == 0 and "differing" in res.stdout, res.stderr[-3000:]
    print(res.stdout.strip())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [1, 32, 128])
@pytest.mark.parametrize("E", [80, 4096])
def test_triton_kernel_matches_twin_and_the_per_sequence_kernel(B, E):
    from deepinfer.kernels.triton import indexer

    g = torch.Generator().manual_seed(B * 10000 + E)
    q, w, store, rows, hidden, lay = _inputs(g, B, 64, 128, E, 50_000, device="cuda")
    out = indexer.indexer_scores_paged_bf16(q, w, store, rows, hidden, lay)
    ref = official.indexer_scores_paged_bf16(q, w, store, rows, hidden, lay)
    err = _rel_err(out, ref, hidden)
    print(f"indexer_scores_paged B={B} E={E}: rel_err {err:.2e}, differing {(out != ref).float().mean().item():.2%}")
    assert err <= 2e-3
    for b in range(B):  # the per-sequence path: decoded keys of this sequence through the unbatched kernel
        one = indexer.indexer_scores_bf16(q[b:b + 1], w[b:b + 1], lay.load(store[rows[b]]))[0]
        one = one.masked_fill(hidden[b], float("-inf"))
        assert torch.equal(out[b].view(torch.int16), one.view(torch.int16)), b
