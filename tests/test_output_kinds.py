"""Output kinds (SamplingParams.output_kind, vLLM's RequestOutputKind) and the text they are cut from.

CUMULATIVE outputs carry everything so far at every step; DELTA outputs only what is new (text held back by
the longest stop string - 1 characters until the request ends); FINAL_ONLY one output at the end. On the
tiny V4 checkpoint (exact numerics, CPU; synchronous and asynchronous loops) the same seeded requests must
read the same in every kind: DELTA outputs concatenated = the CUMULATIVE final output (text, token ids,
logprobs, prompt logprobs sent once), FINAL_ONLY = it, in one output; no DELTA text ever holds a stop
string or runs ahead of the final text. `OutputText` (engine/output_text.py) against a plain string."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from deepinfer import LLM, RequestOutputKind, SamplingParams
from deepinfer.engine.output_text import OutputText

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


def test_output_text_matches_a_string_under_random_appends_reads_and_cuts():
    rng = random.Random(0)
    for trial in range(200):
        text, ref = OutputText(), ""
        for _ in range(rng.randrange(0, 400)):  # past the 64-part chunking, several times
            op = rng.random()
            if op < 0.6:
                delta = "".join(rng.choice("ab€😀 ") for _ in range(rng.randrange(0, 5)))
                text.append(delta)
                ref += delta
            elif op < 0.8:
                start = rng.randrange(-3, len(ref) + 3)
                assert text.since(start) == ref[max(start, 0):], (trial, start)
            elif op < 0.85:
                assert text.value() == ref
            elif op < 0.98:
                start = len(ref) - rng.randrange(0, 8)  # the tail a stop check or a delta reads
                assert text.since(start) == ref[max(start, 0):]
            else:
                cut = rng.randrange(0, len(ref) + 2)
                text.truncate(cut)
                ref = ref[:cut]
            assert len(text) == len(ref)
        assert text.value() == ref and text.since(0) == ref


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 129280, (n,), generator=g).tolist() for n in lengths]


def run(llm, ps, params, kind):
    """Every output of every request, in order: request index -> list of RequestOutput."""
    eng = llm.engine
    seen: dict[int, list] = {i: [] for i in range(len(ps))}
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"k{int(kind)}-{i}", p, replace(sp, output_kind=kind))
    while eng.has_unfinished():
        for out in eng.step():
            seen[int(out.request_id.rsplit("-", 1)[1])].append(out)
    return seen


def final_view(outs):
    """(text, token ids, logprobs, prompt logprobs, finish, stop) of a cumulative or final output."""
    o = outs[-1]
    c = o.outputs[0]
    return c.text, c.token_ids, c.logprobs, o.prompt_logprobs, c.finish_reason, c.stop_reason, o.num_output_tokens


def merged_deltas(outs, stops, final_text):
    """The DELTA outputs joined; checks each prefix on the way (no stop string, never ahead of the final
    text, prompt logprobs once)."""
    text, ids, lps, plps = "", [], None, None
    for n, o in enumerate(outs):
        c = o.outputs[0]
        text += c.text
        ids += c.token_ids
        if c.logprobs is not None:
            lps = (lps or []) + c.logprobs
        if o.prompt_logprobs is not None:
            assert plps is None, "prompt logprobs are sent with the first output only"
            plps = o.prompt_logprobs
        assert o.num_output_tokens == len(ids)
        assert o.finished == (n == len(outs) - 1)
        assert final_text.startswith(text), "streamed text the final text does not have"
        if not o.finished:
            assert not any(s in text for s in stops), "a stop string was streamed"
    c = outs[-1].outputs[0]
    return text, ids, lps, plps, c.finish_reason, c.stop_reason, outs[-1].num_output_tokens


@pytest.mark.parametrize("async_on", [False, True])
def test_kinds_read_the_same(tiny_v4_dir, async_on):
    ps = prompts([3, 17, 40, 9, 25, 12])
    llm = LLM(tiny_v4_dir, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=32, async_scheduling=async_on)
    free = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    t2 = free[2].outputs[0].text
    # a stop string across a token boundary (the last 2 characters of one token's text + the first of the
    # next): its start is streamed a step before it completes unless held back
    pieces = [llm.get_tokenizer().decode_token(t) for t in free[1].outputs[0].token_ids]
    k = next(k for k in range(len(pieces) // 2, len(pieces) - 1) if len(pieces[k]) >= 2 and pieces[k + 1])
    stop3 = pieces[k][-2:] + pieces[k + 1][0]
    stop_in = t2[len(t2) // 3: len(t2) // 3 + 2]
    # a stop string that never fires, held back by one character more than the text has after some token k
    # (so an unfinished output's text is shorter than the hold-back, but not less than half of it)
    tok, ids5 = llm.get_tokenizer(), free[5].outputs[0].token_ids
    shown = next(n for n in (len(tok.decode(ids5[:j])) for j in range(1, len(ids5))) if n >= 2)
    long_stop = "\x00" * (shown + 2)
    params = [
        SamplingParams(temperature=0, max_tokens=16, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, stop=[stop3, "\x00never"], ignore_eos=True),  # holds back 6
        SamplingParams(temperature=0, max_tokens=16, stop=[stop_in], include_stop_str_in_output=True,
                       ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, logprobs=1),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=16, stop=[long_stop], ignore_eos=True),
    ]
    runs = {kind: run(llm, ps, params, kind) for kind in KINDS}
    cumulative, delta, final = (runs[k] for k in KINDS)
    for i, sp in enumerate(params):
        want = final_view(cumulative[i])
        assert len(final[i]) == 1 and final[i][0].finished, f"request {i}: FINAL_ONLY gave {len(final[i])} outputs"
        assert final_view(final[i]) == want, f"request {i}: FINAL_ONLY"
        assert merged_deltas(delta[i], sp.stop, want[0]) == want, f"request {i}: DELTA"
        # a cumulative output is a prefix of the final one at every step, and shows what the deltas had sent
        # by the same token (the same characters held back)
        streamed, sent = {}, ""
        for o in delta[i]:
            sent += o.outputs[0].text
            streamed[o.num_output_tokens] = sent
        for o in cumulative[i]:
            c = o.outputs[0]
            assert want[0].startswith(c.text) and want[1][: len(c.token_ids)] == c.token_ids
            assert c.text == streamed.get(len(c.token_ids), c.text), f"request {i} at {len(c.token_ids)} tokens"
    assert cumulative[1][-1].outputs[0].finish_reason == "stop" and cumulative[1][-1].outputs[0].stop_reason == stop3
    assert cumulative[2][-1].outputs[0].text.endswith(stop_in)
    assert len(delta[0]) > 2, "DELTA outputs come every step"
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_generate_asks_for_final_outputs_only(tiny_v4_dir):
    llm = LLM(tiny_v4_dir, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32)
    made = []
    output = llm.engine._output

    def counted(req):
        out = output(req)
        made.append(out is not None)
        return out

    llm.engine._output = counted
    (res,) = llm.generate(prompts([8]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA))
    assert len(res.outputs[0].token_ids) == 10
    assert sum(made) == 1, "generate() returns final results: no output is built before a request ends"
    assert res.num_output_tokens == 10 and res.first_token_time is not None
    (two,) = llm.generate(prompts([8]), SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, ignore_eos=True))
    assert two.num_output_tokens == 8  # over the prompt's two completions


def test_the_server_loop_never_idles_while_the_engine_is_busy(tiny_v4_dir, monkeypatch):
    """FINAL_ONLY (non-streaming) requests give no output before they end: the server's engine loop must step
    again at once, not take an empty step for an idle engine and sleep (it did, 5 ms a step)."""
    import asyncio

    import deepinfer.server.async_engine as ae
    from deepinfer.server.metrics import Metrics

    llm = LLM(tiny_v4_dir, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    engine = ae.AsyncEngine(llm.engine, Metrics())
    idle_naps = []
    real_sleep = asyncio.sleep

    async def sleep(seconds, *a, **k):
        idle_naps.append(llm.engine.has_unfinished())
        return await real_sleep(seconds, *a, **k)

    monkeypatch.setattr(ae.asyncio, "sleep", sleep)

    async def main():
        engine.start()
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        queue = await engine.add([("r0", prompts([20])[0], params)])
        out = await asyncio.wait_for(queue.get(), 120)
        await engine.shutdown()
        return out

    out = asyncio.run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 12
    assert not any(idle_naps), f"the loop slept {sum(idle_naps)} times while the engine had work"


@pytest.mark.parametrize("bad", [True, 3, "DELTA", None])
def test_bad_output_kind_is_refused(bad):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=bad)
