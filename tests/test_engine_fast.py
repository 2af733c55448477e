"""Fast numerics of the V4 engine (official rounding points, BATCHED, weights kept FP8/FP4) on the tiny V4
checkpoint, against the oracle's official numerics.

Official numerics is chaotic (a last-bit difference grows to percent-level logit differences), so fast is
judged against the oracle's OWN noise floors, measured in the same test: (a) the oracle's logits at the same
positions computed by a single prefill of prompt + forced tokens instead of prefill-then-decode (same math,
other shapes), (b) the oracle's prefill + decodes with its embedding table one bf16 ulp off in 10% of the
elements (the parity tools' floor), three seeds; per figure the worst. (a) alone moves only a few ops'
rounding; for V4.1 it sat 3x under (b), and the CUDA engine, whose every op rounds differently, landed at
(b)'s level (scripts/fast_divergence.py, benchmarks/results/fast_divergence_v41_h200.log). Runs are
teacher-forced on the oracle's greedy tokens, so both sides always see identical inputs. Bounds:
* overall logits rel_err(fast) <= 2 x rel_err(floor), median cos deficit <= 2 x the floor's;
* greedy flips <= 2 x the most any floor shows + 1;
* greedy agreement on every row whose oracle top-1 margin exceeds the largest top-1/top-2 margin change
  any floor shows (few rows on the tiny models: the chaos is heavy-tailed, so the aggregate bounds carry
  the power).
The oracle's bits (so the floor) depend on the host CPU: the device machine's floor is another draw.
Measured on CPU (torch twins, 4 prompts x (prefill + 8 decodes)): see the -s output of
test_fast_cpu_matches_the_oracle_within_its_noise. `-m gpu`: the same on CUDA (Triton kernels where registered), exact numerics on CUDA
against CPU exact, and LLM(numerics="fast", device="cuda") end to end. Run with `-s` for the figures.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.config import EngineConfig
from deepinfer.kernels.quant_weights import FP4ExpertBank, QuantLinearWeight
from deepinfer.model import ForwardContext, SeqContext, V4EngineModel
from deepinfer.model.factory import build_v4_model, v4_cache
from deepinfer.model.params import prepare_params
from deepinfer.model.params_fast import BF16_GEMM_WEIGHTS, STACKS, param_bytes, prepare_params_fast

LENS = (150, 40, 7, 100)  # crosses the window, ratio-4 entries and the first ratio-128 entry
STEPS = 8
BLOCKS_PER_SEQ = 4


def prompts(cfg, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g) for n in LENS]


def oracle_decode_run(make_oracle, ps: list[torch.Tensor], steps: int = STEPS, ulp_seeds: tuple[int, ...] = (1, 2, 3)):
    """The oracle (official numerics, batch 1) per prompt: prefill + `steps` greedy decodes -> (logits
    [steps+1, B, V], tokens [steps, B], floor, ulp_floors [seeds, steps+1, B, V]). Measured noise floors of
    the oracle itself on the same positions: `floor` = the logits from one prefill of prompt + tokens
    (another rounding order); `ulp_floors` = the same prefill + decodes teacher-forced on the tokens with the
    embedding table one bf16 ulp off in 10% of its elements (`parity.layers.perturb_last_bit`, the parity
    tools' floor), one run per seed (the chaos is heavy-tailed: on the tiny V4 model one seed's largest
    margin change was 2.9, another's 14.6; on V4.1 8.8 and 21; with seeds 1-2 only, the H200 run of
    2026-12-01 flipped a V4.1 row of margin above 11 with the torch twins on cuda). Why both:
    the first moves only a few ops' rounding and for V4.1 sits ~3x under what a 1-ulp input change alone
    does (H200, 2026-12-01, benchmarks/results/fast_divergence_v41_h200.log); any other device or op order
    moves every op. `make_oracle()` returns a fresh oracle (fresh caches)."""
    from deepinfer.parity.layers import perturb_last_bit

    out, floor, tokens = [], [], []
    ulp = [[] for _ in ulp_seeds]
    for p in ps:
        orc = make_oracle()
        lg = orc(p[None], 0)[0]
        rows, toks = [lg], []
        for k in range(steps):
            toks.append(int(lg.argmax()))
            lg = orc(torch.tensor([[toks[-1]]]), len(p) + k)[0]
            rows.append(lg)
        out.append(torch.stack(rows))
        tokens.append(toks)
        full = torch.cat([p, torch.tensor(toks)])
        one = make_oracle().forward(full[None], 0, all_logits=True)[0]
        floor.append(one[len(p) - 1 :])
        for runs, seed in zip(ulp, ulp_seeds):
            orc = make_oracle()
            table = perturb_last_bit(orc.p["embed.weight"], seed)
            orc.embed = lambda ids, t=table: t[ids]  # every occurrence of a token gets the same perturbed row
            rows = [orc(p[None], 0)[0]] + [orc(torch.tensor([[t]]), len(p) + k)[0] for k, t in enumerate(toks)]
            runs.append(torch.stack(rows))
    return (torch.stack(out, 1), torch.tensor(tokens).T, torch.stack(floor, 1),
            torch.stack([torch.stack(runs, 1) for runs in ulp]))


def floor_figures(oracle_run) -> dict:
    """The noise floor the judge uses: per figure the worst over the oracle's floors (see oracle_decode_run);
    flips = the most greedy flips any floor shows."""
    ref, _, floor, ulp = oracle_run
    figs = [figures(f, ref) for f in (floor, *ulp)]
    return {"rel_err": max(f["rel_err"] for f in figs), "cos_median": min(f["cos_median"] for f in figs),
            "cos_min": min(f["cos_min"] for f in figs), "margin": figs[0]["margin"],
            "delta_margin": torch.stack([f["delta_margin"] for f in figs]).amax(0),
            "flips": max(int((~f["agree"]).sum()) for f in figs)}


def teacher_forced_batch(model, ps: list[torch.Tensor], tokens: torch.Tensor, blocks_per_seq: int,
                         steps: int = STEPS) -> torch.Tensor:
    """All prompts prefilled as ONE varlen batch, then `steps` batched decodes of the forced tokens
    -> logits [steps+1, B, V] on the host."""
    def table(i):
        return tuple(range(blocks_per_seq * i, blocks_per_seq * (i + 1)))

    ctx = ForwardContext(tuple(SeqContext(0, len(p), i, i, table(i)) for i, p in enumerate(ps)))
    out = [model(torch.cat(ps), ctx)]
    for k in range(steps):
        ctx = ForwardContext(tuple(SeqContext(len(p) + k, 1, i, i, table(i)) for i, p in enumerate(ps)))
        out.append(model(tokens[k], ctx))
    return torch.stack(out).to("cpu", torch.float64)


@pytest.fixture(scope="module")
def oracle_run(tiny_v4_raw, oracle_factory):
    cfg, _ = tiny_v4_raw
    return oracle_decode_run(lambda: oracle_factory("official", max_batch=1, max_seq_len=512), prompts(cfg))


def teacher_forced(model: V4EngineModel, cfg, tokens: torch.Tensor) -> torch.Tensor:
    return teacher_forced_batch(model, prompts(cfg), tokens, BLOCKS_PER_SEQ)


def figures(got: torch.Tensor, ref: torch.Tensor) -> dict:
    got, ref = got.double().flatten(0, 1), ref.double().flatten(0, 1)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    top = ref.topk(2, dim=-1).indices
    margin = ref.gather(1, top[:, :1]) - ref.gather(1, top[:, 1:])
    got_margin = got.gather(1, top[:, :1]) - got.gather(1, top[:, 1:])
    return {"rel_err": float((got - ref).norm() / ref.norm()), "cos_median": float(cos.median()),
            "cos_min": float(cos.min()), "margin": margin.squeeze(1), "delta_margin": (got_margin - margin).abs().squeeze(1),
            "agree": got.argmax(-1) == ref.argmax(-1)}


def judge(name: str, got: torch.Tensor, oracle_run) -> None:
    """Against the worst of the oracle's floors: rel_err and the median cos deficit at most 2x; greedy flips
    at most 2x the most a floor shows, plus one; and every row whose oracle margin exceeds the largest
    margin change any floor shows agrees (possibly few rows: on the tiny random checkpoints a 1-ulp input
    change alone moves margins by up to ~15 (V4) / ~21 (V4.1), so the aggregate figures carry the power;
    test_the_judge_fails_a_planted_fp4_scale_broadcast checks that they still refuse a real defect)."""
    ref = oracle_run[0]
    fl, fa = floor_figures(oracle_run), figures(got, ref)
    noise = float(fl["delta_margin"].max())
    sure = fa["margin"] > noise
    flips = int((~fa["agree"]).sum())
    print(f"\n{name}: rel_err {fa['rel_err']:.4g} (floor {fl['rel_err']:.4g}), cos median {fa['cos_median']:.6f} "
          f"min {fa['cos_min']:.6f} (floor {fl['cos_median']:.6f} / {fl['cos_min']:.6f}), greedy flips {flips}/"
          f"{fa['agree'].numel()} (floors at most {fl['flips']}); rows with margin > noise {noise:.3g}: "
          f"{int(sure.sum())}, all agree: {bool(fa['agree'][sure].all())}")
    assert fa["rel_err"] <= 2 * fl["rel_err"]
    assert 1 - fa["cos_median"] <= 2 * (1 - fl["cos_median"])
    assert flips <= 2 * fl["flips"] + 1, f"{flips} greedy flips, the floors at most {fl['flips']}"
    assert bool(fa["agree"][sure].all()), f"greedy flips above the noise margin {noise:.3g}"


def greedy_agreement(outs, ref: torch.Tensor, tokens: torch.Tensor, noise: float) -> int:
    """Generated tokens vs the oracle's greedy ones, per prompt up to the first difference, which must fall
    on a row whose oracle margin is within the noise (after it the sequences legitimately differ).
    Returns how many tokens were equal."""
    equal = 0
    for b, out in enumerate(outs):
        got = out.outputs[0].token_ids
        for k in range(STEPS):
            if got[k] != int(tokens[k, b]):
                top2 = ref[k, b].topk(2).values
                margin = float(top2[0] - top2[1])
                assert margin <= noise, f"prompt {b} step {k}: flip at oracle margin {margin:.3g} > noise {noise:.3g}"
                break
            equal += 1
    return equal


# ---------------------------------------------------------------------------------------------- CPU
def test_fast_params_keep_the_checkpoint_quantised(tiny_v4_raw):
    """FP8 linears stay FP8 (same bytes) with fp32 scales, routed experts stay packed FP4 in one bank per
    layer; their values and every small tensor equal the official numerics' params; the byte count is the
    checkpoint's plus exactly the documented widenings (no dequantised copy anywhere)."""
    cfg, raw = tiny_v4_raw
    fast = prepare_params_fast(raw, cfg)
    official = prepare_params(raw, cfg, numerics="official")
    expected = 0
    for name, t in raw.items():
        if name.endswith(".scale") or name.startswith("mtp."):
            continue
        size = t.numel() * t.element_size()
        scale = raw.get(name[: -len(".weight")] + ".scale")
        if ".ffn.experts." in name:  # the scale rows as the bank stores them: 16-byte strided (sixteen_byte_rows)
            expected += size + scale.shape[0] * -(-scale.shape[1] // 16) * 16 * scale.element_size()
        elif name == "head.weight" or name.endswith(BF16_GEMM_WEIGHTS) or (
                name.endswith("attn.wo_a.weight") and not isinstance(fast[name], QuantLinearWeight)):
            # bf16 values, no fp32 copy (the compressors, the MoE gate, weights_proj: the checkpoint's bf16)
            assert fast[name].dtype == torch.bfloat16 and torch.equal(fast[name].float(), official[name]), name
            expected += 2 * t.numel()
        elif scale is not None:
            w = fast[name]
            assert isinstance(w, QuantLinearWeight), name
            assert torch.equal(w.data.view(torch.uint8), t.view(torch.uint8)), name
            assert torch.equal(w.dequant(), official[name]), name
            expected += size + 4 * scale.numel()
        else:
            assert fast[name].dtype == official[name].dtype and torch.equal(fast[name].to(official[name].dtype),
                                                                             official[name]), name
            expected += t.numel() * fast[name].element_size()
    for layer in range(cfg.n_layers):
        bank = fast[f"layers.{layer}.ffn.experts"]
        assert isinstance(bank, FP4ExpertBank) and bank.n_experts == cfg.n_routed_experts
        for e in (0, cfg.n_routed_experts - 1):
            w1, w3, w2 = bank.dequant_expert(e)
            pe = f"layers.{layer}.ffn.experts.{e}."
            for got, part in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
                assert torch.equal(got, official[pe + part + ".weight"])
    assert not any(".ffn.experts." in n for n in fast)
    # the stacked pairs (params_fast.STACKS) hold each weight once: the names above are views of them
    for suffix in ("attn.wq_a_wkv.weight", "ffn.shared_experts.w13.weight", "attn.compressor.wkv_wgate.weight"):
        assert any(n.endswith(suffix) for n in fast), suffix
    w = fast["layers.0.attn.wq_a_wkv.weight"]
    assert w.data.data_ptr() == fast["layers.0.attn.wq_a.weight"].data.data_ptr()
    assert torch.equal(w.dequant(), torch.cat([official["layers.0.attn.wq_a.weight"], official["layers.0.attn.wkv.weight"]]))
    assert param_bytes(fast) == expected

    with pytest.MonkeyPatch.context() as mp:  # the A/B switch: the pairs apart, the same bytes
        mp.setenv("DEEPINFER_STACK_WEIGHTS", "0")
        apart = prepare_params_fast(raw, cfg)
    assert not any(n.endswith(tuple(STACKS)) for n in apart) and param_bytes(apart) == expected


def test_fast_cpu_matches_the_oracle_within_its_noise(tiny_v4_raw, oracle_run):
    cfg, raw = tiny_v4_raw
    model = build_v4_model(cfg, raw, "fast", "cpu", num_blocks=BLOCKS_PER_SEQ * len(LENS), max_num_seqs=len(LENS))
    judge("fast (cpu twins) vs oracle official", teacher_forced(model, cfg, oracle_run[1]), oracle_run)


def test_the_judge_fails_a_planted_fp4_scale_broadcast(tiny_v4_raw, oracle_run):
    """The seed's FP4 pitfall planted in the fast model's weights (layer 1's routed experts use one E8M0 scale
    per row, broadcast over K, instead of one per 32 values): the judge must refuse it while it passes the
    clean model above, i.e. its floors leave room to catch a real defect. Measured on CPU: rel_err 0.160
    against 2 x 0.064, 13 greedy flips against 2 x 4 + 1."""
    cfg, raw = tiny_v4_raw
    planted = dict(raw)
    for name, t in raw.items():
        if name.startswith("layers.1.ffn.experts.") and name.endswith(".scale"):
            planted[name] = t[..., :1].expand(t.shape).contiguous()
    model = build_v4_model(cfg, planted, "fast", "cpu", num_blocks=BLOCKS_PER_SEQ * len(LENS),
                           max_num_seqs=len(LENS))
    with pytest.raises(AssertionError):
        judge("planted fp4 scale broadcast", teacher_forced(model, cfg, oracle_run[1]), oracle_run)


def test_fast_numerics_errors(tiny_v4_raw):
    cfg, raw = tiny_v4_raw
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="x", numerics="fast", device="tpu")
    official = prepare_params(raw, cfg, numerics="official")
    with pytest.raises(ValueError, match="prepare_params_fast"):
        V4EngineModel(cfg, official, v4_cache(cfg, "fast", 2), "fast")
    fast = prepare_params_fast(raw, cfg)
    with pytest.raises(ValueError, match="cache was built"):
        V4EngineModel(cfg, fast, v4_cache(cfg, "official", 2), "fast")
    fp8_experts = dict(raw)
    fp8_experts["layers.0.ffn.experts.0.w1.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="FP4"):
        prepare_params_fast(fp8_experts, cfg)


def test_llm_fast_generates_on_cpu(tiny_v4_dir, tiny_v4_raw, oracle_run):
    """LLM(numerics="fast") through the scheduler and runner: greedy tokens equal the oracle's while the
    oracle's margin stays above the measured noise (after a legitimate flip the sequences differ)."""
    cfg, _ = tiny_v4_raw
    ref, tokens = oracle_run[:2]
    noise = float(floor_figures(oracle_run)["delta_margin"].max())
    llm = LLM(tiny_v4_dir, numerics="fast", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512)
    outs = llm.generate([p.tolist() for p in prompts(cfg)],
                        SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == STEPS + 1 for o in outs)
    checked = greedy_agreement(outs, ref, tokens, noise)
    print(f"\nLLM fast cpu: {checked} greedy tokens equal to the oracle's")
    assert checked >= 2 * len(LENS)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("ops", ["twins", "registered"])
def test_fast_cuda_matches_the_oracle_within_its_noise(tiny_v4_raw, oracle_run, cuda_kernels, ops, monkeypatch):
    """`twins`: the engine's CUDA path alone (every op the torch twin on cuda tensors); `registered`: with
    the Triton kernels registered for cuda."""
    from deepinfer import kernels

    if ops == "twins":  # hide the cuda entries for this test only (monkeypatch restores the registry)
        monkeypatch.setattr(kernels, "_REGISTRY", {k: v for k, v in kernels._REGISTRY.items() if k[1] == "cpu"})
    cfg, raw = tiny_v4_raw
    print("\ncuda kernels:", sorted(n for n in kernels.ops() if kernels.get(n, "cuda") is not kernels.get(n)))
    forms = _count_moe_forms(monkeypatch)
    model = build_v4_model(cfg, raw, "fast", "cuda", num_blocks=BLOCKS_PER_SEQ * len(LENS), max_num_seqs=len(LENS))
    judge(f"fast (cuda, {ops}) vs oracle official", teacher_forced(model, cfg, oracle_run[1].cuda()), oracle_run)
    print(f"routed-expert forms run: {dict(forms)}")
    if ops == "registered" and torch.cuda.get_device_capability() == (9, 0):
        # the batched prefill (297 tokens x top-2 over 8 experts: the prefill regime) must have run the wgmma
        # kernel and the decode steps the CUDA decode form, so this oracle check covers both
        assert forms["wgmma"] > 0 and forms["cuda decode"] > 0, dict(forms)


def _count_moe_forms(monkeypatch):
    """Count the calls of fp4_moe's CUDA forms (wrapping them, same results)."""
    import collections

    from deepinfer.kernels.triton import fp4_moe as moe

    forms = collections.Counter()
    for attr, name in (("_fp4_moe_wgmma", "wgmma"), ("_fp4_moe_mma", "cuda decode")):
        inner = getattr(moe, attr)

        def counted(*args, _inner=inner, _name=name, **kwargs):
            forms[_name] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(moe, attr, counted)
    return forms


@pytest.mark.gpu
def test_exact_cuda_matches_cpu_exact(tiny_v4_dir, tiny_v4_raw, cuda_kernels):
    cfg, _ = tiny_v4_raw
    ps = [p.tolist() for p in prompts(cfg)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_v4_dir, device=device, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512,
                  num_blocks=16)
        runs[device] = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert runs["cuda"] == runs["cpu"]


@pytest.mark.gpu
@pytest.mark.parametrize("extend_graphs", ["2048", "0"])
def test_llm_fast_cuda_generates(tiny_v4_dir, tiny_v4_raw, oracle_run, cuda_kernels, extend_graphs, monkeypatch):
    """The engine on CUDA, its prefill steps through the piecewise graphs (model/extend_graphs.py) or eager."""
    monkeypatch.setenv("DEEPINFER_EXTEND_GRAPH_TOKENS", extend_graphs)
    cfg, _ = tiny_v4_raw
    ref, tokens = oracle_run[:2]
    noise = float(floor_figures(oracle_run)["delta_margin"].max())
    llm = LLM(tiny_v4_dir, numerics="fast", device="cuda", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=512)  # KV sized from free GPU memory (capped, see ModelRunner)
    outs = llm.generate([p.tolist() for p in prompts(cfg)],
                        SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True))
    checked = greedy_agreement(outs, ref, tokens, noise)
    print(f"\nLLM fast cuda (extend graphs {extend_graphs}): {checked} greedy tokens equal to the oracle's")
    assert checked >= 2 * len(LENS)
    extender = llm.engine.runner.extender
    if extend_graphs == "0":
        assert extender is None
    else:  # the prompts' steps replayed the pieces, bound to the serving model (not the sizing one)
        assert extender.replayed > 0 and extender.model is llm.engine.runner.model, (extender.replayed, extender.eager)
