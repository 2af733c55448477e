"""The FP8 tensor-core form of the prefill experts' wgmma GEMM (deepinfer/kernels/cuda/fp4_moe_wgmma_fp8.cu,
`fp4_moe_wgmma.expert_gemm_fp8`; wired into `fp4_moe` as config FP8_FOLD and by DEEPINFER_MOE_PREFILL_KERNEL /
PREFILL_FORM "wgmma-fp8"), its operand order (`act_quant.wgmma_fp8_k_order`, `act_quant_gather_fp8`) and the
fold rule that makes its weight operands exact (`quant_weights.fp8_fold_ok`).

CPU: the K order is the one the 8-bit A fragments hold (derived here from the fragment layout and the kernel's
even / odd nibble assignment) and a bijection; the kernel's expansion recipe (an E4M3 byte table indexed by a
byte permute), emulated bit for bit, gives E2M1 x 2^j exactly for every code and j in [-5, 6]; the fold rule's
edges; `act_quant_gather_fp8` under the interpreter against formats.act_quant + gather + order; the launcher's
checks; the source compiles for sm_90a where NVRTC is installed.
GPU (`-m gpu`, fresh random inputs):
* one-hot activation rows: every output equals one weight E2M1 x 2^(S-127) bit for bit, all 256 bytes, scale
  groups spanning the fold's full 11 octaves, rows past N, the ring wrapping;
* the plain kernel (fp32 out) against float64 sums of the dequantised operands: rel_err <= 5e-4 (the tensor
  cores' FP8 accumulation inside each 128-K group; printed);
* the gated kernel against the plain kernel's own sums through the official SwiGLU;
* the whole op against the torch twin and the bf16 wgmma form at V4-Flash dims (rel_err <= 2e-3), CUDA-graph
  replay == eager, and the default's choice by DEEPINFER_MOE_PREFILL_KERNEL with the fallback where the bank
  does not fold.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import formats
from deepinfer.kernels.quant_weights import FP4ExpertBank, fp4_moe_torch, fp8_fold_ok

BF16 = torch.bfloat16
TILE_CONFIGS = [dict(BT=128, CWG=2, STAGES=6, MIN_CTAS=1), dict(BT=128, CWG=1, STAGES=4, MIN_CTAS=1),
                dict(BT=64, CWG=2, STAGES=8, MIN_CTAS=1), dict(BT=64, CWG=1, STAGES=3, MIN_CTAS=2),
                dict(BT=128, CWG=2, STAGES=2, MIN_CTAS=1)]


def _tag(c: dict) -> str:
    return f"BT{c['BT']}wg{c['CWG']}s{c['STAGES']}m{c['MIN_CTAS']}"


# ---------------------------------------------------------------------------------------------- CPU
def test_fp8_k_order_is_what_the_a_fragments_hold():
    """8-bit wgmma A fragments (one 8-row x 16-byte square per register, 4 lanes a row): lane (g, t) of a warp
    holds, for 32-K step s, register 0 = (row g, logical K 32s + 4t + i), 1 = (row g + 8, same), 2 = (row g,
    32s + 16 + 4t + i), 3 = (row g + 8, same), byte i = i. The kernel fills step s from word s of the lane's 16
    bytes of the row (physical K 32t .. 32t + 31, nibble n of the word = physical 32t + 8s + n): registers 0 / 1
    its even nibbles (byte i = nibble 2i), 2 / 3 its odd ones (nibble 2i + 1). That map must be
    `wgmma_fp8_k_order`, and a bijection of each 128."""
    from deepinfer.kernels.triton.act_quant import wgmma_fp8_k_order

    held = {}
    for t in range(4):
        for s in range(4):
            for h in range(2):
                for i in range(4):
                    held[32 * s + 16 * h + 4 * t + i] = 32 * t + 8 * s + 2 * i + h
    assert sorted(held) == list(range(128)) and sorted(held.values()) == list(range(128))
    logical = torch.arange(384)
    want = torch.tensor([held[int(c) % 128] + 128 * (int(c) // 128) for c in logical])
    assert torch.equal(wgmma_fp8_k_order(logical), want)


def _byte_perm(x: int, y: int, sel: int) -> int:
    """PRMT's default mode for selector nibbles 0..7: byte n of the result = byte sel_n of (y:x)."""
    src = x | (y << 32)
    return sum(((src >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _expand(x: int, j: int, even: bool) -> int:
    """fp4_moe_wgmma_fp8.cu's `fold_table` + `e2m1x4_e4m3`, step by step in Python integers."""
    lo, hi = (0x3C383000 + j * 0x08080800) & 0xFFFFFFFF, (0x4C484440 + j * 0x08080808) & 0xFFFFFFFF
    mag = (x if even else x >> 4) & 0x07070707
    sel = _byte_perm(mag | (mag >> 4), 0, 0x0020)
    return _byte_perm(lo, hi, sel & 0xFFFF) | (((x << 4) if even else x) & 0x80808080)


def test_expansion_recipe_gives_every_code_times_2_to_the_j():
    gen = torch.Generator().manual_seed(4)
    words = [0x76543210, 0xFEDCBA98, 0x88888888] + torch.randint(0, 2 ** 31, (64,), generator=gen).tolist()
    for j in range(-5, 7):
        for x in words:
            for even in (True, False):
                got = _expand(x, j, even).to_bytes(4, "little")
                got = torch.frombuffer(bytearray(got), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                codes = torch.tensor([(x >> (4 * (2 * i + (0 if even else 1)))) & 0xF for i in range(4)])
                want = formats.fp4_codes_to_float(codes.to(torch.uint8)).float() * 2.0 ** j
                assert torch.equal(got, want), (j, hex(x), even, got, want)


def test_fold_rule_edges():
    """Span <= 11 octaves folds, 12 does not; an all-zero 32-block (either zero sign) may have any scale;
    groups whose largest byte is small use W = 1; K not a whole number of 128-groups does not fold."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randint(0, 256, (3, 8, 128), dtype=torch.uint8, generator=gen)  # K = 256: two groups a row
    w |= 0x01  # every 32-block has a non-zero code
    s = torch.full((3, 8, 8), 120, dtype=torch.uint8)
    assert fp8_fold_ok(w, s)
    s[2, 5, 6] = 109  # group max 120 -> W 114, j = -5
    assert fp8_fold_ok(w, s)
    s[2, 5, 6] = 108  # j = -6: not an E4M3 normal for the 0.5 code
    assert not fp8_fold_ok(w, s)
    w0 = w.clone()
    w0[2, 5, 96:112] = torch.tensor([0x00, 0x88] * 8, dtype=torch.uint8)  # block 6 = bytes 96..111: zeros
    assert fp8_fold_ok(w0, s)
    small = torch.full((3, 8, 8), 3, dtype=torch.uint8)  # max 3: W = 1, j = 2
    assert fp8_fold_ok(w, small)
    assert not fp8_fold_ok(w[:, :, :48], s[:, :, :3])  # K = 96


def check_act_quant_gather_fp8(device: str = "cpu") -> None:
    """act_quant_gather_fp8 against formats.act_quant (the reference) + the gather + `wgmma_fp8_k_order`, bit
    for bit: codes in order, scales transposed; padding rows zero codes; unused blocks' rows left alone."""
    from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8, wgmma_fp8_k_order
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    gen = torch.Generator().manual_seed(7)
    t, topk, e, bt = 7, 3, 5, 8
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])
    sorted_slots, block_expert = align_by_expert(ids, e, bt)
    assert int((block_expert < 0).sum()) > 0
    for k in (256, 2048):
        x = (torch.randn(t, k, generator=gen) * 3).to(BF16)
        q, s_t = act_quant_gather_fp8(x.to(device), sorted_slots.to(device), block_expert.to(device), t * topk, topk, bt)
        q, s_t = q.cpu(), s_t.cpu()
        want_q, want_s = formats.act_quant(x.float(), 128)
        want_q = want_q.view(torch.uint8)
        order = wgmma_fp8_k_order(torch.arange(k))
        for p, slot in enumerate(sorted_slots.tolist()):
            if block_expert[p // bt] < 0:
                continue
            if slot < t * topk:
                assert torch.equal(q[p], want_q[slot // topk, order]), (k, p, slot)
                assert torch.equal(s_t[:, p], want_s[slot // topk].float()), (k, p, slot)
            else:
                assert not q[p].view(torch.float8_e4m3fn).float().any(), (k, p)


def test_act_quant_gather_fp8_matches_act_quant_and_the_order():
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    from test_kernels_fp8_linear import _INTERPRETER_FIXES

    done = run_interpreted(_INTERPRETER_FIXES + "\nfrom test_kernels_fp4_moe_wgmma_fp8 import check_act_quant_gather_fp8"
                           " as c\nc()\nprint('ok')\n")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_launcher_rejects_bad_inputs_before_launching():
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm_fp8

    w = torch.zeros(2, 64, 128, dtype=torch.uint8)  # K = 256
    s = torch.zeros(2, 64, 8, dtype=torch.uint8)
    slots, blocks = torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    aq, st = torch.zeros(128, 256, dtype=torch.uint8), torch.ones(2, 128)
    out, rw = torch.zeros(4, 64, dtype=BF16), torch.ones(4)
    with pytest.raises(ValueError, match="a must be contiguous uint8"):
        expert_gemm_fp8(aq.to(BF16), st, w, s, out, rw, slots, blocks, 4, False)
    with pytest.raises(ValueError, match=r"a_scale_t must be contiguous fp32 \[2, 128\]"):
        expert_gemm_fp8(aq, st.t().contiguous(), w, s, out, rw, slots, blocks, 4, False)
    with pytest.raises(ValueError, match=r"out must be \[4, 32\] torch.bfloat16"):
        expert_gemm_fp8(aq, st, w, s, out, rw, slots, blocks, 4, True)
    with pytest.raises(ValueError, match="FP8 tiles: BT 64/128, CWG 1/2"):
        expert_gemm_fp8(aq, st, w, s, out, rw, slots, blocks, 4, False, config={"CWG": 4})


def test_fp8_tile_rules_and_shared_memory():
    from deepinfer.kernels.cuda import fp4_moe_wgmma as wg

    cfg = wg.tiles_fp8()
    assert wg.smem_bytes_fp8(cfg) == cfg["STAGES"] * (128 * 128 + 128 * 4 + 128 * 64) + 16 * cfg["STAGES"] + 1024
    assert wg.tiles_fp8({"STAGES": 8})["STAGES"] == 8  # 8 x 25 KB fits
    with pytest.raises(ValueError, match="shared memory"):
        wg.tiles_fp8({"STAGES": 10})
    with pytest.raises(ValueError, match="MIN_CTAS 1 .2 only with CWG 1 and BT 64"):
        wg.tiles_fp8({"MIN_CTAS": 2})
    assert wg.tiles_fp8({"MIN_CTAS": 2, "CWG": 1, "BT": 64, "STAGES": 3})["MIN_CTAS"] == 2


def test_prefill_kernel_choice_accepts_the_fp8_form(monkeypatch):
    from deepinfer import env

    monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", "WGMMA-FP8")
    assert env.moe_prefill_kernel() == "wgmma-fp8"


def test_source_compiles_for_sm90a_where_nvrtc_is_installed():
    from deepinfer.kernels.cuda.fp4_moe_wgmma import SOURCE_FP8
    from test_cuda_runtime import compile_configs

    compile_configs(SOURCE_FP8, [{**cfg, "GATED": gated, "OUT_F32": out_f32} for cfg in TILE_CONFIGS
                                 for gated, out_f32 in ((1, 0), (0, 0), (0, 1))], arch="sm_90a")


# ---------------------------------------------------------------------------------------------- GPU
def _cuda():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        pytest.skip("the wgmma form needs sm_90")
    return dev


def _plain_fp8(x, w, s, ids, cfg, dev):
    """The plain kernel (fp32 out) over top-k routed rows of x: [slots, R] fp32 and the routing."""
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm_fp8
    from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    t, topk = ids.shape
    sorted_slots, block_expert = (v.to(dev) for v in align_by_expert(ids, w.shape[0], cfg["BT"]))
    xq, xs = act_quant_gather_fp8(x.to(dev), sorted_slots, block_expert, t * topk, topk, cfg["BT"])
    out = torch.full((t * topk, w.shape[1]), float("nan"), device=dev)
    expert_gemm_fp8(xq, xs, w.to(dev), s.to(dev), out, torch.ones(t * topk, device=dev), sorted_slots, block_expert,
                    t * topk, False, 0.0, cfg)
    return out


def _fold_scales(e: int, n: int, k: int, low: int, high: int, gen) -> torch.Tensor:
    """E8M0 bytes per 32-block whose 128-K groups span up to 11 octaves (the fold's limit): group bases in
    [low, high - 11], the group's 4 bytes base + a permutation of (0, 3, 7, 11)."""
    groups = k // 128
    base = torch.randint(low, high - 10, (e, n, groups, 1), generator=gen)
    offs = torch.stack([torch.tensor([0, 3, 7, 11])[torch.randperm(4, generator=gen)] for _ in range(e * n * groups)])
    return (base + offs.view(e, n, groups, 4)).view(e, n, k // 32).to(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_one_hot_rows_give_every_weight_exactly(cfg):
    """K one-hot rows (token k has 1.0 at K position k, top-1 to expert 0 of 2) at K = 2048 (16 stages, the ring
    wraps) and 96 rows (a partial CTA tile): out[k, n] = W[0, n, k] exactly, every byte on every row, scale
    bytes 2..200 in groups spanning 11 octaves."""
    from test_kernels_fp4_moe_mma import _weights_f64

    dev = _cuda()
    gen = torch.Generator().manual_seed(13)
    n, k = 96, 2048
    w = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=gen)
    w[0, :, :256] = torch.arange(256, dtype=torch.uint8)
    s = _fold_scales(2, n, k, 2, 200, gen)
    assert fp8_fold_ok(w, s)
    ids = torch.zeros(k, 1, dtype=torch.int64)
    got = _plain_fp8(torch.eye(k, dtype=BF16), w, s, ids, cfg, dev).cpu()
    want = _weights_f64(w, s)[0].T.float()
    bad = got != want
    assert not bad.any(), (cfg, int(bad.sum()), bad.nonzero()[:8].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS, ids=_tag)
def test_plain_kernel_matches_float64(cfg):
    from test_kernels_fp4_moe_mma import _weights_f64

    dev = _cuda()
    gen = torch.Generator().manual_seed(17)
    e, i, d = 16, 512, 2048
    w = torch.randint(0, 256, (e, 2 * i, d // 2), dtype=torch.uint8, generator=gen)
    s = _fold_scales(e, 2 * i, d, 100, 130, gen)
    wf = _weights_f64(w, s)
    for t in (1, 5, 40, 300):
        x = (torch.randn(t, d, generator=gen) * torch.exp(torch.randn(t, 1, generator=gen))).to(BF16)
        ids = torch.stack([torch.randperm(e, generator=gen)[:6] for _ in range(t)])
        got = _plain_fp8(x, w, s, ids, cfg, dev).cpu().double()
        xd = formats.act_quant_dequant(x.float(), 128).double()
        want = torch.empty(t * 6, 2 * i, dtype=torch.float64)
        flat = ids.reshape(-1)
        for ex in flat.unique().tolist():
            slots = (flat == ex).nonzero().view(-1)
            want[slots] = xd[slots // 6] @ wf[ex].T
        assert not torch.isnan(got).any(), (cfg, t)
        rel = float((got - want).norm() / want.norm())
        print(f"{_tag(cfg)} T={t}: rel_err {rel:.2e} vs float64")
        assert rel <= 5e-4, (cfg, t, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_CONFIGS[:3], ids=_tag)
def test_gated_kernel_is_the_official_swiglu_of_its_sums(cfg):
    from deepinfer.kernels.cuda.fp4_moe_wgmma import expert_gemm_fp8
    from deepinfer.kernels.triton.act_quant import act_quant_gather_fp8
    from deepinfer.kernels.triton.fp4_moe import align_by_expert

    dev = _cuda()
    gen = torch.Generator().manual_seed(21)
    e, d, inter, t, topk = 8, 1024, 288, 150, 6  # I = 288: the last CTA's features run past N
    w = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, generator=gen).to(dev)
    s = _fold_scales(e, 2 * inter, d, 105, 127, gen).to(dev)
    x = torch.randn(t, d, generator=gen).to(BF16).to(dev)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)]).to(dev)
    route_w = torch.rand(t * topk, generator=gen).to(dev)
    sorted_slots, block_expert = align_by_expert(ids, e, cfg["BT"])
    xq, xs = act_quant_gather_fp8(x, sorted_slots, block_expert, t * topk, topk, cfg["BT"])
    sums = torch.full((t * topk, 2 * inter), float("nan"), device=dev)
    expert_gemm_fp8(xq, xs, w, s, sums, route_w, sorted_slots, block_expert, t * topk, False, 0.0, cfg)
    for limit in (0.0, 7.0):
        got = torch.full((t * topk, inter), float("nan"), device=dev, dtype=BF16)
        expert_gemm_fp8(xq, xs, w, s, got, route_w, sorted_slots, block_expert, t * topk, True, limit, cfg)
        gate, up = sums[:, :inter].to(BF16).float(), sums[:, inter:].to(BF16).float()
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        want = (route_w[:, None] * (gate * torch.sigmoid(gate) * up)).to(BF16)
        assert not torch.isnan(got.float()).any()
        diff = (got.float() - want.float()).abs()
        ulp = want.float().abs().clamp(min=1e-30) * 2.0 ** -7
        off = diff > 0
        print(f"{_tag(cfg)} limit={limit}: {int(off.sum())} of {off.numel()} outputs differ")
        assert bool((diff <= ulp).all()) and int(off.sum()) <= off.numel() // 1000, (cfg, limit)


@pytest.fixture(scope="module")
def flash_bank():
    from test_kernels_gemm import _random_bank

    bank = _random_bank(256, 4096, 2048, 128, _cuda())
    assert bank.fp8_fold
    return bank


@pytest.mark.gpu
@pytest.mark.parametrize("t", [512, 2048, 8192])
def test_op_matches_twin_and_bf16_form_v4_flash_dims(flash_bank, t):
    from deepinfer.kernels.triton.fp4_moe import fp4_moe
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _rel

    x, ids, weights = _inputs(t, flash_bank.w13.device)
    for limit in (10.0, 0.0):
        want = fp4_moe_torch(x, ids, weights, flash_bank, limit)
        bf16_form = fp4_moe(x, ids, weights, flash_bank, limit, config={"WGMMA": True})
        for cfg in ({"WGMMA": True, "FP8_FOLD": True}, {"WGMMA": True, "FP8_FOLD": True, "BT": 64},
                    {"WGMMA": True, "FP8_FOLD": True, "CWG": 1}):
            got = fp4_moe(x, ids, weights, flash_bank, limit, config=cfg)
            rel, rel_bf16 = _rel(got, want), _rel(got, bf16_form)
            print(f"wgmma fp8 T={t} limit={limit} {cfg}: rel_err {rel:.2e} vs twin, {rel_bf16:.2e} vs the bf16 form "
                  f"(bf16 form vs twin {_rel(bf16_form, want):.2e})")
            assert bool(torch.isfinite(got).all()) and max(rel, rel_bf16) <= 2e-3, (cfg, rel, rel_bf16)


@pytest.mark.gpu
def test_op_small_bank_graph_replay_and_default_choice(monkeypatch):
    """CUDA-graph replay == eager; DEEPINFER_MOE_PREFILL_KERNEL=wgmma-fp8 runs the FP8 form (bit-identical to
    config FP8_FOLD) where the bank folds and the bf16 wgmma form where it does not (a 12-octave group)."""
    from deepinfer.kernels.triton.fp4_moe import PREFILL_WGMMA, PREFILL_WGMMA_FP8, fp4_moe, wgmma_fp8_form_usable
    from test_kernels_fp4_moe_split import _inputs
    from test_kernels_gemm import _random_bank, _rel, assert_replay_is_eager

    dev = _cuda()
    bank = _random_bank(8, 512, 256, 128, dev)
    x, ids, weights = _inputs(64, dev, e=8, d=512)  # 384 slots over 8 experts: the prefill regime
    assert wgmma_fp8_form_usable(bank, dev)
    want = fp4_moe_torch(x, ids, weights, bank, 10.0)
    got = fp4_moe(x, ids, weights, bank, 10.0, config=PREFILL_WGMMA_FP8)
    assert _rel(got, want) <= 2e-3, _rel(got, want)
    assert_replay_is_eager(lambda: fp4_moe(x, ids, weights, bank, 10.0, config=PREFILL_WGMMA_FP8), "fp4_moe wgmma fp8")
    monkeypatch.setenv("DEEPINFER_MOE_PREFILL_KERNEL", "wgmma-fp8")
    assert torch.equal(fp4_moe(x, ids, weights, bank, 10.0), got)
    w2s = bank.w2_scale.clone()
    w2s[3, 5, 0], w2s[3, 5, 1:4] = 128, 116  # a 12-octave group (its blocks' codes are random: non-zero)
    loose = FP4ExpertBank(bank.w13, bank.w13_scale, bank.w2, w2s, 128)
    assert not loose.fp8_fold and not wgmma_fp8_form_usable(loose, dev)
    assert torch.equal(fp4_moe(x, ids, weights, loose, 10.0), fp4_moe(x, ids, weights, loose, 10.0, config=PREFILL_WGMMA))
    with pytest.raises(ValueError, match="fold exactly into E4M3"):
        fp4_moe(x, ids, weights, loose, 10.0, config=PREFILL_WGMMA_FP8)
