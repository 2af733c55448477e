"""The engine's V4 MTP block (model/mtp.py) against the oracle's `mtp_forward` (exact numerics): same
logits at 1e-9 for positions 0..S-2 fed the oracle's final residual and the next tokens, computed in
chunks across the MTP window (16) so the ring is exercised; the drafter's first draft is the argmax of
the oracle MTP row of the last real position."""
from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.context import ForwardContext, SeqContext
from deepinfer.model.mtp import MTPCache, V4MTP, prepare_mtp_params
from deepinfer.model.params import prepare_params
from deepinfer.weights import load_tensors


def test_mtp_matches_oracle(tiny_v4_dir, oracle_factory):
    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    raw = load_tensors(tiny_v4_dir, cfg, progress=False)
    target = prepare_params(raw, cfg, torch.float64)
    mtp = V4MTP(cfg, prepare_mtp_params(raw, cfg, torch.float64, "exact"), target,
                MTPCache(cfg, cfg.mtp_layer_ids[0], 2, torch.float64, "exact"))
    oracle = oracle_factory("exact", max_batch=1, max_seq_len=128)
    ids = torch.randint(0, cfg.vocab_size, (1, 41), generator=torch.Generator().manual_seed(4))
    hidden = oracle.hidden(ids, 0)  # [1, S, hc, D]
    ref = oracle.mtp_forward(hidden[:, :-1], ids[:, 1:], 0, all_logits=True)[0]  # [S-1, V]
    got, at = [], 0
    for n in (7, 1, 1, 13, 1, 17):  # a prefill, decode steps and extends crossing the window twice
        ctx = ForwardContext((SeqContext(at, n, 1, 1),), all_logits=True)
        _, logits = mtp.forward(hidden[0, at : at + n], ids[0, at + 1 : at + n + 1], ctx)
        got.append(logits)
        at += n
    got = torch.cat(got)
    assert at == ids.shape[1] - 1
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(err.max()) <= 1e-9
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_mtp_drafter_feeds_hidden_t_and_token_t_plus_1(tiny_v4_dir, oracle_factory):
    """Through the engine: the first draft after the prefill is the oracle MTP's argmax at the prompt's
    last position, fed that position's final residual and the token just sampled."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(tiny_v4_dir, max_model_len=128, max_num_seqs=2, num_blocks=2,
              speculative={"method": "mtp", "num_speculative_tokens": 1})
    proposer = llm.engine.spec.proposer
    seen = []
    propose = proposer.propose

    def capture(requests, k):
        drafts = propose(requests, k)
        seen.extend((list(r.all_token_ids), drafts[r.request_id]) for r in requests if r.request_id in drafts)
        return drafts

    proposer.propose = capture
    prompt = torch.randint(0, 129280, (21,), generator=torch.Generator().manual_seed(8)).tolist()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    tokens, draft = seen[0]
    assert len(tokens) == len(prompt) + 1
    oracle = oracle_factory("exact", max_batch=1, max_seq_len=128)
    seq = torch.tensor([tokens])
    hidden = oracle.hidden(seq[:, :-1], 0)
    ref = oracle.mtp_forward(hidden, seq[:, 1:], 0)  # last position: hidden_{P-1} with the sampled token
    assert draft == [int(ref[0].argmax())]


def test_mtp_official_numerics_bit_identical_to_oracle(tiny_v4_dir, oracle_factory):
    """Official numerics (bf16 activations, FP8 act-quant GEMMs): one extend over the prompt gives the
    oracle's MTP logits bit for bit."""
    cfg = ModelConfig.from_checkpoint(tiny_v4_dir)
    raw = load_tensors(tiny_v4_dir, cfg, progress=False)
    target = prepare_params(raw, cfg, torch.float32, numerics="official")
    mtp = V4MTP(cfg, prepare_mtp_params(raw, cfg, torch.float32, "official"), target,
                MTPCache(cfg, cfg.mtp_layer_ids[0], 2, torch.float32, "official"), "official")
    oracle = oracle_factory("official", max_batch=1, max_seq_len=128)
    ids = torch.randint(0, cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(4))
    hidden = oracle.hidden(ids, 0)
    ref = oracle.mtp_forward(hidden[:, :-1], ids[:, 1:], 0, all_logits=True)[0]
    _, got = mtp.forward(hidden[0, :-1], ids[0, 1:], ForwardContext((SeqContext(0, 20, 1, 1),), all_logits=True))
    assert torch.equal(got, ref)
