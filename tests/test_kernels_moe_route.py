"""Op "moe_route" (kernels/triton/moe_route.py): the MoE's gate GEMV, gate, slot blocks and act_quant(x) in
one launch at b1, against the ops it replaces.

CPU: the twin (`official_fused.moe_route`) is exactly the ops the MoE layers ran (linear_f32's twin, the
division by gate_temp, either gate's twin); bad inputs raise ValueError naming the op; `fp4_moe`'s check of
a ready-made routing refuses one made for another call.
Interpreter (TRITON_INTERPRET=1, fresh process, the GPU's roundings): the fused kernel against the unfused
Triton ops on the same inputs, bit for bit: weights and indices against `bf16_gemv` + `moe_gate` (biased
top-k with V4's norm, V4.1's norm_eps, the hash gate), the slot blocks against `align_by_expert`, xa against
`act_quant_dequant_bf16` (act blocks 128 and 32); ties and 3 rows with the gate's packed-key top-k the same
bits as with its three-reduction rounds (DEEPINFER_GATE_PACKED_KEY=0); at 1 and 3 rows, several launches in a
row (the counter returns to 0), the op's choice (fused at 1 row, unfused with routed None above
FUSED_ROUTE_MAX_ROWS), and the twin within the GEMV's fp32 summation-order bound.
GPU (-m gpu): V4-Flash's and V4.1-Flash's gate shapes, the fused launch bit-identical to the unfused CUDA
ops, in eager and in a replayed CUDA graph (twice: the counter's reset), and `fp4_moe_shared` given the
PreRouted bit-identical to it without (the decode mma.sync form).
"""
from __future__ import annotations

import pytest
import torch

from interpreted import GPU_ROUNDINGS, assert_ran_ok, run_interpreted
from deepinfer import kernels
from deepinfer.kernels import official_fused
from deepinfer.kernels.bf16_gemm import linear_f32_torch
from deepinfer.kernels.quant_weights import PreRouted

BF16, F32 = torch.bfloat16, torch.float32


def _inputs(m, d, e, seed, vocab=50, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, d, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(BF16)
    w = (torch.randn(e, d, generator=g) * 0.05).to(BF16)
    bias = torch.randn(e, generator=g) * 0.1
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:6] for _ in range(vocab)]).to(torch.int32)
    ids = torch.randint(0, vocab, (m,), generator=g)
    return [t.to(dev) for t in (x, w, bias, tid2eid, ids)]


def test_twin_is_the_ops_it_replaces():
    x, w, bias, tid2eid, ids = _inputs(3, 256, 64, 1)
    assert kernels.get("moe_route") is official_fused.moe_route
    logits = linear_f32_torch(x, w)
    got = official_fused.moe_route(x, w, bias, 6, 2.5)
    want = official_fused.moe_gate_sqrtsoftplus(logits, bias, 6, 2.5)
    assert got[2] is None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = official_fused.moe_route(x, w, bias, 6, 2.5, 1e-20, 1.5)
    want = official_fused.moe_gate_sqrtsoftplus(logits / 1.5, bias, 6, 2.5, 1e-20)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got = official_fused.moe_route(x, w, None, 6, 2.5, tid2eid=tid2eid, ids=ids)
    want = official_fused.moe_gate_hash_sqrtsoftplus(logits, tid2eid, ids, 2.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("args,match", [
    (dict(x=torch.zeros(2, 128, dtype=BF16)), "x \\[T, D\\], weight \\[E, D\\]"),
    (dict(topk=0), "0 < topk"),
    (dict(bias=torch.zeros(5)), "bias \\[64\\]"),
    (dict(bias=None, tid2eid=torch.zeros(50, 4, dtype=torch.int32), ids=torch.zeros(3, dtype=torch.int64)),
     "a hash gate needs tid2eid \\[vocab, 6\\]"),
    (dict(bias=None, tid2eid=torch.zeros(50, 6, dtype=torch.int32), ids=torch.zeros(2, dtype=torch.int64)),
     "a hash gate needs tid2eid \\[vocab, 6\\] and ids \\[3\\]"),
    (dict(bias=None, tid2eid=torch.zeros(50, 6), ids=torch.zeros(3, dtype=torch.int64)), "integer tid2eid"),
    (dict(x=torch.zeros(3, 256, dtype=torch.float32)), "bf16 x"),
])
def test_bad_inputs_raise_errors_naming_the_op(args, match):
    x, w, bias, _, _ = _inputs(3, 256, 64, 2)
    call = dict(x=x, weight=w, bias=bias, topk=6, route_scale=1.0)
    call.update(args)
    with pytest.raises(ValueError, match="moe_route: " + match):
        official_fused.moe_route(**call)


def test_fp4_moe_refuses_a_routing_made_for_another_call():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton import fp4_moe

    x = torch.zeros(1, 256, dtype=BF16)
    ok = PreRouted(torch.zeros(6 * 8, dtype=torch.int32), torch.zeros(6, dtype=torch.int32), 8, x.clone(), 128)
    fp4_moe.check_pre_routed(ok, x, 6, 64)  # 6 slots of 64 experts: 6 blocks of 8
    with pytest.raises(ValueError, match="routed made for another call"):
        fp4_moe.check_pre_routed(ok, x, 12, 64)
    with pytest.raises(ValueError, match="routed made for another call"):
        fp4_moe.check_pre_routed(ok, torch.zeros(2, 256, dtype=BF16), 6, 64)


_INTERPRET_CHECK = GPU_ROUNDINGS + r'''
import torch
from deepinfer.kernels import official_fused
from deepinfer.kernels.triton import bf16_gemv, fp4_moe, moe_gate, moe_route
from deepinfer.kernels.triton.act_quant import act_quant_dequant_bf16
from test_kernels_moe_route import _inputs

F32 = torch.float32
D, E, K = 256, 64, 6
counter = None
for m in (1, 3):
    for ab in (128, 32):
        for mode in ("v4", "v41", "hash"):
            x, w, bias, tid2eid, ids = _inputs(m, D, E, 10 * m + ab + len(mode))
            kw = dict(tid2eid=tid2eid, ids=ids) if mode == "hash" else dict(tid2eid=None, ids=None)
            eps = 1e-20 if mode == "v41" else 0.0
            for repeat in range(2):  # the counter must be back at 0 for the second launch
                got_w, got_i, pre = moe_route.launch_fused(x, w, None if mode == "hash" else bias, K, 2.5, eps,
                                                           ab, **kw)
                counter = moe_route._counter(x.device)
                assert int(counter.item()) == 0, (m, ab, mode)
                logits = bf16_gemv._launch(x, w, F32)
                if mode == "hash":
                    want_w, want_i = moe_gate.moe_gate_hash_sqrtsoftplus(logits, tid2eid, ids, 2.5)
                else:
                    want_w, want_i = moe_gate.moe_gate_sqrtsoftplus(logits, bias, K, 2.5, eps)
                what = (m, ab, mode, repeat)
                assert got_i.dtype == want_i.dtype == torch.int64 and got_w.dtype == torch.float32, what
                assert torch.equal(got_i, want_i), what
                assert torch.equal(got_w, want_w), what
                slots, blocks = fp4_moe.align_by_expert(want_i, E, moe_route.ROUTE_BLOCK_M)
                assert torch.equal(pre.sorted_slots, slots) and torch.equal(pre.block_expert, blocks), what
                assert pre.block_m == moe_route.ROUTE_BLOCK_M and pre.act_block == ab
                assert torch.equal(pre.xa, act_quant_dequant_bf16(x, ab)), what
                # the twin: the same gate on logits within the fp32 summation-order bound of the GEMV's
                tw, ti, none = official_fused.moe_route(x, w, None if mode == "hash" else bias, K, 2.5, eps, 1.0,
                                                        ab, **kw)
                assert none is None and torch.equal(ti, got_i), what
                assert torch.allclose(tw, got_w, rtol=1e-5, atol=0), what

# ties: equal biased scores pick the lower expert first, in both kernels and both top-k forms
import os
x, w, bias, _, _ = _inputs(1, D, E, 7)
x = x.abs() + 0.5  # experts 3, 7, 9, 20, 40: the same weight row, positive: the same largest logit
w[[3, 7, 9, 20, 40]] = w[3].abs() + 0.5
flat = torch.zeros(E)
for packed in ("0", "1"):
    os.environ["DEEPINFER_GATE_PACKED_KEY"] = packed
    got_w, got_i, _ = moe_route.launch_fused(x, w, flat, K, 1.0, 0.0, 128, None, None)
    assert got_i[0, :5].tolist() == [3, 7, 9, 20, 40], (packed, got_i)
    want_w, want_i = moe_gate.moe_gate_sqrtsoftplus(bf16_gemv._launch(x, w, F32), flat, K, 1.0)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w), packed
    x3, w3, bias3, _, _ = _inputs(3, D, E, 31)  # and the packed form's rows against the rounds form's
    a = moe_route.launch_fused(x3, w3, bias3, K, 2.5, 1e-20, 32, None, None)
    if packed == "0":
        rounds = a
    else:
        assert torch.equal(a[0], rounds[0]) and torch.equal(a[1], rounds[1])
os.environ.pop("DEEPINFER_GATE_PACKED_KEY")

# the op: fused at one row (a PreRouted), the unfused ops above FUSED_ROUTE_MAX_ROWS (routed None)
x, w, bias, _, _ = _inputs(1, D, E, 99)
w1, i1, pre = moe_route.moe_route(x, w, bias, K, 1.0)
from deepinfer.kernels.quant_weights import PreRouted
assert isinstance(pre, PreRouted) and pre.xa.shape == x.shape
rows = moe_route.FUSED_ROUTE_MAX_ROWS + 1
x, w, bias, _, _ = _inputs(rows, D, E, 98)
_, _, pre = moe_route.moe_route(x, w, bias, K, 1.0)
assert pre is None
# a gate_temp other than 1 (V4.1's option) takes the unfused ops: torch's division, routed None
x, w, bias, _, _ = _inputs(1, D, E, 97)
got_w, got_i, pre = moe_route.moe_route(x, w, bias, K, 1.0, 1e-20, 1.5)
want_w, want_i = moe_gate.moe_gate_sqrtsoftplus(bf16_gemv._launch(x, w, F32) / 1.5, bias, K, 1.0, 1e-20)
assert pre is None and torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
print("ok")
'''


def test_fused_route_under_the_interpreter():
    pytest.importorskip("triton")
    assert_ran_ok(run_interpreted(_INTERPRET_CHECK, timeout=900))


# ---------------------------------------------------------------------------------------------- cuda
@pytest.mark.gpu
@pytest.mark.parametrize("d,e,k,ab,eps,hashed", [
    (4096, 256, 6, 128, 0.0, False),    # V4-Flash
    (4096, 256, 6, 128, 0.0, True),     # V4-Flash's hash layers
    (5120, 384, 6, 32, 1e-20, False),   # V4.1-Flash's shapes and its norm (gate_temp 1: other values stay unfused)
])
def test_fused_route_matches_the_unfused_ops_on_cuda(d, e, k, ab, eps, hashed, cuda_kernels):
    from deepinfer.kernels.triton import bf16_gemv, fp4_moe, moe_gate, moe_route
    from deepinfer.kernels.triton.act_quant import act_quant_dequant_bf16

    x, w, bias, tid2eid, ids = _inputs(1, d, e, d + e, dev="cuda")
    tid2eid = torch.stack([torch.randperm(e)[:k] for _ in range(50)]).to(torch.int32).cuda()
    kw = dict(tid2eid=tid2eid, ids=ids) if hashed else dict(tid2eid=None, ids=None)
    b = None if hashed else bias

    def fused():
        return moe_route.launch_fused(x, w, b, k, 2.5, eps, ab, **kw)

    def unfused():
        logits = bf16_gemv._launch(x, w, F32)
        if hashed:
            gw, gi = moe_gate.moe_gate_hash_sqrtsoftplus(logits, tid2eid, ids, 2.5)
        else:
            gw, gi = moe_gate.moe_gate_sqrtsoftplus(logits, bias, k, 2.5, eps)
        slots, blocks = fp4_moe.align_by_expert_small(gi, e, moe_route.ROUTE_BLOCK_M)
        return gw, gi, slots, blocks, act_quant_dequant_bf16(x, ab)

    def flat(out):
        gw, gi, pre = out
        return gw, gi, pre.sorted_slots, pre.block_expert, pre.xa

    want = unfused()
    got = flat(fused())
    for name, a, b_ in zip(("weights", "indices", "sorted_slots", "block_expert", "xa"), got, want):
        assert a.dtype == b_.dtype and torch.equal(a, b_), name
    assert int(moe_route._counter(x.device).item()) == 0
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused()  # warm
        with torch.cuda.graph(graph, stream=s):
            out = flat(fused())
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):
        for t in out:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b_ in zip(("weights", "indices", "sorted_slots", "block_expert", "xa"), out, want):
            assert torch.equal(a, b_), ("graph", name)
    assert int(moe_route._counter(x.device).item()) == 0


@pytest.mark.gpu
def test_fp4_moe_shared_with_the_prerouted_is_bit_identical(cuda_kernels):
    from test_kernels_gemm import _random_bank
    from deepinfer.kernels.triton import fp4_moe as m
    from deepinfer.kernels.triton import moe_route

    bank = _random_bank(256, 4096, 2048, 128, "cuda")
    x, w, bias, _, _ = _inputs(1, 4096, 256, 7, dev="cuda")
    gw, gi, pre = moe_route.launch_fused(x, w, bias, 6, 2.5, 0.0, 128, None, None)
    shared = (torch.randn(1, 4096, device="cuda") * 0.3).to(BF16)
    want = m.fp4_moe_shared(x, gi, gw, bank, 10.0, shared, config=m.DECODE_MMA)
    got = m.fp4_moe_shared(x, gi, gw, bank, 10.0, shared, config=m.DECODE_MMA, routed=pre)
    assert torch.equal(got, want)
    # a routing for another act block is not used (the op makes its own): the same bits again
    other = moe_route.PreRouted(pre.sorted_slots, pre.block_expert, pre.block_m, pre.xa, 32)
    assert torch.equal(m.fp4_moe_shared(x, gi, gw, bank, 10.0, shared, config=m.DECODE_MMA, routed=other), want)
