"""Split-K partials left to their consumers (kernels/split_k.py, op "fp8_linear_unsummed",
kernels/triton/split_k_load.py): the consumer kernels that add a SplitK's partials on their loads give the
same bits as the split-sum kernel followed by the same consumer on its bf16 result.

* `SplitK` itself: its checks, its column views, `total()` (the partials added in order, rounded once).
* Under the Triton interpreter: op "fp8_linear_unsummed" returns a SplitK where the Triton form splits K and
  its total is fp8_linear's output bit for bit; `qkv_norm_rope_store` on the two column views of a SplitK
  (the stacked wq_a | wkv), `swiglu_bf16` on those of the shared expert's w1 | w3, and `hc_post_pre_fused` on
  a SplitK f give the same bits as on the summed tensors (qr and the ring rows; x, y, post, comb; the post-mix
  kernel's PIN_F plan too); a planted bug (the kernels told one partial fewer) is caught.
* On the GPU (-m gpu): the same, compiled. (The engine's decode with each switch against the sum kernel is
  tests/test_engine_fast_decode.py's `test_split_sum_switches_change_no_bit_of_a_decode`.)"""
from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.split_k import SplitK, cols, summed
from interpreted import assert_check_failed, assert_ran_ok, run_check


def test_split_k_total_adds_the_partials_in_order_and_rounds_once():
    g = torch.Generator().manual_seed(0)
    part = torch.randn(5, 3, 40, generator=g)
    part[1], part[2] = 2.0**24, -(2.0**24)  # in order: 1 + 2^24 rounds back to 2^24, so part[0] is lost
    want = part[0].clone()
    for s in range(1, 5):
        want = want + part[s]
    backwards = part[4] + part[3] + part[2] + part[1] + part[0]
    got = SplitK(part).total()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    assert not torch.equal(got, backwards.bfloat16())  # the order shows in the bits
    sk = SplitK(part)
    assert tuple(sk.shape) == (3, 40) and sk.splits == 5 and sk.dim() == 2 and sk.dtype == torch.bfloat16
    assert torch.equal(cols(sk, 8, 20).total(), got[:, 8:20]) and torch.equal(cols(sk, 20).total(), got[:, 20:])
    t = torch.randn(3, 40).bfloat16()
    assert summed(t) is t and torch.equal(cols(t, 8, 20), t[:, 8:20]) and torch.equal(summed(sk), got)


@pytest.mark.parametrize("bad", ["one split", "dtype", "rank", "column stride"])
def test_split_k_refuses_what_is_not_partials(bad):
    part = {"one split": torch.zeros(1, 2, 4), "dtype": torch.zeros(2, 2, 4, dtype=torch.float16),
            "rank": torch.zeros(2, 8), "column stride": torch.zeros(2, 4, 2).transpose(1, 2)}[bad]
    with pytest.raises(ValueError, match="SplitK: want fp32 partials"):
        SplitK(part)


def _partials(S, M, N, seed, device):
    """fp32 partials whose sums round differently in another order (magnitudes 1e3 apart)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.logspace(0, 3, S).view(S, 1, 1)
    return (torch.randn(S, M, N, generator=g) * mag).to(device)


def _check(device: str, plant: str = "") -> None:
    """plant "short": the consumer kernels are told one partial fewer (the check must fail)."""
    from deepinfer.kernels.triton import attn_norm_rope, fp8_gemm, norm_hc, split_k_load, swiglu
    from test_kernels_attn_norm_rope import _inputs as qkv_inputs
    from test_kernels_fp8_linear import _activation, _random_fp8_weight
    from test_kernels_hc_post_pre import _inputs as hc_inputs

    if plant == "short":
        real = split_k_load.operand

        def short(x):
            t, S, stride_s, stride_m = real(x)
            return t, max(1, S - 1), stride_s, stride_m

        split_k_load.operand = short
    cpu = lambda t: t.to("cpu")  # noqa: E731

    # op fp8_linear_unsummed: the Triton form's split partials, whose total is fp8_linear's output
    g = torch.Generator().manual_seed(7)
    w = _random_fp8_weight(64, 1024, 128, 128, "cpu", g).to(device)
    x = _activation(1, 1024, "cpu", g).to(device)
    cfg = {"BN": 16, "num_warps": 4, "SPLIT_K": 4}
    got = fp8_gemm.fp8_linear_unsummed(x, w, config=cfg, mma="bf16")
    assert isinstance(got, SplitK) and got.splits > 1, type(got)
    assert torch.equal(cpu(got.total()), cpu(fp8_gemm.fp8_linear(x, w, config=cfg, mma="bf16")))

    # qkv_norm_rope_store on the column views of one SplitK = on the summed views
    for i, case in enumerate([(1, 1024, 64, 512, 64), (3, 128, 4, 128, 64)]):
        _, _, qw, kvw, pos, freqs, layout, store, rows, _ = qkv_inputs(case, device, 300 + i)
        B, nq, d = case[0], case[1], case[3]
        for S in (2, 16):
            sk = SplitK(_partials(S, B, nq + d, 10 * i + S, device))
            want_store, got_store = store.clone(), store.clone()
            want = attn_norm_rope.qkv_norm_rope_store(summed(sk.cols(0, nq)), summed(sk.cols(nq)), qw, kvw, 1e-6,
                                                      pos, freqs, None, layout, want_store, rows)
            got = attn_norm_rope.qkv_norm_rope_store(sk.cols(0, nq), sk.cols(nq), qw, kvw, 1e-6, pos, freqs, None,
                                                     layout, got_store, rows)
            assert torch.equal(cpu(got), cpu(want)), ("qr", case, S)
            assert torch.equal(cpu(got_store), cpu(want_store)), ("ring rows", case, S)
        # bf16 inputs in two programs a token (DEEPINFER_QKV_PROGRAMS=2) = in one
        import os

        q_lora, kv = summed(sk.cols(0, nq)), summed(sk.cols(nq))
        outs = []
        for programs in ("1", "2"):
            os.environ["DEEPINFER_QKV_PROGRAMS"] = programs
            try:
                st = store.clone()
                outs.append((attn_norm_rope.qkv_norm_rope_store(q_lora, kv, qw, kvw, 1e-6, pos, freqs, None, layout,
                                                                st, rows), st))
            finally:
                del os.environ["DEEPINFER_QKV_PROGRAMS"]
        assert torch.equal(cpu(outs[0][0]), cpu(outs[1][0])) and torch.equal(cpu(outs[0][1]), cpu(outs[1][1])), case

    # swiglu_bf16 on the column views of one SplitK (the shared expert's stacked w1 | w3) = on the summed views
    for T, N, weighted in [(1, 2048, False), (5, 96, True)]:
        sk = SplitK(_partials(16, T, 2 * N, T + N, device))
        wt = torch.rand(T, 1, generator=torch.Generator().manual_seed(T)).to(device) if weighted else None
        want = swiglu.swiglu_bf16(summed(sk.cols(0, N)), summed(sk.cols(N)), 10.0, wt)
        got = swiglu.swiglu_bf16(sk.cols(0, N), sk.cols(N), 10.0, wt)
        assert torch.equal(cpu(got), cpu(want)), ("swiglu", T, N)

    # hc_post_pre_fused on a SplitK f = on its sum (the fused kernel up to POST_MIX_MAX_T tokens, then the ops)
    for i, (T, D) in enumerate([(1, 256), (3, 128), (20, 64)]):
        _, r, post, comb, fn, scale, base, nw = hc_inputs(T, D, device, 60 + i)
        hc_args = (fn, scale, base, nw, 4, 20, 1e-6, 1e-6)
        sk = SplitK(_partials(16, T, D, 70 + i, device))
        want = norm_hc.hc_post_pre_fused(sk.total(), r, post, comb, *hc_args)
        got = norm_hc.hc_post_pre_fused(sk, r, post, comb, *hc_args)
        pinned = norm_hc.hc_post_pre_fused(sk, r, post, comb, *hc_args, config={"PIN_F": 1})
        pinned1 = norm_hc.hc_post_pre_fused(sk.total(), r, post, comb, *hc_args, config={"PIN_F": 1})
        for name, a, b, c, d in zip(("x", "y", "post", "comb"), got, want, pinned, pinned1):
            assert torch.equal(cpu(a), cpu(b)), (name, T, D)
            assert torch.equal(cpu(c), cpu(b)) and torch.equal(cpu(d), cpu(b)), ("PIN_F", name, T, D)
        assert torch.equal(cpu(norm_hc.hc_post_fused(sk, r, post, comb)), cpu(want[0]))


def test_consumers_add_the_partials_bit_for_bit_under_the_interpreter():
    assert_ran_ok(run_check("test_kernels_split_k", "_check('cpu')", timeout=900))


def test_the_check_catches_a_consumer_that_drops_a_partial():
    assert_check_failed(run_check("test_kernels_split_k", "_check('cpu', 'short')", timeout=900))


@pytest.mark.gpu
def test_consumers_add_the_partials_bit_for_bit_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer.kernels.triton import register_cuda_kernels

    register_cuda_kernels()
    _check("cuda")
