"""Op `greedy_sample` (kernels/triton/greedy.py), the sampler's all-greedy fast path, against its twin: the
sampler's general path (`log_softmax`, `argmax`, `gather_logprobs`).

Triton under the interpreter (CPU) and compiled (-m gpu), fresh random rows: token ids and ranks equal,
logprobs within 2e-6 of the float64 log_softmax (5e-5 of the twin's fp32); planted ties within a step,
across the steps of a chunk and across chunks (the first wins), a NaN, +inf and an all -inf row behave as torch's;
a strided row view. The sampler takes the fast path only for all-greedy rows without top logprobs, and
then returns the general path's tokens and ranks (-m gpu).
"""
from __future__ import annotations

import pytest
import torch

from interpreted import run_interpreted

_CASES = """
import math
import torch
from deepinfer.sampling.logprobs import gather_logprobs, log_softmax

def rows(n, v, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4
    if n > 2:
        best = int(x[1].argmax())
        x[1, best // 2] = x[1, best]  # a tie before the max: the first one wins
        x[1, min(v - 1, best + 7)] = x[1, best]
    return x.to(device)

def twin(x):
    t = gather_logprobs(log_softmax(x), x.argmax(-1), 0)
    return t.token_ids, t.logprobs, t.ranks

def check(fn, x, what):
    tok, lp, rk = fn(x)
    want_tok, want_lp, want_rk = twin(x)
    assert tok.dtype == torch.int64 and rk.dtype == torch.int64 and lp.dtype == torch.float32, what
    assert torch.equal(tok.cpu(), want_tok.cpu()), (what, tok, want_tok)
    assert torch.equal(rk.cpu(), want_rk.cpu()), what
    nan = torch.isnan(want_lp)
    assert torch.equal(torch.isnan(lp), nan), (what, lp, want_lp)
    if bool((~nan).any()):
        # against the float64 log_softmax at the token (CPU torch's fp32 log_softmax itself is off by up to
        # ~1.3e-5 over 129,280 entries; the kernel's chunked sum by ~1e-7), and against the twin
        truth = torch.log_softmax(x.double(), -1).gather(1, want_tok.unsqueeze(1)).squeeze(1)
        assert float((lp[~nan].double() - truth[~nan]).abs().max()) <= 2e-6, what
        assert float((lp[~nan] - want_lp[~nan]).abs().max()) <= 5e-5, what

def run_all(fn, device, big):
    shapes = [(1, 5), (3, 1000), (4, 4097)] + ([(3, 129280), (130, 9000)] if big else [(2, 129280)])
    for n, v in shapes:
        check(fn, rows(n, v, n * v, device), (n, v))
    x = rows(4, 3000, 7, device)
    x[0, 17] = float("nan"); x[0, 2000] = float("nan")  # the first NaN, logprob NaN (torch's argmax)
    x[1, 2999] = float("inf")
    x[2] = -float("inf")
    check(fn, x, "nan / inf / -inf rows")
    # ties across the steps of one chunk and across chunks: 264 rows of 16384 split into 4 chunks of 4096,
    # each two 2048-wide steps, so the online max must keep the first of equal maxima
    from deepinfer.kernels.triton.greedy import chunks_for
    assert chunks_for(264, 16384, 132) == (4096, 4)
    x = rows(264, 16384, 11, device)
    x[5, 100] = x[5, 3000] = 99.0  # same chunk, different steps
    x[6, 3000] = x[6, 5000] = 99.0  # different chunks
    x[7, 2047] = x[7, 2048] = 99.0  # the two sides of a step boundary
    check(fn, x, "ties across steps and chunks")
    tok = fn(x)[0]
    assert tok[5].item() == 100 and tok[6].item() == 3000 and tok[7].item() == 2047
    wide = rows(3, 6000, 9, device)
    check(fn, wide[:, :5000], "a strided view")
    try:
        fn(wide.to(torch.float64))
        raise SystemExit("float64 logits were accepted")
    except ValueError as err:
        assert "fp32" in str(err)
"""

_INTERPRET = _CASES + """
from deepinfer.kernels.triton.greedy import greedy_sample
run_all(greedy_sample, "cpu", big=False)
print("ok")
"""


def test_greedy_sample_interpreted():
    pytest.importorskip("triton")
    proc = run_interpreted(_INTERPRET)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_twin_is_the_general_path():
    exec(_CASES, ns := {})
    from deepinfer import kernels
    from deepinfer.kernels import torch_ops

    assert kernels.get("greedy_sample") is torch_ops.greedy_sample
    x = ns["rows"](3, 1000, 4, "cpu")
    for got, want in zip(torch_ops.greedy_sample(x), ns["twin"](x)):
        assert torch.equal(got, want)


def test_chunk_plan_covers_the_row():
    pytest.importorskip("triton")
    from deepinfer.kernels.triton.greedy import BLOCK, chunks_for
    for n, v in [(1, 129280), (128, 129280), (1, 5), (7, 4097), (1000, 129280)]:
        chunk, count = chunks_for(n, v, 132)
        assert chunk % BLOCK == 0 and (count - 1) * chunk < v <= count * chunk, (n, v)
        assert n * count <= max(n, 8 * 132 + 8 * n), (n, v, count)


@pytest.mark.gpu
def test_greedy_sample_cuda(cuda_kernels):
    namespace: dict = {}
    exec(_CASES, namespace)
    from deepinfer.kernels.triton.greedy import greedy_sample
    namespace["run_all"](greedy_sample, "cuda", big=True)


@pytest.mark.gpu
def test_sampler_takes_the_fast_path_only_when_every_row_is_greedy(cuda_kernels, monkeypatch):
    from deepinfer import kernels
    from deepinfer.sampling import SamplingParams
    from deepinfer.sampling.sampler import Sampler

    calls = []
    fused = kernels.find("greedy_sample", "cuda")
    assert fused is not None

    def counted(x):
        calls.append(x.shape)
        return fused(x)

    monkeypatch.setattr(kernels, "find", lambda op, dev: counted if op == "greedy_sample" else None)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 129280, generator=g) * 3).cuda()
    sampler = Sampler()
    fast = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 64)
    assert calls == [(64, 129280)]
    general = sampler.sample(logits, [SamplingParams(temperature=0.0)] * 63 + [SamplingParams(temperature=0.0,
                                                                                                logprobs=2)])
    assert len(calls) == 1  # a row asked for top logprobs: the general path
    assert torch.equal(fast.token_ids, general.token_ids) and torch.equal(fast.ranks, general.ranks)
    assert float((fast.logprobs - general.logprobs).abs().max()) <= 5e-5
    assert fast.top_ids.shape == (64, 0) and fast.num_top_logprobs == (0,) * 64
    sampler.sample(logits[:2], [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)])
    assert len(calls) == 1  # a random row: the general path
