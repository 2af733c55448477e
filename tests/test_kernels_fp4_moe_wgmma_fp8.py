"""The FP8 wgmma form of the routed experts at prefill (deepinfer/kernels/cuda/fp4_moe_wgmma_fp8.cu + .py: the
FP4 weights placed into E4M3 codes as wgmma's register operand, act_quant's E4M3 codes as its shared-memory
operand, the official promotion into fp32 every 32 of K; wired into `fp4_moe` as config WGMMA_FP8 and by
DEEPINFER_MOE_PREFILL_KERNEL=wgmma_fp8), and its operand order (`act_quant.wgmma_fp8_k_order`,
`act_quant_gather_fp8`).

CPU: the bit placement E2M1 nibble -> E4M3 byte is E2M1 x 2^-6 exactly for all 16 codes (what the kernel's
weight scale 2^(S-121) assumes); the K order is a bijection and is the one the A fragment's registers hold
(derived from the m16n8k32 fragment layout and the even / odd nibble split, independently of the formula);
`act_quant_gather_fp8` under the Triton interpreter against formats.act_quant + gather + that order; the
launcher's checks; the source compiles for sm_90a where NVRTC is installed.
GPU (`-m gpu`, fresh random inputs):
* one-hot activation rows pick single weights: every output equals one weight E2M1 x 2^(S-127) bit for bit
  (all 256 bytes, scale bytes 2..128, rows past N, K long enough for the ring to wrap), act blocks 128 and 32;
* the plain kernel (fp32 out) against float64 sums of the dequantised operands (the official math's value);
* the gated kernel against the plain kernel's own fp32 sums through the official SwiGLU in torch;
* the whole op against the torch twin and the bf16 wgmma form at V4-Flash dims; act block 32 (V4.1) and
  CUDA-graph replay == eager; DEEPINFER_MOE_PREFILL_KERNEL=wgmma_fp8 picks it.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import fp4_moe_torch

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(BT=64, CWG=2, STAGES=4, PBUFS=1, MIN_CTAS=1), dict(BT=64, CWG=2, STAGES=4, PBUFS=2, MIN_CTAS=1),
                dict(BT=128, CWG=1, STAGES=3, PBUFS=1, MIN_CTAS=1), dict(BT=64, CWG=1, STAGES=2, PBUFS=2, MIN_CTAS=1),
                dict(BT=64, CWG=3, STAGES=3, PBUFS=1, MIN_CTAS=1)]


def _tag(c: dict) -> str:
    return f"BT{c['BT']}wg{c['CWG']}s{c['STAGES']}p{c['PBUFS']}m{c['MIN_CTAS']}"


# ---------------------------------------------------------------------------------------------- CPU
def _place(byte_words: torch.Tensor, odd: bool) -> torch.Tensor:
    """The kernel's e4m3_even / e4m3_odd on int64 words (32-bit values)."""
    w = byte_words
    if odd:
        return ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)


def test_e2m1_bit_placement_is_e4m3_times_2_pow_minus_6():
    """Every byte's two nibbles, placed as the kernel does, decode (as float8_e4m3fn) to their E2M1 value x 2^-6,
    including the subnormal 0.5 and both zeros: the kernel's weight scale is 2^(S-127+6)."""
    b = torch.arange(256, dtype=torch.int64)
    words = b | (b << 8) | (b << 16) | (b << 24)  # the byte in every position of the word
    e2m1 = formats.fp4_codes_to_float(formats.unpack_fp4(b.to(torch.uint8))).view(256, 2).double()
    for odd in (False, True):
        placed = _place(words, odd)
        for pos in range(4):
            code = ((placed >> (8 * pos)) & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).double()
            assert torch.equal(code, e2m1[:, int(odd)] * 2.0 ** -6), (odd, pos)


def test_k_order_is_what_the_a_fragments_hold():
    """Lane (g, t) holds, for a 32-K step, A registers r0 = (row g, logical K 4t .. 4t + 3), r1 = (row g + 8,
    same), r2 = (row g, 16 + 4t .. + 3), r3 = (row g + 8, same) (PTX m16n8k32 / wgmma RS layout for 8-bit types,
    byte i = the lower K first). The kernel fills r0 / r1 with the even nibbles and r2 / r3 with the odd nibbles
    of the lane's word (natural K 8t .. 8t + 7, nibble i = natural 8t + i). So each logical K names a natural
    K; that map must be `wgmma_fp8_k_order`, a bijection of each 32."""
    from deepinfer.kernels.triton.act_quant import wgmma_fp8_k_order

    held = {}
    for t in range(4):
        for i in range(4):
            held[4 * t + i] = 8 * t + 2 * i  # r0 byte i: nibble 2i
            held[16 + 4 * t + i] = 8 * t + 2 * i + 1  # r2 byte i: nibble 2i + 1
    assert sorted(held) == list(range(32)) and sorted(held.values()) == list(range(32))
    logical = torch.arange(256)
    want = torch.tensor([held[int(c) % 32] + 32 * (int(c) // 32) for c in logical])
    assert torch.equal(wgmma_fp8_k_order(logical), want)


def check_act_quant_gather_fp8(device: str = "cpu") -> None:
    """act_quant_gather_fp8 against formats.act_quant (the reference) + the gather + `wgmma_fp8_k_order`, bit for
    bit, codes and transposed scales, for act blocks 128, 64 and 32; padding rows zero codes, unused blocks'
    rows left alone."""
    from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8, wgmma_fp8_k_order
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    gen = torch.Generator().manual_seed(5)
    t, topk, e, bt = 7, 3, 5, 8
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])
    sorted_slots, block_expert = align_by_expert(ids, e, bt)
    assert int((block_expert < 0).sum()) > 0  # the bound leaves unused blocks: they must be skipped
    for k, block in ((256, 128), (256, 32), (384, 64), (2048, 128)):
        x = (torch.randn(t, k, generator=gen) * 3).to(BF16)
        q, s_t = act_quant_gather_fp8(x.to(device), block, sorted_slots.to(device), block_expert.to(device), t * topk,
                                      topk, bt)
        q, s_t = q.cpu(), s_t.cpu()
        assert q.dtype == torch.float8_e4m3fn and tuple(s_t.shape) == (k // block, sorted_slots.numel())
        ref_q, ref_s = formats.act_quant(x.float(), block)
        order = wgmma_fp8_k_order(torch.arange(k))
        for p, slot in enumerate(sorted_slots.tolist()):
            if block_expert[p // bt] < 0:
                continue  # unused blocks: not written
            if slot < t * topk:
                assert torch.equal(q[p].view(torch.uint8), ref_q[slot // topk, order].view(torch.uint8)), (k, block, p)
                assert torch.equal(s_t[:, p], ref_s[slot // topk]), (k, block, p)
            else:
                assert not q[p].float().any(), (k, block, p)


def test_act_quant_gather_fp8_matches_act_quant_and_the_order():
    """Under the interpreter (with the GPU's fp32 -> E4M3 rounding restored, as the fp8_linear tests)."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    from test_kernels_fp8_linear import _INTERPRETER_FIXES

    done = run_interpreted(_INTERPRETER_FIXES + "\nfrom test_kernels_fp4_moe_wgmma_fp8 import check_act_quant_gather_fp8"
                           " as c\nc()\nprint('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_wgmma_fp8 import expert_gemm

    w = torch.zeros(2, 64, 128, dtype=torch.uint8)  # K = 256
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    slots, blocks = torch.zeros(64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    aq = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(2, 64)
    out, rw = torch.zeros(4, 64, dtype=BF16), torch.ones(4)
    with pytest.raises(ValueError, match="aq must be contiguous float8_e4m3fn"):
        expert_gemm(aq.float(), a_s, w, s, out, rw, slots, blocks, 4, False, 128)
    with pytest.raises(ValueError, match="aq has 32 rows, the routing 1 blocks of 64"):
        expert_gemm(aq[:32], a_s, w, s, out, rw, slots, blocks, 4, False, 128)
    with pytest.raises(ValueError, match=r"a_scale_t must be contiguous fp32 \[8, 64\]"):
        expert_gemm(aq, a_s, w, s, out, rw, slots, blocks, 4, False, 32)
    with pytest.raises(ValueError, match="act_block must be one of"):
        expert_gemm(aq, a_s, w, s, out, rw, slots, blocks, 4, False, 16)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        expert_gemm(aq, a_s, w, s[:, :, :4], out, rw, slots, blocks, 4, False, 128)
    with pytest.raises(ValueError, match=r"out must be \[4, 32\] torch.bfloat16"):
        expert_gemm(aq, a_s, w, s, out, rw, slots, blocks, 4, True, 128)  # gated: N = 64 / 2
    with pytest.raises(ValueError, match="K=64 must be a positive multiple of 128"):
        expert_gemm(aq[:, :64].contiguous(), a_s, w[:, :, :32], s[:, :, :2], out, rw, slots, blocks, 4, False, 128)
    with pytest.raises(ValueError, match="BT 64/128"):
        expert_gemm(aq, a_s, w, s, out, rw, slots, blocks, 4, False, 128, config={"BT": 32})


def test_tile_rules_and_shared_memory():
    from deepinfer.kernels.cuda import fp4_moe_wgmma_fp8 as wf

    cfg = wf.tiles()
    # per stage: 64 x 128 activation bytes, 128 x 64 weight bytes, 4 groups x 64 fp32 scales (act block 32)
    assert wf.smem_bytes(dict(cfg, BT=64, CWG=2, STAGES=4), 32) == 4 * (8192 + 8192 + 1024) + 64 + 1024
    assert wf.smem_bytes(dict(cfg, BT=64, CWG=2, STAGES=4), 128) == 4 * (8192 + 8192 + 256) + 64 + 1024
    with pytest.raises(ValueError, match="shared memory"):
        wf.tiles({"STAGES": 8, "BT": 128, "CWG": 4})
    with pytest.raises(ValueError, match="PBUFS 1/2"):
        wf.tiles({"PBUFS": 3})


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_wgmma_fp8 import SOURCE
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE, [{**cfg, "GATED": gated, "OUT_F32": out_f32, "ABLK": ablk} for cfg in TILE_CONFIGS[:2]
                             for gated, out_f32 in ((1, 0), (0, 1)) for ablk in (128, 32)]
                    + [{**cfg, "GATED": 1, "ABLK": 128} for cfg in TILE_CONFIGS[2:]], arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the wgmma form needs sm_90")
    return dev


def _partials(act_block: int):
    """The plain kernel (fp32 out) as an `expert_gemm_partials` for `assert_one_hot_exact` (split 1 only): the
    activations act_quant'ed (one-hot rows quantise exactly: 1 = 256 x 2^-8)."""
    def partials(a, w, s, out, sorted8, block8, n_slots, a_row_div, cfg):
        from deepinfer.kernels.cuda.fp4_moe_wgmma_fp8 import expert_gemm
        from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8
        from test_kernels_fp4_moe_wgmma import _slot_routing

        assert out.shape[0] == 1, "the wgmma kernel has no split-K"
        dev = out.device
        sorted_slots, block_expert = (t.to(dev) for t in _slot_routing(sorted8, block8, n_slots, w.shape[0], cfg["BT"]))
        aq, a_s = act_quant_gather_fp8(a, act_block, sorted_slots, block_expert, n_slots, a_row_div, cfg["BT"])
        route_w = torch.ones(n_slots, device=dev)
        expert_gemm(aq, a_s, w, s, out[0], route_w, sorted_slots, block_expert, n_slots, False, act_block, 0.0, cfg)
        return out
    return partials


@pytest.mark.gpu
def test_act_quant_gather_fp8_compiled():
    check_act_quant_gather_fp8(str(_cuda()))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """`assert_one_hot_exact` at K = 2048 (16 stages: every ring wraps) and 96 rows (a partial TMA box)."""
    from test_kernels_fp4_moe_mma import assert_one_hot_exact

    for act_block in (128, 32):
        assert_one_hot_exact(_partials(act_block), cfg, (1,), _cuda(), k=2048)


# The FP8 tensor cores' own sum of a 32-K partial is not an fp32 sum: they keep about 14 bits when adding the
# exact products (DeepSeek-V3 report, 3.3.2), so the promoted sums sit ~2e-5 off float64 (H100 2026-12-05: 2.1e-5
# at T=1, act block 128), where the bf16 forms' sums of exact products in fp32 meet 1e-5 (measured ~1e-6). The
# official fp4_gemm on Hopper runs the same instruction; the oracle's CPU math does not.
FP8_SUM_REL_ERR = 1e-4
FP8_OP_REL_ERR = 3e-3  # the whole op: that noise flips bf16 / E4M3 roundings of h (measured 1.4e-3, bf16 form 1.1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
@pytest.mark.parametrize("act_block", [128, 32])
def test_plain_kernel_matches_float64(cfg, act_block):
    """fp32 out against float64 sums of the dequantised operands (act_quant's q x s, the weights' E2M1 x
    2^(S-127)): T = 1, 5, 40 top-6 slots over 16 experts, w13's shape, K = 2048; no entry left unwritten."""
    from test_kernels_fp4_moe_mma import _routing, _weights_f64

    dev = _cuda()
    gen = torch.Generator(device="cpu").manual_seed(11)
    e, i, d = 16, 512, 2048
    w = torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 129, (e, 2 * i, d // 32), dtype=torch.uint8, generator=gen)
    wf = _weights_f64(w, s)
    w, s = w.to(dev), s.to(dev)
    for t in (1, 5, 40):
        x = (torch.randn(t, d, generator=gen) * torch.exp(torch.randn(t, 1, generator=gen))).to(BF16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)])
        out = torch.full((1, t * 6, 2 * i), float("nan"), device=dev)
        _partials(act_block)(x.to(dev), w, s, out, *(r.to(dev) for r in _routing(ids, e)), t * 6, 6, cfg)
        xd = formats.act_quant_dequant(x.float(), act_block).double().repeat_interleave(6, 0)
        want = torch.zeros(t * 6, 2 * i, dtype=torch.float64)
        for ex in ids.unique().tolist():
            rows = (ids.view(-1) == ex).nonzero().view(-1)
            want[rows] = xd[rows] @ wf[ex].T
        got = out[0].cpu().double()
        assert not torch.isnan(got).any(), (cfg, t, int(torch.isnan(got).sum()))
        rel = float((got - want).norm() / want.norm())
        print(f"{_tag(cfg)} act_block={act_block} T={t}: rel_err {rel:.2e}")
        assert rel <= FP8_SUM_REL_ERR, (cfg, t, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:2], ids=_tag)
def test_gated_kernel_is_the_official_swiglu_of_its_sums(cfg):
    """GATED output = bf16(route_w * silu(bf16 gate) * bf16 up) with the clamps, gate and up being the plain
    kernel's fp32 sums of the same rows (the same per-element promotion order in both kernels: the same bits)."""
    from deepinfer.kernels.cuda.fp4_moe_wgmma_fp8 import expert_gemm
    from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    dev = _cuda()
    gen = torch.Generator().manual_seed(21)
    e, d, inter, t, topk = 8, 1024, 288, 150, 6  # I = 288: the last CTA's features run past N
    w = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, generator=gen).to(dev)
    s = torch.randint(110, 126, (e, 2 * inter, d // 32), dtype=torch.uint8, generator=gen).to(dev)
    x = torch.randn(t, d, generator=gen).to(BF16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)]).to(dev)
    route_w = torch.rand(t * topk, generator=gen).to(dev)
    sorted_slots, block_expert = align_by_expert(ids, e, cfg["BT"])
    aq, a_s = act_quant_gather_fp8(x, 128, sorted_slots, block_expert, t * topk, topk, cfg["BT"])
    sums = torch.full((t * topk, 2 * inter), float("nan"), device=dev)
    expert_gemm(aq, a_s, w, s, sums, route_w, sorted_slots, block_expert, t * topk, False, 128, 0.0, cfg)
    for limit in (0.0, 7.0):
        got = torch.full((t * topk, inter), float("nan"), device=dev, dtype=BF16)
        expert_gemm(aq, a_s, w, s, got, route_w, sorted_slots, block_expert, t * topk, True, 128, limit, cfg)
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


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    return _random_bank(256, 4096, 2048, 128, _cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 2048])
def test_op_matches_twin_and_bf16_wgmma_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        bf16_form = fp4_moe(x, ids, weights, flash_bank, limit, config={"WGMMA": True})
        for cfg in TILE_CONFIGS[:3]:
            got = fp4_moe(x, ids, weights, flash_bank, limit, config={"WGMMA_FP8": True, **cfg})
            rel, rel_bf16 = _rel(got, want), _rel(got, bf16_form)
            print(f"wgmma fp8 T={t} limit={limit} {_tag(cfg)}: rel_err {rel:.2e} vs twin, {rel_bf16:.2e} vs bf16 form")
            assert bool(torch.isfinite(got).all()) and max(rel, rel_bf16) <= FP8_OP_REL_ERR, (cfg, rel, rel_bf16)


@pytest.mark.gpu
def test_op_small_bank_act_block_32_and_graph_replay():
    from deepinfer.kernels.triton.fp4_moe import fp4_moe, wgmma_fp8_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(32, 512, 256, 32, dev)
    assert wgmma_fp8_form_usable(bank, dev)
    for t in (1, 40, 300):
        x, ids, weights = _inputs(t, dev, e=32, d=512)
        want = fp4_moe_torch(x, ids, weights, bank, 10.0)
        got = fp4_moe(x, ids, weights, bank, 10.0, config={"WGMMA_FP8": True})
        assert _rel(got, want) <= FP8_OP_REL_ERR, (t, _rel(got, want))
        assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config={"WGMMA_FP8": True}),
                               f"fp4_moe wgmma fp8 T={t}")


@pytest.mark.gpu
def test_prefill_kernel_choice_picks_it(monkeypatch):
    """DEEPINFER_MOE_PREFILL_KERNEL=wgmma_fp8 runs this form above 16 slots per expert (bit-identical to config
    WGMMA_FP8)."""
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank

    dev = _cuda()
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", "wgmma_fp8")
    bank = _random_bank(8, 512, 256, 128, dev)
    x, ids, weights = _inputs(64, dev, e=8, d=512)
    got = fp4_moe(x, ids, weights, bank, 10.0)
    assert torch.equal(got, fp4_moe(x, ids, weights, bank, 10.0, config={"WGMMA_FP8": True}))
