"""The sampler: greedy, filters, seeded draws, the distribution it samples from, and logprobs that are the
real log_softmax of the very logits it sampled (the seed shipped all-0.0 token_logprobs: H20 plan P5)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.sampling import (
    Sampler, SamplingParams, StopChecker, gather_logprobs, make_generator, prompt_logprobs,
)
from deepinfer.sampling.filters import apply_filters, apply_min_p, apply_top_k_top_p

NEG_INF = float("-inf")


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist())


# ---- parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.0),
    ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 21), ("prompt_logprobs", -1),
    ("n", 0), ("seed", "42"), ("seed", 1.5),
    ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("ignore_eos", 1),
])
def test_bad_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_params_normalise_and_stay_hashable():
    p = SamplingParams(stop="###", stop_token_ids=[5, 7], top_k=0, logprobs=20, temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 7) and p.top_k_or_off == 0 and p.greedy
    assert hash(p) == hash(SamplingParams(stop=["###"], stop_token_ids=(5, 7), top_k=0, logprobs=20, temperature=0))
    assert SamplingParams().stop == () and not SamplingParams().greedy
    assert p.stop_token_set(eos_token_id=1) == {1, 5, 7}
    assert SamplingParams(ignore_eos=True, stop_token_ids=[5]).stop_token_set(1) == {5}


# ---- logprobs (P5) ---------------------------------------------------------------------------------------
def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.8, seed=1, logprobs=3),
            SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.01, logprobs=0),
            SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0, logprobs=20),
            SamplingParams(temperature=0.5, top_p=0.5, logprobs=1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_are_log_softmax_of_the_sampled_logits_and_not_zero(dtype):
    torch.manual_seed(0)
    params = mixed_params()
    logits = (3.0 * torch.randn(len(params), 1000)).to(dtype)
    out = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
    ref = torch.log_softmax(logits, dim=-1)
    expected = ref.gather(1, out.token_ids.unsqueeze(-1)).squeeze(-1)
    assert out.logprobs.dtype == dtype
    torch.testing.assert_close(out.logprobs, expected, atol=1e-6, rtol=0)
    # P5: a sampler (or a plumbing step) that returns zeros must fail here
    assert (out.logprobs < -1e-3).any() and not (out.logprobs == 0).all()
    assert (out.logprobs <= 0).all()
    # ranks: 1 + number of strictly better tokens; greedy rows are rank 1
    brute = (ref > expected.unsqueeze(-1)).sum(-1) + 1
    assert torch.equal(out.ranks, brute) and out.ranks[0] == 1 and out.ranks[4] == 1
    # top logprobs: the largest request (20), sorted descending, equal to the true top-k
    assert out.top_ids.shape == (len(params), 20) and out.num_top_logprobs == (5, 3, 0, 0, 20, 1)
    top_vals, top_ids = ref.topk(20, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top_vals, atol=1e-6, rtol=0)
    assert torch.equal(out.top_ids, top_ids)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    token, lp, rank, top = out.row(1, out.num_top_logprobs[1])
    assert (token, rank) == (int(out.token_ids[1]), int(out.ranks[1])) and len(top) == 3
    assert top[0] == (int(top_ids[1, 0]), pytest.approx(float(top_vals[1, 0]), abs=1e-6))


def test_half_precision_logits_give_fp32_logprobs():
    torch.manual_seed(1)
    logits = (4 * torch.randn(3, 300)).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=2)] * 3)
    assert out.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-6, rtol=0)


def test_processed_logprobs_mode_uses_the_filtered_scaled_row():
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -2.0]])
    params = [SamplingParams(temperature=2.0, top_k=2, seed=0, logprobs=3)]
    out = Sampler("processed_logprobs").sample(logits, params, [make_generator(0)])
    processed = torch.log_softmax(torch.tensor([[2.0, 1.5, NEG_INF, NEG_INF, NEG_INF]]), -1)
    assert int(out.token_ids[0]) in (0, 1)
    torch.testing.assert_close(out.logprobs, processed[0, out.token_ids], atol=1e-6, rtol=0)
    assert out.top_logprobs[0, 2] == NEG_INF
    raw = Sampler().sample(logits, params, [make_generator(0)])
    assert int(raw.token_ids[0]) == int(out.token_ids[0])  # the mode changes reporting only
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("whatever")


def test_prompt_logprobs_of_whole_prompt_and_of_a_chunk():
    torch.manual_seed(2)
    prompt = [5, 9, 2, 7, 7, 1, 0, 3]
    logits = torch.randn(len(prompt), 12, dtype=torch.float64)
    ref = torch.log_softmax(logits, -1)
    whole = prompt_logprobs(logits, prompt, num_top=2)
    # row j predicts prompt[j + 1]; the last row predicts the first generated token and is dropped
    assert whole.token_ids.tolist() == prompt[1:]
    torch.testing.assert_close(whole.logprobs, ref[torch.arange(7), torch.tensor(prompt[1:])], atol=1e-12, rtol=0)
    assert whole.top_ids.shape == (7, 2) and (whole.logprobs < -1e-3).any()
    chunk = prompt_logprobs(logits[2:5], prompt, start=2)  # positions 2..4 predict tokens 3..5
    assert chunk.token_ids.tolist() == prompt[3:6]
    torch.testing.assert_close(chunk.logprobs, whole.logprobs[2:5])
    last = prompt_logprobs(logits[6:8], prompt, start=6)
    assert last.token_ids.tolist() == [3]
    with pytest.raises(ValueError, match="do not fit"):
        prompt_logprobs(logits[:4], prompt, start=6)


def test_gather_logprobs_ranks_ties_and_shape_checks():
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), -1)
    out = gather_logprobs(lp, torch.tensor([2]), 0)
    assert int(out.ranks[0]) == 1 and out.top_ids.shape == (1, 0)  # a tie with the best is still rank 1
    assert int(gather_logprobs(lp, torch.tensor([3]), 0).ranks[0]) == 4
    with pytest.raises(ValueError):
        gather_logprobs(lp, torch.tensor([1, 2]), 0)


# ---- greedy and filters ----------------------------------------------------------------------------------
def test_greedy_is_argmax_and_ignores_seed():
    torch.manual_seed(3)
    logits = torch.randn(6, 500, dtype=torch.float64)
    params = [SamplingParams(temperature=0.0, seed=i, top_k=3, top_p=0.2) for i in range(6)]
    out = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    tie = torch.tensor([[0.0, 2.0, 2.0]])
    assert int(Sampler().sample(tie, [SamplingParams(temperature=0)]).token_ids[0]) == 1  # first best


def test_top_k_keeps_k_best_and_their_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0]])
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), None)) == {1, 3}
    assert kept(apply_top_k_top_p(logits, torch.tensor([3]), None)) == {1, 2, 3}
    assert kept(apply_top_k_top_p(logits, torch.tensor([1]), None)) == {1, 3}  # tie at the k-th value
    assert kept(apply_top_k_top_p(logits, torch.tensor([0]), None)) == set(range(5))  # 0 = off
    assert kept(apply_top_k_top_p(logits, torch.tensor([99]), None)) == set(range(5))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # probs, shuffled
    for p, expected in ((0.3, {1}), (0.5, {1}), (0.6, {1, 3}), (0.9, {1, 3, 0}), (0.99, {0, 1, 2, 3}),
                        (1.0, {0, 1, 2, 3})):
        assert kept(apply_top_k_top_p(logits, None, torch.tensor([p]))) == expected, p
    # per-row parameters in one batch; top-k applies before top-p
    two = logits.repeat(2, 1)
    masked = apply_top_k_top_p(two, torch.tensor([0, 1]), torch.tensor([0.6, 1.0]))
    assert kept(masked[:1]) == {1, 3} and kept(masked[1:]) == {1}


def test_min_p_is_relative_to_the_best_token():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    assert kept(apply_min_p(logits, torch.tensor([0.2]))) == {0, 1, 3}  # threshold 0.1
    assert kept(apply_min_p(logits, torch.tensor([0.5]))) == {1, 3}  # threshold 0.25
    assert kept(apply_min_p(logits, torch.tensor([0.0]))) == {0, 1, 2, 3}
    assert kept(apply_min_p(logits, torch.tensor([1.0]))) == {1}
    both = apply_filters(logits, top_k=torch.tensor([3]), top_p=torch.tensor([0.7]), min_p=torch.tensor([0.2]))
    assert kept(both) == {1, 3}  # min-p drops 2; top-k keeps {1,3,0}; top-p 0.7 over what is left


def test_sampled_tokens_never_leave_the_filtered_set():
    torch.manual_seed(4)
    logits = torch.randn(1, 40).repeat(400, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    out = Sampler().sample(logits, [SamplingParams(temperature=5.0, top_k=3)] * 400)
    assert set(out.token_ids.tolist()) == top3  # all three reached, nothing else at a high temperature
    out = Sampler().sample(logits[:50], [SamplingParams(temperature=1.0, top_p=1e-6)] * 50)
    assert (out.token_ids == logits[0].argmax()).all()


# ---- random sampling -------------------------------------------------------------------------------------
def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(5)
    steps = [torch.randn(3, 64) for _ in range(6)]  # rows: request a, b, c
    pa, pb = SamplingParams(temperature=1.0, seed=11, top_p=0.95), SamplingParams(temperature=0.7, seed=12, top_k=20)
    pc = SamplingParams(temperature=1.0)  # unseeded
    ga, gb = make_generator(11), make_generator(12)
    together = [Sampler().sample(l, [pa, pb, pc], [ga, gb, None]).token_ids[:2].tolist() for l in steps]
    ga, gb = make_generator(11), make_generator(12)
    reordered = []
    for l in steps:  # b and c share a batch in the other order, a runs alone
        tb = Sampler().sample(l[[2, 1]], [pc, pb], [None, gb]).token_ids[1]
        ta = Sampler().sample(l[:1], [pa], [ga]).token_ids[0]
        reordered.append([int(ta), int(tb)])
    assert together == reordered
    other = make_generator(99)
    changed = [int(Sampler().sample(l[:1], [pa], [other]).token_ids[0]) for l in steps]
    assert changed != [t[0] for t in together]  # the seed matters


def test_matches_the_official_draw_for_a_batch_of_one():
    from deepinfer.reference.generate import sample as official_sample

    torch.manual_seed(6)
    mine, theirs = make_generator(33377335), make_generator(33377335)
    for _ in range(5):
        logits = torch.randn(1, 1000)
        a = Sampler().sample(logits, [SamplingParams(temperature=0.6)], [mine]).token_ids
        assert torch.equal(a, official_sample(logits, 0.6, theirs))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_temperature_sampling_follows_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0])
    n = 20000
    with torch.random.fork_rng():
        torch.manual_seed(7)
        out = Sampler().sample(logits.repeat(n, 1), [SamplingParams(temperature=temperature)] * n)
    target = torch.softmax(logits / temperature, -1)
    assert chi_square(out.token_ids, target) < CHI2_DF4_P001
    # and it is not the plain softmax when T != 1 (the test can tell temperatures apart)
    if temperature != 1.0:
        assert chi_square(out.token_ids, torch.softmax(logits, -1)) > 10 * CHI2_DF4_P001


def test_per_request_generators_follow_the_distribution_too():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0])
    n = 4000
    gens = [make_generator(1000 + i) for i in range(n)]
    out = Sampler().sample(logits.repeat(n, 1), [SamplingParams(temperature=1.0, seed=0)] * n, gens)
    assert chi_square(out.token_ids, torch.softmax(logits, -1)) < CHI2_DF4_P001


def test_sampler_input_checks():
    with pytest.raises(ValueError, match="N = 2"):
        Sampler().sample(torch.randn(3, 5), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(torch.randn(2, 5), [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match="float"):
        Sampler().sample(torch.ones(1, 5, dtype=torch.long), [SamplingParams()])


# ---- stop conditions -------------------------------------------------------------------------------------
def feed(checker: StopChecker, pieces: list[str]):
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        match = checker.check_text(text, len(piece))
        if match:
            return i, match
    return None, text


def test_stop_string_across_token_boundaries_is_cut_from_the_output():
    i, match = feed(StopChecker(["lo Wo"]), ["Hel", "lo W", "orld", "!"])
    assert i == 2 and match.stop == "lo Wo" and match.text == "Hel"
    i, match = feed(StopChecker(["lo Wo"], include_stop_str_in_output=True), ["Hel", "lo W", "orld", "!"])
    assert i == 2 and match.text == "Hello Wo"
    assert feed(StopChecker(["xyz"]), ["Hel", "lo"]) == (None, "Hello")


def test_the_earliest_stop_string_wins_and_old_text_is_not_rescanned():
    checker = StopChecker(["World", "o W"])
    match = checker.check_text("Hello World", 6)
    assert match.stop == "o W" and match.text == "Hell"
    assert StopChecker(["STOP"]).check_text("abSTOPcdef", 3) is None  # ended before the new chars


def test_stop_tokens_and_eos():
    params = SamplingParams(stop_token_ids=[42])
    checker = StopChecker.from_params(params, eos_token_id=1)
    assert checker.check_token(1) and checker.check_token(42) and not checker.check_token(7)
    ignoring = StopChecker.from_params(SamplingParams(stop_token_ids=[42], ignore_eos=True), eos_token_id=1)
    assert not ignoring.check_token(1) and ignoring.check_token(42)


def test_streaming_holds_back_a_possible_stop_prefix():
    checker = StopChecker(["###", "\n\n"])
    assert checker.streamable_length("answer #", finished=False) == len("answer #") - 2
    assert checker.streamable_length("answer #", finished=True) == len("answer #")
    assert StopChecker().streamable_length("abc", finished=False) == 3
    assert StopChecker(["###"], include_stop_str_in_output=True).streamable_length("ab#", False) == 3
    assert StopChecker(["##"]).streamable_length("ab", finished=False) == 1
