"""`deepinfer parity` commands: clean engine -> no defect; a planted seed bug -> the right command flags
the right tensor / layout / position."""
from __future__ import annotations

import json

import pytest
import torch

from deepinfer.cli import PARITY_CANNOT_RUN, main
from deepinfer.parity.kv import run_kv
from deepinfer.parity.next_token import run_next_token
from deepinfer.parity.weights import run_weights


def test_weights_clean_and_planted_p3(tiny_v4_dir, monkeypatch):
    clean = run_weights(tiny_v4_dir, pattern=r"layers\.2\.")
    assert clean.ok and clean.rows and max(r["rel_err"] for r in clean.rows) == 0.0
    import deepinfer.model.params as engine_params

    good = engine_params._dequant

    def p3(name, w, scale, cfg):  # the seed's P3: the FP4 scale expanded along BOTH axes
        if w.dtype == torch.int8:
            s = torch.exp2(scale.view(torch.uint8).double() - 127)
            s = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1] * 2]
            from deepinfer import formats

            return formats.fp4_codes_to_float(formats.unpack_fp4(w)).double() * s
        return good(name, w, scale, cfg)

    monkeypatch.setattr(engine_params, "_dequant", p3)
    bad = run_weights(tiny_v4_dir, pattern=r"layers\.2\.ffn\.experts\.0\.")
    flagged = {r["tensor"] for r in bad.rows if r["note"]}
    assert flagged == {f"layers.2.ffn.experts.0.{w}.weight" for w in ("w1", "w2", "w3")}
    assert all("wrong axis" in d for d in bad.defects)


def test_kv_clean_and_planted_scale_type(tiny_v4_dir, monkeypatch):
    assert run_kv(tiny_v4_dir).ok
    import deepinfer.cache.layouts as layouts

    def as_fp32_bytes(scales):  # the seed's SM90 failure: ue8m0 bytes read as another scale type
        return scales.view(torch.uint8).to(torch.float32)

    monkeypatch.setattr(layouts.formats, "e8m0_to_float", as_fp32_bytes)
    bad = run_kv(tiny_v4_dir, layouts=["v4_fp8_ds_mla", "v41_latent_fp4", "seed_fp8_per128"])
    assert [d.split(":")[0] for d in bad.defects] == ["v4_fp8_ds_mla"]  # E8M0 layouts only


def test_next_token_clean(tiny_v4_dir):
    report = run_next_token(tiny_v4_dir, [2056, 768, 17607, 2793], force_ids=[3139, 12108, 6692])
    assert report.ok, report.defects
    assert [r["mode"] for r in report.rows] == ["prefill"] + ["decode"] * 4
    assert all(r["rel_err"] < 1e-9 for r in report.rows)


def test_parity_cli(tiny_v4_dir, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["parity", "kv", "--model", str(tiny_v4_dir), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "kv" and data["verdict"] == "no defect" and len(data["rows"]) >= 7
    assert "verdict: no defect" in capsys.readouterr().out
    assert main(["parity", "kv", "--model", str(tiny_v4_dir), "--layouts", "nope"]) == PARITY_CANNOT_RUN


def test_drift_clean_and_planted_defect(tiny_v4_dir, monkeypatch):
    from deepinfer.parity.drift import run_drift

    ids = [2056, 768, 17607, 2793, 3139]
    clean = run_drift(tiny_v4_dir, ids, steps=8)
    assert clean.ok and not any(r["flip"] for r in clean.rows) and clean.meta["noise_std"] < 1e-9
    # plant a decode-only defect: the engine's head drops one token's logit on every later step
    from deepinfer.parity import next_token

    extend = next_token.EngineSession.extend

    def biased(self, new_ids):
        logits = extend(self, new_ids).clone()
        if self.pos > len(ids):
            logits[logits.argmax()] -= 1e3
        return logits

    monkeypatch.setattr(next_token.EngineSession, "extend", biased)
    bad = run_drift(tiny_v4_dir, ids, steps=8)
    noise = bad.meta["noise_std"]
    assert bad.defects and sum(r["flip"] for r in bad.rows) == 7
    for r in bad.rows:  # a flip is a defect exactly where the reference was decisive beyond the noise
        if r["flip"]:
            assert (r["judgement"] == "defect") == (r["ref_margin"] >= 2.0 * noise)
    assert bad.rows[0]["flip"] is False  # the prefill step was untouched


LAYER_IDS = [2056, 768, 17607, 2793, 3139, 12108, 6692, 7624, 768] * 3


def _plant_p3(monkeypatch):
    import deepinfer.model.params as engine_params
    from deepinfer import formats

    good = engine_params._dequant

    def p3(name, w, scale, cfg):
        if w.dtype == torch.int8:
            s = torch.exp2(scale.view(torch.uint8).double() - 127)
            s = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1] * 2]
            return formats.fp4_codes_to_float(formats.unpack_fp4(w)).double() * s
        return good(name, w, scale, cfg)

    monkeypatch.setattr(engine_params, "_dequant", p3)


def test_layers_clean_then_points_at_the_planted_layer(tiny_v4_dir, monkeypatch):
    from deepinfer.parity.layers import run_layers

    clean = run_layers(tiny_v4_dir, LAYER_IDS)
    assert clean.ok and len(clean.rows) == 13 and all(r["x_floor"] < 10 for r in clean.rows)
    _plant_p3(monkeypatch)  # the seed's P3 in the engine's expert decoding: the FFN of layer 0 is first
    bad = run_layers(tiny_v4_dir, LAYER_IDS)
    assert bad.meta["first_divergence"] == "layers.0.ffn"
    assert not next(r for r in bad.rows if r["point"] == "layers.0.attn")["diverged"]


def test_layers_refuses_a_sublayer_output(tiny_v4_dir, monkeypatch):
    """The seed's first comparison used a sublayer output (cos 0.02): the tool compares full residuals only."""
    from deepinfer.parity import layers as layers_mod

    extend = layers_mod.EngineSession.extend

    def sublayer_only(self, ids):
        tap = self.runner.model.tap
        self.runner.model.tap = lambda name, x, seq: tap(name, x[:, 0], seq)  # one stream, not the state
        return extend(self, ids)

    monkeypatch.setattr(layers_mod.EngineSession, "extend", sublayer_only)
    with pytest.raises(ValueError, match="full residual"):
        layers_mod.run_layers(tiny_v4_dir, LAYER_IDS[:5])


def test_next_token_api_path_catches_p5_and_row_mapping(tiny_v4_dir, monkeypatch):
    ids = [2056, 768, 17607, 2793, 3139]
    clean = run_next_token(tiny_v4_dir, ids, api_steps=4)
    assert clean.ok, clean.defects
    assert [r["mode"] for r in clean.rows].count("api") == 4
    # the seed's P5: logprobs never carried to the output (every value 0.0)
    from deepinfer.sampling import sampler as sampler_mod

    sample = sampler_mod.Sampler.sample

    def zeroed(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        return sampler_mod.SamplerOutput(out.token_ids, torch.zeros_like(out.logprobs), out.ranks, out.top_ids,
                                         out.top_logprobs, out.num_top_logprobs)

    monkeypatch.setattr(sampler_mod.Sampler, "sample", zeroed)
    p5 = run_next_token(tiny_v4_dir, ids, api_steps=4)
    assert p5.defects and all("logprob" in d for d in p5.defects)
    monkeypatch.undo()
    # the seed's P4.2: logits rows mapped to the wrong request (off by one)
    from deepinfer.scheduler import output as output_mod

    rows_of = output_mod.SchedulerOutput.sample_rows

    def shifted(self):
        rows = rows_of(self)
        n = sum(len(r) for r in rows.values())
        return {k: range((r.start + 1) % n, (r.start + 1) % n + len(r)) if len(r) == 1 else r for k, r in rows.items()}

    monkeypatch.setattr(output_mod.SchedulerOutput, "sample_rows", shifted)
    p42 = run_next_token(tiny_v4_dir, ids, api_steps=4)
    assert any("wrong request" in d for d in p42.defects)


def test_plots_are_written(tiny_v4_dir, tmp_path):
    ids = "2056,768,17607,2793,3139"
    assert main(["parity", "layers", "--ids", ids, "--model", str(tiny_v4_dir), "--plot", str(tmp_path)]) == 0
    assert main(["parity", "drift", "--ids", ids, "--steps", "4", "--model", str(tiny_v4_dir), "--plot",
                 str(tmp_path)]) == 0
    for name in ("parity-layers.png", "parity-drift.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_next_token_catches_planted_causal_mask_off(tiny_v4_dir, monkeypatch):
    """The seed's P1: a prefill whose queries see the chunk's later tokens: the one-shot prefill row is
    flagged (the clean engine has no defect: test_next_token_clean)."""
    import deepinfer.model.attention as engine_attention

    def unmasked(qpos, win):  # every query sees the chunk's last `win` positions, future included
        return (qpos.max() - win + 1 + torch.arange(win)).expand(qpos.shape[0], -1)

    monkeypatch.setattr(engine_attention, "causal_window", unmasked)
    ids = [2056, 768, 17607, 2793, 3139, 12108, 6692, 7624, 768, 11, 12, 13]
    report = run_next_token(tiny_v4_dir, ids, force_ids=[3139, 12108], api_steps=0)
    flagged = {d.split(" position")[0] for d in report.defects}
    assert "prefill" in flagged


def test_layers_refuses_a_dump_from_the_warm_up_forward(tiny_v4_dir, monkeypatch):
    """The seed's dump from the warm-up: plant a runner whose warm-up (the worst-case batch) runs through
    the TAPPED model instance before the request; layers must refuse and say why."""
    from deepinfer.model.context import ForwardContext, SeqContext
    from deepinfer.parity import layers as layers_mod

    extend = layers_mod.EngineSession.extend

    def warm_up_on_the_tapped_model(self, ids):
        if self.pos == 0:  # a lazy warm-up at the first step, on self.runner.model instead of a scratch copy
            n = 2 * len(ids)
            ctx = ForwardContext((SeqContext(0, n, 0, 0, self.table),))
            self.runner.model.forward(torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(0)), ctx)
        return extend(self, ids)

    monkeypatch.setattr(layers_mod.EngineSession, "extend", warm_up_on_the_tapped_model)
    with pytest.raises(ValueError, match=r"saw 2 call\(s\).*warm-up"):
        layers_mod.run_layers(tiny_v4_dir, LAYER_IDS[:5])


def test_the_engine_warm_up_never_reaches_the_tapped_model(tiny_v4_dir, monkeypatch):
    """The runner sizes its KV cache with a warm-up forward: it must run on another model instance than
    `runner.model` (the one parity taps)."""
    from deepinfer.config import ModelConfig
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.model import v4 as engine_v4

    ran_on: list = []  # the instances themselves: a freed warm-up model's id() can be reused by runner.model
    forward = engine_v4.V4EngineModel.forward

    def recording(self, *args, **kwargs):
        ran_on.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(engine_v4.V4EngineModel, "forward", recording)
    config = EngineConfig(model=str(tiny_v4_dir), numerics="exact", max_model_len=256, max_num_batched_tokens=64,
                          num_blocks=None)  # None: sized by the warm-up forward
    runner = ModelRunner(config, ModelConfig.from_checkpoint(tiny_v4_dir))
    assert ran_on, "the runner sized its cache without a warm-up forward"
    assert all(m is not runner.model for m in ran_on)


def test_next_token_api_path_catches_a_row_map_off_by_one_under_drafting(tiny_v4_dir, monkeypatch):
    """P4.2 under drafting: with 2 MTP drafts per step a request samples 3 rows per step; read every
    sampled row one further (wrapping) and the API path must flag the tokens."""
    ids = [2056, 768, 17607, 2793, 3139]
    clean = run_next_token(tiny_v4_dir, ids, api_steps=5, api_speculative=2)
    assert clean.ok, clean.defects
    assert [r["mode"] for r in clean.rows].count("api+draft") == 5
    from deepinfer.scheduler import output as output_mod

    rows_of = output_mod.SchedulerOutput.sample_rows

    def shifted(self):
        rows = rows_of(self)
        total = sum(len(r) for r in rows.values())
        return {k: [(i + 1) % total for i in r] for k, r in rows.items()}

    monkeypatch.setattr(output_mod.SchedulerOutput, "sample_rows", shifted)
    bad = run_next_token(tiny_v4_dir, ids, api_steps=5, api_speculative=2)
    assert any("wrong request" in d for d in bad.defects), bad.defects
