"""The sampler on the GPU (-m gpu), as a CUDA engine runs it: logits, filters and noise on the device, the
per-request generators made there, only the result rows returned to the host.

Against the host path on the same logits: greedy tokens, ranks and top ids identical, logprobs within fp32
rounding (1e-5). Seeded draws on CUDA generators: independent of the batch a request shares, equal to the
official draw for a batch of one, and distributed as softmax(logits / T). The engine on cuda makes its
generators on the GPU and returns the same seeded outputs run after run.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.sampling import Sampler, make_generator

from test_sampling import CHI2_DF4_P001, chi_square

pytestmark = pytest.mark.gpu

VOCAB = 129280


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


def test_device_greedy_and_logprobs_equal_the_host_path(cuda):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(16, VOCAB, device=cuda, generator=g) * 3
    params = [SamplingParams(temperature=0.0, logprobs=5)] * 16
    dev = Sampler().sample(logits, params)
    host = Sampler().sample(logits.cpu(), params)
    for t in (dev.token_ids, dev.logprobs, dev.ranks, dev.top_ids, dev.top_logprobs):
        assert t.device.type == "cpu"  # the rows come back to the host, once
    assert torch.equal(dev.token_ids, logits.argmax(-1).cpu())
    assert torch.equal(dev.token_ids, host.token_ids) and torch.equal(dev.ranks, host.ranks)
    assert torch.equal(dev.top_ids, host.top_ids)
    assert float((dev.logprobs - host.logprobs).abs().max()) < 1e-5
    assert float((dev.top_logprobs - host.top_logprobs).abs().max()) < 1e-5
    assert bool((dev.logprobs < 0).all())  # real log-probabilities, not the seed's 0.0


def test_seeded_cuda_rows_do_not_depend_on_the_batch(cuda):
    g = torch.Generator(device="cuda").manual_seed(5)
    steps = [torch.randn(3, 4096, device=cuda, generator=g) for _ in range(6)]
    pa, pb = SamplingParams(temperature=1.0, seed=11, top_p=0.95), SamplingParams(temperature=0.7, seed=12, top_k=20)
    pc = SamplingParams(temperature=1.0)  # unseeded: the global CUDA RNG
    ga, gb = make_generator(11, cuda), make_generator(12, cuda)
    together = [Sampler().sample(l, [pa, pb, pc], [ga, gb, None]).token_ids[:2].tolist() for l in steps]
    ga, gb = make_generator(11, cuda), make_generator(12, cuda)
    reordered = []
    for l in steps:
        tb = Sampler().sample(l[[2, 1]], [pc, pb], [None, gb]).token_ids[1]
        ta = Sampler().sample(l[:1], [pa], [ga]).token_ids[0]
        reordered.append([int(ta), int(tb)])
    assert together == reordered
    other = make_generator(99, cuda)
    assert [int(Sampler().sample(l[:1], [pa], [other]).token_ids[0]) for l in steps] != [t[0] for t in together]


def test_cuda_draw_matches_the_official_draw_for_a_batch_of_one(cuda):
    from deepinfer.reference.generate import sample as official_sample

    g = torch.Generator(device="cuda").manual_seed(6)
    mine, theirs = make_generator(33377335, cuda), make_generator(33377335, cuda)
    for _ in range(5):
        logits = torch.randn(1, 1000, device=cuda, generator=g)
        a = Sampler().sample(logits, [SamplingParams(temperature=0.6)], [mine]).token_ids
        assert torch.equal(a, official_sample(logits, 0.6, theirs).cpu())


def test_cuda_generators_follow_the_distribution(cuda):
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0], device=cuda)
    n = 4000
    gens = [make_generator(1000 + i, cuda) for i in range(n)]
    out = Sampler().sample(logits.repeat(n, 1), [SamplingParams(temperature=1.0, seed=0)] * n, gens)
    target = torch.softmax(logits.cpu(), -1)
    assert chi_square(out.token_ids, target) < CHI2_DF4_P001
    assert chi_square(out.token_ids, torch.softmax(logits.cpu() / 0.3, -1)) > 10 * CHI2_DF4_P001


def test_cuda_engine_samples_on_the_gpu_reproducibly(tiny_v4_dir, cuda_kernels):
    prompts = [[5, 17, 99, 123, 7, 64], [3, 1000, 2000, 11]]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=8, logprobs=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(tiny_v4_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=512, num_blocks=16)
        llm.engine.add_request("probe", [5, 6], SamplingParams(seed=1))
        gen = llm.engine._requests["probe"].payload.generator
        assert gen.device.type == "cuda"  # made where the runner's logits are
        llm.engine.abort("probe")
        outs = llm.generate(prompts, params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs])
        for o in outs:
            c = o.outputs[0]
            assert len(c.token_ids) == 8 and len(c.logprobs) == 8
            chosen = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
            assert all(lp <= 0 for lp in chosen) and any(lp < 0 for lp in chosen)
            assert abs(sum(chosen) - c.cumulative_logprob) < 1e-3
    assert runs[0] == runs[1]


def test_host_sampling_switch_gives_the_same_greedy_tokens(tiny_v4_dir, cuda_kernels, monkeypatch):
    """DEEPINFER_SAMPLE_ON=host (the A/B switch of bench_engine_step.py) samples on the CPU with CPU
    generators; greedy tokens and their logprobs equal the device path's."""
    prompts = [[5, 17, 99, 123, 7, 64], [3, 1000, 2000, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    runs = {}
    for where in ("host", "device"):
        monkeypatch.setenv("DEEPINFER_SAMPLE_ON", where)
        llm = LLM(tiny_v4_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=512, num_blocks=16)
        assert llm.engine.sample_device.type == ("cpu" if where == "host" else "cuda")
        runs[where] = [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                                            o.outputs[0].token_ids)])
                       for o in llm.generate(prompts, params)]
    for (ta, la), (tb, lb) in zip(runs["host"], runs["device"]):
        assert ta == tb
        assert max(abs(a - b) for a, b in zip(la, lb)) < 1e-5
