"""Tests of deepinfer.weights: reader, writer, checker, loader and the convert.py emulation.

One small V4 config (4 layers with ratios 0/4/128/0, one MTP stage, one hash layer, 4 FP4 experts) is
generated once per module from `schema.expected_tensors` with the `formats` quantisers; tests that damage
a checkpoint work on their own copy.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.formats import dequant_fp4, dequant_fp8_blocks, pack_fp4, quant_fp8_blocks
from deepinfer.weights import (
    CheckpointError,
    CheckpointReader,
    check_checkpoint,
    convert_checkpoint,
    converted_specs,
    expected_tensors,
    load_tensors,
    native_name,
    official_key_dim,
    read_header,
    write_checkpoint,
)

SHARD_BYTES = 1 << 20  # small shards so the test checkpoint has several files


def small_config() -> ModelConfig:
    return ModelConfig(
        family="v4", vocab_size=512, dim=256, moe_inter_dim=128, n_layers=4, n_heads=4,
        n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, q_lora_rank=128, head_dim=128,
        rope_head_dim=64, o_groups=2, o_lora_rank=128, window_size=16, compress_ratios=(0, 4, 128, 0, 0),
        index_n_heads=2, index_head_dim=128, index_topk=4, n_hash_layers=1, n_mtp_layers=1,
        expert_dtype="fp4",
    )


def make_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors in the official HF layout: FP8 + block scales, packed FP4 (int8) + row scales."""
    g = torch.Generator().manual_seed(seed)
    specs = expected_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.kind == "scale" or name in out:
            continue
        scale = name[: -len(".weight")] + ".scale"
        if spec.kind == "fp4":
            # random E2M1 codes and E8M0 exponents 2**-8..2**3 (quantising randn is slow and adds nothing
            # here; formats.py has its own tests): every code, both nibbles, scales varying along rows
            out_dim, in_dim = spec.shape[0], spec.shape[1] * 2
            out[name] = pack_fp4(torch.randint(0, 16, (out_dim, in_dim), generator=g, dtype=torch.uint8))
            exps = torch.randint(119, 131, (out_dim, in_dim // 32), generator=g, dtype=torch.uint8)
            out[scale] = exps.view(torch.float8_e8m0fnu)
        elif spec.kind == "fp8":
            # rows of different magnitude so the block scales differ
            row_exp = torch.randint(-3, 3, (spec.shape[0], 1), generator=g).float()
            w = torch.randn(spec.shape, generator=g) * torch.exp2(row_exp)
            out[name], out[scale] = quant_fp8_blocks(w, cfg.weight_block)
        elif spec.kind == "int":
            out[name] = torch.randint(0, cfg.n_routed_experts, spec.shape, generator=g, dtype=torch.int64)
        else:
            dtype = torch.bfloat16 if spec.kind == "bf16" else torch.float32
            out[name] = torch.randn(spec.shape, generator=g).to(dtype)
    return {name: out[name] for name in specs}  # schema order, deterministic


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return small_config()


@pytest.fixture(scope="module")
def tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return make_tensors(cfg)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tensors) -> Path:
    d = tmp_path_factory.mktemp("hf")
    write_checkpoint(d, tensors, max_shard_bytes=SHARD_BYTES)
    (d / "tokenizer.json").write_text('{"model": "x"}')
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def mp2_fp4(tmp_path_factory, hf_dir, cfg) -> Path:
    d = tmp_path_factory.mktemp("mp2_fp4")
    convert_checkpoint(hf_dir, d, 2, "fp4", cfg=cfg, progress=False)
    return d


@pytest.fixture
def hf_copy(tmp_path, hf_dir) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(hf_dir, d)
    return d


def rewrite(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    for f in d.glob("model-*.safetensors"):
        f.unlink()
    write_checkpoint(d, tensors, max_shard_bytes=SHARD_BYTES)


def check_error(d: Path, cfg: ModelConfig) -> str:
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(CheckpointReader(d), cfg).raise_if_failed()
    return str(e.value)


# ---------------------------------------------------------------------------------------- reader/writer
def test_round_trip_is_bit_exact(hf_dir, tensors):
    reader = CheckpointReader(hf_dir)
    assert reader.format == "hf" and reader.mp == 1
    assert len(reader.files) > 1, "SHARD_BYTES should force several shards"
    assert sorted(reader.names()) == sorted(tensors)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        assert reader.shape_dtype(name) == (tuple(t.shape), t.dtype), name
        assert same_bits(reader.get(name), t), name
    # packed FP4 is stored as I8, like the HF release
    fp4 = "layers.0.ffn.experts.0.w1.weight"
    assert reader.get(fp4).dtype == torch.int8
    assert reader.file_of(fp4).name == index["weight_map"][fp4]


def test_writer_stores_float4_view_as_int8(tmp_path):
    packed = torch.randint(-128, 128, (4, 8), dtype=torch.int8)
    write_checkpoint(tmp_path, {"w": packed.view(torch.float4_e2m1fn_x2), "s": torch.ones(3)})
    reader = CheckpointReader(tmp_path)
    assert reader.shape_dtype("w") == ((4, 8), torch.int8)
    assert torch.equal(reader.get("w"), packed)


def test_single_file_checkpoint(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.arange(6.0).view(2, 3)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert reader.format == "hf" and reader.names() == ["a"]
    assert torch.equal(reader.get("a"), torch.arange(6.0).view(2, 3))


def test_header_shape_of_float4(tmp_path):
    from safetensors.torch import save_file

    # safetensors counts 4-bit elements in the header; torch's float4_e2m1fn_x2 counts bytes
    save_file({"w": torch.zeros(4, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, str(tmp_path / "x.safetensors"))
    entry = read_header(tmp_path / "x.safetensors")["w"]
    assert entry.shape == (4, 8) and entry.dtype == torch.float4_e2m1fn_x2 and entry.end - entry.begin == 32


def test_missing_shard_file_is_named(hf_copy):
    victim = sorted(hf_copy.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"do not exist: {victim.name}"):
        CheckpointReader(hf_copy)


def test_truncated_data_is_caught_at_open(hf_copy):
    victim = sorted(hf_copy.glob("model-*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        CheckpointReader(hf_copy)


@pytest.mark.parametrize("damage", ["short", "length", "json"])
def test_corrupt_header_is_named(hf_copy, damage):
    victim = sorted(hf_copy.glob("model-*.safetensors"))[-1]
    data = victim.read_bytes()
    if damage == "short":
        data = data[:5]
    elif damage == "length":
        data = (10**12).to_bytes(8, "little") + data[8:]
    else:
        data = data[:8] + b"{not json" + data[17:]
    victim.write_bytes(data)
    with pytest.raises(CheckpointError, match=victim.name):
        CheckpointReader(hf_copy)


def test_index_entry_absent_from_shard(hf_copy):
    index_path = hf_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["norm.weight"]
    index["weight_map"]["layers.9.ghost.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"layers.9.ghost.weight.*{shard}"):
        CheckpointReader(hf_copy)


def test_shard_tensor_missing_from_index_is_reported(hf_copy, cfg):
    index_path = hf_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("layers.2.attn.attn_sink")
    index_path.write_text(json.dumps(index))
    report = check_checkpoint(hf_copy, cfg)
    assert [(p.kind, p.tensor) for p in report.problems] == [
        ("missing", "layers.2.attn.attn_sink"), ("unindexed", "layers.2.attn.attn_sink")]
    assert report.problems[1].file.endswith(shard)


def test_unknown_tensor_requested(hf_dir):
    with pytest.raises(CheckpointError, match="no.such.tensor"):
        CheckpointReader(hf_dir).get("no.such.tensor")


def test_mp_requires_all_ranks(tmp_path, mp2_fp4):
    d = tmp_path / "mp"
    shutil.copytree(mp2_fp4, d)
    (d / "model1-mp2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model1-mp2.safetensors"):
        CheckpointReader(d)


# ---------------------------------------------------------------------------------------- check
def test_check_passes_on_good_checkpoint(hf_dir, cfg):
    report = check_checkpoint(hf_dir, cfg, scan_scales=True)
    assert report.ok, report.summary()
    assert report.checked == len(expected_tensors(cfg))


def test_wrong_shape_names_tensor_and_file(hf_copy, tensors, cfg):
    bad = dict(tensors)
    name = "layers.2.attn.compressor.wkv.weight"
    bad[name] = bad[name][:, :-1].clone()
    rewrite(hf_copy, bad)
    shard = json.loads((hf_copy / "model.safetensors.index.json").read_text())["weight_map"][name]
    msg = check_error(hf_copy, cfg)
    assert name in msg and shard in msg and "shape" in msg


def test_wrong_dtype(hf_copy, tensors, cfg):
    bad = dict(tensors)
    bad["layers.0.ffn.gate.bias"] = bad["layers.0.attn.attn_sink"].to(torch.int32)[:0]  # hash layer: not expected
    bad["layers.1.ffn.gate.bias"] = bad["layers.1.ffn.gate.bias"].to(torch.float16)
    rewrite(hf_copy, bad)
    report = check_checkpoint(hf_copy, cfg)
    assert [p.tensor for p in report.of_kind("dtype")] == ["layers.1.ffn.gate.bias"]
    assert report.unexpected == ["layers.0.ffn.gate.bias"]


def test_missing_and_unexpected_are_all_listed(hf_copy, tensors, cfg):
    bad = dict(tensors)
    gone = ["head.weight", "layers.3.ffn.gate.bias", "mtp.0.e_proj.weight", "mtp.0.e_proj.scale"]
    for name in gone:
        del bad[name]
    extra = ["layers.0.attn.extra_thing", "vision.patch_embed.weight"]
    for name in extra:
        bad[name] = torch.zeros(3)
    rewrite(hf_copy, bad)
    report = check_checkpoint(hf_copy, cfg)
    assert sorted(report.missing) == sorted(gone)
    assert sorted(report.unexpected) == sorted(extra)
    msg = check_error(hf_copy, cfg)
    assert all(n in msg for n in gone + extra)


def test_problem_list_is_capped(hf_copy, tensors, cfg):
    bad = {n: t for n, t in tensors.items() if not n.startswith("layers.")}
    rewrite(hf_copy, bad)
    msg = check_error(hf_copy, cfg)
    n_missing = sum(n.startswith("layers.") for n in tensors)
    assert f"{n_missing} problem(s)" in msg and f"and {n_missing - 20} more" in msg


def test_weight_without_scale(hf_copy, tensors, cfg):
    bad = dict(tensors)
    del bad["layers.1.attn.wq_b.scale"]
    del bad["layers.2.ffn.experts.3.w2.scale"]
    rewrite(hf_copy, bad)
    report = check_checkpoint(hf_copy, cfg)
    assert sorted(p.tensor for p in report.of_kind("no_scale")) == [
        "layers.1.attn.wq_b.weight", "layers.2.ffn.experts.3.w2.weight"]
    assert not report.missing


@pytest.mark.parametrize("wrong", ["transposed", "wrong_axis"])
def test_fp4_scale_layout(hf_copy, tensors, cfg, wrong):
    bad = dict(tensors)
    name = "layers.1.ffn.experts.2.w1.scale"  # weight [128, 256/2] -> scale [128, 8]
    s = bad[name]
    out_dim, groups = s.shape
    bad[name] = s.t().contiguous() if wrong == "transposed" else s.reshape(out_dim // 32, groups * 32)
    rewrite(hf_copy, bad)
    report = check_checkpoint(hf_copy, cfg)
    problems = report.of_kind("scale_layout")
    assert [p.tensor for p in problems] == [name]
    assert "[out, in/32]" in problems[0].detail and problems[0].file and problems[0].file.endswith(".safetensors")
    assert ("transposed" if wrong == "transposed" else "along out") in problems[0].detail


def test_scan_scales_finds_e8m0_nan(hf_copy, tensors, cfg):
    bad = dict(tensors)
    name = "layers.0.attn.wkv.scale"
    raw = bad[name].view(torch.uint8).clone()
    raw.view(-1)[0] = 0xFF
    bad[name] = raw.view(torch.float8_e8m0fnu)
    rewrite(hf_copy, bad)
    assert check_checkpoint(hf_copy, cfg).ok  # headers alone cannot see it
    report = check_checkpoint(hf_copy, cfg, scan_scales=True)
    assert [p.tensor for p in report.of_kind("nan_scale")] == [name]


def test_mtp_emb_and_head_are_ignored_then_dropped(tmp_path, tensors, cfg):
    src = tmp_path / "src"
    extra = dict(tensors)
    extra["mtp.0.emb.tok_emb.weight"] = torch.zeros(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16)
    extra["mtp.0.head.weight"] = torch.zeros(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16)
    write_checkpoint(src, extra)
    report = check_checkpoint(src, cfg)
    assert report.ok and sorted(report.ignored) == ["mtp.0.emb.tok_emb.weight", "mtp.0.head.weight"]
    dst = tmp_path / "dst"
    convert_checkpoint(src, dst, 1, cfg=cfg, progress=False)
    names = CheckpointReader(dst).names()
    assert "mtp.0.head.weight" not in names and "mtp.0.emb.tok_emb.weight" not in names
    assert "mtp.0.hc_head_fn" in names and check_checkpoint(dst, cfg).ok


# ---------------------------------------------------------------------------------------- convert/load
def test_schema_shard_dims_match_convert_key_rule(cfg):
    for name, spec in expected_tensors(cfg).items():
        assert native_name(name) == name
        if ".experts." not in name:  # routed experts go by ownership, not by a split axis
            assert official_key_dim(name) == spec.shard_dim, name


def test_load_hf(hf_dir, cfg, tensors):
    loaded = load_tensors(hf_dir, cfg, progress=False)
    assert loaded.source_format == "hf" and not loaded.dequantised
    assert set(loaded) == set(tensors)
    assert all(same_bits(loaded[n], t) for n, t in tensors.items())
    part = load_tensors(hf_dir, cfg, names=["norm.weight"], progress=False)
    assert list(part) == ["norm.weight"]


def test_load_refuses_bad_checkpoint(hf_copy, tensors, cfg):
    bad = dict(tensors)
    del bad["norm.weight"]
    rewrite(hf_copy, bad)
    with pytest.raises(CheckpointError, match="norm.weight"):
        load_tensors(hf_copy, cfg, progress=False)
    assert "embed.weight" in load_tensors(hf_copy, cfg, check=False, progress=False)


def test_converted_mp2_per_rank_layout(mp2_fp4, hf_dir, cfg):
    reader = CheckpointReader(mp2_fp4)
    assert reader.format == "mp" and reader.mp == 2
    assert (mp2_fp4 / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    report = check_checkpoint(reader, cfg)
    assert report.ok and report.expert_dtype == "fp4", report.summary()
    # experts 0,1 on rank 0 and 2,3 on rank 1; sharded tensors halve; wo_a bf16 without scale
    assert reader.ranks_of("layers.0.ffn.experts.1.w1.weight") == [0]
    assert reader.ranks_of("layers.0.ffn.experts.2.w1.weight") == [1]
    assert reader.shape_dtype("layers.0.ffn.experts.2.w1.weight", 1) == ((128, 128), torch.float4_e2m1fn_x2)
    assert reader.shape_dtype("layers.0.attn.wq_b.weight", 1)[0] == (256, 128)
    assert reader.shape_dtype("layers.0.attn.wo_b.scale", 0)[0] == (2, 1)
    assert reader.shape_dtype("layers.0.attn.wo_a.weight", 0) == ((128, 256), torch.bfloat16)
    assert "layers.0.attn.wo_a.scale" not in reader
    assert reader.ranks_of("layers.0.attn.wkv.weight") == [0, 1]
    with pytest.raises(CheckpointError, match="rank"):
        reader.get("layers.0.attn.wkv.weight")  # replicated: ambiguous without rank=


def test_converted_mp2_reassembles(mp2_fp4, cfg, tensors):
    loaded = load_tensors(mp2_fp4, cfg, progress=False)
    wo_a = {n for n in tensors if ".wo_a." in n}
    assert set(loaded) == set(tensors) - {n for n in wo_a if n.endswith(".scale")}
    assert loaded.dequantised == {n for n in wo_a if n.endswith(".weight")}
    for name, t in tensors.items():
        if name in loaded.dequantised:
            want = dequant_fp8_blocks(t, tensors[name[:-7] + ".scale"], cfg.weight_block).to(torch.bfloat16)
            assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], want), name
        elif name in loaded:
            if ".experts." in name and name.endswith(".weight") and "shared" not in name:
                assert loaded[name].dtype == torch.float4_e2m1fn_x2
            assert same_bits(loaded[name], t), name


def test_convert_fp8_experts_is_exact(tmp_path, hf_dir, cfg, tensors):
    dst = tmp_path / "mp2_fp8"
    convert_checkpoint(hf_dir, dst, 2, "fp8", cfg=cfg, progress=False)
    report = check_checkpoint(dst, cfg)
    assert report.ok and report.expert_dtype == "fp8", report.summary()
    loaded = load_tensors(dst, cfg, progress=False)
    experts = [n for n in tensors if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(experts) == 3 * 4 * (cfg.n_layers + cfg.n_mtp_layers)
    for name in experts:
        scale = name[:-7] + ".scale"
        w, s = loaded[name], loaded[scale]
        assert w.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0] // 128, w.shape[1] // 128)
        want = dequant_fp4(tensors[name], tensors[scale])
        assert torch.equal(dequant_fp8_blocks(w, s, cfg.weight_block), want), name


def test_mp_check_flags_misplaced_expert(tmp_path, mp2_fp4, cfg):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "mp"
    shutil.copytree(mp2_fp4, d)
    r0 = load_file(str(d / "model0-mp2.safetensors"))
    r1 = load_file(str(d / "model1-mp2.safetensors"))
    name = "layers.3.ffn.experts.0.w3.weight"
    r1[name] = r0.pop(name)
    save_file(r0, str(d / "model0-mp2.safetensors"))
    save_file(r1, str(d / "model1-mp2.safetensors"))
    report = check_checkpoint(d, cfg)
    assert report.missing == [name] and report.unexpected == [name]
    assert report.of_kind("missing")[0].file.endswith("model0-mp2.safetensors")
    assert report.of_kind("unexpected")[0].file.endswith("model1-mp2.safetensors")


def test_converted_specs_match_convert_output(mp2_fp4, cfg):
    reader = CheckpointReader(mp2_fp4)
    for rank in range(2):
        specs = converted_specs(cfg, 2, rank, "fp4")
        held = {n for n in reader.names() if rank in reader.ranks_of(n)}
        assert held == set(specs)


def test_convert_refuses_split_through_scale_blocks(tmp_path, hf_dir, cfg):
    # mp=4 would give each rank 64 rows of wo_a, half a 128-row scale block (convert.py would mis-scale)
    with pytest.raises(CheckpointError, match="scale blocks"):
        convert_checkpoint(hf_dir, tmp_path / "mp4", 4, cfg=cfg, progress=False)
    with pytest.raises(CheckpointError, match="scale blocks"):
        converted_specs(cfg, 4, 0)
