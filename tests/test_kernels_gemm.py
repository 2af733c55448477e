"""FP8 block-scaled linear and FP4 MoE: the weight containers, their torch twins, and the Triton kernels.

CPU tests (no triton): containers built from the tiny checkpoints dequantise to exactly the engine's official
weights; the twins equal the engine's official numerics bit for bit (`official.qlinear`, the model's
`_forward_official` MoE); bad input raises a clear error.
GPU tests (`-m gpu`, fresh random inputs every run): act_quant kernel bit-identical to formats.act_quant;
fp8_linear and fp4_moe against their twins on the same device. Both sides compute exact products summed in
fp32 (in different orders) and round to bf16 at the same points, so only last-bit flips differ. Bounds,
with the H200 measurements of 2026-11-29 (M/T = 1, 7, 128, 1000; blocks 128 and 32):
* fp8_linear: rel_err <= 3e-4 (measured 0 at M <= 7, <= 6.0e-5 above; <= 0.01% of elements differ);
* fp4_moe: rel_err <= 1e-3 (measured <= 1.1e-4; a flipped bf16 bit of gate/up or h can move an FP8 code
  of act_quant(h), which is why it is above fp8_linear's).
(An FP8-tensor-core version measured 6e-4 / 1.1e-3: Hopper's FP8 MMA accumulates with reduced precision.)
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels import official
from deepinfer.kernels.quant_weights import (FP4ExpertBank, QuantLinearWeight, fp4_moe_torch,
                                             fp8_linear_torch)

BF16 = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _checkpoint(family: str):
    from deepinfer.config import ModelConfig
    from deepinfer.tiny import default_model_dir
    from deepinfer.weights import load_tensors

    d = default_model_dir(family, seed=0)
    cfg = ModelConfig.from_checkpoint(d)
    return cfg, load_tensors(d, cfg, progress=False)


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request):
    from deepinfer.model.params import prepare_params

    cfg, raw = _checkpoint(request.param)
    return cfg, raw, prepare_params(raw, cfg, numerics="official")


def _sub(params: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


# ----------------------------------------------------------------------------------------------
# CPU: containers and twins
# ----------------------------------------------------------------------------------------------
FP8_NAMES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2")


def test_quant_linear_from_checkpoint_dequantises_to_the_engine_weight(tiny):
    cfg, raw, params = tiny
    for name in FP8_NAMES:
        full = f"layers.3.{name}"
        w = QuantLinearWeight.from_checkpoint(raw[full + ".weight"], raw[full + ".scale"], cfg)
        assert w.block == cfg.weight_block and w.act_block == cfg.act_block
        assert torch.equal(w.data.view(torch.uint8), raw[full + ".weight"].view(torch.uint8))
        assert torch.equal(w.dequant(), params[full + ".weight"]), full


def test_fp8_linear_twin_is_official_qlinear_bit_for_bit(tiny):
    cfg, raw, params = tiny
    g = torch.Generator().manual_seed(1)
    for name in FP8_NAMES:
        full = f"layers.3.{name}"
        w = QuantLinearWeight.from_checkpoint(raw[full + ".weight"], raw[full + ".scale"], cfg)
        for m in (1, 5):
            x = (torch.randn(m, w.in_features, generator=g) * 2).to(BF16)
            got = fp8_linear_torch(x, w)
            assert got.dtype == BF16 and got.shape == (m, w.out_features)
            assert torch.equal(got, official.qlinear(x, params[full + ".weight"], cfg.act_block)), full


def test_fp4_bank_from_checkpoint_keeps_the_exact_expert_weights(tiny):
    cfg, raw, params = tiny
    bank = FP4ExpertBank.from_checkpoint(raw, "layers.3.ffn.", cfg)
    e, d, i = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    assert bank.w13.shape == (e, 2 * i, d // 2) and bank.w2.shape == (e, d, i // 2)
    assert bank.w13_scale.shape == (e, 2 * i, d // 32) and bank.w2_scale.dtype == torch.uint8
    assert bank.act_block == cfg.act_block
    for expert in range(e):
        w1, w3, w2 = bank.dequant_expert(expert)
        p = f"layers.3.ffn.experts.{expert}."
        assert torch.equal(w1, params[p + "w1.weight"]) and torch.equal(w3, params[p + "w3.weight"])
        assert torch.equal(w2, params[p + "w2.weight"])  # error 0: no per-128 requantisation


def _shared_expert_official(x, p, limit, block):
    """The clamped shared expert at the official rounding points (both families' current revision)."""
    gate = official.qlinear(x, p["shared_experts.w1.weight"], block).float().clamp(max=limit)
    up = official.qlinear(x, p["shared_experts.w3.weight"], block).float().clamp(-limit, limit)
    h = torch.nn.functional.silu(gate) * up
    return official.qlinear(h.to(BF16), p["shared_experts.w2.weight"], block)


def test_fp4_moe_twin_is_the_engine_official_moe_bit_for_bit(tiny):
    """twin(routed) + shared expert, rounded once, == the engine model's official MoE on the tiny layer."""
    cfg, raw, params = tiny
    layer = 3  # a gate-routed layer in both families (V4's hash layers are 0..2)
    bank = FP4ExpertBank.from_checkpoint(raw, f"layers.{layer}.ffn.", cfg)
    p = _sub(params, f"layers.{layer}.ffn.")
    if cfg.is_v41:
        from deepinfer.model.v41_moe import V41MoE

        moe = V41MoE(layer, p, cfg, official=True)
        route, call = (lambda x, ids: moe.route(x)), (lambda x, ids: moe(x))
    else:
        from deepinfer.model.moe import V4MoE

        moe = V4MoE(layer, p, cfg, official=True)
        route, call = moe.route, moe
    g = torch.Generator().manual_seed(2)
    for t in (1, 9):
        x = torch.randn(t, cfg.dim, generator=g).to(BF16)
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
        weights, indices = route(x, ids)
        routed = fp4_moe_torch(x, indices, weights.to(torch.float32), bank, cfg.swiglu_limit)
        assert routed.dtype == torch.float32 and routed.shape == x.shape
        shared = _shared_expert_official(x, p, cfg.swiglu_limit, cfg.act_block)
        assert torch.equal((routed + shared.to(torch.float32)).to(BF16), call(x, ids))


def test_bad_inputs_raise_clear_errors(tiny):
    cfg, raw, _ = tiny
    w, s = raw["layers.3.attn.wq_a.weight"], raw["layers.3.attn.wq_a.scale"]
    with pytest.raises(ValueError, match="scale shape"):
        QuantLinearWeight(w, formats.e8m0_to_float(s)[:, :1], cfg.weight_block, cfg.act_block)
    with pytest.raises(ValueError, match="E8M0"):
        QuantLinearWeight.from_checkpoint(w, formats.e8m0_to_float(s), cfg)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        QuantLinearWeight(w.float(), formats.e8m0_to_float(s), cfg.weight_block, cfg.act_block)
    q = QuantLinearWeight.from_checkpoint(w, s, cfg)
    with pytest.raises(ValueError, match="bf16"):
        fp8_linear_torch(torch.zeros(1, q.in_features), q)
    with pytest.raises(ValueError, match=r"x must be \[M"):
        fp8_linear_torch(torch.zeros(1, q.in_features + 1, dtype=BF16), q)
    bank = FP4ExpertBank.from_checkpoint(raw, "layers.3.ffn.", cfg)
    with pytest.raises(ValueError, match="w2_scale shape"):
        FP4ExpertBank(bank.w13, bank.w13_scale, bank.w2, bank.w2_scale[:, :, :1], bank.act_block)
    with pytest.raises(KeyError, match="missing"):
        FP4ExpertBank.from_checkpoint({}, "layers.3.ffn.", cfg)
    x = torch.zeros(2, cfg.dim, dtype=BF16)
    ids = torch.zeros(2, cfg.n_activated_experts, dtype=torch.int64)
    with pytest.raises(ValueError, match="topk_weights"):
        fp4_moe_torch(x, ids, torch.ones(2, cfg.n_activated_experts, dtype=torch.float64), bank, 10.0)
    with pytest.raises(ValueError, match="outside"):
        fp4_moe_torch(x, ids + cfg.n_routed_experts, torch.ones(ids.shape), bank, 10.0)


def test_align_by_expert_groups_every_slot_once():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    g = torch.Generator().manual_seed(3)
    for t, k, e, bm in ((1, 6, 256, 16), (37, 6, 16, 16), (300, 4, 8, 64)):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        slots, experts = align_by_expert(ids, e, bm)
        flat = ids.flatten()
        assert slots.numel() == experts.numel() * bm
        real = slots[slots < t * k]
        assert sorted(real.tolist()) == list(range(t * k))  # every slot exactly once
        for b, ex in enumerate(experts.tolist()):
            block = slots[b * bm:(b + 1) * bm]
            block = block[block < t * k]
            if ex < 0:
                assert block.numel() == 0
            else:
                assert block.numel() > 0 and bool((flat[block.long()] == ex).all())


# ----------------------------------------------------------------------------------------------
# GPU: Triton kernels vs twins, fresh random inputs
# ----------------------------------------------------------------------------------------------
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


def _random_fp8_weight(n: int, k: int, block: int, act_block: int, dev) -> QuantLinearWeight:
    w = torch.randn(n, k, device=dev) * torch.exp(torch.randn(n, 1, device=dev))  # varied row magnitudes
    q, s = formats.quant_fp8_blocks(w, block)
    return QuantLinearWeight(q, formats.e8m0_to_float(s), block, act_block)


def assert_replay_is_eager(run, label: str) -> None:
    """`run()` twice eagerly, then captured in a CUDA graph whose output is poisoned with NaN before the
    replay: both eager runs and the replay must be bit-identical (shared by the GEMM ops' graph tests)."""
    eager = run()
    again = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, again), f"{label}: two eager runs differ"
    assert torch.equal(captured, eager), f"{label}: graph replay differs from eager"


def _random_bank(e: int, d: int, i: int, act_block: int, dev) -> FP4ExpertBank:
    """Any byte is a valid pair of E2M1 codes; scales 2**-8..2**1 around the real checkpoints' range."""
    def scales(*shape):
        return torch.randint(119, 129, shape, dtype=torch.uint8, device=dev)

    return FP4ExpertBank(torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, device=dev), scales(e, 2 * i, d // 32),
                         torch.randint(0, 256, (e, d, i // 2), dtype=torch.uint8, device=dev), scales(e, d, i // 32),
                         act_block)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
def test_triton_act_quant_is_bit_identical(block):
    dev = _cuda()
    from deepinfer.kernels.triton.act_quant import act_quant

    for m, k in ((1, 4096), (7, 512), (1000, 2048)):
        x = (torch.randn(m, k, device=dev) * torch.exp(3 * torch.randn(m, 1, device=dev))).to(BF16)
        x[0, :block] = 0  # an all-zero group: the 1e-4 amax floor
        q, s = act_quant(x, block)
        q_ref, s_ref = formats.act_quant(x, block)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("m", [1, 7, 128, 1000])
def test_triton_fp8_linear_matches_twin(block, m):
    dev = _cuda()
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    for n, k in ((1536, 1024), (1000, 4096)):  # 1000: a partial weight block along N
        w = _random_fp8_weight(n, k, block, block, dev)
        x = (torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))).to(BF16)
        got = fp8_linear(x, w)
        want = fp8_linear_torch(x, w)
        assert got.dtype == BF16 and got.shape == (m, n) and bool(torch.isfinite(got).all())
        rel = _rel(got, want)
        differ = float((got != want).float().mean())
        print(f"fp8_linear block={block} M={m} N={n} K={k}: rel_err={rel:.2e}, {differ:.3%} of elements differ")
        assert rel <= 3e-4, f"rel_err {rel:.2e} ({differ:.3%} of elements differ)"


@pytest.mark.gpu
@pytest.mark.parametrize("act_block", [128, 32])
@pytest.mark.parametrize("t", [1, 7, 128, 1000])
def test_triton_fp4_moe_matches_twin(act_block, t):
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    e, d, i, k = 32, 512, 256, 6
    bank = _random_bank(e, d, i, act_block, dev)
    x = torch.randn(t, d, device=dev).to(BF16)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    weights = torch.rand(t, k, device=dev) * 0.5
    for limit in (10.0, 0.0):
        got = fp4_moe(x, ids, weights, bank, limit)
        want = fp4_moe_torch(x, ids, weights, bank, limit)
        assert got.dtype == torch.float32 and got.shape == (t, d) and bool(torch.isfinite(got).all())
        rel = _rel(got, want)
        print(f"fp4_moe act_block={act_block} T={t} limit={limit}: rel_err={rel:.2e}")
        assert rel <= 1e-3


@pytest.mark.gpu
def test_triton_fp4_moe_real_dims():
    """V4-Flash dims: D=4096, I=2048, E=256, k=6 (decode and a small prefill)."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    bank = _random_bank(256, 4096, 2048, 128, dev)
    for t in (1, 64):
        x = torch.randn(t, 4096, device=dev).to(BF16)
        ids = torch.stack([torch.randperm(256, device=dev)[:6] for _ in range(t)])
        weights = torch.rand(t, 6, device=dev) * 0.5
        rel = _rel(fp4_moe(x, ids, weights, bank, 10.0), fp4_moe_torch(x, ids, weights, bank, 10.0))
        print(f"fp4_moe real dims T={t}: rel_err={rel:.2e}")
        assert rel <= 1e-3


_CHUNKED_ROUTING_CHECK = r"""
import torch
from deepinfer.kernels.triton.fp4_moe import SMALL_ROUTING_SLOTS, align_by_expert, align_by_expert_parallel, align_by_expert_small

g = torch.Generator().manual_seed(11)
cases = [(256, 6, 64, 16), (256, 6, 32, 16), (256, 6, 11, 16), (300, 8, 48, 64), (7, 2, 100, 32), (256, 6, 1, 16),
         (256, 6, 8, 16), (5, 3, 20, 32)]
for e, k, t, bm in cases:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    want = align_by_expert(ids, e, bm)
    forms = [align_by_expert_parallel] + ([align_by_expert_small] if t * k <= SMALL_ROUTING_SLOTS else [])
    for route in forms:
        got = route(ids, e, bm)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (route.__name__, e, k, t, bm)
# the per-expert kernel past one chunk of slots (1024), a prefill block size, and a skewed routing (3 of 64
# experts: long runs of one expert, many empty experts, a long tail of unused blocks)
for ids, e, bm in ((torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(400)]), 256, 128),
                   (torch.randint(0, 3, (700, 2), generator=g), 64, 16)):
    want, got = align_by_expert(ids, e, bm), align_by_expert_parallel(ids, e, bm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (e, bm)
print("ok")
"""


def test_routing_form_follows_the_measured_crossovers():
    """route_slots' choice (H100, results/bench_routing_h100_2026-12-06_s30.log): the per-expert kernel while
    experts x slots stays small (its programs each read every slot), else the torch sort; torch off CUDA."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import routing_form

    assert routing_form(6, 256, cuda=True) == "small"
    assert routing_form(6, 256, cuda=False) == "torch"
    assert routing_form(6 * 2048, 256, cuda=True) == "parallel"  # 62 us against torch's 130
    assert routing_form(6 * 3072, 256, cuda=True) == "parallel"  # 113 against 120
    assert routing_form(6 * 4096, 256, cuda=True) == "torch"  # 122 against 119
    assert routing_form(6 * 2048, 384, cuda=True) == "parallel"  # V4.1: 76 against 131
    assert routing_form(6 * 3072, 384, cuda=True) == "torch"  # 146 against 122
    assert routing_form(6 * 8192, 256, cuda=True) == "torch"


def test_routing_kernels_equal_align_by_expert_under_the_interpreter():
    """The one-launch routing kernels (one program up to 64 slots; one program per expert) give
    align_by_expert's outputs exactly: E=256 k=6 at T=1..64 (6..384 slots), odd expert counts, block sizes
    16/32/64/128, 2400 slots (several chunks of the per-expert kernel), a skewed routing."""
    pytest.importorskip("triton")
    from interpreted import assert_ran_ok, run_interpreted

    res = run_interpreted(_CHUNKED_ROUTING_CHECK, timeout=600)
    assert_ran_ok(res)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,limit,blocks", [("align_by_expert_small", "SMALL_ROUTING_SLOTS", (16, 32)),
                                                 ("align_by_expert_parallel", "PARALLEL_ROUTING_SLOTS",
                                                  (16, 32, 64, 128))])
def test_routing_kernels_equal_align_by_expert(kernel, limit, blocks):
    """The one-launch routings (one program up to 64 slots; one program per expert up to
    PARALLEL_ROUTING_SLOTS) give align_by_expert's outputs exactly, on fresh random routings."""
    dev = _cuda()
    from deepinfer.kernels.triton import fp4_moe

    route, max_slots = getattr(fp4_moe, kernel), getattr(fp4_moe, limit)
    for _ in range(20):
        e = int(torch.randint(2, 300, ()))
        k = int(torch.randint(1, min(e, 8) + 1, ()))
        t = int(torch.randint(1, max_slots // k + 1, ()))
        bm = blocks[int(torch.randint(0, len(blocks), ()))]
        ids = torch.rand(t, e, device=dev).argsort(dim=1)[:, :k].contiguous()  # k distinct experts per token
        want, got = fp4_moe.align_by_expert(ids, e, bm), route(ids, e, bm)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (kernel, t, k, e, bm)


@pytest.mark.gpu
@pytest.mark.parametrize("expand", [0, 1, 2])
def test_triton_fp4_expansions_match_twin(expand):
    """Every FP4 -> bf16 expansion of fp4_moe (`EXPANSIONS`), default or not, at a decode and a prefill
    shape: the benchmark compares them, so each must compute the twin's function."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe

    for rows in (3, 200):
        bank = _random_bank(32, 512, 256, 128, dev)
        x = torch.randn(rows, 512, device=dev).to(BF16)
        ids = torch.stack([torch.randperm(32, device=dev)[:6] for _ in range(rows)])
        weights = torch.rand(rows, 6, device=dev) * 0.5
        got = fp4_moe(x, ids, weights, bank, 10.0, expand=expand)
        rel = _rel(got, fp4_moe_torch(x, ids, weights, bank, 10.0))
        print(f"fp4_moe expand={expand} T={rows}: rel_err={rel:.2e}")
        assert bool(torch.isfinite(got).all()) and rel <= 1e-3


@pytest.mark.gpu
def test_register_cuda_kernels_installs_the_ops():
    _cuda()
    from deepinfer import kernels
    from deepinfer.kernels.triton import register_cuda_kernels
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    names = register_cuda_kernels()
    assert {"fp8_linear", "fp4_moe"} <= set(names)
    assert kernels.get("fp8_linear", "cuda") is fp8_linear and kernels.get("fp4_moe", "cuda") is fp4_moe


@pytest.mark.gpu
def test_triton_ops_capture_in_a_cuda_graph():
    """No host sync inside either op (routing included): both replay from a CUDA graph, same results."""
    dev = _cuda()
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from deepinfer.kernels.triton.fp8_gemm import fp8_linear

    w = _random_fp8_weight(512, 1024, 128, 128, dev)
    bank = _random_bank(32, 512, 256, 128, dev)
    x = torch.randn(3, 1024, device=dev).to(BF16)
    xm = torch.randn(3, 512, device=dev).to(BF16)
    ids = torch.stack([torch.randperm(32, device=dev)[:6] for _ in range(3)])
    weights = torch.rand(3, 6, device=dev)
    eager = (fp8_linear(x, w), fp4_moe(xm, ids, weights, bank, 10.0))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (fp8_linear(x, w), fp4_moe(xm, ids, weights, bank, 10.0))
    captured[0].fill_(float("nan"))
    captured[1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
