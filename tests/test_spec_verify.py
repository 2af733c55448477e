"""Verification of drafts (spec/verify.py) on a small vocabulary slice: the emitted tokens follow the
target distribution whatever the drafts (chi-square over many seeded draws), acceptance happens with
probability p(draft), greedy accepts exactly the argmax prefix; a planted biased verifier is rejected by
the same statistics (the test can fail). Plus the acceptance bookkeeping."""
from __future__ import annotations

import pytest
import torch

from deepinfer.sampling import Sampler, SamplingParams
from deepinfer.spec.metrics import AcceptanceStats
from deepinfer.spec.verify import verify

V = 6
TRIALS = 3000
# chi-square critical value for 5 degrees of freedom at p = 1e-4 (a fixed seed keeps the test deterministic)
CHI2_CRIT = 25.74


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run(rows, drafts, params, trials=TRIALS, seed0=1000):
    sampler = Sampler()
    outs = []
    for t in range(trials):
        gen = torch.Generator().manual_seed(seed0 + t)
        outs.append(verify(sampler, [rows], [drafts], [params], [gen])[0])
    return outs


@pytest.fixture
def rows():
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, V, generator=g, dtype=torch.float64) * 1.5  # target rows for 2 drafts + bonus


@pytest.mark.parametrize("drafts", [[0, 1], [4, 4], [5, 2]])
def test_emitted_tokens_follow_the_target(rows, drafts):
    params = SamplingParams(temperature=0.8)
    p = torch.softmax(rows / 0.8, dim=-1)
    outs = run(rows, drafts, params)
    first = torch.bincount(torch.tensor([o.tokens[0] for o in outs]), minlength=V).double()
    assert chi2(first, p[0]) < CHI2_CRIT
    accepted = [o for o in outs if o.num_accepted >= 1]
    rate = len(accepted) / TRIALS  # P(accept draft 1) = p0(draft)
    p_d = float(p[0, drafts[0]])
    assert abs(rate - p_d) < 4 * (p_d * (1 - p_d) / TRIALS) ** 0.5 + 1e-9  # within 4 standard errors
    if len(accepted) > 300:  # the token after an accepted draft follows the next row
        second = torch.bincount(torch.tensor([o.tokens[1] for o in accepted]), minlength=V).double()
        assert chi2(second, p[1]) < CHI2_CRIT
    for o in outs:  # a rejected draft's replacement is never the draft itself
        assert o.tokens[: o.num_accepted] == drafts[: o.num_accepted]
        if o.num_accepted < len(drafts):
            assert o.tokens[-1] != drafts[o.num_accepted]


def test_planted_biased_verifier_is_detected(rows):
    """Accepting draft 1 with probability min(1, 2 p(d)) (a wrong acceptance rule) shifts the first token's
    distribution; the same chi-square must flag it."""
    p = torch.softmax(rows / 0.8, dim=-1)[0]
    d = 1
    g = torch.Generator().manual_seed(5)
    first = []
    for _ in range(TRIALS):
        if torch.rand((), generator=g, dtype=torch.float64) < min(1.0, 2 * float(p[d])):
            first.append(d)
        else:
            first.append(int(torch.multinomial(p, 1, generator=g)))
    counts = torch.bincount(torch.tensor(first), minlength=V).double()
    assert chi2(counts, p) > CHI2_CRIT


def test_greedy_accepts_the_argmax_prefix(rows):
    best = rows.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0)
    for drafts, accepted in [(best[:2], 2), ([best[0], (best[1] + 1) % V], 1), ([(best[0] + 1) % V, best[1]], 0)]:
        (out,) = verify(Sampler(), [rows], [drafts], [params], [None])
        assert out.num_accepted == accepted
        assert out.tokens == best[: accepted + 1]


def test_rows_must_match_drafts(rows):
    with pytest.raises(ValueError, match="expected \\[2, V\\]"):
        verify(Sampler(), [rows], [[1]], [SamplingParams()], [None])


def test_acceptance_stats():
    s = AcceptanceStats()
    s.record(3, 3)
    s.record(3, 1)
    s.record(2, 0)
    assert s.proposed == [3, 3, 2] and s.accepted == [2, 1, 1]
    assert s.rates() == [2 / 3, 1 / 3, 0.5]
    assert s.mean_accepted_length == 1 + 4 / 3
    with pytest.raises(ValueError):
        s.record(1, 2)


def test_one_tensor_form_equals_the_per_request_rows():
    """Without drafts the engine hands verify its [n, V] logits as they are: the same tokens, logprobs and
    generator draws as one [1, V] row per request; with drafts that form is refused."""
    from deepinfer.sampling import make_generator

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, seed=1)] * 2 + \
        [SamplingParams(temperature=0.5, top_k=5, seed=2)]
    outs = []
    for form in ("tensor", "rows"):
        gens = [make_generator(10 + i) for i in range(5)]
        rows = logits if form == "tensor" else [logits[i : i + 1] for i in range(5)]
        got = verify(Sampler(), rows, [[]] * 5, params, gens)
        outs.append([(v.tokens, [s.row(r, 2 if p.logprobs else 0) for s, r in v.sampled])
                     for v, p in zip(got, params)])
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="without drafts"):
        verify(Sampler(), logits, [[1]] + [[]] * 4, params, [None] * 5)
