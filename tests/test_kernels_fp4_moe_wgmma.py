"""The wgmma form of the routed experts at prefill (deepinfer/kernels/cuda/fp4_moe_wgmma.cu + .py: a producer
warp feeds weights and gathered activations through a TMA ring, consumer warpgroups expand the FP4 weights
into wgmma's register operand; wired into `fp4_moe` as config WGMMA and, by DEEPINFER_MOE_PREFILL_KERNEL /
PREFILL_FORM, as the prefill form), and its operand order (`act_quant.wgmma_k_order`, `act_quant_gather`).

CPU: the K order is a bijection and is the one the A fragment's registers hold (derived here from the
m16n8k16 fragment layout and `e2m1_pair`, independently of the kernel's formula); `act_quant_gather` under
the Triton interpreter against act_quant + gather + that order; the launcher's checks; the source compiles
for sm_90a where NVRTC is installed.
GPU (`-m gpu`, fresh random inputs):
* one-hot activation rows pick single weights: every output equals one weight E2M1 x 2^(S-127) bit for bit,
  all 256 bytes, scale bytes 2..128, rows past N (a partial TMA box), K long enough for the ring to wrap;
* the plain kernel (fp32 out) against float64 sums, rel_err <= 1e-5; the gated kernel against the plain
  kernel's own fp32 sums through the official SwiGLU in torch (bf16 outputs equal but for rare 1-ulp
  differences of expf);
* the whole op against the torch twin and the Triton prefill plan at V4-Flash dims (rel_err <= 1e-3);
  CUDA-graph replay == eager; the default and DEEPINFER_MOE_PREFILL_KERNEL pick it (or Triton).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=1), dict(BT=128, CWG=2, STAGES=4, FRAG_BUFS=2, HALVES=0),
                dict(BT=64, CWG=2, STAGES=4, FRAG_BUFS=2, HALVES=0), dict(BT=128, CWG=1, STAGES=2, FRAG_BUFS=2, HALVES=0),
                dict(BT=64, CWG=4, STAGES=6, FRAG_BUFS=1, HALVES=1), dict(BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=0),
                dict(BT=128, CWG=2, STAGES=2, FRAG_BUFS=1, HALVES=1)]
TILE_CONFIGS = [dict(c, MIN_CTAS=1) for c in TILE_CONFIGS] + [
    dict(BT=128, CWG=2, STAGES=2, FRAG_BUFS=1, HALVES=0, MIN_CTAS=2), dict(BT=128, CWG=1, STAGES=3, FRAG_BUFS=1, HALVES=1, MIN_CTAS=2)]
# thread 0 as the producer (no producer warp): every pipeline form (whole stages, halves, two fragment buffers)
PW0_CONFIGS = [dict(BT=128, CWG=4, STAGES=4, FRAG_BUFS=1, HALVES=0, MIN_CTAS=1, PRODUCER_WARP=0),
               dict(BT=64, CWG=2, STAGES=3, FRAG_BUFS=1, HALVES=0, MIN_CTAS=2, PRODUCER_WARP=0),
               dict(BT=128, CWG=2, STAGES=2, FRAG_BUFS=1, HALVES=1, MIN_CTAS=1, PRODUCER_WARP=0),
               dict(BT=64, CWG=1, STAGES=2, FRAG_BUFS=2, HALVES=0, MIN_CTAS=1, PRODUCER_WARP=0)]
TILE_CONFIGS = TILE_CONFIGS + PW0_CONFIGS


def _tag(c: dict) -> str:
    return f"BT{c['BT']}wg{c['CWG']}s{c['STAGES']}f{c['FRAG_BUFS']}h{c['HALVES']}m{c['MIN_CTAS']}pw{c.get('PRODUCER_WARP', 1)}"


# ---------------------------------------------------------------------------------------------- CPU
def test_k_order_is_what_the_a_fragments_hold():
    """Lane (g, t) of a warp holds, for 16-K step s, A fragment registers a0..a3 = (row g, logical K 16s + 2t,
    +1), (row g + 8, same), (row g, 16s + 2t + 8, +9), (row g + 8, same) (PTX m16n8k16 / wgmma RS layout),
    low half = the lower K. The kernel fills them from word q = s >> 1 of the lane's 16 bytes of the row
    (physical K 32t .. 32t + 31) with e2m1_pair<2u> (a0, a1) and e2m1_pair<2u + 1> (a2, a3), u = s & 1,
    e2m1_pair<c>(w) = (nibble c, nibble c + 4). So the logical K of each half names a physical K; that map
    must be `wgmma_k_order`, and a bijection of each 128."""
    from deepinfer.kernels.triton.act_quant import wgmma_k_order

    held = {}
    for t in range(4):
        for s in range(8):
            q, u = s >> 1, s & 1
            for c, k_lo in ((2 * u, 16 * s + 2 * t), (2 * u + 1, 16 * s + 2 * t + 8)):
                for half, nibble in ((0, c), (1, c + 4)):  # low half = logical k_lo, high = k_lo + 1
                    held[k_lo + half] = 32 * t + 8 * q + nibble
    assert sorted(held) == list(range(128)) and sorted(held.values()) == list(range(128))
    logical = torch.arange(256)
    want = torch.tensor([held[int(c) % 128] + 128 * (int(c) // 128) for c in logical])
    assert torch.equal(wgmma_k_order(logical), want)


def check_act_quant_gather(device: str = "cpu") -> None:
    """act_quant_gather against act_quant (formats, the reference) + the gather + `wgmma_k_order`, bit for bit,
    for act blocks 128 and 32 and the unquantised form; padding rows zero, unused blocks' rows left alone."""
    from deepinfer.kernels.triton.act_quant import act_quant_gather, wgmma_k_order
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    gen = torch.Generator().manual_seed(5)
    t, topk, e, bt = 7, 3, 5, 8
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])
    sorted_slots, block_expert = align_by_expert(ids, e, bt)
    assert int((block_expert < 0).sum()) > 0  # the bound leaves unused blocks: they must be skipped
    # The default (8192 values a program, here bt = 8 slots at most): K = 256 programs of 256 columns and 8 slots;
    # 2048: 1024 columns, 8 slots; 2304 (V4.1-Flash's I): 9 programs of 256 columns across a row, 8 slots each.
    # (elems, num_warps), other program sizes: 512 at K 256: 2 slots; 128: one 128-column group of one slot a
    # program, at any K; 4096 at K 2048: 4 slots of 1024 columns; 1024: one slot (the rule before 2026-12-07)
    for k, block, quant, elems, warps in ((256, 128, True, None, None), (256, 32, True, None, None),
                                          (256, 128, False, None, None), (2048, 128, True, None, None),
                                          (2304, 32, True, None, None), (256, 128, True, 512, 2),
                                          (2304, 32, True, 128, 1), (2048, 128, True, 4096, 8),
                                          (2048, 128, True, 1024, 4)):
        x = (torch.randn(t, k, generator=gen) * 3).to(BF16)
        got = act_quant_gather(x.to(device), block, sorted_slots.to(device), block_expert.to(device), t * topk, topk,
                               bt, quant=quant, elems=elems, num_warps=warps).cpu()
        deq = formats.act_quant_dequant(x.float(), block).to(BF16) if quant else x
        order = wgmma_k_order(torch.arange(k))
        for p, slot in enumerate(sorted_slots.tolist()):
            if block_expert[p // bt] < 0:
                continue  # unused blocks: not written
            row = deq[slot // topk, order] if slot < t * topk else torch.zeros(k, dtype=BF16)
            assert torch.equal(got[p], row), (k, block, quant, elems, p, slot)


def test_act_quant_gather_matches_act_quant_and_the_order():
    """Under the interpreter (with the GPU's fp32 -> E4M3 / bf16 rounding restored, as the fp8_linear tests)."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    from interpreted import GPU_ROUNDINGS  # the GPU's roundings in Triton's interpreter

    done = run_interpreted(GPU_ROUNDINGS + "\nfrom test_kernels_fp4_moe_wgmma import check_act_quant_gather as c\n"
                           "c()\nprint('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_act_quant_gather_rejects_a_bad_program_size(monkeypatch):
    """A bad program size, given or from DEEPINFER_GATHER_PLAN (the A/B switch), is refused before a launch."""
    pytest.importorskip("triton")
    from deepinfer import env
    from deepinfer.kernels.triton.act_quant import act_quant_gather

    x, slots, blocks = torch.zeros(4, 256, dtype=BF16), torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for elems in (100, 64):
        with pytest.raises(ValueError, match=f"elems {elems} must be a power of two >= 128"):
            act_quant_gather(x, 128, slots, blocks, 4, 1, 8, elems=elems)
    monkeypatch.setenv("DEEPINFER_GATHER_PLAN", "elems:4096;warps:8")
    assert env.gather_plan() == {"elems": 4096, "warps": 8}
    monkeypatch.setenv("DEEPINFER_GATHER_PLAN", "elems:96")
    with pytest.raises(ValueError, match="elems 96 must be a power of two"):
        act_quant_gather(x, 128, slots, blocks, 4, 1, 8)
    monkeypatch.setenv("DEEPINFER_GATHER_PLAN", "rows:2")
    with pytest.raises(ValueError, match="DEEPINFER_GATHER_PLAN: unknown key 'rows'"):
        env.gather_plan()
    monkeypatch.setenv("DEEPINFER_GATHER_PLAN", "elems=4096")
    with pytest.raises(ValueError, match="DEEPINFER_GATHER_PLAN must be key:int items"):
        env.gather_plan()


def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm

    w = torch.zeros(2, 64, 128, dtype=torch.uint8)  # K = 256
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    slots, blocks = torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    a = torch.zeros(128, 256, dtype=BF16)
    out, rw = torch.zeros(4, 64, dtype=BF16), torch.ones(4)
    with pytest.raises(ValueError, match="a must be contiguous bf16"):
        expert_gemm(a.float(), w, s, out, rw, slots, blocks, 4, False)
    with pytest.raises(ValueError, match="a has 64 rows, the routing 1 blocks of 128"):
        expert_gemm(a[:64], w, s, out, rw, slots, blocks, 4, False)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        expert_gemm(a, w, s[:, :, :4], out, rw, slots, blocks, 4, False)
    with pytest.raises(ValueError, match=r"out must be \[4, 32\] torch.bfloat16"):
        expert_gemm(a, w, s, out, rw, slots, blocks, 4, True)  # gated: N = 64 / 2
    with pytest.raises(ValueError, match="sorted_slots must be int32"):
        expert_gemm(a, w, s, out, rw, slots[:64], blocks, 4, False)
    with pytest.raises(ValueError, match="route_w must be fp32"):
        expert_gemm(a, w, s, out, rw[:2], slots, blocks, 4, False)
    with pytest.raises(ValueError, match="K=128 must be a positive multiple of 256"):
        expert_gemm(a[:, :128].contiguous(), w[:, :, :64], s[:, :, :4], out, rw, slots, blocks, 4, False,
                    config={"FRAG_BUFS": 2, "HALVES": 0})
    with pytest.raises(ValueError, match="BT 64/128"):
        expert_gemm(a, w, s, out, rw, slots, blocks, 4, False, config={"BT": 32})


def test_tile_rules_and_shared_memory():
    from deepinfer.kernels.cuda import fp4_moe_wgmma as wg
    from deepinfer.kernels.cuda import runtime

    cfg = wg.tiles()
    assert wg.rows_per_cta(cfg) == 64 * cfg["CWG"]
    assert wg.smem_bytes(dict(cfg, CWG=2)) == 4 * (2 * 128 * 128 + 128 * 64) + 16 * 4 + 1024  # 160 KB of ring
    assert wg.check_k(4096, cfg) is None and "multiple of 256" in wg.check_k(384, dict(cfg, FRAG_BUFS=2))
    assert wg.check_k(384, wg.tiles({"FRAG_BUFS": 1, "HALVES": 0})) is None
    with pytest.raises(ValueError, match="HALVES 0/1 .only with FRAG_BUFS 1"):
        wg.tiles({"FRAG_BUFS": 2, "HALVES": 1})
    with pytest.raises(ValueError, match="shared memory"):
        wg.tiles({"STAGES": 6, "CWG": 2})
    with pytest.raises(ValueError, match="2 CTAs do not fit"):
        wg.tiles({"STAGES": 3, "CWG": 2, "MIN_CTAS": 2})
    assert wg.tiles({"STAGES": 2, "CWG": 2, "MIN_CTAS": 2})["MIN_CTAS"] == 2
    with pytest.raises(ValueError, match="too few registers"):
        wg.tiles({"STAGES": 2, "CWG": 4, "MIN_CTAS": 2})
    with pytest.raises(ValueError, match="BT 64/128"):
        wg.tiles({"BT": 256})
    # without the producer warp a CTA is its consumer warpgroups: 2 CTAs of 4 fit the SM's thread budget
    assert wg.threads(dict(cfg, CWG=4, PRODUCER_WARP=1)) == 544 and wg.threads(dict(cfg, CWG=4, PRODUCER_WARP=0)) == 512
    assert wg.tiles({"STAGES": 2, "CWG": 2, "MIN_CTAS": 3, "BT": 64, "PRODUCER_WARP": 0})["MIN_CTAS"] == 3
    with pytest.raises(ValueError, match="PRODUCER_WARP 0/1"):
        wg.tiles({"PRODUCER_WARP": 2})
    assert "at most 128 bytes" in runtime.check_tensor_map((256, 512), (512, 1), 0x1000, (128, 256), swizzle=128)
    assert runtime.check_tensor_map((256, 512), (512, 1), 0x1000, (128, 128), swizzle=128) is None
    assert "swizzle 100" in runtime.check_tensor_map((256, 512), (512, 1), 0x1000, (128, 128), swizzle=100)


def test_plan_tiles_by_regime():
    """Tiles by slots per expert, config on top; both regimes' tiles take one fragment buffer (the tiny
    checkpoints' I = 128 is one 128-K stage: the launcher refuses two buffers there)."""
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.fp4_moe import WGMMA_TILES, WGMMA_TILES_FEW, plan_wgmma

    from deepinfer.kernels.cuda.fp4_moe_wgmma import tiles

    assert plan_wgmma(8192 * 6, 256, {"WGMMA": True}) == tiles(WGMMA_TILES) == dict(tiles(), **WGMMA_TILES)
    assert plan_wgmma(2048 * 6, 256, {"WGMMA": True}) == tiles(WGMMA_TILES_FEW)  # 48 slots per expert
    assert plan_wgmma(8192 * 6, 256, {"WGMMA": True, "TRIM": 0})["TRIM"] == 0
    assert plan_wgmma(8192 * 6, 256, {"WGMMA": True, "BT": 64})["BT"] == 64
    two = {"WGMMA": True, "CWG": 2, "FRAG_BUFS": 2, "HALVES": 0}
    assert plan_wgmma(8192 * 6, 256, two)["FRAG_BUFS"] == 2
    assert plan_wgmma(600, 8, {k: v for k, v in two.items() if k != "FRAG_BUFS"})["FRAG_BUFS"] == 1
    assert plan_wgmma(600, 8, two)["FRAG_BUFS"] == 2  # given: the launcher refuses I = 128


def test_moe_prefill_kernel_choice(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", "WGMMA")
    assert env.moe_prefill_kernel() == "wgmma"
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", "tma")
    with pytest.raises(ValueError, match="DEEPINFER_MOE_PREFILL_KERNEL='tma'"):
        env.moe_prefill_kernel()


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_wgmma import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [{**cfg, "GATED": gated, "OUT_F32": out_f32} for cfg in TILE_CONFIGS
                             for gated, out_f32 in ((1, 0), (0, 0), (0, 1))], arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the wgmma form needs sm_90")
    return dev


def _slot_routing(sorted8: torch.Tensor, block8: torch.Tensor, n_slots: int, e: int, bt: int):
    """The routing of the helpers' blocks of 8 re-made in blocks of bt: each slot as a token with top-1."""
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    expert = torch.empty(n_slots, dtype=torch.int64)
    slots = sorted8.cpu().view(-1, 8)
    for b, ex in enumerate(block8.cpu().tolist()):
        for slot in slots[b].tolist():
            if ex >= 0 and slot < n_slots:
                expert[slot] = ex
    return align_by_expert(expert.view(-1, 1), e, bt)


def wgmma_partials(a, w, s, out, sorted8, block8, n_slots, a_row_div, cfg):
    """The plain kernel (fp32 out) behind the decode forms' `expert_gemm_partials` call (split 1 only), for
    `assert_one_hot_exact` / `assert_partials_match_float64`: the activations gathered without act_quant."""
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm
    from deepinfer.kernels.triton.act_quant import act_quant_gather

    assert out.shape[0] == 1, "the wgmma kernel has no split-K"
    dev = out.device
    sorted_slots, block_expert = (t.to(dev) for t in _slot_routing(sorted8, block8, n_slots, w.shape[0], cfg["BT"]))
    ag = act_quant_gather(a, 128, sorted_slots, block_expert, n_slots, a_row_div, cfg["BT"], quant=False)
    route_w = torch.ones(n_slots, device=dev)
    expert_gemm(ag, w, s, out[0], route_w, sorted_slots, block_expert, n_slots, False, 0.0, cfg)
    return out


@pytest.mark.gpu
def test_act_quant_gather_compiled():
    check_act_quant_gather(str(_cuda()))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """`assert_one_hot_exact` at K = 2048 (16 stages: every ring wraps) and 96 rows (a partial TMA box)."""
    from test_kernels_fp4_moe_mma import assert_one_hot_exact

    assert_one_hot_exact(wgmma_partials, cfg, (1,), _cuda(), k=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_plain_kernel_matches_float64(cfg):
    from test_kernels_fp4_moe_mma import assert_partials_match_float64

    assert_partials_match_float64(wgmma_partials, cfg, 2048, (1,), _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:3], ids=_tag)
def test_gated_kernel_is_the_official_swiglu_of_its_sums(cfg):
    """GATED output = bf16(route_w * silu(bf16 gate) * bf16 up) with the clamps, gate and up being the plain
    kernel's fp32 sums of the same rows (the same per-element K order in both kernels, so the same bits)."""
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm
    from deepinfer.kernels.triton.act_quant import act_quant_gather
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    dev = _cuda()
    gen = torch.Generator().manual_seed(21)
    e, d, inter, t, topk = 8, 1024, 288, 150, 6  # I = 288: the last CTA of 64 features runs past N
    w = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, generator=gen).to(dev)
    s = torch.randint(110, 126, (e, 2 * inter, d // 32), dtype=torch.uint8, generator=gen).to(dev)
    x = torch.randn(t, d, generator=gen).to(BF16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)]).to(dev)
    route_w = torch.rand(t * topk, generator=gen).to(dev)
    sorted_slots, block_expert = align_by_expert(ids, e, cfg["BT"])
    ag = act_quant_gather(x, 128, sorted_slots, block_expert, t * topk, topk, cfg["BT"], quant=False)
    sums = torch.full((t * topk, 2 * inter), float("nan"), device=dev)
    expert_gemm(ag, w, s, sums, route_w, sorted_slots, block_expert, t * topk, False, 0.0, cfg)
    for limit in (0.0, 7.0):
        got = torch.full((t * topk, inter), float("nan"), device=dev, dtype=BF16)
        expert_gemm(ag, w, s, got, route_w, sorted_slots, block_expert, t * topk, True, limit, cfg)
        gate, up = sums[:, :inter].to(BF16).float(), sums[:, inter:].to(BF16).float()
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        want = (route_w[:, None] * (gate * torch.sigmoid(gate) * up)).to(BF16)
        assert not torch.isnan(got.float()).any()
        diff = (got.float() - want.float()).abs()
        ulp = want.float().abs().clamp(min=1e-30) * 2.0 ** -7
        off = diff > 0
        print(f"{_tag(cfg)} limit={limit}: {int(off.sum())} of {off.numel()} outputs differ, "
              f"max {float((diff / ulp).max()):.2f} ulp")
        assert bool((diff <= ulp).all()) and int(off.sum()) <= off.numel() // 1000, (cfg, limit)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TILE_CONFIGS[5], dict(BT=64, CWG=2, STAGES=3, FRAG_BUFS=1, HALVES=1, MIN_CTAS=3),
                                 TILE_CONFIGS[0]], ids=_tag)
def test_trimmed_blocks_match_untrimmed_bit_for_bit(cfg):
    """TRIM 1 (a routing block's wgmmas over the smallest N of 16 .. BT that holds its real slots) gives the
    untrimmed kernel's bits, plain and gated: every output element is the same per-element MMA sum. The
    experts' slot counts are set so the last blocks hold 1..BT real slots (every width runs)."""
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm, tiles
    from deepinfer.kernels.triton.act_quant import act_quant_gather
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    dev = _cuda()
    gen = torch.Generator().manual_seed(33)
    bt = cfg["BT"]
    counts = [1, 9, 16, 17, 33, 64, 65, 100, bt, bt + 1, 2 * bt - 1, 40]  # slots per expert
    e, d, inter = len(counts), 512, 256
    expert = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    expert = expert[torch.randperm(expert.numel(), generator=gen)]
    n = expert.numel()
    w = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, generator=gen).to(dev)
    s = torch.randint(110, 126, (e, 2 * inter, d // 32), dtype=torch.uint8, generator=gen).to(dev)
    x = torch.randn(n, d, generator=gen).to(BF16).to(dev)
    route_w = torch.rand(n, generator=gen).to(dev)
    sorted_slots, block_expert = align_by_expert(expert.view(-1, 1).to(dev), e, bt)
    ag = act_quant_gather(x, 128, sorted_slots, block_expert, n, 1, bt, quant=False)
    for gated, shape, dtype in ((False, (n, 2 * inter), torch.float32), (True, (n, inter), BF16)):
        outs = []
        for trim in (1, 0):
            out = torch.full(shape, float("nan"), device=dev, dtype=dtype)
            expert_gemm(ag, w, s, out, route_w, sorted_slots, block_expert, n, gated, 7.0, tiles(dict(cfg, TRIM=trim)))
            outs.append(out)
        print(f"trim {_tag(cfg)} gated={gated}: {int((outs[0] != outs[1]).sum())} of {outs[0].numel()} differ")
        assert not torch.isnan(outs[0].float()).any() and torch.equal(outs[0], outs[1]), (cfg, gated)


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    return _random_bank(256, 4096, 2048, 128, _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 512, 2048])
def test_op_matches_twin_and_triton_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import PREFILL_V2, fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        triton_v2 = fp4_moe(x, ids, weights, flash_bank, limit, expand=6, config=PREFILL_V2)
        for cfg in ({"WGMMA": True}, {"WGMMA": True, "BT": 64}, {"WGMMA": True, "CWG": 2, "FRAG_BUFS": 2, "HALVES": 0}):
            got = fp4_moe(x, ids, weights, flash_bank, limit, config=cfg)
            rel, rel_v2 = _rel(got, want), _rel(got, triton_v2)
            print(f"wgmma T={t} limit={limit} {cfg}: rel_err {rel:.2e} vs twin, {rel_v2:.2e} vs triton")
            assert bool(torch.isfinite(got).all()) and max(rel, rel_v2) <= 1e-3, (cfg, rel, rel_v2)


@pytest.mark.gpu
def test_op_small_bank_act_block_32_and_graph_replay():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, wgmma_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(32, 512, 256, 32, dev)
    assert wgmma_form_usable(bank, dev)
    for t in (1, 40, 300):
        x, ids, weights = _inputs(t, dev, e=32, d=512)
        want = fp4_moe_torch(x, ids, weights, bank, 10.0)
        got = fp4_moe(x, ids, weights, bank, 10.0, config={"WGMMA": True})
        assert _rel(got, want) <= 1e-3, (t, _rel(got, want))
        assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"WGMMA": True}),
                               f"fp4_moe wgmma T={t}")


@pytest.mark.gpu
def test_default_form_switches_above_wgmma_slots_per_expert(monkeypatch):
    """The default (auto) runs the TMA decode form up to WGMMA_SLOTS_PER_EXPERT slots per expert and the wgmma
    form above (the H100's crossover, 2026-12-06), bit-identical to the explicit configs on each side."""
    from deepinfer.kernels.triton.fp4_moe import (DECODE_TMA, PREFILL_WGMMA, WGMMA_SLOTS_PER_EXPERT, fp4_moe,
                                                  tma_form_usable, wgmma_form_usable)
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank

    for name in ("DEEPINFER_MOE_PREFILL_KERNEL", "DEEPINFER_MOE_DECODE_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    dev = _cuda()
    e = 32
    bank = _random_bank(e, 512, 256, 128, dev)
    assert tma_form_usable(bank, dev) and wgmma_form_usable(bank, dev)
    edge = WGMMA_SLOTS_PER_EXPERT * e // 6  # tokens of 6 slots each: at most the boundary's slots per expert
    for t, want_cfg in ((edge, DECODE_TMA), (edge + 1, PREFILL_WGMMA), (3 * edge, PREFILL_WGMMA)):
        x, ids, weights = _inputs(t, dev, e=e, d=512)
        got = fp4_moe(x, ids, weights, bank, 10.0)
        assert torch.equal(got, fp4_moe(x, ids, weights, bank, 10.0, config=want_cfg)), (t, want_cfg)
        other = PREFILL_WGMMA if want_cfg is DECODE_TMA else DECODE_TMA
        assert not torch.equal(got, fp4_moe(x, ids, weights, bank, 10.0, config=other)), (t, "forms agree")


@pytest.mark.gpu
def test_prefill_default_follows_the_env_choice(monkeypatch):
    """Above 16 slots per expert (past WGMMA_SLOTS_PER_EXPERT too) the default (auto, PREFILL_FORM "wgmma") and
    DEEPINFER_MOE_PREFILL_KERNEL=wgmma run the wgmma form (bit-identical to config WGMMA; I = 128 with one
    fragment buffer), =triton the Triton plan; a bank it cannot run (a scale byte above 128) falls back to the
    Triton plan (expand 5 there)."""
    from deepinfer.kernels.triton.fp4_moe import PREFILL_V2, fp4_moe, wgmma_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank

    dev = _cuda()
    wgmma = {"WGMMA": True}
    for choice, inter, big_scale, want_cfg, expand in (
            ("auto", 256, False, wgmma, None), ("wgmma", 128, False, wgmma, None),
            ("triton", 256, False, PREFILL_V2, 6), ("auto", 256, True, PREFILL_V2, 5)):
        monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", choice)
        bank = _random_bank(8, 512, inter, 128, dev)
        if big_scale:
            w2s = bank.w2_scale.clone()
            w2s[3, 5, 1] = 129
            bank = FP4ExpertBank(bank.w13, bank.w13_scale, bank.w2, w2s, 128)
        assert wgmma_form_usable(bank, dev) == (not big_scale)
        x, ids, weights = _inputs(64, dev, e=8, d=512)  # 384 slots over 8 experts: the prefill regime
        got = fp4_moe(x, ids, weights, bank, 10.0)
        want = fp4_moe(x, ids, weights, bank, 10.0, expand=expand, config=want_cfg)
        assert torch.equal(got, want), (choice, inter, big_scale)


@pytest.mark.gpu
def test_op_refuses_scales_above_the_exact_range():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, wgmma_form_usable

    dev = _cuda()
    sc = lambda *s: torch.full(s, 120, dtype=torch.uint8, device=dev)  # noqa: E731
    w2s = sc(4, 512, 8)
    w2s[1, 2, 3] = 129
    bank = FP4ExpertBank(torch.randint(0, 256, (4, 512, 256), dtype=torch.uint8, device=dev), sc(4, 512, 16),
                         torch.randint(0, 256, (4, 512, 128), dtype=torch.uint8, device=dev), w2s, 128)
    assert not wgmma_form_usable(bank, dev)
    x, ids, w = torch.randn(2, 512, device=dev).to(BF16), torch.tensor([[0, 1], [2, 3]], device=dev), torch.rand(2, 2, device=dev)
    with pytest.raises(ValueError, match="wgmma form: exact for E8M0 scale bytes up to 128; this bank has 129"):
        fp4_moe(x, ids, w, bank, 0.0, config={"WGMMA": True})
