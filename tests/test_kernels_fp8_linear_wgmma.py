"""fp8_linear for batched decode on Hopper's warpgroup MMA (deepinfer/kernels/cuda/fp8_linear_wgmma.cu + .py:
a producer warp feeds E4M3 weight tiles and the activations through a TMA ring, consumer warpgroups expand the
weights into wgmma's register operand; split-K partials added in order by each row tile's last CTA), its operand
order (`act_quant.linear_wgmma_k_order`, `act_quant_dequant_bf16(..., wgmma_order=True)`), and the op's
dispatch (fp8_gemm.fp8_linear: "wgmma" for 9..128 rows by DEEPINFER_LINEAR_BATCH_KERNEL / BATCH_LINEAR_FORM).

CPU: the K order is the one the A fragments hold (derived here from the m16n8k16 layout and the byte pairs the
kernel takes, independently of the order's formula) and a bijection; the ordered act_quant pass under the
Triton interpreter against formats.act_quant_dequant + the order, bit for bit; the plan's rules and the
launcher's checks; the env choice; the source compiles for sm_90a where NVRTC is installed.
GPU (`-m gpu`, fresh random inputs):
* one-hot activation rows pick single weights: out[m, n] = W[n, k_m] (E4M3 x scale, exact in bf16) bit for bit;
* against the torch twin (rel_err <= 3e-4, the bf16 form's bound: exact products, fp32 sums, one bf16
  rounding) and the Triton bf16 form, M = 1..128, blocks 128 and 32, a partial row tile, every split count;
* CUDA-graph replays bit-identical to eager, twice (the split-K counters reset themselves);
* the op's auto form picks it for 9..128 rows, Triton under DEEPINFER_LINEAR_BATCH_KERNEL=triton.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import fp8_linear_torch

BF16 = torch.bfloat16
COMPILE_CONFIGS = [dict(NT=nt, CWG=cwg, STAGES=st, SPLIT=sp) for nt, cwg, st in
                   ((8, 1, 8), (16, 1, 8), (32, 1, 8), (64, 2, 4), (128, 2, 4), (128, 1, 2)) for sp in (0, 1)]


# ---------------------------------------------------------------------------------------------- CPU
def test_k_order_is_what_the_a_fragments_hold():
    """Lane (g, t) of a warp holds, for 16-K step j, A registers a0 / a1 = rows g / g + 8 at logical K
    (16j + 2t, +1), a2 / a3 = the same rows at (16j + 2t + 8, +9), low half the lower K (m16n8k16 layout). The
    kernel fills them from word j of the lane's 32 bytes of the row (physical K 32t + 4j + b for byte b):
    `pair<0xA280>` = bytes (0, 2) for a0 / a1, `pair<0xB391>` = bytes (1, 3) for a2 / a3. That map must be
    `linear_wgmma_k_order`, and a bijection of each 128."""
    from deepinfer.kernels.triton.act_quant import linear_wgmma_k_order

    held = {}
    for t in range(4):
        for j in range(8):
            for k_lo, (b_lo, b_hi) in ((16 * j + 2 * t, (0, 2)), (16 * j + 2 * t + 8, (1, 3))):
                held[k_lo] = 32 * t + 4 * j + b_lo
                held[k_lo + 1] = 32 * t + 4 * j + b_hi
    assert sorted(held) == list(range(128)) and sorted(held.values()) == list(range(128))
    logical = torch.arange(384)
    want = torch.tensor([held[int(c) % 128] + 128 * (int(c) // 128) for c in logical])
    assert torch.equal(linear_wgmma_k_order(logical), want)


def check_ordered_act_quant(device: str = "cpu") -> None:
    """act_quant_dequant_bf16(wgmma_order=True) = formats.act_quant_dequant's q * s with column
    linear_wgmma_k_order(L) at column L, bit for bit, act blocks 128 and 32; the plain form is unchanged."""
    from deepinfer.kernels.triton.act_quant import act_quant_dequant_bf16, linear_wgmma_k_order

    gen = torch.Generator().manual_seed(8)
    for m, k, block in ((5, 256, 128), (3, 512, 32), (2, 4096, 128)):
        x = (torch.randn(m, k, generator=gen) * 3).to(BF16)
        x[0, :block] = 0  # an all-zero group: the amax floor
        want = formats.act_quant_dequant(x.float(), block).to(BF16)
        got = act_quant_dequant_bf16(x.to(device), block, wgmma_order=True).cpu()
        assert torch.equal(got, want[:, linear_wgmma_k_order(torch.arange(k))]), (m, k, block)
        assert torch.equal(act_quant_dequant_bf16(x.to(device), block).cpu(), want), (m, k, block)


def test_ordered_act_quant_matches_formats_under_the_interpreter():
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    from test_kernels_fp8_linear import _INTERPRETER_FIXES

    done = run_interpreted(_INTERPRETER_FIXES + "\nfrom test_kernels_fp8_linear_wgmma import check_ordered_act_quant as c\n"
                           "c()\nprint('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_plan_rules():
    from deepinfer.kernels.cuda import fp8_linear_wgmma as wg

    assert [wg.tokens_tile(m) for m in (1, 8, 9, 16, 17, 33, 64, 65, 128)] == [8, 8, 16, 16, 32, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="M=129 rows is more than 128"):
        wg.tokens_tile(129)
    big = wg.plan(128, 32768, 1024, 132)  # wq_b at b128: 256 row tiles of 128, no split
    assert (big["NT"], big["CWG"], big["SPLIT_K"]) == (128, 2, 1) and wg.smem_bytes(big) <= 227 * 1024
    small = wg.plan(1, 1024, 4096, 132)  # wq_a at b1: 16 tiles of 64 rows x 16 splits of 2 steps
    assert (small["NT"], small["CWG"], small["SPLIT_K"]) == (8, 1, 16)
    assert wg.plan(32, 512, 256, 132)["SPLIT_K"] == 1  # 2 steps: every split keeps >= 2
    for m, n, k in ((9, 4096, 2048), (64, 8192, 1024), (100, 4096, 8192)):
        cfg = wg.plan(m, n, k, 132)
        tiles = -(-n // wg.rows_per_cta(cfg))
        assert tiles * cfg["SPLIT_K"] <= 2 * 132 and (k // 128) % cfg["SPLIT_K"] == 0, (m, n, k, cfg)
        assert 2 <= cfg["STAGES"] <= 8 and wg.smem_bytes(cfg) <= 227 * 1024, cfg
    assert wg.plan(16, 4096, 4096, 132, {"SPLIT_K": 4, "STAGES": 3})["SPLIT_K"] == 4
    with pytest.raises(ValueError, match="SPLIT_K=3 divides"):
        wg.plan(16, 4096, 4096, 132, {"SPLIT_K": 3})
    with pytest.raises(ValueError, match="do not fit NT=16"):
        wg.plan(17, 4096, 4096, 132, {"NT": 16})
    with pytest.raises(ValueError, match="shared memory"):
        wg.plan(128, 4096, 4096, 132, {"STAGES": 12})


def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp8_linear_wgmma import fp8_linear_wgmma
    from test_kernels_fp8_linear import _random_fp8_weight

    w = _random_fp8_weight(256, 512, 128, 128, "cpu")
    x, out = torch.zeros(4, 512, dtype=BF16), torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match=r"xp must be contiguous bf16 \[M, 512\]"):
        fp8_linear_wgmma(x.float(), w, out)
    with pytest.raises(ValueError, match=r"out must be bf16 \[4, 256\]"):
        fp8_linear_wgmma(x, w, out[:, :128])
    with pytest.raises(ValueError, match="CUDA tensors only"):
        fp8_linear_wgmma(x, w, out)


def test_batch_kernel_choice(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_LINEAR_BATCH_KERNEL", "WGMMA")
    assert env.linear_batch_kernel() == "wgmma"
    monkeypatch.setenv("DEEPINFER_LINEAR_BATCH_KERNEL", "sync")
    with pytest.raises(ValueError, match="DEEPINFER_LINEAR_BATCH_KERNEL='sync'"):
        env.linear_batch_kernel()


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp8_linear_wgmma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, COMPILE_CONFIGS, arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    return dev


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_one_hot_rows_give_every_weight_exactly(block):
    """Row m of x = 1.0 at K position k_m (act_quant: code 256 x 2^-8, exact): out[m, n] = W[n, k_m] (E4M3 x
    its block scale, exact in bf16) for 128 positions spread over K = 2048 (the ring wraps), N = 200 (a partial
    row tile), split 1 and 4."""
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_fp8_linear import _random_fp8_weight

    dev = _cuda()
    gen = torch.Generator(device=dev).manual_seed(4)
    w = _random_fp8_weight(200, 2048, block, block, dev, gen)
    wf = w.dequant()
    for m, split in ((128, 1), (128, 4), (8, 16)):
        ks = torch.randperm(2048, device=dev, generator=gen)[:m]
        x = torch.zeros(m, 2048, dtype=BF16, device=dev)
        x[torch.arange(m, device=dev), ks] = 1.0
        got = fp8_linear(x, w, config={"SPLIT_K": split}, mma="wgmma")
        want = wf[:, ks].T.to(BF16)
        assert torch.equal(got, want), (block, m, split, int((got != want).sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, 8, 9, 16, 33, 64, 100, 128])
def test_matches_twin_and_the_triton_form(block, m):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_fp8_linear import BOUND, _activation, _random_fp8_weight, _rel

    dev = _cuda()
    for n, k in ((1536, 1024), (1000, 4096), (4096, 2048)):  # 1000: a partial row tile and weight block
        w = _random_fp8_weight(n, k, block, block, dev)
        x = _activation(m, k, dev)
        x[0, :block] = 0
        want = fp8_linear_torch(x, w)
        tri = fp8_linear(x, w, mma="bf16")
        out = torch.full((m, n), float("nan"), dtype=BF16, device=dev)
        got = fp8_linear(x, w, mma="wgmma", out=out)
        rel, rel_tri = _rel(got, want), _rel(got, tri)
        print(f"wgmma block={block} M={m} N={n} K={k}: rel_err {rel:.2e} vs twin, {rel_tri:.2e} vs triton bf16 "
              f"(triton vs twin {_rel(tri, want):.2e})")
        assert got is out and bool(torch.isfinite(got).all()) and max(rel, rel_tri) <= BOUND["bf16"], (n, k, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_every_split_matches_twin(block):
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_fp8_linear import BOUND, _activation, _random_fp8_weight, _rel

    dev = _cuda()
    w = _random_fp8_weight(1000, 4096, block, block, dev)
    for m in (1, 20, 128):
        x = _activation(m, 4096, dev)
        want = fp8_linear_torch(x, w)
        for split in (1, 2, 4, 8, 16, 32):
            got = fp8_linear(x, w, config={"SPLIT_K": split}, mma="wgmma")
            assert _rel(got, want) <= BOUND["bf16"], (m, split, _rel(got, want))


@pytest.mark.gpu
def test_graph_replay_is_eager_bit_for_bit_twice():
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear
    from test_kernels_fp8_linear import _activation, _random_fp8_weight
    from test_kernels_gemm import assert_replay_is_eager

    dev = _cuda()
    w = _random_fp8_weight(4096, 4096, 128, 128, dev)
    for m, config in ((1, None), (24, None), (128, None), (64, {"SPLIT_K": 8})):
        x = _activation(m, 4096, dev)
        for _ in range(2):
            assert_replay_is_eager(lambda: fp8_linear(x, w, config=config, mma="wgmma"), f"wgmma M={m} {config}")


@pytest.mark.gpu
def test_auto_form_takes_it_for_batched_rows(monkeypatch):
    from deepinfer.kernels.triton.fp8_gemm import SYNC_MAX_M, WGMMA_MAX_M, fp8_linear
    from test_kernels_fp8_linear import _activation, _random_fp8_weight

    dev = _cuda()
    w = _random_fp8_weight(2048, 4096, 128, 128, dev)
    for m in (SYNC_MAX_M + 1, 64, WGMMA_MAX_M, WGMMA_MAX_M + 1):
        x = _activation(m, 4096, dev)
        auto, wg, tri = fp8_linear(x, w), None, fp8_linear(x, w, mma="bf16")
        if m <= WGMMA_MAX_M:
            wg = fp8_linear(x, w, mma="wgmma")
        assert torch.equal(auto, wg if m <= WGMMA_MAX_M else tri), m
        monkeypatch.setenv("DEEPINFER_LINEAR_BATCH_KERNEL", "triton")
        assert torch.equal(fp8_linear(x, w), tri), m
        monkeypatch.delenv("DEEPINFER_LINEAR_BATCH_KERNEL")
