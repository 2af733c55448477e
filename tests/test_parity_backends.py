"""Reference backends of `deepinfer parity` (`--ref`): the official inference/ folder loaded at run time
(with the kernel stand-in on CPU), transformers, and the `--dump` file naming."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from deepinfer.cli import PARITY_CANNOT_RUN, main
from deepinfer.parity.backends import RefSpec, parse_ref

OFFICIAL_ENV = "DEEPINFER_OFFICIAL_INFERENCE"
IDS = [2056, 768, 17607, 2793, 3139, 12108, 6692, 7624, 768, 11, 12, 13, 2056, 768, 17607, 2793, 3139, 12108]


@pytest.mark.skipif(not os.environ.get(OFFICIAL_ENV), reason=f"set {OFFICIAL_ENV} to the official DeepSeek-V4 "
                    "inference/ folder (model.py + kernel.py) to run the official reference backend")
def test_official_backend_agrees_with_the_engine(tiny_v4_dir):
    """The official model.py, run unmodified on the tiny checkpoint (converted like convert.py), against the
    engine in official numerics: next token (prefill + decode across the window) and every residual."""
    from deepinfer.parity.layers import run_layers
    from deepinfer.parity.next_token import run_next_token

    ref = RefSpec("official", os.environ[OFFICIAL_ENV])
    report = run_next_token(tiny_v4_dir, IDS, force_ids=[3139, 12108, 6692], numerics="official", ref=ref)
    assert report.ok, report.defects
    assert report.meta["reference"].startswith("official:") and not any(r["flip"] for r in report.rows)
    layers = run_layers(tiny_v4_dir, IDS, numerics="official", ref=ref)
    assert layers.ok and len(layers.rows) == 13, layers.verdict


def _official_folder(tmp_path, model_src: str, kernel_src: str = "import tilelang\n"):
    folder = tmp_path / "inference"
    folder.mkdir()
    (folder / "model.py").write_text(model_src)
    (folder / "kernel.py").write_text(kernel_src)  # TileLang-only: the stand-in replaces it on CPU
    return folder


def test_official_loader_names_what_is_missing(tmp_path):
    from deepinfer.parity.official_ref import OfficialLoadError, load_official_module

    with pytest.raises(OfficialLoadError, match="does not exist"):
        load_official_module(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OfficialLoadError, match="no model.py"):
        load_official_module(tmp_path / "empty")
    # a model.py that imports the kernels (served by the stand-in) but lacks the classes the backend needs
    folder = _official_folder(tmp_path, "from kernel import act_quant, sparse_attn\nclass ModelArgs: pass\n")
    with pytest.raises(OfficialLoadError, match=r"does not define \['Transformer', 'Block'\]"):
        load_official_module(folder)
    # a kernel name the stand-in does not provide: the import error is reported with the file
    (folder / "model.py").write_text("from kernel import act_quant, not_a_kernel\n")
    with pytest.raises(OfficialLoadError, match="model.py: import failed.*not_a_kernel"):
        load_official_module(folder)
    import sys

    assert "kernel" not in sys.modules  # the stand-in is installed only while the official code runs


def test_kernel_stand_in_matches_the_oracle_ops():
    """The stand-in's sparse_attn / hc_split_sinkhorn / act_quant against the oracle's independent ops,
    on fresh random inputs."""
    from deepinfer import formats
    from deepinfer.parity import official_kernel_shim as shim
    from deepinfer.reference import ops
    from deepinfer.reference.numerics import Numerics

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    num = Numerics("official", "current", 128)
    q = torch.randn(2, 5, 4, 64, generator=g).bfloat16()
    kv = torch.randn(2, 70, 64, generator=g).bfloat16()
    idx = torch.randint(-1, 70, (2, 5, 80), generator=g, dtype=torch.int32)
    sink = torch.randn(4, generator=g)
    assert torch.equal(shim.sparse_attn(q, kv, sink, idx, 0.125), ops.sparse_attn(q, kv, sink, idx, 0.125, num))
    mixes = torch.randn(2, 5, 24, generator=g)
    scale, base = torch.rand(3, generator=g), torch.randn(24, generator=g)
    for got, want in zip(shim.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6),
                         ops.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    x = (torch.randn(3, 256, generator=g) * 10).bfloat16()
    y = x.clone()
    shim.act_quant(y, 64, "ue8m0", torch.float8_e8m0fnu, inplace=True)
    assert torch.equal(y, formats.fp8_fake_quant(x, 64)) and not torch.equal(y, x)
    a, s = shim.act_quant(x, 128, "ue8m0", torch.float8_e8m0fnu)
    assert a.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    w = torch.randn(32, 256, generator=g)
    codes, ws = formats.fp4_act_quant(w, 32)
    packed, wscale = formats.pack_fp4(codes).view(torch.float4_e2m1fn_x2), formats.float_to_e8m0(ws)
    want = (formats.act_quant_dequant(x, 128) @ formats.dequant_fp4(packed, wscale).T).bfloat16()
    assert torch.equal(shim.fp4_gemm(a, s, packed, wscale).to(torch.bfloat16), want)


def test_ref_parsing_and_refusals(tiny_v4_dir, tmp_path, capsys):
    assert parse_ref(None) == RefSpec() and parse_ref("official:/x/inference").path == "/x/inference"
    with pytest.raises(ValueError, match="official:PATH"):
        parse_ref("official:")
    ids = "2056,768,17607"
    base = ["parity", "next-token", "--ids", ids, "--model", str(tiny_v4_dir), "--api-steps", "0"]
    missing = ["--ref", "official:" + str(tmp_path / "missing"), "--numerics", "official"]
    assert main(base + missing) == PARITY_CANNOT_RUN
    assert "does not exist" in capsys.readouterr().err
    assert main(base + ["--ref", "official:" + str(tmp_path)]) == PARITY_CANNOT_RUN  # exact numerics asked
    assert "--numerics official" in capsys.readouterr().err


_HAVE = {m: importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate")}


@pytest.mark.skipif(all(_HAVE.values()), reason="transformers and accelerate are installed: the backend can run")
def test_transformers_backend_says_what_is_missing(tiny_v4_dir, capsys):
    argv = ["parity", "drift", "--ids", "2056,768", "--steps", "2", "--numerics", "official", "--ref",
            "transformers", "--model", str(tiny_v4_dir)]
    assert main(argv) == PARITY_CANNOT_RUN
    missing = next(m for m, have in _HAVE.items() if not have)
    assert missing in capsys.readouterr().err


def test_dump_files_are_named_by_rank_and_pid(tmp_path, monkeypatch):
    from deepinfer.parity.dump import dump_path, write_dump

    monkeypatch.delenv("RANK", raising=False)
    assert dump_path(tmp_path, "layers", "engine").name == f"rank0-pid{os.getpid()}-layers-engine.pt"
    monkeypatch.setenv("RANK", "3")
    path = write_dump(tmp_path / "d", "layers", "reference", {"embed": torch.arange(4.0)})
    assert path.name == f"rank3-pid{os.getpid()}-layers-reference.pt"
    assert torch.equal(torch.load(path)["embed"], torch.arange(4.0))
    with pytest.raises(ValueError, match="dump name part"):
        dump_path(tmp_path, "../x", "engine")


def test_dump_rank_comes_from_torch_distributed_first(tmp_path, monkeypatch):
    import torch.distributed as dist

    from deepinfer.parity.dump import dump_path

    monkeypatch.setenv("RANK", "7")  # stale env: an initialised group's rank wins
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dump_path(tmp_path, "layers", "engine").name.startswith("rank0-")
    finally:
        dist.destroy_process_group()
    assert dump_path(tmp_path, "layers", "engine").name.startswith("rank7-")
