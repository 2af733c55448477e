"""kernels/triton/indexer_rotate.py against the separate Triton kernels it replaces (rope32, hadamard32,
fp4_fake_quant / the FP4 key codec: bit for bit under the interpreter, where the same operations run in the
same order; on the GPU nearly all bits) and against the torch twins (`official_fused.indexer_q_rotate`,
`official_fused.index_key_rotate_store`: within the rounding of another fp32 summation order and torch's
polar RoPE table), on fresh random inputs at V4-Flash's shapes (64 heads of 128, a 64-channel rope tail,
FP4 keys of 68 bytes) and small ones; rows not kept and rows not named stay untouched; and the checks fail
on a planted bug (no RoPE, keys into the wrong rows)."""
from __future__ import annotations

import pytest
import torch

from interpreted import assert_check_failed, assert_ran_ok, run_check

CASES = [(1, 64), (5, 64), (3, 4)]  # (tokens, heads)
D, ROPE = 128, 64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _check(device: str, plant: str = "") -> None:
    from types import SimpleNamespace

    from deepinfer.cache.layouts import get_layout
    from deepinfer.kernels import official, official_fused
    from deepinfer.kernels.triton import hadamard, kv_pack, rope
    from deepinfer.kernels.triton.fp4_quant import fp4_fake_quant
    from deepinfer.kernels.triton.indexer_rotate import index_key_rotate_store, indexer_q_rotate

    cpu = lambda t: t.to("cpu")  # noqa: E731
    layout = get_layout("v4_index_fp4", SimpleNamespace(head_dim=512, rope_head_dim=ROPE, index_head_dim=D))
    for i, (T, H) in enumerate(CASES):
        g = torch.Generator().manual_seed(300 + i)
        q = (torch.randn(T, H, D, generator=g) * 2).bfloat16().to(device)
        pos = torch.randint(0, 50_000, (T,), generator=g).to(device)
        freqs = official.rope_freqs32(ROPE, 65536, 160000.0, 16.0, 32, 1).to(device)
        table = rope.rope_table32(pos, freqs)
        bad_freqs = torch.zeros_like(freqs) if plant == "rope" else freqs
        got = indexer_q_rotate(q, pos, bad_freqs, None)
        ops = fp4_fake_quant(hadamard.hadamard32(rope.rope32(q, pos, freqs, table=table)), 32)
        assert got.shape == q.shape and got.dtype == torch.bfloat16
        if device == "cpu":
            assert torch.equal(got, ops), ("query vs the separate kernels", T, H)
        else:
            assert (got != ops).float().mean().item() <= 0.01 and _rel(got, ops) <= 0.05, ("query", T, H)
        twin = official_fused.indexer_q_rotate(cpu(q), cpu(pos), cpu(freqs), None)
        assert _rel(cpu(got), twin) <= 0.05, ("query vs the twin", T, H, _rel(cpu(got), twin))  # equal here

        n_rows = 3 * T + 2
        e = (torch.randn(T, D, generator=g) * 2).bfloat16().to(device)
        store = torch.randint(0, 256, (n_rows, layout.bytes_per_token), generator=g, dtype=torch.uint8).to(device)
        rows = torch.randperm(n_rows, generator=g)[:T].to(device)
        keep = (torch.rand(T, generator=g) < 0.6).to(device)
        keep[0] = True
        want = store.clone()
        kv_pack.kv_encode_into(layout, hadamard.hadamard32(rope.rope32(e, pos, freqs, table=table)), want, rows, keep)
        out = store.clone()
        index_key_rotate_store(e, pos, freqs, None, layout, out, (rows + 1) % n_rows if plant == "rows" else rows,
                               keep)
        if device == "cpu":
            assert torch.equal(out, want), ("keys vs the separate kernels", T)
        else:
            assert (out != want).float().mean().item() <= 0.01, ("keys", T)
        untouched = torch.ones(n_rows, dtype=torch.bool, device=device)
        untouched[rows[keep]] = False
        assert torch.equal(out[untouched], store[untouched]), ("rows not kept or not named changed", T)
        twin_store = cpu(store).clone()
        official_fused.index_key_rotate_store(cpu(e), cpu(pos), cpu(freqs), None, layout, twin_store, cpu(rows),
                                              cpu(keep))
        r = cpu(rows[keep])
        assert _rel(layout.load(cpu(out)[r]).float(), layout.load(twin_store[r]).float()) <= 0.05, ("keys vs twin", T)
    import os  # DEEPINFER_ATTN_FUSIONS=0: the separate kernels, the same results

    os.environ["DEEPINFER_ATTN_FUSIONS"] = "0"
    try:
        off_q = indexer_q_rotate(q, pos, freqs, None)
        off_store = store.clone()
        index_key_rotate_store(e, pos, freqs, None, layout, off_store, rows, keep)
    finally:
        del os.environ["DEEPINFER_ATTN_FUSIONS"]
    on_store = store.clone()
    index_key_rotate_store(e, pos, freqs, None, layout, on_store, rows, keep)
    if device == "cpu":
        assert torch.equal(off_q, indexer_q_rotate(q, pos, freqs, None)) and torch.equal(off_store, on_store)
    with pytest.raises(ValueError, match="indexer_q_rotate"):
        indexer_q_rotate(q, pos.repeat(2), freqs, None)


def _interpreted(plant: str = ""):
    return run_check("test_kernels_indexer_rotate", f"_check('cpu', {plant!r})", timeout=600)


def test_indexer_rotate_ops_are_the_separate_kernels_under_the_interpreter():
    res = _interpreted()
    assert_ran_ok(res)


@pytest.mark.parametrize("plant", ["rope", "rows"])
def test_the_check_catches_a_planted_bug(plant):
    res = _interpreted(plant)
    assert_check_failed(res)


@pytest.mark.gpu
def test_indexer_rotate_ops_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 300])
def test_indexer_q_rotate_bits_do_not_depend_on_its_warps(T):
    """The warps override (benchmarks/bench_indexer_rotate.py) changes how a program's tile is spread over
    threads, not its MMA tiles or their order: 8 and 16 warps give 4 warps' bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels import official
    from deepinfer.kernels.triton.indexer_rotate import indexer_q_rotate

    g = torch.Generator(device="cuda").manual_seed(T)
    q = (torch.randn(T, 64, D, generator=g, device="cuda") * 2).bfloat16()
    pos = torch.randint(0, 50_000, (T,), generator=g, device="cuda")
    freqs = official.rope_freqs32(ROPE, 65536, 160000.0, 16.0, 32, 1).to("cuda")
    want = indexer_q_rotate(q, pos, freqs, None, warps=4)
    for warps in (8, 16, None):  # None: the default by T (8 up to FEW_ROWS tokens)
        assert torch.equal(indexer_q_rotate(q, pos, freqs, None, warps=warps), want), warps
