"""ModelConfig against the spec's facts (§1.2, §1.3, §9b, §10.1, §10.3) on every config fixture, and its
error messages on broken checkpoint directories."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.config_keys import V41_ONLY_KEYS

FIX = Path(__file__).parent / "fixtures" / "configs"
ALL = ["v4-flash", "v4-pro", "v4-pro-0813", "v4-flash-0731", "v41-flash"]


@pytest.fixture(scope="module")
def cfgs() -> dict[str, ModelConfig]:
    return {name: ModelConfig.from_checkpoint(FIX / name) for name in ALL}


# spec §1.2 table (+ §10.1, §10.8, §11 and SOURCES.md for the 0731 / 0813 DSpark releases)
EXPECTED = {
    "v4-flash": dict(family="v4", dim=4096, n_layers=43, mtp=1, n_heads=64, q_lora_rank=1024, o_groups=8,
                     n_routed_experts=256, moe_inter_dim=2048, n_hash_layers=3, route_scale=1.5,
                     index_n_heads=64, index_topk=512, norm_eps=1e-6),
    "v4-pro": dict(family="v4", dim=7168, n_layers=61, mtp=1, n_heads=128, q_lora_rank=1536, o_groups=16,
                   n_routed_experts=384, moe_inter_dim=3072, n_hash_layers=3, route_scale=2.5,
                   index_n_heads=64, index_topk=1024, norm_eps=1e-6),
    "v4-pro-0813": dict(family="v4", dim=7168, n_layers=61, mtp=3, n_heads=128, q_lora_rank=1536, o_groups=16,
                        n_routed_experts=384, moe_inter_dim=3072, n_hash_layers=3, route_scale=2.5,
                        index_n_heads=64, index_topk=1024, norm_eps=1e-6),
    "v4-flash-0731": dict(family="v4", dim=4096, n_layers=43, mtp=3, n_heads=64, q_lora_rank=1024, o_groups=8,
                          n_routed_experts=256, moe_inter_dim=2048, n_hash_layers=3, route_scale=1.5,
                          index_n_heads=64, index_topk=512, norm_eps=1e-6),
    "v41-flash": dict(family="v41", dim=5120, n_layers=40, mtp=3, n_heads=64, q_lora_rank=1280, o_groups=8,
                      n_routed_experts=384, moe_inter_dim=2304, n_hash_layers=0, route_scale=1.5,
                      index_n_heads=32, index_topk=512, norm_eps=1e-20),
}


# ------------------------------------------------------------------------------------------------
# values shared by every fixture, and the per-model table
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_fixture_values(cfgs, name):
    c, e = cfgs[name], EXPECTED[name]
    assert c.family == e["family"]
    for key in ("dim", "n_layers", "n_heads", "q_lora_rank", "o_groups", "n_routed_experts", "moe_inter_dim",
                "n_hash_layers", "route_scale", "index_n_heads", "index_topk", "norm_eps"):
        assert getattr(c, key) == e[key], key
    # MTP (V4) / DSpark (V4.1, 0731, 0813) layers = len(compress_ratios) - n_layers
    assert c.n_mtp_layers == e["mtp"] == len(c.compress_ratios) - c.n_layers
    assert c.mtp_layer_ids == tuple(range(c.n_layers, c.n_layers + e["mtp"]))
    assert all(c.compress_ratios[layer] == 0 for layer in c.mtp_layer_ids)
    assert c.num_total_layers == len(c.compress_ratios)
    # common to the whole family (§1.2)
    assert c.vocab_size == 129280
    assert (c.head_dim, c.rope_head_dim, c.nope_head_dim) == (512, 64, 448)
    assert (c.o_lora_rank, c.window_size, c.index_head_dim) == (1024, 128, 128)
    assert (c.n_activated_experts, c.n_shared_experts) == (6, 1)
    assert (c.score_func, c.swiglu_limit) == ("sqrtsoftplus", 10.0)
    assert (c.rope_theta, c.compress_rope_theta) == (10000, 160000)
    assert (c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow) == (16, 65536, 32, 1)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    assert (c.dtype, c.scale_fmt, c.expert_dtype) == ("fp8", "ue8m0", "fp4")
    assert c.fp4_experts
    # blocks: V4 128x128 weights / per-128 activations; V4.1 32x32 / per-32 (§10.1)
    v41 = e["family"] == "v41"
    assert c.is_v41 == v41
    assert (c.weight_block, c.act_block) == ((32, 32) if v41 else (128, 128))
    assert c.kv_quant_block == (32 if v41 else 64)


def test_v4_flash_schedule(cfgs):
    for name in ("v4-flash", "v4-flash-0731"):  # 0731 has the same backbone, only more DSpark stages
        c = cfgs[name]
        backbone = c.compress_ratios[: c.n_layers]
        r4 = [i for i, r in enumerate(backbone) if r == 4]
        r128 = [i for i, r in enumerate(backbone) if r == 128]
        r0 = [i for i, r in enumerate(backbone) if r == 0]
        assert r4 == list(range(2, 43, 2)) and len(r4) == 21
        assert r128 == list(range(3, 42, 2)) and len(r128) == 20
        assert r0 == [0, 1]
        assert [i for i in range(c.num_total_layers) if c.is_hash_layer(i)] == [0, 1, 2]
        assert [i for i in range(c.n_layers) if c.has_indexer(i)] == r4
        for i in range(c.n_layers):
            assert c.uses_yarn(i) == (i >= 2)
            assert c.rope_base(i) == (160000 if i >= 2 else 10000)
            assert c.kv_source_of(i) == (i if i >= 2 else None)
            assert c.index_source_of(i) == (i if i in r4 else None)
    assert len(cfgs["v4-flash"].compress_ratios) == 44
    assert cfgs["v4-flash-0731"].dspark_target_layer_ids == (40, 41, 42)
    assert cfgs["v4-flash"].dspark_target_layer_ids == ()


def test_v4_pro_schedule(cfgs):
    for name in ("v4-pro", "v4-pro-0813"):
        c = cfgs[name]
        backbone = c.compress_ratios[: c.n_layers]
        assert [i for i, r in enumerate(backbone) if r == 4] == list(range(2, 61, 2))  # 30 layers
        assert [i for i, r in enumerate(backbone) if r == 128] == [0, 1] + list(range(3, 60, 2))  # 31 layers
        assert 0 not in backbone  # no window-only backbone layer in V4-Pro
        assert [i for i in range(c.n_layers) if c.is_hash_layer(i)] == [0, 1, 2]
        assert all(c.rope_base(i) == 160000 for i in range(c.n_layers))
    pro, p0813 = cfgs["v4-pro"], cfgs["v4-pro-0813"]
    assert len(pro.compress_ratios) == 62
    # the reconstructed V4-Pro and the real V4-Pro-0813 differ only in the DSpark stages
    assert p0813.compress_ratios[: pro.num_total_layers] == pro.compress_ratios
    assert p0813.compress_ratios[62:] == (0, 0)
    assert (p0813.dspark_target_layer_ids, p0813.dspark_markov_rank, p0813.dspark_block_size) == ((58, 59, 60), 512, 5)
    same = {k: v for k, v in pro.to_inference_json().items() if not k.startswith("dspark_")}
    other = p0813.to_inference_json()
    assert {k for k in same if same[k] != other[k]} == {"n_mtp_layers", "compress_ratios"}


def test_v41_layout(cfgs):
    c = cfgs["v41-flash"]
    assert list(c.compress_ratios) == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert c.kv_source_layers == (2, 8, 14, 20)
    assert c.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    kv_groups = {2: range(2, 8), 8: range(8, 14), 14: range(14, 20), 20: range(20, 40)}
    for src, layers in kv_groups.items():
        for layer in layers:
            assert c.kv_source_of(layer) == src, layer
            assert c.ratio(layer) == (2 if src < 20 else 1)
    idx_groups = {2: range(2, 8), 8: range(8, 14), 14: range(14, 20), 20: range(20, 24), 24: range(24, 28),
                  28: range(28, 32), 32: range(32, 36), 36: range(36, 40)}
    for src, layers in idx_groups.items():
        for layer in layers:
            assert c.index_source_of(layer) == src, layer
    for layer in (0, 1):
        assert c.kv_source_of(layer) is None and c.index_source_of(layer) is None
        assert not c.uses_yarn(layer) and c.rope_base(layer) == 10000
    assert [i for i in range(c.n_layers) if c.has_indexer(i)] == list(c.index_source_layers)
    assert not any(c.is_hash_layer(i) for i in range(c.num_total_layers))
    assert c.norm_eps == 1e-20
    assert (c.candidate_source_layer, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    assert c.engram_layer_ids == (1, 14) and c.engram_num_embeddings == (384006168, 384016682)
    assert (c.engram_vocab_size, c.engram_n_heads, c.engram_head_dim, c.engram_pad_id) == (16000000, 8, 256, 2)
    assert (c.engram_max_ngram_size, c.engram_compressed_vocab_size) == (4, 99092)
    assert (c.dspark_block_size, c.dspark_noise_token_id, c.dspark_target_layer_ids) == (5, 128799, (37, 38, 39))
    assert (c.dspark_markov_rank, c.dspark_n_routed_experts, c.dspark_n_activated_experts) == (256, 128, 3)
    rows = c.schedule()
    assert len(rows) == 43 and [r["kind"] for r in rows].count("mtp") == 3
    assert [r["layer"] for r in rows if r["engram"]] == [1, 14]


def test_v41_hf_only_and_inference_only_agree(cfgs, tmp_path):
    """The HF config alone (text_config, HF key names) and the inference config alone give the same config."""
    full = cfgs["v41-flash"]
    (tmp_path / "hf").mkdir()
    shutil.copy(FIX / "v41-flash" / "config.json", tmp_path / "hf" / "config.json")
    hf_only = ModelConfig.from_checkpoint(tmp_path / "hf")
    assert hf_only == full
    assert hf_only.extra["weight_block_size"] == [32, 32]
    (tmp_path / "inf" / "inference").mkdir(parents=True)
    shutil.copy(FIX / "v41-flash" / "inference" / "config.json", tmp_path / "inf" / "inference" / "config.json")
    assert ModelConfig.from_checkpoint(tmp_path / "inf") == full


@pytest.mark.parametrize("name", ALL)
def test_to_inference_json_round_trip(cfgs, name):
    c = cfgs[name]
    j = c.to_inference_json()
    assert json.loads(json.dumps(j)) == j
    back = ModelConfig.from_dict(json.loads(json.dumps(j)))
    assert back == c
    assert back.family == c.family
    # every key of the shipped inference config is reproduced with its value
    shipped = json.loads((FIX / name / "inference" / "config.json").read_text())
    for key, value in shipped.items():
        if key in j:
            assert j[key] == value, key
        else:
            assert key.startswith("vision_") or key == "image_token_id", key  # kept in `extra`, not ModelArgs
    if c.family == "v4":
        assert all(k.startswith("dspark_") for k in j if k in V41_ONLY_KEYS)


# ------------------------------------------------------------------------------------------------
# YaRN anchor (§3.3, §9b)
# ------------------------------------------------------------------------------------------------
def _yarn_range(base, dim=64, original=65536, beta_fast=32, beta_slow=1):
    def corr(rotations):
        return dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(base))

    return corr(beta_fast), corr(beta_slow), max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)


def test_yarn_anchor(cfgs):
    c = cfgs["v4-flash"]
    cf, cs, low, high = _yarn_range(c.compress_rope_theta, c.rope_head_dim, c.original_seq_len, c.beta_fast, c.beta_slow)
    assert (round(cf, 2), round(cs, 2), low, high) == (15.45, 24.71, 15, 25)
    assert _yarn_range(10000)[2:] == (20, 33)
    # the engine's RoPE table applies exactly that ramp: i <= 15 unchanged, i >= 25 divided by 16
    from deepinfer.reference.ops import rope_table

    fc = rope_table(64, 2, c.original_seq_len, c.compress_rope_theta, c.rope_factor, c.beta_fast, c.beta_slow, exact=True)
    freqs = torch.angle(fc[1]).to(torch.float64)
    plain = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ratio = (freqs / plain).tolist()
    assert all(abs(r - 1) < 1e-12 for r in ratio[: low + 1])
    assert all(abs(r - 1 / 16) < 1e-12 for r in ratio[high:])
    for i in range(low + 1, high):  # linear ramp in between
        t = (i - low) / (high - low)
        assert abs(ratio[i] - ((1 - t) + t / 16)) < 1e-12, i
    # window-only layers: no YaRN at all
    fc0 = rope_table(64, 2, 0, c.rope_theta, c.rope_factor, c.beta_fast, c.beta_slow, exact=True)
    plain0 = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert torch.allclose(torch.angle(fc0[1]).to(torch.float64), plain0, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------
def _inference_dir(tmp_path: Path, args: dict, name: str = "ckpt") -> Path:
    d = tmp_path / name
    (d / "inference").mkdir(parents=True)
    (d / "inference" / "config.json").write_text(json.dumps(args, indent=4))
    return d


def _load(name: str, hf: bool = False) -> dict:
    return json.loads((FIX / name / ("config.json" if hf else "inference/config.json")).read_text())


def test_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("key", ["dim", "compress_ratios", "index_topk"])
def test_missing_required_key(tmp_path, key):
    args = _load("v4-flash")
    del args[key]
    d = _inference_dir(tmp_path, args)
    with pytest.raises(ConfigError, match=rf"missing required keys: {key}$") as e:
        ModelConfig.from_checkpoint(d)
    assert str(d) in str(e.value)


def test_compress_ratios_wrong_length(tmp_path):
    # explicit n_mtp_layers (0731 style): one entry too many
    args = _load("v4-flash-0731")
    args["compress_ratios"] = args["compress_ratios"] + [0]
    with pytest.raises(ConfigError, match=r"compress_ratios has 47 entries, expected .* = 43 \+ 3 = 46"):
        ModelConfig.from_checkpoint(_inference_dir(tmp_path, args, "a"))
    # no n_mtp_layers (V4-Flash style): fewer entries than backbone layers can't be an MTP count
    args = _load("v4-flash")
    args["compress_ratios"] = args["compress_ratios"][:42]
    with pytest.raises(ConfigError, match=r"compress_ratios has 42 entries, expected .* = 43 \+ 1 = 44"):
        ModelConfig.from_checkpoint(_inference_dir(tmp_path, args, "b"))
    # V4.1 states n_mtp_layers 3
    args = _load("v41-flash")
    args["compress_ratios"] = args["compress_ratios"][:-1]
    with pytest.raises(ConfigError, match=r"42 entries, expected .* = 40 \+ 3 = 43"):
        ModelConfig.from_checkpoint(_inference_dir(tmp_path, args, "c"))


def test_ratio_not_allowed_for_family(tmp_path):
    args = _load("v4-flash")
    args["compress_ratios"][5] = 2
    with pytest.raises(ConfigError, match=r"contains \[2\]; family v4 allows \[0, 4, 128\]"):
        ModelConfig.from_checkpoint(_inference_dir(tmp_path, args, "a"))
    args = _load("v41-flash")
    args["compress_ratios"][30] = 4
    with pytest.raises(ConfigError, match=r"contains \[4\]; family v41 allows \[0, 1, 2\]"):
        ModelConfig.from_checkpoint(_inference_dir(tmp_path, args, "b"))


def _v41_pair(tmp_path: Path, edit_text_config: dict) -> Path:
    d = tmp_path / "pair"
    (d / "inference").mkdir(parents=True)
    hf = _load("v41-flash", hf=True)
    hf["text_config"].update(edit_text_config)
    (d / "config.json").write_text(json.dumps(hf))
    shutil.copy(FIX / "v41-flash" / "inference" / "config.json", d / "inference" / "config.json")
    return d


@pytest.mark.parametrize(
    "edit,key,values",
    [
        ({"hidden_size": 4096}, "dim", "4096 vs 5120"),
        ({"kv_source_layer_ids": [2, 8, 14]}, "kv_source_layers", r"\[2, 8, 14\] vs \[2, 8, 14, 20\]"),
        ({"rms_norm_eps": 1e-6}, "norm_eps", "1e-06 vs 1e-20"),
        ({"rms_norm_eps": 1e-21}, "norm_eps", "1e-21 vs 1e-20"),  # tiny eps values are compared relatively
        ({"routed_scaling_factor": 2.5}, "route_scale", "2.5 vs 1.5"),
    ],
)
def test_hf_and_inference_disagree(tmp_path, edit, key, values):
    d = _v41_pair(tmp_path, edit)
    with pytest.raises(ConfigError, match=rf"disagree on {key}: {values}") as e:
        ModelConfig.from_checkpoint(d)
    assert str(d / "config.json") in str(e.value)
    assert str(d / "inference" / "config.json") in str(e.value)


def test_hf_and_inference_agree_despite_int_float(tmp_path):
    d = _v41_pair(tmp_path, {"swiglu_limit": 10, "compress_rope_theta": 160000.0})
    assert ModelConfig.from_checkpoint(d).swiglu_limit == 10


@pytest.mark.parametrize("which", ["inference/config.json", "config.json"])
def test_invalid_json(tmp_path, which):
    d = _inference_dir(tmp_path, _load("v4-flash"))
    (d / which).write_text('{"dim": 4096,\n')
    with pytest.raises(ConfigError, match="is not valid JSON") as e:
        ModelConfig.from_checkpoint(d)
    assert str(d / which) in str(e.value)
    (d / which).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_checkpoint(d)


def test_no_config(tmp_path):
    (tmp_path / "empty" / "inference").mkdir(parents=True)
    with pytest.raises(ConfigError, match="neither config.json nor inference/config.json") as e:
        ModelConfig.from_checkpoint(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(e.value)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_checkpoint(tmp_path / "missing")
