"""The scheduler against a fake deterministic model: whatever the budget, pool size, preemptions, drafts or
aborts, every request produces exactly the tokens it would produce alone, and the pool returns to full."""
from __future__ import annotations

import hashlib
import random

import pytest

from dataclasses import replace

from deepinfer.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput
from deepinfer.scheduler.request import PENDING_TOKEN

VOCAB = 64
STOP = 0  # the fake model's EOS: about one token in 64


def next_token(context: list[int]) -> int:
    """The fake model: the next token is a hash of the whole context (so a lost or doubled token shows)."""
    return int.from_bytes(hashlib.blake2b(repr(context).encode(), digest_size=4).digest(), "little") % VOCAB


def alone(prompt: list[int], max_tokens: int, max_model_len: int, stop=(STOP,)) -> list[int]:
    """What a request generates with unlimited resources."""
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if t in stop or len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out


class FakeRunner:
    """Plays the model runner: a per-request 'KV cache' of position -> token, reset at start_position 0.
    Verifies drafts greedily, the way spec/ will."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cache: dict[str, dict[int, int]] = {}

    def run(self, out: SchedulerOutput) -> dict[str, list[int]]:
        assert out.num_batched_tokens == sum(sr.num_new_tokens for sr in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            req, start, n = sr.request, sr.start_position, sr.num_new_tokens
            assert n > 0 and start + n <= self.config.max_model_len
            assert len(sr.slots.block_table) * self.config.block_size >= start + n
            cache = self.cache.setdefault(req.request_id, {})
            if start == 0:
                cache.clear()  # a fresh or recomputed sequence: the ring and compressor state restart
            truth = req.all_token_ids
            assert [cache.get(p) for p in range(start)] == truth[:start], "computed context was lost"
            for j, t in enumerate(sr.token_ids):
                cache[start + j] = t
            if not sr.num_sampled_rows:
                continue
            first = start + n - sr.num_sampled_rows  # position whose logits are the first sampled row
            toks = []
            for j in range(sr.num_sampled_rows):
                t = next_token([cache[p] for p in range(first + j + 1)])
                toks.append(t)
                if j == sr.num_draft_tokens or sr.token_ids[first + j + 1 - start] != t:
                    break  # bonus token, or the first rejected draft replaced by the model's choice
            sampled[req.request_id] = toks
        return sampled


def propose_drafts(sched: Scheduler, k: int, rng: random.Random) -> None:
    """A drafter that is right most of the time."""
    for req in sched.running:
        if req.num_computed_tokens == req.num_tokens - 1:
            ctx = req.all_token_ids
            drafts = []
            for _ in range(k):
                t = next_token(ctx + drafts)
                drafts.append(t if rng.random() < 0.7 else (t + 1) % VOCAB)
            req.draft_token_ids = drafts


def drive(sched: Scheduler, runner: FakeRunner, late: list[Request] = (), drafts: int = 0, seed: int = 0):
    """Step until everything is done; `late` requests arrive at random steps. Returns the steps."""
    late, rng, steps = list(late), random.Random(seed), []
    while sched.has_unfinished() or late:
        if late and rng.random() < 0.3:
            sched.add_request(late.pop(0))
        out = sched.schedule()
        assert sched.num_running <= sched.config.max_num_seqs
        sched.update(out, runner.run(out))
        sched.block_pool.check_invariants()
        if drafts:
            propose_drafts(sched, drafts, rng)
        steps.append(out)
        assert len(steps) < 5000, "no progress"
    return steps


def make(max_num_seqs=4, budget=32, max_model_len=64, block_size=4, num_blocks=64, chunked=True):
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, block_size, num_blocks, chunked)
    return Scheduler(cfg), FakeRunner(cfg)


def req(rid: str, prompt_len: int, max_tokens: int = 8, seed: int = 0) -> Request:
    rng = random.Random(f"{rid}-{seed}")
    return Request(rid, [rng.randrange(1, VOCAB) for _ in range(prompt_len)], max_tokens, frozenset({STOP}))


def assert_pool_full(sched: Scheduler) -> None:
    pool = sched.block_pool
    assert pool.num_free == pool.num_blocks and len(pool) == 0 and pool.num_free_seq_slots == pool.max_num_seqs
    assert not sched.running and not sched.waiting and not sched.requests


# ---- configuration and intake ----------------------------------------------------------------------------
@pytest.mark.parametrize("field, kwargs", [
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=-1)),
    ("block_size", dict(block_size=2.5)),
    ("chunked_prefill", dict(chunked_prefill="yes")),
    ("max_model_len", dict(num_blocks=3)),  # 3 * 4 positions cannot hold one sequence of 64
    ("chunked_prefill is off", dict(chunked_prefill=False, max_num_batched_tokens=32)),
])
def test_config_validation_names_the_field(field, kwargs):
    base = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{**base, **kwargs})


def test_bad_requests_are_rejected_clearly():
    sched, _ = make(max_model_len=16)
    with pytest.raises(ValueError, match="longer than max_model_len = 16"):
        sched.add_request(req("long", 17))
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Request("e", [], 4)
    for bad in (0, -3, 1.5):
        with pytest.raises(ValueError, match="max_tokens"):
            Request("m", [1], bad)
    sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 3))
    assert sched.num_waiting == 1  # the rejected ones left no trace


def test_prompt_of_max_model_len_gets_one_token_and_never_computes_past_it():
    sched, runner = make(max_model_len=16, budget=16)
    r = Request("a", [7] * 16, 10)  # no stop tokens
    sched.add_request(r)
    drive(sched, runner)  # the runner asserts start + num_new <= max_model_len at every step
    assert r.output_token_ids == alone([7] * 16, 10, 16, stop=())
    assert r.num_output_tokens == 1 and r.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_generation_is_capped_at_max_model_len():
    sched, runner = make(max_model_len=20)
    r = Request("a", [5] * 12, 100)  # no stop tokens: only the length can end it
    sched.add_request(r)
    drive(sched, runner)
    assert r.num_tokens == 20 and r.status.finish_reason == "length"
    assert r.output_token_ids == alone([5] * 12, 100, 20, stop=())


# ---- scheduling policy -----------------------------------------------------------------------------------
def test_chunked_prefill_splits_the_prompt_and_samples_only_at_its_end():
    sched, runner = make(budget=4)
    sched.add_request(req("a", 10))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (sr,) = out.scheduled
        chunks.append((sr.start_position, sr.num_new_tokens, sr.num_sampled_rows))
        sched.update(out, runner.run(out))
    assert chunks == [(0, 4, 0), (4, 4, 0), (8, 2, 1)]
    out = sched.schedule()
    assert [(sr.start_position, sr.num_new_tokens) for sr in out.scheduled] == [(10, 1)]


def test_decode_first_then_fcfs_and_the_running_cap():
    sched, runner = make(max_num_seqs=2, budget=8)
    for rid, n in (("a", 3), ("b", 6), ("c", 2)):
        sched.add_request(req(rid, n, max_tokens=20))
    out = sched.schedule()  # a (3) then b chunk (5): budget 8; c waits (budget and cap)
    assert [(sr.request_id, sr.num_new_tokens) for sr in out.scheduled] == [("a", 3), ("b", 5)]
    sched.update(out, runner.run(out))
    out = sched.schedule()  # running first: a decodes, b finishes its prompt; c still capped out
    assert [(sr.request_id, sr.num_new_tokens) for sr in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.sample_rows() == {"a": range(0, 1), "b": range(1, 2)}
    assert sched.num_waiting == 1


def test_without_chunking_a_big_head_is_not_skipped():
    sched, runner = make(budget=64, max_model_len=64, chunked=False)
    sched.add_request(req("a", 40, max_tokens=30))
    sched.update(o := sched.schedule(), runner.run(o))
    sched.add_request(req("big", 64))
    sched.add_request(req("small", 2))
    out = sched.schedule()  # a decodes (1); big needs 64 > 63 left: it waits and so does small (FCFS)
    assert [sr.request_id for sr in out.scheduled] == ["a"]


def test_preemption_takes_the_latest_arrival_and_puts_it_first_in_line():
    sched, runner = make(max_num_seqs=3, budget=64, block_size=4, num_blocks=16, max_model_len=64)
    a, b, c = (Request(rid, [i + 1] * 20, 30) for i, rid in enumerate("abc"))  # no stop tokens
    d = Request("d", [9] * 4, 30)  # arrives last, waits behind the running cap
    for r in (a, b, c, d):
        sched.add_request(r)  # 5 blocks each: 15 of 16 used after the prefill
    sched.update(o := sched.schedule(), runner.run(o))
    out = sched.schedule()  # every decode needs a 6th block: only a gets one... b then preempts c
    assert out.preempted_ids == ("c",)
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # the preempted request goes first in line
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_output_tokens == 1
    sched.update(out, runner.run(out))
    steps = drive(sched, runner)
    assert sum(len(s.preempted_ids) for s in steps) >= 1  # the pool stays too small for all three
    for r in (a, b, c, d):
        assert r.output_token_ids == alone(r.prompt_token_ids, 30, 64, stop=()), r.request_id
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.num_preemptions >= 1
    assert_pool_full(sched)


def run_random_workload(seed: int, drafts: int) -> list[SchedulerOutput]:
    rng = random.Random(seed)
    max_model_len = 48
    block_size = rng.choice([2, 4, 8])
    # a pool barely above one max-length sequence: preemptions are frequent
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 6)
    sched, runner = make(max_num_seqs=rng.randint(1, 5), budget=rng.randint(8, 48), max_model_len=max_model_len,
                         block_size=block_size, num_blocks=num_blocks)
    reqs = [req(f"r{i}", rng.randint(1, max_model_len), max_tokens=rng.randint(1, 24), seed=seed)
            for i in range(12)]
    for r in reqs[:6]:
        sched.add_request(r)
    steps = drive(sched, runner, reqs[6:], drafts, seed)
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.max_tokens, max_model_len), r.request_id
        assert r.status.finish_reason == ("stop" if r.output_token_ids[-1] == STOP else "length")
    assert_pool_full(sched)
    return steps


@pytest.mark.parametrize("drafts", [0, 3])
def test_random_workloads_match_running_alone(drafts):
    steps = [s for seed in range(8) for s in run_random_workload(seed, drafts)]
    assert sum(len(s.preempted_ids) for s in steps) > 0  # the workloads did exercise preemption
    if drafts:
        assert any(sr.num_draft_tokens for s in steps for sr in s.scheduled)


# ---- asynchronous scheduling: step n+1 scheduled and advanced before step n's tokens are committed ---------
def run_pending(runner: FakeRunner, out: SchedulerOutput, prev: dict[str, list[int]]) -> dict[str, list[int]]:
    """The device's part: a pending position takes the token its request sampled in the previous step."""
    resolved = []
    for sr in out.scheduled:
        ids = list(sr.token_ids)
        for j, t in enumerate(ids):
            if t == PENDING_TOKEN:
                ids[j] = prev[sr.request_id][-1]
        resolved.append(replace(sr, token_ids=tuple(ids)))
    return runner.run(replace(out, scheduled=tuple(resolved)))


def drive_async(sched: Scheduler, runner: FakeRunner, late: list[Request] = (), seed: int = 0):
    """The asynchronous engine's loop: schedule and advance step n+1, then commit step n."""
    late, rng, steps, in_flight = list(late), random.Random(seed), [], None
    while sched.has_unfinished() or late or in_flight:
        if late and rng.random() < 0.3:
            sched.add_request(late.pop(0))
        out = sched.schedule()
        launched = None
        if not out.is_empty:
            launched = (out, run_pending(runner, out, in_flight[1] if in_flight else {}))
            sched.advance(out)
            for sr in out.scheduled:  # a pending token never sits past a request's limits
                r = sr.request
                assert r.num_pending_tokens <= 2 and r.num_output_tokens + r.num_pending_tokens <= r.max_tokens
        if in_flight:
            sched.commit(*in_flight)
        in_flight = launched
        sched.block_pool.check_invariants()
        assert all(r.num_pending_tokens <= 1 for r in sched.requests.values())
        steps.append(out)
        assert len(steps) < 5000, "no progress"
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_async_workloads_match_running_alone_and_compute_nothing_past_a_limit(seed):
    """The same random workloads (preemptions, chunked prefill, late arrivals) through the asynchronous
    loop: every request's tokens are those it makes alone, and no position past a length limit is computed
    (a request ending by length computes exactly what the synchronous loop computes)."""
    rng = random.Random(seed)
    max_model_len = 48
    block_size = rng.choice([2, 4, 8])
    num_blocks = -(-max_model_len // block_size) + rng.randint(0, 6)
    cfg = dict(max_num_seqs=rng.randint(1, 5), budget=rng.randint(8, 48), max_model_len=max_model_len,
               block_size=block_size, num_blocks=num_blocks)
    reqs = [req(f"r{i}", rng.randint(1, max_model_len), max_tokens=rng.randint(1, 24), seed=seed)
            for i in range(12)]
    sched, runner = make(**cfg)
    for r in reqs[:6]:
        sched.add_request(r)
    steps = drive_async(sched, runner, reqs[6:], seed)
    for r in reqs:
        assert r.output_token_ids == alone(r.prompt_token_ids, r.max_tokens, max_model_len), r.request_id
        assert r.status.finish_reason == ("stop" if r.output_token_ids[-1] == STOP else "length")
        computed = max(sr.start_position + sr.num_new_tokens for s in steps for sr in s.scheduled
                       if sr.request_id == r.request_id)
        extra = 1 if r.status is RequestStatus.FINISHED_STOPPED and r.num_tokens < max_model_len else 0
        assert computed <= r.num_tokens - 1 + extra, r.request_id  # the last token is computed only after a stop
    assert_pool_full(sched)


def test_commit_after_a_preemption_keeps_the_token():
    """Step n+1's schedule preempts a request whose step-n token is still pending: the commit appends it,
    and the request is recomputed with it later."""
    sched, runner = make(max_num_seqs=3, budget=64, block_size=4, num_blocks=16)
    a, b, c = (Request(rid, [i + 1] * 20, 30) for i, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    first = sched.schedule()
    sampled = run_pending(runner, first, {})
    sched.advance(first)
    assert [r.num_pending_tokens for r in (a, b, c)] == [1, 1, 1]
    assert c.token_ids_to_compute(20, 1) == [PENDING_TOKEN]
    second = sched.schedule()  # every decode needs a 6th block: c is preempted with its token pending
    assert second.preempted_ids == ("c",) and c.status is RequestStatus.PREEMPTED
    sched.advance(second)
    sched.commit(first, sampled)
    assert c.num_pending_tokens == 0 and c.output_token_ids == [sampled["c"][0]] and c.num_computed_tokens == 0
    assert a.num_pending_tokens == 1 and a.num_output_tokens == 1


def test_a_preempted_request_with_a_pending_token_is_not_readmitted_before_its_commit():
    sched, runner = make(max_num_seqs=3, budget=64, block_size=4, num_blocks=16)
    a, b, c = (Request(rid, [i + 1] * 20, 30) for i, rid in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    sched.advance(sched.schedule())
    sched.advance(sched.schedule())  # preempts c, its first token pending
    sched.abort("a")  # blocks free up: c would fit again
    third = sched.schedule()
    assert "c" not in [sr.request_id for sr in third.scheduled] and c.status is RequestStatus.PREEMPTED


def test_commit_checks_its_order():
    sched, runner = make()
    sched.add_request(r := req("r", 5))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="without a pending token"):
        sched.commit(out, {"r": [1]})  # commit before advance
    sched.advance(out)
    sched.commit(out, {"r": [1]})
    with pytest.raises(RuntimeError, match="without a pending token"):
        sched.commit(out, {"r": [2]})  # twice
    assert r.output_token_ids == [1]


# ---- endings ---------------------------------------------------------------------------------------------
def test_abort_in_every_state_frees_everything():
    sched, runner = make(max_num_seqs=2, budget=6, block_size=4, num_blocks=16)
    waiting, prefilling, decoding = req("w", 5), req("p", 12), req("d", 3, max_tokens=30)
    for r in (decoding, prefilling, waiting):
        sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))  # d: 3 (prefill), p: 3 of 12; w capped out
    sched.update(o := sched.schedule(), runner.run(o))
    assert decoding.num_output_tokens == 2 and prefilling.status is RequestStatus.RUNNING
    assert sched.abort("w") and waiting.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("p") and prefilling.status.finish_reason == "abort"
    out = sched.schedule()
    assert set(out.finished_ids) == {"w", "p"}  # the runner learns what to drop
    assert sched.abort("d")  # aborted between schedule() and update(): its tokens are dropped
    sched.update(out, runner.run(out))
    assert decoding.num_output_tokens == 2
    assert not sched.abort("d") and not sched.abort("never-seen")  # late aborts are harmless
    assert_pool_full(sched)
    sched.block_pool.check_invariants()


def test_abort_of_a_preempted_request():
    sched, runner = make(max_num_seqs=3, budget=64, block_size=4, num_blocks=16)
    reqs = [Request(rid, [i + 1] * 20, 30) for i, rid in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    sched.update(o := sched.schedule(), runner.run(o))
    assert reqs[2].status is RequestStatus.PREEMPTED and reqs[2].num_output_tokens == 1
    assert sched.abort("c")
    drive(sched, runner)
    assert_pool_full(sched)


def test_fail_records_the_error():
    sched, runner = make()
    r = req("a", 5)
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    assert sched.fail("a", RuntimeError("kernel exploded"))
    assert r.status is RequestStatus.FINISHED_ERROR and r.error == "kernel exploded"
    assert r.status.finish_reason == "error"
    assert_pool_full(sched)


def test_stop_string_ends_a_request_through_finish():
    sched, runner = make()
    r = req("a", 5, max_tokens=20)
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    assert sched.finish("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert r.stop_reason == "\n\n" and r.status.finish_reason == "stop"
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish("a", RequestStatus.RUNNING)
    assert_pool_full(sched)


def test_stop_token_inside_accepted_drafts_truncates_there():
    sched, runner = make()
    prompt = [3, 4, 5]
    ref = alone(prompt, 50, 64, stop=())
    stop_at = 3  # the 4th generated token is declared a stop token
    r = Request("a", prompt, 50, frozenset({ref[stop_at]}))
    assert ref[stop_at] not in ref[:stop_at]
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))  # prefill -> ref[0]
    r.draft_token_ids = ref[1:6]  # all correct: the runner accepts all five
    out = sched.schedule()
    (sr,) = out.scheduled
    assert (sr.num_new_tokens, sr.num_draft_tokens, sr.num_sampled_rows) == (6, 5, 6)
    result = sched.update(out, runner.run(out))
    assert r.output_token_ids == ref[: stop_at + 1] and result.new_token_ids == {"a": ref[1 : stop_at + 1]}
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == ref[stop_at]
    assert result.finished == [r]
    assert_pool_full(sched)


def test_rejected_drafts_roll_back_num_computed_tokens():
    sched, runner = make()
    r = Request("a", [9, 8, 7], 50)
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    ref = alone([9, 8, 7], 50, 64, stop=())
    r.draft_token_ids = [ref[1], (ref[2] + 1) % VOCAB, ref[3]]  # second draft wrong
    out = sched.schedule()
    sched.update(out, runner.run(out))  # accepted: ref[1]; then the correction ref[2]
    assert r.output_token_ids == ref[:3]
    assert r.num_computed_tokens == r.num_tokens - 1  # the correction is not computed yet


def test_drafts_are_trimmed_to_what_max_tokens_can_use():
    sched, runner = make()
    r = Request("a", [1, 2], 3)
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    r.draft_token_ids = [11, 12, 13, 14]  # at most 2 more tokens allowed: 1 draft + 1 bonus
    (sr,) = sched.schedule().scheduled
    assert sr.num_draft_tokens == 1 and sr.num_new_tokens == 2


def test_update_rejects_tokens_for_rows_that_were_not_sampled():
    sched, runner = make(budget=4)
    sched.add_request(req("a", 10))
    out = sched.schedule()  # a partial prefill chunk: no logits row is sampled
    with pytest.raises(ValueError, match="sampled no row"):
        sched.update(out, {"a": [5]})
    sched2, runner2 = make()
    sched2.add_request(req("b", 3))
    out2 = sched2.schedule()
    with pytest.raises(ValueError, match="expected 1..1 sampled tokens"):
        sched2.update(out2, {"b": [5, 6]})


def test_block_pool_and_scheduler_stay_torch_free():
    import subprocess
    import sys

    code = ("import sys, deepinfer\n"
            "if 'torch' in sys.modules: print('skip')\n"  # the package root may one day load the engine
            "else:\n"
            "    import deepinfer.scheduler, deepinfer.cache.block_pool\n"
            "    print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if done.stdout.strip() == "skip":
        pytest.skip("the deepinfer package root imports torch itself")
    assert done.stdout.strip() == "False"


def test_budget_cuts_drafts_and_the_rest_are_dropped():
    sched, runner = make(budget=3)
    r = Request("a", [4, 4], 50)
    sched.add_request(r)
    sched.update(o := sched.schedule(), runner.run(o))
    ref = alone([4, 4], 50, 64, stop=())
    r.draft_token_ids = ref[1:5]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert (sr.num_new_tokens, sr.num_draft_tokens, sr.num_sampled_rows) == (3, 2, 3)
    assert r.draft_token_ids == ref[1:3] and sr.token_ids == (ref[0], ref[1], ref[2])
    sched.update(out, runner.run(out))
    assert r.output_token_ids == ref[:4] and r.num_computed_tokens == 5


def test_an_injected_pool_is_used_and_checked():
    from deepinfer.cache import BlockPool

    cfg = SchedulerConfig(2, 16, 16, 4, 8)
    pool = BlockPool(8, 4, 2)
    assert Scheduler(cfg, pool).block_pool is pool  # an empty pool (len 0) is still the one given
    with pytest.raises(ValueError, match="block_pool"):
        Scheduler(cfg, BlockPool(8, 8, 2))
