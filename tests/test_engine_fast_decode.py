"""The batched decode path of fast numerics (`model/decode_*.py`) on the tiny V4 checkpoint.

CPU: against the existing per-sequence fast path (`V4EngineModel.forward`) on the same params and inputs,
teacher-forced, over steps that cross window, ratio-4 and ratio-128 block boundaries: logits within a tight
bound (only summation order may differ; measured: bit-identical on the CPU twins) and every cache tensor
of the real sequences equal at the end (rings, compressed entries, indexer keys, compressor states).
Padding rows of a bucket leave the real sequences' logits and every cache row they do not own unchanged
(they write only the scratch slot and block).
GPU (-m gpu): graph replay vs the eager decode path on the same inputs, bit-identical; the decode path on
cuda (Triton kernels) vs the oracle within its noise floor (the `test_engine_fast` judge). Measured on the
H200: replay == eager bit for bit; decode path rel_err 0.056 (floor 0.042), median cos 0.99913 (floor
0.99938), every row above the noise margin agrees.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext, V4EngineModel
from deepinfer.model.decode_step import DecodeRunner
from deepinfer.model.factory import build_v4_model, v4_cache, v4_params

import test_engine_fast as tef
from test_engine_fast import oracle_run  # noqa: F401  (the module-scoped fixture, used by the GPU test)

LENS = (120, 40, 7, 126)  # rows 0 and 3 cross a ratio-128 boundary during the decode steps
STEPS = 12
BPS = 2  # blocks per sequence: 256 positions
SLOTS = len(LENS) + 1  # the last slot (and block) is the decode path's scratch


def table(i: int) -> tuple[int, ...]:
    return tuple(range(BPS * i, BPS * (i + 1)))


def fresh_model(cfg, params, device="cpu") -> V4EngineModel:
    return V4EngineModel(cfg, params, v4_cache(cfg, "fast", BPS * SLOTS, 128, SLOTS, device), "fast")


def prefilled_models(make, vocab_size: int, lens, tables, device="cpu"):
    """Two models from `make()`, both with random prompts of `lens` tokens prefilled by the existing path into
    slot i with block table tables(i) (the same logits asserted) -> (models, each sequence's greedy next
    token). Both families' decode tests."""
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(2, vocab_size, (n,), generator=g) for n in lens]
    ctx = ForwardContext(tuple(SeqContext(0, len(p), i, i, tables(i)) for i, p in enumerate(ps)))
    models = [make() for _ in range(2)]
    logits = [m(torch.cat(ps).to(device), ctx) for m in models]
    assert torch.equal(logits[0], logits[1])
    return models, logits[0].argmax(-1)


def prefilled_pair(cfg, params, lens, device="cpu"):
    """Two models over the same params, both with `lens` prompts prefilled by the existing path."""
    models, tok = prefilled_models(lambda: fresh_model(cfg, params, device), cfg.vocab_size, lens, table, device)
    return models, tok, lens


def cache_tensors(model: V4EngineModel) -> dict[str, torch.Tensor]:
    out = {}
    for i, lc in enumerate(model.cache.layers):
        out[f"{i}.ring"] = lc.ring
        for name in ("comp", "index_keys"):
            if getattr(lc, name) is not None:
                out[f"{i}.{name}"] = getattr(lc, name)
        for name in ("comp_state", "index_state"):
            st = getattr(lc, name)
            if st is not None:
                out[f"{i}.{name}.kv"], out[f"{i}.{name}.score"] = st.kv, st.score
    return out


def owned(name: str, model: V4EngineModel, seqs: range) -> tuple[torch.Tensor, ...]:
    """Index of the rows of cache tensor `name` that the sequences `seqs` own (slots or their blocks)."""
    if name.endswith(("ring", ".kv", ".score")):
        return (torch.tensor(list(seqs), dtype=torch.long),)
    layer = int(name.split(".")[0])
    epb = model.cache.block_size // model.cfg.compress_ratios[layer]
    blocks = torch.tensor([b for i in seqs for b in table(i)])
    return ((blocks.unsqueeze(1) * epb + torch.arange(epb)).flatten(),)


def assert_caches_equal(got_model, ref_model, ends: dict[int, int]) -> None:
    """Every cache row sequence i (ending at position ends[i]) will read again is equal: ring, entries and
    indexer keys of its slot and blocks; of the compressor states the rows holding data (the previous
    complete block for ratio 4, the current partial block's first end % r rows); rows past those are stale
    by design (either path may leave anything there)."""
    ref, got = cache_tensors(ref_model), cache_tensors(got_model)
    for name in ref:
        if name.endswith((".kv", ".score")):
            r = ref_model.cfg.compress_ratios[int(name.split(".")[0])]
            off = r if r == 4 else 0
            for i, end in ends.items():
                rows = slice(0, off + end % r)
                assert torch.equal(got[name][i, rows], ref[name][i, rows]), (name, i)
        else:
            idx = owned(name, ref_model, list(ends))
            assert torch.equal(got[name][idx], ref[name][idx]), name


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_both(models, tok, lens, runner, steps=STEPS, **kw):
    """Teacher-forced decode steps: models[0] by the existing path, models[1] by `runner` -> worst rel_err."""
    worst = 0.0
    for k in range(steps):
        seqs = [SeqContext(n + k, 1, i, i, table(i)) for i, n in enumerate(lens)]
        ref = models[0](tok, ForwardContext(tuple(seqs)))
        got = runner(tok, seqs, **kw).clone()
        worst = max(worst, rel_err(got, ref))
        tok = ref.argmax(-1)
    return worst


# ---------------------------------------------------------------------------------------------- CPU
def test_batched_decode_equals_the_per_sequence_fast_path(fast_params):
    cfg, params = fast_params
    models, tok, lens = prefilled_pair(cfg, params, LENS)
    runner = DecodeRunner(models[1], max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1,
                          scratch_block=BPS * (SLOTS - 1))
    assert runner.contexts == (128, 256)
    used = []
    run = runner.__call__

    def tracked(ids, seqs):
        out = run(ids, seqs)
        used.append(runner.last_bucket)
        return out

    worst = run_both(models, tok, lens, tracked)
    assert set(used) == {(4, 128), (4, 256)}  # positions 126.. start in the 128 bucket, then cross it
    print(f"\nbatched decode vs per-sequence fast path: worst logits rel_err {worst:.3g}")
    assert worst <= 1e-6
    # compressor states across block boundaries, entries, keys, rings of the real sequences
    assert_caches_equal(models[1], models[0], {i: n + STEPS for i, n in enumerate(LENS)})


def test_padding_rows_touch_only_the_scratch(fast_params):
    """3 sequences padded to a bucket of 4 vs the same 3 with a real 4th sequence in the 4th row (same
    shapes: CPU GEMMs round per row count, so an unpadded batch of 3 is another draw): the real rows'
    logits and caches are bit-identical, and nothing of the unused slot 3 and its blocks changed."""
    cfg, params = fast_params
    models, tok, lens = prefilled_pair(cfg, params, LENS)
    runners = [DecodeRunner(m, max_batch=4, max_context=BPS * 128, scratch_slot=SLOTS - 1,
                            scratch_block=BPS * (SLOTS - 1)) for m in models]
    assert runners[1].bucket(3) == 4
    before = {k: v.clone() for k, v in cache_tensors(models[1]).items()}
    steps = 6
    padded_steps_equal_full(runners, tok, lens, steps, table)
    assert_caches_equal(models[1], models[0], {i: n + steps for i, n in enumerate(lens[:3])})
    got = cache_tensors(models[1])
    for name, t in got.items():
        idx = owned(name, models[1], [3])
        assert torch.equal(t[idx], before[name][idx]), name
    # the padding row did run: it wrote the scratch slot's ring
    assert not torch.equal(got["0.ring"][SLOTS - 1], before["0.ring"][SLOTS - 1])


def padded_steps_equal_full(runners, tok, lens, steps: int, table) -> None:
    """`steps` teacher-forced decode steps of the sequences of `lens` (slot i, blocks table(i)): runners[0]
    decodes all of them, runners[1] the first 3 padded to the bucket; the 3 rows' logits bit-identical."""
    for k in range(steps):
        seqs = [SeqContext(n + k, 1, i, i, table(i)) for i, n in enumerate(lens)]
        full = runners[0](tok, seqs).clone()
        padded = runners[1](tok[:3], seqs[:3])
        assert torch.equal(padded, full[:3]), f"step {k}"
        tok = full.argmax(-1)


def replay_steps_equal_eager(runners, tok, lens, steps: int, table) -> None:
    """`steps` teacher-forced decode steps of the 4 sequences of `lens` (slot i, blocks table(i); on odd steps
    sequence 3 waits, so bucket 4 runs full and padded): runners[0] eagerly, runners[1] by its default (the
    graphs where captured); their logits bit-identical."""
    pos, tok = list(lens), tok.clone()
    for k in range(steps):
        active = list(range(len(lens) if k % 2 == 0 else 3))  # odd steps: sequence 3 waits
        seqs = [SeqContext(pos[i], 1, i, i, table(i)) for i in active]
        eager = runners[0](tok[active], seqs, graphs=False).clone()
        replay = runners[1](tok[active], seqs).clone()
        assert torch.equal(replay, eager), f"step {k}"
        tok[active] = eager.argmax(-1)
        for i in active:
            pos[i] += 1


def test_batched_indexer_scores_equal_the_per_sequence_op():
    """indexer_scores_batched_bf16 (per-sequence keys) vs indexer_scores_bf16 run one sequence at a time."""
    from deepinfer import kernels

    g = torch.Generator().manual_seed(3)
    B, h, d, E = 5, 4, 64, 33
    q = torch.randn(B, h, d, generator=g).bfloat16()
    w = torch.randn(B, h, generator=g).bfloat16()
    keys = torch.randn(B, E, d, generator=g).bfloat16()
    got = kernels.get("indexer_scores_batched_bf16")(q, w, keys)
    want = torch.cat([kernels.get("indexer_scores_bf16")(q[b : b + 1], w[b : b + 1], keys[b]) for b in range(B)])
    assert got.dtype == torch.bfloat16 and got.shape == (B, E)
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    assert (got == want).float().mean() > 0.9  # only fp32 summation order may differ


def test_llm_fast_decodes_through_the_batched_path(tiny_v4_dir, tiny_v4_raw):
    """LLM(numerics="fast"): pure-decode steps go through the runner's DecodeRunner, and the greedy tokens
    equal those of the same engine with the decode path switched off (4 prompts finishing together: every
    decode step fills bucket 4 exactly, so on the CPU twins both paths are bit-identical)."""
    engine_decodes_with_and_without_the_batched_path(tiny_v4_dir, tiny_v4_raw[0], (30, 9, 131, 4))


def engine_decodes_with_and_without_the_batched_path(model_dir, cfg, lens) -> None:
    """Greedy `LLM.generate` of prompts of `lens` tokens (4, finishing together) through the runner's
    DecodeRunner and with it switched off: every decode step goes through it, and the tokens are equal."""
    from deepinfer import LLM, SamplingParams

    g = torch.Generator().manual_seed(2)
    ps = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(numerics="fast", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512, num_blocks=8)
    runs = []
    for on in (True, False):
        llm = LLM(model_dir, **kw)
        runner = llm.engine.runner
        assert runner.decoder is not None and runner.model.cache.max_num_seqs == 5
        calls = []
        if on:
            inner = runner.decoder
            runner.decoder = lambda ids, seqs: calls.append(len(seqs)) or inner(ids, seqs)
        else:
            runner.decoder = None
        runs.append([o.outputs[0].token_ids for o in llm.generate(ps, params)])
        assert len(calls) == (5 if on else 0), calls  # the 5 decode steps after the prefill step
    assert runs[0] == runs[1]


def test_decode_runner_errors(fast_params):
    cfg, params = fast_params
    model = fresh_model(cfg, params)
    runner = DecodeRunner(model, max_batch=2, max_context=BPS * 128, scratch_slot=SLOTS - 1,
                          scratch_block=BPS * (SLOTS - 1))
    ids = torch.tensor([5, 6])
    with pytest.raises(ValueError, match="one new token"):
        runner(ids[:1], [SeqContext(3, 2, 0, 0, table(0))])
    with pytest.raises(ValueError, match="exceeds max_batch"):
        runner(torch.tensor([1, 2, 3]), [SeqContext(3, 1, i, i, table(i)) for i in range(3)])
    with pytest.raises(ValueError, match="scratch"):
        runner(ids[:1], [SeqContext(3, 1, SLOTS - 1, 0, table(0))])
    with pytest.raises(ValueError, match="max_context"):
        runner(ids[:1], [SeqContext(BPS * 128, 1, 0, 0, table(0))])
    with pytest.raises(ValueError, match="does not cover"):
        runner(ids[:1], [SeqContext(200, 1, 0, 0, table(0)[:1])])
    with pytest.raises(ValueError, match="vocabulary"):
        runner(torch.tensor([cfg.vocab_size]), [SeqContext(3, 1, 0, 0, table(0))])
    with pytest.raises(ValueError, match="outside the cache"):
        DecodeRunner(model, 2, 256, scratch_slot=SLOTS, scratch_block=0)


# ---------------------------------------------------------------------------------------------- GPU

def test_indexer_lanes_change_no_bit_on_the_cpu(fast_params, monkeypatch):
    """DEEPINFER_INDEXER_LANES=1 (model/decode_attention.py select_in_lanes: an indexer layer's side work over
    three side streams) runs inline here in its own order (the indexer's weights, the two compressors, the
    query, the scores and rows): logits and every cache tensor bit-identical to the one-chain order. (On
    CUDA the same kernels run concurrently: test_side_streams_change_no_bit.)"""
    cfg, params = fast_params
    models, tok, lens = prefilled_pair(cfg, params, LENS)
    assert any(cfg.compress_ratios[i] == 4 for i in range(cfg.n_layers)), "the tiny model needs an indexer layer"
    mk = dict(max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1, scratch_block=BPS * (SLOTS - 1))
    runners = [DecodeRunner(m, **mk) for m in models]
    for k in range(3):
        seqs = [SeqContext(n + k, 1, i, i, table(i)) for i, n in enumerate(lens)]
        monkeypatch.setenv("DEEPINFER_INDEXER_LANES", "0")
        ref = runners[0](tok, seqs).clone()
        monkeypatch.setenv("DEEPINFER_INDEXER_LANES", "1")
        got = runners[1](tok, seqs).clone()
        assert torch.equal(got, ref), f"step {k}"
        tok = ref.argmax(-1)
    for name, ref in cache_tensors(models[0]).items():
        assert torch.equal(cache_tensors(models[1])[name], ref), name



@pytest.mark.gpu
def test_graph_replay_is_bit_identical_to_eager(tiny_v4_raw, cuda_kernels):
    """Two models in the same state; one replays the captured graphs, the other runs the same decode path
    eagerly: logits and every cache tensor bit-identical after each step (bucket 4 full, and 3 sequences
    padded to it)."""
    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    models, tok, lens = prefilled_pair(cfg, params, LENS, "cuda")
    runners = [DecodeRunner(m, max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1,
                            scratch_block=BPS * (SLOTS - 1), cuda_graphs=True) for m in models]
    assert set(runners[1]._graphs) == {(b, c) for b in (1, 2, 4) for c in (128, 256)}
    replay_steps_equal_eager(runners, tok, lens, STEPS, table)
    for name, ref in cache_tensors(models[0]).items():  # same path both sides: every row, stale ones too
        assert torch.equal(cache_tensors(models[1])[name], ref), name


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["DEEPINFER_FUSED_ROUTE", "DEEPINFER_ROUTE_FIRST", "DEEPINFER_GATE_PACKED_KEY"])
def test_moe_route_switches_change_no_bit_of_a_b1_decode(tiny_v4_raw, cuda_kernels, monkeypatch, switch):
    """Op "moe_route"'s one launch at b1 (the gate's GEMV, the gate, the slot blocks, act_quant(x); the
    routed experts then take its PreRouted) against DEEPINFER_FUSED_ROUTE=0 (the unfused ops, fp4_moe
    routing itself), the MoE's routing queued before the shared expert against after it
    (DEEPINFER_ROUTE_FIRST) and the gate's two top-k forms (DEEPINFER_GATE_PACKED_KEY): one sequence's decode
    logits and every cache tensor bit-identical after each step, eager and in replayed graphs (captured with
    the switch as set)."""
    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    for graphs in (False, True):
        models, tok, lens = prefilled_pair(cfg, params, LENS[:1], "cuda")
        mk = dict(max_batch=1, max_context=BPS * 128, scratch_slot=SLOTS - 1, scratch_block=BPS * (SLOTS - 1),
                  cuda_graphs=graphs)
        runners = []
        for m, flag in zip(models, "01"):  # (in case a runner captures when it is made)
            monkeypatch.setenv(switch, flag)
            runners.append(DecodeRunner(m, **mk))
        for k in range(4):
            seqs = [SeqContext(lens[0] + k, 1, 0, 0, table(0))]
            monkeypatch.setenv(switch, "0")
            ref = runners[0](tok, seqs).clone()
            monkeypatch.setenv(switch, "1")
            got = runners[1](tok, seqs).clone()
            assert torch.equal(got, ref), (graphs, k)
            tok = ref.argmax(-1)
        for name, ref in cache_tensors(models[0]).items():
            assert torch.equal(cache_tensors(models[1])[name], ref), (graphs, name)


def _forced_split(monkeypatch):
    """The tiny model's linears are too small to split K (K = 256: one 256-wide step of the decode kernel), so
    its ops "fp8_linear" / "fp8_linear_unsummed" on cuda run the Triton bf16 form with 2 splits where K has
    two 128-wide steps: the summed form through `_split_sum_kernel`, the unsummed one as a SplitK."""
    from deepinfer import kernels
    from deepinfer.kernels.triton import fp8_gemm

    def cfg(x):
        return {"SPLIT_K": 2 if x.shape[-1] % 256 == 0 else 1}

    monkeypatch.setitem(kernels._REGISTRY, ("fp8_linear", "cuda"),
                        lambda x, w, config=None, mma=None, out=None:
                        fp8_gemm.fp8_linear(x, w, config=cfg(x), mma="bf16", out=out))
    monkeypatch.setitem(kernels._REGISTRY, ("fp8_linear_unsummed", "cuda"),
                        lambda x, w: fp8_gemm.fp8_linear_unsummed(x, w, config=cfg(x), mma="bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("switch,off,on", [("DEEPINFER_SPLIT_SUM", "kernel", "consumer"),
                                           ("DEEPINFER_SPLIT_SUM", "kernel", "qkv"),
                                           ("DEEPINFER_HC_POST_MIX", "", "PIN_F:1"),
                                           ("DEEPINFER_QKV_PROGRAMS", "1", "2")])
def test_split_sum_switches_change_no_bit_of_a_decode(tiny_v4_raw, cuda_kernels, monkeypatch, switch, off, on):
    """The split-K partials added by their consumers (DEEPINFER_SPLIT_SUM=consumer / qkv: op
    fp8_linear_unsummed into qkv_norm_rope_store and hc_post_pre_fused; the linears forced to split,
    `_forced_split`) against the split-sum kernel, and the post-mix kernel's f pinned to its load layout
    (PIN_F) against not, the fused qkv kernel in two programs a token against one: a 4-sequence batch's decode
    logits and every cache tensor bit-identical after each step, eager and in replayed graphs (captured with the
    switch as set)."""
    from deepinfer.kernels.split_k import SplitK

    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    if switch == "DEEPINFER_SPLIT_SUM":
        _forced_split(monkeypatch)
        from deepinfer import kernels

        w = params["layers.0.attn.wo_b.weight"]
        x = torch.randn(1, w.in_features, device="cuda").bfloat16()
        assert isinstance(kernels.get("fp8_linear_unsummed", "cuda")(x, w), SplitK)  # the switch has partials to leave
    for graphs in (False, True):
        models, tok, lens = prefilled_pair(cfg, params, LENS, "cuda")
        mk = dict(max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1,
                  scratch_block=BPS * (SLOTS - 1), cuda_graphs=graphs)
        runners = []
        for m, flag in zip(models, (off, on)):
            monkeypatch.setenv(switch, flag)
            runners.append(DecodeRunner(m, **mk))
        for k in range(3):
            seqs = [SeqContext(n + k, 1, i, i, table(i)) for i, n in enumerate(lens)]
            monkeypatch.setenv(switch, off)
            ref = runners[0](tok, seqs).clone()
            monkeypatch.setenv(switch, on)
            got = runners[1](tok, seqs).clone()
            assert torch.equal(got, ref), (graphs, k)
            tok = ref.argmax(-1)
        for name, ref in cache_tensors(models[0]).items():
            assert torch.equal(cache_tensors(models[1])[name], ref), (graphs, name)


@pytest.mark.gpu
def test_fast_decode_cuda_matches_the_oracle_within_its_noise(tiny_v4_raw, oracle_run, cuda_kernels):
    """Prefill by the existing path, then the oracle's greedy tokens decoded by the graphed decode path,
    judged like test_engine_fast (the oracle's own prefill-vs-decode noise floor)."""
    cfg, raw = tiny_v4_raw
    n = len(tef.LENS)
    model = build_v4_model(cfg, raw, "fast", "cuda", num_blocks=tef.BLOCKS_PER_SEQ * (n + 1), max_num_seqs=n + 1)
    runner = DecodeRunner(model, max_batch=n, max_context=tef.BLOCKS_PER_SEQ * 128, scratch_slot=n,
                          scratch_block=tef.BLOCKS_PER_SEQ * n)

    def tab(i):
        return tuple(range(tef.BLOCKS_PER_SEQ * i, tef.BLOCKS_PER_SEQ * (i + 1)))

    ps, tokens = tef.prompts(cfg), oracle_run[1]
    out = [model(torch.cat(ps), ForwardContext(tuple(SeqContext(0, len(p), i, i, tab(i)) for i, p in enumerate(ps))))]
    for k in range(tef.STEPS):
        seqs = [SeqContext(len(p) + k, 1, i, i, tab(i)) for i, p in enumerate(ps)]
        out.append(runner(tokens[k], seqs).clone())
    tef.judge("fast decode path (cuda graphs) vs oracle official", torch.stack(out).to("cpu", torch.float64),
              oracle_run)


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", ["0", "1"])
def test_side_streams_change_no_bit(tiny_v4_raw, cuda_kernels, monkeypatch, lanes):
    """The layer's independent branches on the side stream (model/side_stream.py: the shared expert, the
    compressors and the indexer) change only the order of independent kernels: graphs captured with side
    streams, replayed, against the eager path with everything on one stream: logits and every cache tensor
    bit-identical after each step; and the eager path with side streams against the one without. lanes "1":
    DEEPINFER_INDEXER_LANES=1, the indexer layers' side work over three side streams at once."""
    monkeypatch.setenv("DEEPINFER_INDEXER_LANES", lanes)
    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    models, tok, lens = prefilled_pair(cfg, params, LENS, "cuda")
    third = prefilled_pair(cfg, params, LENS, "cuda")[0][0]
    monkeypatch.setenv("DEEPINFER_SIDE_STREAMS", "1")
    mk = dict(max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1, scratch_block=BPS * (SLOTS - 1))
    # every runner captures its graphs (the capture runs steps into the scratch rows), so that the caches
    # match row for row at the end, stale rows too; two of them are then called eagerly
    graphed, eager_side, inline = (DecodeRunner(m, cuda_graphs=True, **mk) for m in (models[1], third, models[0]))
    pos, tok = list(lens), tok.clone()
    for k in range(STEPS):
        seqs = [SeqContext(pos[i], 1, i, i, table(i)) for i in range(len(LENS))]
        monkeypatch.setenv("DEEPINFER_SIDE_STREAMS", "0")
        ref = inline(tok, seqs, graphs=False).clone()
        monkeypatch.setenv("DEEPINFER_SIDE_STREAMS", "1")
        side = eager_side(tok, seqs, graphs=False).clone()
        replay = graphed(tok, seqs).clone()
        assert torch.equal(side, ref), f"step {k}: eager with side streams"
        assert torch.equal(replay, ref), f"step {k}: graph replay with side streams"
        tok = ref.argmax(-1)
        for i in range(len(LENS)):
            pos[i] += 1
    for name, ref in cache_tensors(models[0]).items():
        assert torch.equal(cache_tensors(models[1])[name], ref), name
        assert torch.equal(cache_tensors(third)[name], ref), name


@pytest.mark.gpu
def test_dependent_launch_changes_no_bit(tiny_v4_raw, cuda_kernels, monkeypatch):
    """Programmatic dependent launch (kernels/triton/pdl.py: each kernel starts while the previous one runs
    and waits for it on the device) only moves launches: the prefill and decode steps with PDL on (graphs
    captured with it and replayed, and eagerly, with the side streams) against everything launched plainly,
    logits and every cache tensor bit-identical after each step. A kernel touching memory before its wait
    would race here."""
    from deepinfer.kernels.cuda import runtime

    def pdl(on: bool) -> None:  # the one switch of the Triton and CUDA kernels
        monkeypatch.setattr(runtime, "PDL_ENABLED", on)

    monkeypatch.setenv("DEEPINFER_SIDE_STREAMS", "1")
    cfg, raw = tiny_v4_raw
    params = v4_params(raw, cfg, "fast", "cuda")
    pdl(False)
    (plain, _), tok_plain, lens = prefilled_pair(cfg, params, LENS, "cuda")
    pdl(True)
    (graphed, eager), tok, _ = prefilled_pair(cfg, params, LENS, "cuda")
    assert torch.equal(tok, tok_plain)
    mk = dict(max_batch=len(LENS), max_context=BPS * 128, scratch_slot=SLOTS - 1, scratch_block=BPS * (SLOTS - 1))
    pdl(False)
    ref_runner = DecodeRunner(plain, cuda_graphs=True, **mk)  # captures too: the scratch rows match at the end
    pdl(True)
    runners = [DecodeRunner(m, cuda_graphs=True, **mk) for m in (graphed, eager)]
    pos = list(lens)
    for k in range(STEPS):
        seqs = [SeqContext(pos[i], 1, i, i, table(i)) for i in range(len(LENS))]
        pdl(False)
        ref = ref_runner(tok, seqs, graphs=False).clone()
        pdl(True)
        assert torch.equal(runners[0](tok, seqs), ref), f"step {k}: graph replay with PDL"
        assert torch.equal(runners[1](tok, seqs, graphs=False), ref), f"step {k}: eager with PDL"
        tok = ref.argmax(-1)
        for i in range(len(LENS)):
            pos[i] += 1
    for name, ref in cache_tensors(plain).items():
        assert torch.equal(cache_tensors(graphed)[name], ref), name
        assert torch.equal(cache_tensors(eager)[name], ref), name
