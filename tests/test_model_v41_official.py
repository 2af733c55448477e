"""The V4.1 engine model in official numerics (bf16 activations, FP8 activation quantisation per 32,
packed FP8/FP4 caches, the V4.1 sparse-attention kernel) against the oracle's official mode on the tiny
V4.1 checkpoint.

Official numerics runs one sequence per call (batch-1 shapes, like the oracle's calls), so the engine
reproduces the oracle BIT FOR BIT:
1. end to end: prompts of mixed lengths (window 16 crossed, ratio-2 groups half filled, more than 4
   compressed entries so the candidate-block filter engages) prefilled as ONE varlen batch, then decode
   steps of all of them together, teacher-forced on the oracle's greedy tokens: every logit equal, and
   every tapped residual state (embed, engram updates, each sublayer's hc_post, final) equal;
2. KV storage: the values the engine's packed caches load back equal the oracle's cached values (window
   ring, FP4 latents, FP4 index keys) and the fp32 partial-group state equals the oracle's;
3. the tap contract (names, order, shapes, sequence indices) in both numerics;
4. the engine runner builds the official V4.1 model from `EngineConfig(numerics="official")`, and
   LLM.generate in official numerics reproduces the oracle's greedy tokens.
Run with `-s` to see the measured figures.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.model import ForwardContext, SeqContext, prepare_params
from deepinfer.model.v41 import V41EngineModel
from deepinfer.model.v41_cache import V41Cache

BLOCK = 128
PROMPTS = {0: 5, 1: 17, 2: 41, 3: 70}  # seq index -> prompt length
DECODES = 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def parts(tiny_v41_dir):
    from deepinfer.config import ModelConfig
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    raw = load_tensors(tiny_v41_dir, cfg, progress=False)
    return cfg, raw, Tokenizer.from_checkpoint(tiny_v41_dir)


@pytest.fixture(scope="module")
def official_params(parts):
    cfg, raw, _ = parts
    return prepare_params(raw, cfg, numerics="official")


def make_engine(parts, params, numerics="official", num_blocks=8, max_num_seqs=4):
    cfg, raw, tok = parts
    dtype = torch.float32 if numerics == "official" else torch.float64
    cache = V41Cache(cfg, num_blocks, BLOCK, max_num_seqs, dtype, numerics)
    return V41EngineModel(cfg, params, cache, raw=raw, tokenizer=tok, numerics=numerics)


@pytest.fixture(scope="module")
def oracle_runs(oracle41_factory):
    """Per prompt: the official oracle (batch 1) on the prefill then DECODES greedy steps.
    Returns {seq: (oracle, ids [len + DECODES], [logits per step], [[(tap name, state)] per step])}."""
    runs = {}
    for i, n in PROMPTS.items():
        orc = oracle41_factory("official", max_batch=1, max_seq_len=256)
        taps: list = []
        orc.tap = lambda name, x: taps[-1].append((name, x[0].clone()))
        ids = tokens(n, 100 + i)
        taps.append([])
        logits = [orc(ids[None], 0)[0]]
        seq = ids.tolist()
        for k in range(DECODES):
            seq.append(int(logits[-1].argmax()))
            taps.append([])
            logits.append(orc(torch.tensor([seq[-1:]]), n + k)[0])
        orc.tap = None
        runs[i] = (orc, torch.tensor(seq), logits, taps)
    return runs


@pytest.fixture(scope="module")
def engine_run(parts, official_params, oracle_runs):
    """The engine over all prompts as one varlen batch (slots/blocks deliberately not the identity), then
    DECODES batched decode steps; returns (engine, [logits [num_seqs, V] per step], taps per step, seqs)."""
    eng = make_engine(parts, official_params)
    order = [2, 0, 3, 1]  # batch order != seq index order
    slots = {2: (1, 3), 0: (3, 0), 3: (0, 2), 1: (2, 1)}  # seq -> (window_slot, state_slot)
    tables = {2: (5,), 0: (7,), 3: (1,), 1: (2,)}
    steps_logits, steps_taps = [], []

    def run(step: int):
        seqs, flat = [], []
        for i in order:
            ids = oracle_runs[i][1]
            n = PROMPTS[i]
            start, num = (0, n) if step == 0 else (n + step - 1, 1)
            seqs.append(SeqContext(start, num, *slots[i], tables[i]))
            flat.append(ids[start : start + num])
        taps: list = []
        eng.tap = lambda name, x, seq: taps.append((name, seq, x.clone()))
        out = eng(torch.cat(flat), ForwardContext(tuple(seqs)))
        eng.tap = None
        steps_logits.append({i: out[k] for k, i in enumerate(order)})
        steps_taps.append([(name, order[seq], x) for name, seq, x in taps])

    for step in range(DECODES + 1):
        run(step)
    return eng, steps_logits, steps_taps, (order, slots, tables)


def test_end_to_end_bit_identical(oracle_runs, engine_run):
    _, logits, _, _ = engine_run
    rows = equal = agree = margin_rows = 0
    worst = 0.0
    for step in range(DECODES + 1):
        for i in PROMPTS:
            got, ref = logits[step][i], oracle_runs[i][2][step]
            assert got.dtype == ref.dtype == torch.float32
            worst = max(worst, rel_err(got, ref))
            rows += 1
            equal += int(torch.equal(got, ref))
            top2 = ref.topk(2).values
            if top2[0] - top2[1] >= 2:
                margin_rows += 1
                agree += int(got.argmax() == ref.argmax())
    print(f"\nV4.1 official end to end: {equal}/{rows} logit rows bit-identical, worst rel_err {worst:.3g}, "
          f"argmax agreement {agree}/{margin_rows} at margin >= 2")
    assert equal == rows, f"only {equal}/{rows} rows bit-identical (worst rel_err {worst:.3g})"


def test_taps_bit_identical(oracle_runs, engine_run):
    _, _, taps, _ = engine_run
    n_cmp = 0
    for step in range(DECODES + 1):
        for i in PROMPTS:
            ref = oracle_runs[i][3][step]
            got = [(name, x) for name, seq, x in taps[step] if seq == i]
            assert [n for n, _ in got] == [n for n, _ in ref]
            for (name, x), (_, r) in zip(got, ref):
                assert x.shape == r.shape and x.dtype == r.dtype, f"step {step} seq {i} {name}"
                assert torch.equal(x, r), f"step {step} seq {i} {name}: rel_err {rel_err(x, r):.3g}"
                n_cmp += 1
    print(f"\nV4.1 official taps: {n_cmp} tapped states bit-identical")


def test_caches_bit_identical(parts, oracle_runs, engine_run):
    cfg = parts[0]
    eng, _, _, (order, slots, tables) = engine_run
    win = cfg.window_size
    checked = 0
    for i in PROMPTS:
        orc, ids = oracle_runs[i][0], oracle_runs[i][1]
        end = len(ids)  # prompt + every greedy token (each was fed)
        wslot, sslot = slots[i]
        for layer, blk in enumerate(orc.layers):
            lc, attn = eng.cache.layers[layer], blk.attn
            live = torch.arange(max(0, end - win), end) % win
            ring = lc.decode("window", lc.ring[wslot, live])
            assert torch.equal(ring, attn.window_cache[0, live]), f"seq {i} layer {layer}: window ring"
            checked += 1
            r = cfg.compress_ratios[layer]
            if not (r and layer in cfg.kv_source_layers):
                continue
            rows = eng.cache.entry_rows(tables[i], r, end // r)
            latent = lc.decode("latent", lc.comp[rows])
            assert torch.equal(latent, attn.compress_cache[0, : end // r]), f"seq {i} layer {layer}: latents"
            keys = lc.decode("index", lc.index_keys[rows])
            assert torch.equal(keys, attn.indexer.k_cache[0, : end // r]), f"seq {i} layer {layer}: index keys"
            checked += 2
            if r > 1 and end % r:
                part = end % r
                assert lc.state_kv.dtype == torch.float32
                assert torch.equal(lc.state_kv[sslot, :part], attn.compressor.kv_state[0, :part])
                assert torch.equal(lc.state_score[sslot, :part], attn.compressor.score_state[0, :part])
                checked += 1
    assert eng.cache.layers[0].ring.dtype == torch.uint8
    print(f"\nV4.1 official caches: {checked} cache tensors bit-identical")


def test_tap_contract(parts, official_params):
    cfg = parts[0]
    hc, dim = cfg.hc_mult, cfg.dim
    expected = ["embed"]
    for layer in range(cfg.n_layers):
        if layer in cfg.engram_layer_ids:
            expected.append(f"layers.{layer}.engram")
        expected += [f"layers.{layer}.attn", f"layers.{layer}.ffn"]
    expected.append("final")
    lengths = (3, 20)
    for numerics, params in (("official", official_params), ("exact", prepare_params(parts[1], cfg))):
        eng = make_engine(parts, params, numerics)
        seen: list = []
        eng.tap = lambda name, x, seq: seen.append((name, seq, tuple(x.shape), x.dtype))
        seqs = (SeqContext(0, lengths[0], 0, 0, (0,)), SeqContext(0, lengths[1], 1, 1, (1,)))
        ids = torch.cat([tokens(n, 7 + k) for k, n in enumerate(lengths)])
        out = eng(ids, ForwardContext(seqs))
        assert out.shape == (2, cfg.vocab_size)
        dtype = torch.bfloat16 if numerics == "official" else torch.float64
        for seq, n in enumerate(lengths):
            mine = [(name, shape, dt) for name, s, shape, dt in seen if s == seq]
            assert [name for name, _, _ in mine] == expected, numerics
            for name, shape, dt in mine:
                assert shape == ((n, dim) if name == "final" else (n, hc, dim)), (numerics, name, shape)
                assert dt == dtype, (numerics, name, dt)
        eng.tap = None  # no tap: same logits
        eng2 = make_engine(parts, params, numerics)
        assert torch.equal(eng2(ids, ForwardContext(seqs)), out)


def test_runner_builds_official_v41(tiny_v41_dir, oracle41_factory):
    from deepinfer.config import ModelConfig
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_runner import ModelRunner

    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    runner = ModelRunner(EngineConfig(tiny_v41_dir, numerics="official", max_model_len=256, max_num_seqs=2,
                                      max_num_batched_tokens=64, kv_cache_bytes=1 << 22), cfg)
    model = runner.model
    assert model.numerics == "official" and model.cache.numerics == "official"
    assert model.cache.layers[cfg.kv_source_layers[0]].comp.dtype == torch.uint8
    assert runner.num_blocks >= 2
    ids = tokens(23, 5)
    got = model(ids, ForwardContext((SeqContext(0, 23, 0, 0, (0,)),)))[0]
    ref = oracle41_factory("official", max_batch=1)(ids[None], 0)[0]
    assert torch.equal(got, ref)


def test_llm_generate_official_v41(tiny_v41_dir, oracle41_factory):
    """LLM.generate in official numerics (each prompt prefilled in one chunk, decodes batched) produces
    the oracle's own official greedy tokens (8 per prompt, EOS ignored)."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.reference.generate import generate

    prompts = [tokens(n, 40 + n).tolist() for n in (3, 17, 40, 70)]
    llm = LLM(tiny_v41_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, numerics="official")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = generate(oracle41_factory("official", max_batch=1), [prompt], 8, eos_id=-1)[0]
        assert out.outputs[0].token_ids == ref.tokens
