"""Op "grouped_proj_fp8": the grouped output LoRA with `wo_a` kept as its FP8 bytes + block scales.

CPU: the twin is the official einsum on convert.py's bf16 value of wo_a, bit for bit the "grouped_proj_bf16"
twin on that value (V4's 128 x 128 blocks and V4.1's 32 x 32); a fast model holding wo_a FP8 gives the same
logits bits as one holding the bf16 value; bad input names what was wrong.
Interpreter (TRITON_INTERPRET=1, a fresh process): the fused kernel and the dequant kernel at small shapes.
GPU (`-m gpu`, fresh random inputs, V4-Flash's shapes): the mma.sync form (decode, split sums separate and
by cluster), the wgmma form (9..256 tokens) and the fused kernel within one bf16 rounding of the
float64 value (`_within_one_rounding`: the fp32 sums' order is the only difference from the twin), the
dequant form bit for bit "grouped_proj_bf16"'s cuBLAS batched GEMM on the bf16 weight and dense, and a
CUDA-graph replay equal to eager.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.kernels.bf16_gemm import grouped_proj_bf16_cublas, grouped_proj_bf16_torch
from deepinfer.kernels.quant_weights import QuantLinearWeight, grouped_proj_fp8_torch

BF16 = torch.bfloat16


def _weight(G: int, R: int, d: int, block: int, g: torch.Generator, device="cpu") -> QuantLinearWeight:
    """Random E4M3 codes (no NaN) with power-of-two block scales 2^-12..2^-5, as checkpoints have."""
    codes = torch.randint(0, 256, (G * R, d), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # the two NaN codes -> 1.5
    scale = 2.0 ** torch.randint(-12, -4, (-(-G * R // block), -(-d // block)), generator=g).float()
    return QuantLinearWeight(codes.view(torch.float8_e4m3fn).to(device), scale.to(device), block, block)


def _within_one_rounding(got: torch.Tensor, o: torch.Tensor, w: QuantLinearWeight) -> None:
    """Every output is one of the two bf16 neighbours of the exact (float64) value, give or take the fp32
    summation error (K x 2^-24 x the sum of |products|)."""
    G, d = o.shape[1], o.shape[2]
    wd = w.dequant().double().view(G, -1, d)
    exact = torch.einsum("tgd,grd->tgr", o.double(), wd)
    mag = torch.einsum("tgd,grd->tgr", o.double().abs(), wd.abs())
    ulp = torch.where(exact == 0, torch.zeros_like(exact), 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7))
    err = (got.double() - exact).abs()
    bound = ulp + d * 2.0**-24 * mag
    bad = err > bound
    assert not bool(bad.any()), f"{int(bad.sum())} outputs beyond one bf16 rounding, worst {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("block", [128, 32])
def test_twin_is_the_bf16_einsum_on_convert_values(block):
    g = torch.Generator().manual_seed(block)
    G, R, d = 4, 128, 256
    w = _weight(G, R, d, block, g)
    o = torch.randn(5, G, d, generator=g).to(BF16)
    wa = w.dequant().to(BF16).view(G, R, d)  # convert.py's wo_a
    assert torch.equal(wa.float().view(G * R, d), w.dequant())  # exact: 4 significant bits x a power of two
    z = grouped_proj_fp8_torch(o, w)
    assert z.dtype == BF16 and z.shape == (5, G, R)
    assert torch.equal(z, grouped_proj_bf16_torch(o, wa))
    _within_one_rounding(z, o, w)
    assert kernels.get("grouped_proj_fp8") is grouped_proj_fp8_torch


def test_bad_inputs_raise_clear_errors():
    g = torch.Generator().manual_seed(1)
    w = _weight(4, 128, 256, 128, g)
    o = torch.zeros(2, 4, 256, dtype=BF16)
    with pytest.raises(ValueError, match="bf16"):
        grouped_proj_fp8_torch(o.float(), w)
    with pytest.raises(ValueError, match="does not fit"):
        grouped_proj_fp8_torch(torch.zeros(2, 4, 128, dtype=BF16), w)
    with pytest.raises(ValueError, match="does not fit"):
        grouped_proj_fp8_torch(torch.zeros(2, 3, 256, dtype=BF16), w)
    with pytest.raises(ValueError, match="QuantLinearWeight"):
        grouped_proj_fp8_torch(o, torch.zeros(512, 256, dtype=BF16))


def test_fast_model_logits_same_bits_with_wo_a_fp8_or_bf16(tiny_v4_raw, monkeypatch):
    """The CPU fast model with wo_a held FP8 (default) and as convert.py's bf16 (DEEPINFER_WO_A_FP8=0): the
    same values through the same twin math, so the same logits bits over a prefill and decode steps."""
    from deepinfer.model.context import ForwardContext, SeqContext
    from deepinfer.model.factory import v4_cache
    from deepinfer.model.params_fast import prepare_params_fast
    from deepinfer.model.v4 import V4EngineModel

    cfg, raw = tiny_v4_raw
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DEEPINFER_WO_A_FP8", flag)
        params = prepare_params_fast(raw, cfg)
        wo_a = params["layers.0.attn.wo_a.weight"]
        assert isinstance(wo_a, QuantLinearWeight) == (flag == "1")
        model = V4EngineModel(cfg, params, v4_cache(cfg, "fast", 2, 128, 1), "fast")
        ids = torch.randint(0, cfg.vocab_size, (140,), generator=torch.Generator().manual_seed(0))
        table = (0, 1)
        out = [model(ids[:137], ForwardContext((SeqContext(0, 137, 0, 0, table),)))]
        for pos in (137, 138, 139):
            out.append(model(ids[pos:pos + 1], ForwardContext((SeqContext(pos, 1, 0, 0, table),))))
        runs.append(out)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


_INTERPRET = """
exec(__import__("interpreted").GPU_ROUNDINGS)  # the GPU's fp32 -> bf16 rounding
import torch
import test_kernels_grouped_proj as t
from deepinfer.kernels.triton import grouped_proj as gp

g = torch.Generator().manual_seed(7)
for G, R, d, block, T, config in [(2, 64, 256, 128, 3, None), (2, 64, 96, 32, 20, dict(BLOCK_N=32, BLOCK_K=64)),
                                  (4, 32, 128, 32, 1, dict(BLOCK_N=32))]:
    w = t._weight(G, R, d, block, g)
    o = torch.randn(T, G, d, generator=g).to(torch.bfloat16)
    got = gp.grouped_proj_fp8(o, w, config, form="fused")
    t._within_one_rounding(got, o, w)
    assert torch.equal(gp.dequant_bf16(w), w.dequant().to(torch.bfloat16)), (G, R, d, block)
    # the dequant form is the Triton dequantisation (above) + "grouped_proj_bf16"'s batched GEMM, which off
    # CUDA is its twin (fp32 sums, one rounding): bit for bit that, within one rounding of the exact value
    # (that it is dense on CUDA, the GPU test checks)
    deq = gp.grouped_proj_fp8(o, w, form="dequant")
    assert torch.equal(deq, t.grouped_proj_bf16_torch(o, w.dequant().to(torch.bfloat16).view(G, R, d)))
    t._within_one_rounding(deq, o, w)
print("ok")
"""


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    from interpreted import assert_ran_ok, run_interpreted

    res = run_interpreted(_INTERPRET, timeout=600)
    assert_ran_ok(res)


def test_sync_launcher_rejects_bad_grouped_inputs():
    from deepinfer.kernels.cuda.fp8_linear_mma import fp8_linear_partials

    g = torch.Generator().manual_seed(3)
    w = _weight(2, 256, 512, 128, g)
    out = torch.zeros(3, 512, dtype=BF16)
    with pytest.raises(ValueError, match=r"o must be bf16 \[M, G, 512\] with G x 256 = 512 weight rows"):
        fp8_linear_partials(torch.zeros(3, 4, 512, dtype=BF16), w, out, group_rows=256)
    with pytest.raises(ValueError, match="each token's groups contiguous"):
        fp8_linear_partials(torch.zeros(3, 512, 2, dtype=BF16).transpose(1, 2), w, out, group_rows=256)
    with pytest.raises(ValueError, match="group_rows 64 must be whole CTA tiles of 128 rows"):
        fp8_linear_partials(torch.zeros(3, 8, 512, dtype=BF16), w, out, group_rows=64)
    with pytest.raises(ValueError, match="CUDA tensors only"):  # every input fits: only the device is wrong
        fp8_linear_partials(torch.zeros(3, 2, 512, dtype=BF16), w, out, group_rows=256)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_sync_form_against_the_twin(block):
    """The decode form (mma.sync, raw bf16 o, one group per CTA): within one bf16 rounding of the float64
    value for 1..8 tokens, split sums separate, by cluster and by the last split CTA the same bits, every output
    written, the serial split's counters put back, groups of
    1024 (V4-Flash) and 512 rows, o a strided view."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton import grouped_proj as gp

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(21 + block)
    for G, R, d in ((8, 1024, 4096), (4, 512, 2048)):
        w = _weight(G, R, d, block, g, dev)
        for T in (1, 3, 8):
            big = torch.randn(T, G, d + 64, generator=g).to(BF16).to(dev)
            for o in (big[:, :, :d].contiguous(), big[:, :, :d]):  # the view: copied by the op
                sep = gp.grouped_proj_fp8(o, w, {"CLUSTER": False, "SERIAL": False}, form="sync")
                clu = gp.grouped_proj_fp8(o, w, {"CLUSTER": True}, form="sync")
                ser = gp.grouped_proj_fp8(o, w, {"CLUSTER": False, "SERIAL": True}, form="sync")
                assert sep.shape == (T, G, R) and bool(torch.isfinite(sep).all())
                _within_one_rounding(sep, o, w)
                assert torch.equal(sep, clu), (G, R, T, int((sep != clu).sum()))
                assert torch.equal(sep, ser), (G, R, T, int((sep != ser).sum()))
                assert not bool(w._split_counters.any()), "the serial split's counters not put back"
                assert torch.equal(gp.grouped_proj_fp8(o, w), sep)  # auto takes it at decode
        print(f"sync form block {block} G={G} R={R} d={d}: within one rounding, cluster == serial == separate sum")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_wgmma_form_against_the_twin(block):
    """The batched-decode form (fp8_linear's wgmma kernel with GROUP_ROWS, o's bf16 reordered once): within one
    bf16 rounding of the float64 value for 9..256 tokens (one and two token tiles, split K and not), groups of
    1024 (V4-Flash) and 512 rows, o a strided view; "auto" takes it there; the serial split the separate
    sum's bits; graph replay == eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg
    from deepinfer.kernels.triton import grouped_proj as gp
    from test_kernels_gemm import assert_replay_is_eager

    dev = torch.device("cuda")
    if not wg.usable(dev):
        pytest.skip("the wgmma kernel needs sm_90")
    g = torch.Generator().manual_seed(31 + block)
    for G, R, d in ((8, 1024, 4096), (4, 512, 2048)):
        w = _weight(G, R, d, block, g, dev)
        for T in (9, 32, 130, 256):
            big = torch.randn(T, G, d + 64, generator=g).to(BF16).to(dev)
            for o in (big[:, :, :d].contiguous(), big[:, :, :d]):
                got = gp.grouped_proj_fp8(o, w, form="wgmma")
                assert got.shape == (T, G, R) and bool(torch.isfinite(got).all())
                _within_one_rounding(got, o, w)
                assert torch.equal(gp.grouped_proj_fp8(o, w), got)  # auto takes it for 9..256 tokens
            for split in (1, 2):  # the plan's own split and a forced one: both within one rounding
                _within_one_rounding(gp.grouped_proj_fp8(o, w, {"SPLIT_K": split}, form="wgmma"), o, w)
            # the tile's last split CTA adding the partials: the separate sum's bits
            sep = gp.grouped_proj_fp8(o, w, {"SPLIT_K": 4, "SERIAL": False}, form="wgmma")
            ser = gp.grouped_proj_fp8(o, w, {"SPLIT_K": 4, "SERIAL": True}, form="wgmma")
            assert torch.equal(sep, ser) and not bool(w._split_counters.any()), (G, R, T, int((sep != ser).sum()))
        print(f"wgmma form block {block} G={G} R={R} d={d}: within one rounding at 9..256 tokens")
        o = torch.randn(40, G, d, generator=g).to(BF16).to(dev)
        assert_replay_is_eager(lambda: gp.grouped_proj_fp8(o, w, form="wgmma"), f"grouped wgmma G={G} block={block}")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_cuda_kernels_against_the_twin(block):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton import grouped_proj as gp
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11 + block)
    G, R, d = 8, 1024, 4096  # V4-Flash: 8 groups of 8 heads x 512, rank 1024
    w = _weight(G, R, d, block, g, dev)
    wa = gp.dequant_bf16(w)
    assert torch.equal(wa, w.dequant().to(BF16))
    for T in (1, 5, 16, 17, 64, 200):
        o = torch.randn(T, G, d, generator=g).to(BF16).to(dev)
        got = gp.grouped_proj_fp8(o, w)
        assert got.shape == (T, G, R) and got.dtype == BF16
        _within_one_rounding(got, o, w)
        twin = grouped_proj_fp8_torch(o, w)
        print(f"block {block} T={T}: {float((got != twin).float().mean()):.3%} of outputs differ from the twin "
              f"in last bits")
        # the dequant form: the bf16 wo_a through "grouped_proj_bf16"'s cuBLAS batched GEMM, bit for bit, written
        # dense (einsum's permuted view, the form before 2026-12-06, cost its caller a copy)
        deq = gp.grouped_proj_fp8(o, w, form="dequant")
        assert torch.equal(deq, grouped_proj_bf16_cublas(o, wa.view(G, R, d))) and deq.is_contiguous()
        for form in ("fused", "dequant"):  # the forms auto no longer takes where the CUDA kernels run
            if form == "dequant" or T <= gp.FUSED_MAX_T:
                _within_one_rounding(gp.grouped_proj_fp8(o, w, form=form), o, w)
    o = torch.randn(4, G, d, generator=g).to(BF16).to(dev)
    eager = gp.grouped_proj_fp8(o, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gp.grouped_proj_fp8(o, w)
    graph.replay()
    assert torch.equal(captured, eager)
    assert kernels.get("grouped_proj_fp8", "cuda") is gp.grouped_proj_fp8
