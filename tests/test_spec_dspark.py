"""DSpark (V4.1, exact numerics): the engine's captured main_hidden equals the oracle's; the engine drafter
(model/dspark.py) equals a batch-1 twin written here in the official code's structure (window cache seeded
like DSparkAttention's prefill, the get_dspark_topk_idxs index set, Block.forward, forward_head's Markov
loop) on the reference ops; drafting through the engine keeps greedy output identical (20 prompts,
batches 1 and 8) and logprobs equal."""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model.dspark import DSpark, DSparkCache, prepare_dspark_params
from deepinfer.model.params import prepare_params
from deepinfer.reference import ops
from deepinfer.reference.moe import MoE
from deepinfer.reference.v4 import collapse, hc_mix, hc_post
from deepinfer.weights import load_tensors
from test_spec_engine import LENGTHS, NEW, assert_same, make_prompts


def _sub(p, prefix):
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def twin_draft(cfg, p, num, main_hidden, last_token):
    """Official forward_spec at start_pos = P = S - 1 with the window seeded by the prefill call."""
    S, win, bs, rd = main_hidden.shape[1], cfg.window_size, cfg.dspark_block_size, cfg.rope_head_dim
    P, eps = S - 1, cfg.norm_eps
    m0, ml = "mtp.0.", f"mtp.{cfg.n_mtp_layers - 1}."
    main_x = ops.rms_norm(main_hidden @ p[m0 + "main_proj.weight"].T, p[m0 + "main_norm.weight"], eps, num)
    ids = torch.full((1, bs), cfg.dspark_noise_token_id)
    ids[0, 0] = last_token
    x = p["embed.weight"][ids].unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
    pre_mix = torch.zeros(1, bs, cfg.hc_mult, dtype=torch.float64)
    pre_mix[..., 0] = 1
    for stage, layer in enumerate(cfg.mtp_layer_ids):
        sp = _sub(p, f"mtp.{stage}.")
        a = _sub(sp, "attn.")
        freqs = ops.rope_table(rd, S + bs + 1, cfg.original_seq_len if cfg.uses_yarn(layer) else 0,
                               cfg.rope_base(layer), cfg.rope_factor, cfg.beta_fast, cfg.beta_slow, True)
        main_kv = ops.apply_rope(ops.rms_norm(main_x @ a["wkv.weight"].T, a["kv_norm.weight"], eps, num),
                                 freqs[:S], num)
        cache = torch.zeros(1, win, cfg.head_dim, dtype=torch.float64)
        if S <= win:
            cache[:, :S] = main_kv
        else:
            cut = S % win
            cache[:, cut:win], cache[:, :cut] = main_kv[:, -win:].split([win - cut, cut], dim=1)

        def mixes(t, which):
            return ops.hc_split_sinkhorn(hc_mix(t, sp[f"hc_{which}_fn"], eps, num), sp[f"hc_{which}_scale"],
                                         sp[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)

        attn_pre, post, comb = mixes(x, "attn")
        y = ops.rms_norm(collapse(x, pre_mix, num), sp["attn_norm.weight"], eps, num)
        bf = freqs[P + 1 : P + 1 + bs]
        qr = ops.rms_norm(y @ a["wq_a.weight"].T, a["q_norm.weight"], eps, num)
        q = ops.apply_rope((qr @ a["wq_b.weight"].T).unflatten(-1, (-1, cfg.head_dim)), bf, num)
        kv = ops.apply_rope(ops.rms_norm(y @ a["wkv.weight"].T, a["kv_norm.weight"], eps, num), bf, num)
        idx = torch.cat([torch.arange(min(win, P + 1)), win + torch.arange(bs)]).view(1, 1, -1).expand(1, bs, -1)
        o = ops.sparse_attn(q, torch.cat([cache, kv], dim=1), a["attn_sink"], idx, cfg.head_dim**-0.5, num, True)
        o = ops.apply_rope(o, bf, num, inverse=True)
        G = a["wo_a.weight"].shape[0] // cfg.o_lora_rank
        z = torch.einsum("bsgd,grd->bsgr", o.reshape(1, bs, G, -1), a["wo_a.weight"].view(G, cfg.o_lora_rank, -1))
        x = hc_post(z.flatten(2) @ a["wo_b.weight"].T, x, post, comb, num)
        ffn_pre, post, comb = mixes(x, "ffn")
        y = ops.rms_norm(collapse(x, attn_pre, num), sp["ffn_norm.weight"], eps, num)
        moe = MoE(layer, _sub(sp, "ffn."), cfg, num, shared_clamp=True)
        moe.topk = cfg.dspark_n_activated_experts
        x = hc_post(moe(y[0], ids[0]).unsqueeze(0), x, post, comb, num)
        pre_mix = ffn_pre
    h = collapse(x, pre_mix, num)[0]  # [bs, D]
    logits = ops.rms_norm(h, p[ml + "norm.weight"], eps, num) @ p["head.weight"].T
    out, embeds = [last_token], []
    for i in range(bs):
        m = p[ml + "markov_head.embed.weight"][out[i]]
        embeds.append(m)
        out.append(int((logits[i] + p[ml + "markov_head.head.weight"] @ m).argmax()))
    conf = torch.cat([h, torch.stack(embeds)], dim=-1) @ p[ml + "confidence_head.proj.weight"].T
    return out[1:], conf.squeeze(-1)


@pytest.mark.parametrize("S", [9, 23])  # inside the window (16) and past it
def test_dspark_matches_official_twin(tiny_v41_dir, oracle41_factory, S):
    cfg = ModelConfig.from_checkpoint(tiny_v41_dir)
    raw = load_tensors(tiny_v41_dir, cfg, progress=False)
    oracle = oracle41_factory("exact", max_batch=1)
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
    oracle.hidden(ids, 0)
    main_hidden = oracle.main_hidden  # [1, S, 3D]
    from deepinfer.reference.params import prepare_params as ref_params
    p = ref_params(raw, cfg, oracle.num)
    want_tokens, want_conf = twin_draft(cfg, p, oracle.num, main_hidden, 777)
    target = prepare_params(raw, cfg, torch.float64)
    dspark = DSpark(cfg, prepare_dspark_params(raw, cfg), target, DSparkCache(cfg, 2))
    dspark.seed(1, 0, main_hidden[0, :5])  # seeded in two chunks, as steps would
    dspark.seed(1, 5, main_hidden[0, 5:])
    block = dspark.draft([1], [S - 1], [777])
    assert block.tokens[0] == want_tokens
    assert torch.allclose(block.confidence[0], want_conf, rtol=1e-9, atol=1e-12)


def test_engine_main_hidden_equals_oracle(tiny_v41_dir, oracle41_factory):
    from deepinfer.scheduler import Request, Scheduler, SchedulerConfig
    from deepinfer.spec.target import execute_with_hidden

    llm = LLM(tiny_v41_dir, max_model_len=128, max_num_seqs=2, num_blocks=2)
    runner = llm.engine.runner
    ids = torch.randint(0, 129280, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    sched = Scheduler(SchedulerConfig(2, 16, 128, 128, 2))
    sched.add_request(Request("a", ids, 4))
    rows = []
    for _ in range(2):  # two prefill chunks of 16 and 14
        out = sched.schedule()
        _, _, hidden = execute_with_hidden(runner.model, out, set(), 129280, torch.float64)
        rows.append(hidden["a"])
        sched.update(out, {"a": [5]} if out.scheduled[0].num_sampled_rows else {})
    oracle = oracle41_factory("exact", max_batch=1)
    oracle.hidden(torch.tensor([ids]), 0)
    assert torch.allclose(torch.cat(rows), oracle.main_hidden[0], rtol=0, atol=1e-9)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)


KW = dict(max_model_len=256, max_num_batched_tokens=128, kv_cache_bytes=1 << 27)


@pytest.fixture(scope="module")
def baseline41(tiny_v41_dir):
    prompts = make_prompts(LENGTHS)
    return prompts, LLM(tiny_v41_dir, max_num_seqs=8, **KW).generate(prompts, GREEDY)


@pytest.mark.parametrize("batch", [1, 8])
def test_dspark_greedy_identity(tiny_v41_dir, baseline41, batch):
    prompts, base = baseline41
    if batch == 1:
        prompts, base = prompts[::4], base[::4]
    llm = LLM(tiny_v41_dir, max_num_seqs=batch, speculative={"method": "dspark", "num_speculative_tokens": 4}, **KW)
    assert_same(base, llm.generate(prompts, GREEDY))
    assert llm.engine.spec_stats.num_steps > 0


def test_v41_forced_drafts_every_rollback_length(tiny_v41_dir, baseline41):
    """Forced drafts right for 0..k tokens: V4.1's window ring, ratio-2 partial group and engram history
    are rolled back on every rejection length (the prompts cross ratio-2 groups and the window)."""
    from spec_proposers import ForcedProposer

    prompts, base = baseline41
    cont = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, base)}
    llm = LLM(tiny_v41_dir, max_num_seqs=8, speculative={
        "method": "custom", "proposer": ForcedProposer(cont, "mixed"), "num_speculative_tokens": 3}, **KW)
    assert_same(base, llm.generate(prompts, GREEDY))
    rates = llm.engine.spec_stats.rates()
    assert 0 < rates[-1] < rates[0] < 1


def test_dspark_config_errors(tiny_v4_dir, tiny_v41_dir):
    with pytest.raises(ValueError, match="no DSpark stages"):
        LLM(tiny_v4_dir, speculative={"method": "dspark"})
    with pytest.raises(ValueError, match="at most dspark_block_size = 5"):
        LLM(tiny_v41_dir, speculative={"method": "dspark", "num_speculative_tokens": 6})
