"""DSpark on V4-Flash-0731 (config family v4 + DSpark stages; exact numerics) over the tiny 0731 checkpoint:
the tiny checkpoint carries the real 0731 `mtp.*` name set; the engine's captured main_hidden equals the V4
oracle's (mean over streams of the inputs of the target layers, read through the oracle's residual tap);
the engine drafter (model/dspark.py) equals a batch-1 twin written here in the official V4.1 DSpark
structure (DSparkAttention's prefill-seeded window cache, get_dspark_topk_idxs, forward_head's Markov loop)
put on V4's Block (per-sublayer hc pre, per-head q norm) and V4's head collapse, on the reference ops;
drafting through the engine keeps greedy output and logprobs identical (batches 1 and 8)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.model.dspark import DSpark, DSparkCache, prepare_dspark_params
from deepinfer.model.params import prepare_params
from deepinfer.reference import ops
from deepinfer.reference.moe import MoE
from deepinfer.reference.v4 import collapse, head_collapse, hc_mix, hc_post
from deepinfer.weights import load_tensors
from test_spec_engine import LENGTHS, NEW, assert_same, make_prompts

FIXTURE_NAMES = "tests/fixtures/index/v4-flash-0731.names.txt"


@pytest.fixture(scope="module")
def tiny_0731_dir():
    from deepinfer.tiny import default_model_dir

    return default_model_dir("v4-0731", seed=0)


@pytest.fixture(scope="module")
def tiny_0731(tiny_0731_dir):
    cfg = ModelConfig.from_checkpoint(tiny_0731_dir)
    return cfg, load_tensors(tiny_0731_dir, cfg, progress=False)


def _pattern(name: str) -> str:
    return re.sub(r"experts\.\d+\.", "experts.{E}.", name)


def test_tiny_0731_has_the_real_dspark_names(tiny_0731_dir, tiny_v4_dir):
    cfg = ModelConfig.from_checkpoint(tiny_0731_dir)
    assert cfg.family == "v4" and cfg.n_mtp_layers == 3 and cfg.dspark_target_layer_ids == (3, 4, 5)
    assert tiny_0731_dir != tiny_v4_dir
    with open(tiny_0731_dir / "model.safetensors.index.json") as f:
        tiny = {_pattern(n) for n in json.load(f)["weight_map"] if n.startswith("mtp.")}
    with open(FIXTURE_NAMES) as f:
        real = {line.split()[0] for line in f if line.startswith("mtp.")}
    assert tiny == real


def _oracle(cfg, raw):
    from deepinfer.reference.numerics import Numerics
    from deepinfer.reference.params import prepare_params as ref_params
    from deepinfer.reference.v4 import V4Model

    num = Numerics("exact", "current", cfg.act_block)
    p = ref_params(raw, cfg, num)
    return V4Model(cfg, p, num, max_batch=1, max_seq_len=256), p, num


def oracle_main_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """[1, S, k*D]: the mean over the 4 streams of the INPUT of each target layer = the residual the oracle's
    tap shows after the previous layer's ffn sublayer (after the embedding for layer 0)."""
    seen = {}
    model.tap = lambda name, x: seen.__setitem__(name, x)
    model.hidden(ids, 0)
    model.tap = None
    names = [f"layers.{t - 1}.ffn" if t else "embed" for t in model.cfg.dspark_target_layer_ids]
    return torch.cat([seen[n].mean(dim=2) for n in names], dim=-1)


def _sub(p, prefix):
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def twin_draft(cfg, p, num, main_hidden, last_token):
    """The official DSpark forward at start_pos = P = S - 1 after a prefill that seeded the window, each stage
    a V4 Block (hc_pre from the sublayer's own input, per-head q RMS norm), the V4 head collapse with the
    last stage's hc_head, markov_w1 then markov_w2."""
    S, win, bs, rd = main_hidden.shape[1], cfg.window_size, cfg.dspark_block_size, cfg.rope_head_dim
    P, eps = S - 1, cfg.norm_eps
    m0, ml = "mtp.0.", f"mtp.{cfg.n_mtp_layers - 1}."
    main_x = ops.rms_norm(main_hidden @ p[m0 + "main_proj.weight"].T, p[m0 + "main_norm.weight"], eps, num)
    ids = torch.full((1, bs), cfg.dspark_noise_token_id)
    ids[0, 0] = last_token
    x = p["embed.weight"][ids].unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
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

        def pre(t, which):
            mixes = hc_mix(t, sp[f"hc_{which}_fn"], eps, num)
            pre_, post, comb = ops.hc_split_sinkhorn(mixes, sp[f"hc_{which}_scale"], sp[f"hc_{which}_base"],
                                                     cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
            return collapse(t, pre_, num), post, comb

        y, post, comb = pre(x, "attn")
        y = ops.rms_norm(y, sp["attn_norm.weight"], eps, num)
        bf = freqs[P + 1 : P + 1 + bs]
        qr = ops.rms_norm(y @ a["wq_a.weight"].T, a["q_norm.weight"], eps, num)
        q = ops.head_rms_norm((qr @ a["wq_b.weight"].T).unflatten(-1, (-1, cfg.head_dim)), eps, num)
        q = ops.apply_rope(q, bf, num)
        kv = ops.apply_rope(ops.rms_norm(y @ a["wkv.weight"].T, a["kv_norm.weight"], eps, num), bf, num)
        idx = torch.cat([torch.arange(min(win, P + 1)), win + torch.arange(bs)]).view(1, 1, -1).expand(1, bs, -1)
        o = ops.sparse_attn(q, torch.cat([cache, kv], dim=1), a["attn_sink"], idx, cfg.head_dim**-0.5, num, True)
        o = ops.apply_rope(o, bf, num, inverse=True)
        G = a["wo_a.weight"].shape[0] // cfg.o_lora_rank
        z = torch.einsum("bsgd,grd->bsgr", o.reshape(1, bs, G, -1), a["wo_a.weight"].view(G, cfg.o_lora_rank, -1))
        x = hc_post(z.flatten(2) @ a["wo_b.weight"].T, x, post, comb, num)
        y, post, comb = pre(x, "ffn")
        y = ops.rms_norm(y, sp["ffn_norm.weight"], eps, num)
        moe = MoE(layer, _sub(sp, "ffn."), cfg, num, shared_clamp=True)
        x = hc_post(moe(y[0], ids[0]).unsqueeze(0), x, post, comb, num)
    h = head_collapse(x, p, ml, cfg, num)[0]  # [bs, D]
    logits = ops.rms_norm(h, p[ml + "norm.weight"], eps, num) @ p["head.weight"].T
    out, embeds = [last_token], []
    for i in range(bs):
        m = p[ml + "markov_head.markov_w1.weight"][out[i]]
        embeds.append(m)
        out.append(int((logits[i] + p[ml + "markov_head.markov_w2.weight"] @ m).argmax()))
    conf = torch.cat([h, torch.stack(embeds)], dim=-1) @ p[ml + "confidence_head.proj.weight"].T
    return out[1:], conf.squeeze(-1)


@pytest.mark.parametrize("S", [9, 23])  # inside the window (16) and past it
def test_dspark_0731_matches_official_twin(tiny_0731, S):
    cfg, raw = tiny_0731
    oracle, p, num = _oracle(cfg, raw)
    ids = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
    main_hidden = oracle_main_hidden(oracle, ids)
    want_tokens, want_conf = twin_draft(cfg, p, num, main_hidden, 777)
    dspark = DSpark(cfg, prepare_dspark_params(raw, cfg), prepare_params(raw, cfg, torch.float64), DSparkCache(cfg, 2))
    dspark.seed(1, 0, main_hidden[0, :5])  # seeded in two chunks, as steps would
    dspark.seed(1, 5, main_hidden[0, 5:])
    block = dspark.draft([1], [S - 1], [777])
    assert block.tokens[0] == want_tokens
    assert torch.allclose(block.confidence[0], want_conf, rtol=1e-9, atol=1e-12)
    # the drafts are not an artefact of the Markov bias alone: the stages' logits matter
    assert len(set(want_tokens)) > 1


def test_engine_main_hidden_0731_equals_oracle(tiny_0731_dir, tiny_0731):
    from deepinfer.scheduler import Request, Scheduler, SchedulerConfig
    from deepinfer.spec.target import execute_with_hidden

    llm = LLM(tiny_0731_dir, max_model_len=128, max_num_seqs=2, num_blocks=2)
    ids = torch.randint(0, 129280, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    sched = Scheduler(SchedulerConfig(2, 16, 128, 128, 2))
    sched.add_request(Request("a", ids, 4))
    rows, logits = [], None
    for _ in range(2):  # two prefill chunks of 16 and 14
        out = sched.schedule()
        sample, _, hidden = execute_with_hidden(llm.engine.runner.model, out, set(), 129280, torch.float64)
        rows.append(hidden["a"])
        if out.scheduled[0].num_sampled_rows:
            logits = sample[0]
        sched.update(out, {"a": [5]} if out.scheduled[0].num_sampled_rows else {})
    cfg, raw = tiny_0731
    oracle, _, _ = _oracle(cfg, raw)
    want = oracle_main_hidden(oracle, torch.tensor([ids]))
    assert torch.allclose(torch.cat(rows), want[0], rtol=0, atol=1e-9)
    assert torch.allclose(logits, oracle(torch.tensor([ids]), 0)[0], rtol=0, atol=1e-9)


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)
KW = dict(max_model_len=256, max_num_batched_tokens=128, kv_cache_bytes=1 << 27)


@pytest.fixture(scope="module")
def baseline0731(tiny_0731_dir):
    prompts = make_prompts(LENGTHS[::2])
    return prompts, LLM(tiny_0731_dir, max_num_seqs=8, **KW).generate(prompts, GREEDY)


@pytest.mark.parametrize("batch", [1, 8])
def test_dspark_0731_greedy_identity(tiny_0731_dir, baseline0731, batch):
    prompts, base = baseline0731
    if batch == 1:
        prompts, base = prompts[::3], base[::3]
    llm = LLM(tiny_0731_dir, max_num_seqs=batch, speculative={"method": "dspark", "num_speculative_tokens": 4},
              **KW)
    assert_same(base, llm.generate(prompts, GREEDY))
    stats = llm.engine.spec_stats
    # some first drafts are right even with random weights (deterministic: 2 of 30 at batch 1, 7 of 73 at 8),
    # so partial acceptance and the rewind after it run through the DSpark drafter's bookkeeping too
    assert stats.num_steps > 0 and stats.accepted[0] > 0


def test_dspark_0731_config_errors(tiny_0731_dir):
    with pytest.raises(ValueError, match="DSpark stages .V4-Flash-0731.; draft with 'dspark'"):
        LLM(tiny_0731_dir, speculative={"method": "mtp"})
    with pytest.raises(ValueError, match="at most dspark_block_size = 5"):
        LLM(tiny_0731_dir, speculative={"method": "dspark", "num_speculative_tokens": 6})
    with pytest.raises(NotImplementedError, match="exact numerics only"):
        LLM(tiny_0731_dir, numerics="official", speculative={"method": "dspark"}, **KW)


def test_dspark_rejects_bad_dspark_config(tiny_0731):
    import dataclasses

    cfg, raw = tiny_0731
    params, target = prepare_dspark_params(raw, cfg), prepare_params(raw, cfg, torch.float64)
    for bad, match in ((dict(dspark_target_layer_ids=(3, 4, 6)), "backbone layers 0..5"),
                       (dict(dspark_target_layer_ids=(4, 3, 5)), "ascending distinct"),
                       (dict(dspark_noise_token_id=129280), "outside the vocabulary")):
        wrong = dataclasses.replace(cfg, **bad)
        with pytest.raises(ValueError, match=match):
            DSpark(wrong, params, target, DSparkCache(wrong, 1))


def test_make_tiny_cli_v4_0731(tmp_path, monkeypatch):
    from deepinfer import tiny
    from deepinfer.cli import main

    small = ModelConfig.from_dict({**tiny.tiny_config("v4-0731").to_inference_json(), "vocab_size": 512,
                                   "dspark_noise_token_id": 500})  # fast: small vocab
    monkeypatch.setattr(tiny, "tiny_config", {"v4-0731": small}.__getitem__)
    assert main(["make-tiny", str(tmp_path / "t"), "--family", "v4-0731"]) == 0
    assert ModelConfig.from_checkpoint(tmp_path / "t") == small
    with open(tmp_path / "t" / "deepinfer_tiny.json") as f:
        assert json.load(f)["family"] == "v4-0731"
    with open(tmp_path / "t" / "model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    assert "mtp.2.markov_head.markov_w2.weight" in names and "mtp.0.main_proj.scale" in names
