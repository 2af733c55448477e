"""The decode L2 prefetch (kernels/cuda/l2_prefetch, model/l2_prefetch.py).

CPU: the spans the kernel is given (16-byte trimmed, in order, cut at the budget), the windows' weights per
layer of the tiny V4 model (each the param's own tensor, in the order the layer reads them), a window outside
a scope or on the CPU does nothing (not even its list), the budget's parsing, and the source compiles for
sm_90 in both policies.
GPU (-m gpu): the kernel over more than one launch's spans leaves every value as it was, and the persisting-L2
set-aside is sized once; the batched decode path with the prefetch on (either policy), eager and replayed
from graphs captured with it, is bit for bit the path without.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import env
from deepinfer.kernels.cuda import l2_prefetch as kernel
from deepinfer.model import SeqContext, l2_prefetch
from deepinfer.model.decode_step import DecodeRunner
from deepinfer.model.factory import v4_params

import test_engine_fast_decode as fd


def test_spans_are_trimmed_to_16_bytes_in_order_and_cut_at_the_budget():
    base = torch.zeros(4096, dtype=torch.uint8)
    a, b, c = base[3:1000], base[1024:2048], base[2048:4096]  # a starts 3 bytes past an aligned address
    lo = (a.data_ptr() + 15) & ~15
    assert kernel.spans([a, b, c], 1 << 20) == [(lo, ((a.data_ptr() + 997) & ~15) - lo), (b.data_ptr(), 1024),
                                                  (c.data_ptr(), 2048)]
    got = kernel.spans([b, c], 1500)  # the budget ends inside c, rounded down to 16 bytes
    assert got == [(b.data_ptr(), 1024), (c.data_ptr(), 464)]
    assert kernel.spans([b, c], 1030) == [(b.data_ptr(), 1024)]  # 6 bytes left: nothing of c
    assert kernel.spans([base[5:17]], 100) == []  # no whole aligned 16 bytes inside
    assert kernel.spans([b], 0) == []


def test_spans_refuse_strided_views_and_a_negative_budget():
    w = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="contiguous tensors only"):
        kernel.spans([w.t()], 1 << 20)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        kernel.spans([w], -1)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 16"):
        kernel.kernel(chunk=100)


def _ptrs(tensors):
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def test_windows_name_each_layers_weights_in_the_order_it_reads_them(fast_params):
    cfg, params = fast_params
    model = fd.fresh_model(cfg, params)
    seen_indexer = seen_plain_ratio = False
    for i, block in enumerate(model.layers):
        pre = f"layers.{i}."

        def w(name):
            v = params[pre + name]
            return [v] if isinstance(v, torch.Tensor) else [v.data, v.scale]

        want = w("attn.wq_a_wkv.weight") + w("attn.wq_b.weight")  # the stacked pair, not its halves
        if cfg.compress_ratios[i]:
            want += w("attn.compressor.wkv_wgate.weight")
        if block.attn.has_indexer:
            seen_indexer = True
            want += (w("attn.indexer.wq_b.weight") + w("attn.indexer.weights_proj.weight")
                     + w("attn.indexer.compressor.wkv_wgate.weight"))
        elif cfg.compress_ratios[i]:
            seen_plain_ratio = True
        assert _ptrs(l2_prefetch.layer_start(block.attn)) == _ptrs(want), f"layer {i}"
        assert _ptrs(l2_prefetch.attn_out(block.attn)) == _ptrs(w("attn.wo_a.weight") + w("attn.wo_b.weight"))
        assert _ptrs(l2_prefetch.ffn_start(block.ffn)) == _ptrs(
            w("ffn.gate.weight") + w("ffn.shared_experts.w13.weight") + w("ffn.shared_experts.w2.weight"))
    assert seen_indexer and seen_plain_ratio, "the tiny model should have both kinds of ratio layer"


def test_halves_stand_in_where_the_pair_is_not_stacked():
    a, b, q = torch.zeros(8, 16), torch.zeros(8, 16), torch.zeros(4, 16)
    assert l2_prefetch.stacked({"a": a, "b": b}, "ab", "a", "b") == [a, b]
    assert l2_prefetch.stacked({"ab": q, "a": a, "b": b}, "ab", "a", "b") == [q]
    assert l2_prefetch.weights({"x": q.t(), "y": q}, "x", "missing", "y") == [q]  # strided and absent: skipped


def test_a_window_does_nothing_outside_a_scope_or_on_the_cpu(monkeypatch):
    def pick(_):
        raise AssertionError("the window's weights were listed")

    monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "40")
    assert l2_prefetch.window(torch.device("cpu"), pick, None) == 0
    with l2_prefetch.scope("cpu"):
        assert l2_prefetch.window(torch.device("cpu"), pick, None) == 0


def test_the_budget_is_read_in_mib_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("DEEPINFER_L2_PREFETCH_MB", raising=False)
    assert env.l2_prefetch_bytes() == 0
    monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "40")
    assert env.l2_prefetch_bytes() == 40 << 20
    for bad in ("-1", "4.5", "lots"):
        monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match="DEEPINFER_L2_PREFETCH_MB"):
            env.l2_prefetch_bytes()


def test_source_compiles_for_sm90_where_nvrtc_is_installed():
    from test_cuda_runtime import compile_configs

    compile_configs(kernel.SOURCE, [{"CHUNK": kernel.CHUNK, "EVICT_LAST": e} for e in (0, 1)] + [{"CHUNK": 16}])


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_the_kernel_changes_no_value():
    from test_cuda_runtime import cuda_with_nvrtc

    dev = cuda_with_nvrtc()
    if not kernel.usable(dev):
        pytest.skip("the bulk prefetch needs compute capability 9.0")
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randint(0, 255, (48 << 20,), dtype=torch.uint8, device=dev, generator=g)
    parts = [big[i * (1 << 20) + 5 : (i + 1) * (1 << 20)] for i in range(11)]  # 11 spans: two launches
    parts.append(torch.randn(1000, 333, device=dev, generator=g))
    before = [t.clone() for t in parts]
    for evict_last in (False, True):
        asked = kernel.prefetch(parts, 64 << 20, dev, evict_last=evict_last)
        assert asked == sum(s for _, s in kernel.spans(parts, 64 << 20))
        assert kernel.prefetch(parts, 3 << 20, dev, chunk=4096) == 3 << 20
    torch.cuda.synchronize()
    for t, ref in zip(parts, before):
        assert torch.equal(t, ref)
    size = kernel.set_aside(dev, 32 << 20)  # the evict_last policy's set-aside: set once, within the maximum
    assert 0 < size <= 32 << 20 and kernel.set_aside(dev, 1 << 20) == size


@pytest.mark.gpu
@pytest.mark.parametrize("evict_last", ["0", "1"])
def test_decode_with_the_prefetch_is_bit_identical(tiny_v4_raw, cuda_kernels, monkeypatch, evict_last):
    """Graphs captured with the prefetch and replayed, and the eager path with it, against the eager path
    without it: logits after every step and every cache tensor at the end, bit for bit (with and without
    the evict_last policy)."""
    monkeypatch.setenv("DEEPINFER_L2_PREFETCH_EVICT_LAST", evict_last)
    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    models, tok, lens = fd.prefilled_pair(cfg, params, fd.LENS, "cuda")
    third = fd.prefilled_pair(cfg, params, fd.LENS, "cuda")[0][0]
    mk = dict(max_batch=len(fd.LENS), max_context=fd.BPS * 128, scratch_slot=fd.SLOTS - 1,
              scratch_block=fd.BPS * (fd.SLOTS - 1))
    monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "40")
    graphed, eager_on = DecodeRunner(models[1], cuda_graphs=True, **mk), DecodeRunner(third, cuda_graphs=True, **mk)
    monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "0")
    plain = DecodeRunner(models[0], cuda_graphs=True, **mk)
    pos, tok = list(lens), tok.clone()
    for k in range(fd.STEPS):
        seqs = [SeqContext(pos[i], 1, i, i, fd.table(i)) for i in range(len(fd.LENS))]
        monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "0")
        ref = plain(tok, seqs, graphs=False).clone()
        monkeypatch.setenv("DEEPINFER_L2_PREFETCH_MB", "40")
        on = eager_on(tok, seqs, graphs=False).clone()
        replay = graphed(tok, seqs).clone()
        assert torch.equal(on, ref), f"step {k}: eager with the prefetch"
        assert torch.equal(replay, ref), f"step {k}: graph replay with the prefetch"
        tok = ref.argmax(-1)
        for i in range(len(fd.LENS)):
            pos[i] += 1
    for name, ref in fd.cache_tensors(models[0]).items():
        assert torch.equal(fd.cache_tensors(models[1])[name], ref), name
        assert torch.equal(fd.cache_tensors(third)[name], ref), name
