"""The official tensor table: every tensor name of a V4 / V4.1 checkpoint with its shape, dtype and layout.

Owns: `expected_tensors(cfg, ...)`, the single source of truth for what a checkpoint holds (spec §5.1,
§10) — used to check real checkpoints on load, to write synthetic ones (`tiny.py`), and to slice
converted `model{rank}-mp{n}` files (spec §5.3).

Layouts (`TensorSpec.kind`):
* `fp8`       E4M3 weight [out, in] whose companion `<name minus .weight>.scale` is E8M0
                [ceil(out/b), ceil(in/b)] with b = 128 (V4) or 32 (V4.1).
* `fp4`       packed E2M1 [out, in/2] (int8 in HF files, float4_e2m1fn_x2 after convert.py) whose scale is
                E8M0 [out, in/32] — one scale per 32 elements *of a row*: never expand it along `out`.
* `scale`     the E8M0 companion of an fp8/fp4 weight.
* `bf16`, `f32`, `int` plain tensors (`int` accepts int32/int64: tid2eid is reported as I64).

Must not: read files (that is `weights/reader.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str  # fp8 | fp4 | scale | bf16 | f32 | int
    shard_dim: int | None = None  # convert.py's tensor-parallel split axis (None = replicated)

    def allowed_dtypes(self) -> tuple[torch.dtype, ...]:
        return _DTYPES[self.kind]


_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "fp8": (torch.float8_e4m3fn,),
    "fp4": (torch.int8, torch.uint8, torch.float4_e2m1fn_x2),
    "scale": (torch.float8_e8m0fnu,),
    # norm weights are bf16 in the official files; float32 is tolerated (the reference promotes them)
    "bf16": (torch.bfloat16, torch.float32),
    "f32": (torch.float32, torch.bfloat16),
    "int": (torch.int64, torch.int32),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Table:
    """Accumulates name -> TensorSpec with the quantised-linear helpers."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.specs: dict[str, TensorSpec] = {}

    def add(self, name: str, shape: tuple[int, ...], kind: str, shard_dim: int | None = None) -> None:
        self.specs[name] = TensorSpec(tuple(shape), kind, shard_dim)

    def fp8_linear(self, prefix: str, out_dim: int, in_dim: int, shard_dim: int | None = None) -> None:
        b = self.cfg.weight_block
        self.add(f"{prefix}.weight", (out_dim, in_dim), "fp8", shard_dim)
        self.add(f"{prefix}.scale", (_cdiv(out_dim, b), _cdiv(in_dim, b)), "scale", shard_dim)

    def expert_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        if self.cfg.fp4_experts:
            self.add(f"{prefix}.weight", (out_dim, in_dim // 2), "fp4")
            self.add(f"{prefix}.scale", (out_dim, in_dim // 32), "scale")
        else:
            self.fp8_linear(prefix, out_dim, in_dim)


def _block_core(t: _Table, p: str) -> str:
    """What every block of both families has: norms, hyper-connection mixes, the attention projections.
    Returns the attention prefix."""
    cfg = t.cfg
    D, H, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    t.add(f"{p}.attn_norm.weight", (D,), "bf16")
    t.add(f"{p}.ffn_norm.weight", (D,), "bf16")
    for s in ("attn", "ffn"):
        t.add(f"{p}.hc_{s}_fn", (mix, cfg.hc_mult * D), "f32")
        t.add(f"{p}.hc_{s}_base", (mix,), "f32")
        t.add(f"{p}.hc_{s}_scale", (3,), "f32")
    a = f"{p}.attn"
    t.add(f"{a}.attn_sink", (H,), "f32", 0)
    t.fp8_linear(f"{a}.wq_a", cfg.q_lora_rank, D)
    t.add(f"{a}.q_norm.weight", (cfg.q_lora_rank,), "bf16")
    t.fp8_linear(f"{a}.wq_b", H * hd, cfg.q_lora_rank, 0)
    t.fp8_linear(f"{a}.wkv", hd, D)
    t.add(f"{a}.kv_norm.weight", (hd,), "bf16")
    t.fp8_linear(f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, 0)
    t.fp8_linear(f"{a}.wo_b", D, cfg.o_groups * cfg.o_lora_rank, 1)
    return a


def _block(t: _Table, p: str, layer: int, experts: int | None = None) -> None:
    """One transformer block (backbone layer or MTP stage) under prefix `p` (e.g. `layers.3`)."""
    cfg = t.cfg
    D, hd = cfg.dim, cfg.head_dim
    ratio = cfg.compress_ratios[layer]
    a = _block_core(t, p)
    if ratio and not cfg.is_v41:
        c = 2 if ratio == 4 else 1  # overlapping compressor keeps two halves
        _compressor(t, f"{a}.compressor", ratio, c * hd, hd)
        if ratio == 4:
            ih, ihd = cfg.index_n_heads, cfg.index_head_dim
            t.fp8_linear(f"{a}.indexer.wq_b", ih * ihd, cfg.q_lora_rank, 0)
            t.add(f"{a}.indexer.weights_proj.weight", (ih, D), "bf16", 0)
            _compressor(t, f"{a}.indexer.compressor", 4, 2 * ihd, ihd)
    _moe(t, f"{p}.ffn", layer, experts or cfg.n_routed_experts)


def _compressor(t: _Table, p: str, ratio: int, width: int, head: int) -> None:
    t.add(f"{p}.ape", (ratio, width), "f32")
    t.add(f"{p}.wkv.weight", (width, t.cfg.dim), "bf16")
    t.add(f"{p}.wgate.weight", (width, t.cfg.dim), "bf16")
    t.add(f"{p}.norm.weight", (head,), "bf16")


def _moe(t: _Table, p: str, layer: int, experts: int) -> None:
    cfg = t.cfg
    D, E, inter = cfg.dim, experts, cfg.moe_inter_dim
    t.add(f"{p}.gate.weight", (E, D), "bf16")
    if cfg.is_hash_layer(layer):
        t.add(f"{p}.gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), "int")
    else:
        t.add(f"{p}.gate.bias", (E,), "f32")
        if cfg.is_v41:  # router bias for image-span tokens (vision-language training)
            t.add(f"{p}.gate.bias_vl", (E,), "f32")
    for e in range(E):
        t.expert_linear(f"{p}.experts.{e}.w1", inter, D)
        t.expert_linear(f"{p}.experts.{e}.w3", inter, D)
        t.expert_linear(f"{p}.experts.{e}.w2", D, inter)
    shared = inter * cfg.n_shared_experts
    t.fp8_linear(f"{p}.shared_experts.w1", shared, D)
    t.fp8_linear(f"{p}.shared_experts.w3", shared, D)
    t.fp8_linear(f"{p}.shared_experts.w2", D, shared)


def _head_collapse(t: _Table, p: str) -> None:
    hc, D = t.cfg.hc_mult, t.cfg.dim
    t.add(f"{p}hc_head_fn", (hc, hc * D), "f32")
    t.add(f"{p}hc_head_base", (hc,), "f32")
    t.add(f"{p}hc_head_scale", (1,), "f32")


def _block_v41(t: _Table, p: str, layer: int, backbone: bool) -> None:
    """A V4.1 block (spec §10): no hc_head, no compressor ape, compressors only on kv sources, indexers
    only on index sources (+ wk/k_norm on kv sources), engram on engram layers, gate bias and bias_vl."""
    cfg = t.cfg
    D, hd = cfg.dim, cfg.head_dim
    a = _block_core(t, p)
    if backbone and layer in cfg.kv_source_layers:
        t.add(f"{a}.compressor.wkv.weight", (hd, D), "bf16")
        if cfg.compress_ratios[layer] > 1:  # ratio 1 is a plain projection: no gate
            t.add(f"{a}.compressor.wgate.weight", (hd, D), "bf16")
        t.add(f"{a}.compressor.norm.weight", (hd,), "bf16")
        t.add(f"{a}.indexer.wk.weight", (cfg.index_head_dim, hd), "bf16")
        t.add(f"{a}.indexer.k_norm.weight", (cfg.index_head_dim,), "bf16")
    if backbone and layer in cfg.index_source_layers:
        ih = cfg.index_n_heads
        t.fp8_linear(f"{a}.indexer.wq_b", ih * cfg.index_head_dim, cfg.q_lora_rank, 0)
        t.add(f"{a}.indexer.weights_proj.weight", (ih, D), "bf16", 0)
    if backbone and layer in cfg.engram_layer_ids:
        e = f"{p}.engram"
        rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        t.add(f"{e}.embed.weight", (rows, cfg.engram_head_dim), "fp8", 0)
        t.add(f"{e}.embed.scale", (rows, cfg.engram_head_dim // 32), "scale", 0)
        t.fp8_linear(f"{e}.wkv", (cfg.hc_mult + 1) * D, cols * cfg.engram_head_dim)
        t.add(f"{e}.q_weight", (cfg.hc_mult, D), "bf16")
        t.add(f"{e}.k_weight", (cfg.hc_mult, D), "bf16")
    _moe(t, f"{p}.ffn", layer, experts=cfg.n_routed_experts if backbone else _dspark_experts(cfg))


def _dspark_experts(cfg: ModelConfig) -> int:
    return cfg.dspark_n_routed_experts or cfg.n_routed_experts


def _dspark_stage_extras(t: _Table, p: str, stage: int) -> None:
    """Stage 0 projects the target layers' hidden states; the last stage owns the heads (spec §10.8)."""
    cfg = t.cfg
    D = cfg.dim
    if stage == 0:
        t.fp8_linear(f"{p}.main_proj", D, D * len(cfg.dspark_target_layer_ids))
        t.add(f"{p}.main_norm.weight", (D,), "bf16")
    if stage == cfg.n_mtp_layers - 1:
        t.add(f"{p}.norm.weight", (D,), "bf16")
        rank = cfg.dspark_markov_rank
        # V4-Flash-0731 names the Markov head's tables markov_w1/markov_w2; V4.1 names them embed/head
        first, second = ("embed", "head") if cfg.is_v41 else ("markov_w1", "markov_w2")
        t.add(f"{p}.markov_head.{first}.weight", (cfg.vocab_size, rank), "bf16")
        t.add(f"{p}.markov_head.{second}.weight", (cfg.vocab_size, rank), "bf16")
        t.add(f"{p}.confidence_head.proj.weight", (1, D + rank), "bf16")
        if not cfg.is_v41:
            _head_collapse(t, f"{p}.")


def expected_tensors(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, TensorSpec]:
    """Every tensor of an official HF-format checkpoint for `cfg` (V4, V4.1; MTP or DSpark stages).

    V4.1's vision tower is not part of the table: see `skipped_prefixes`.
    """
    t = _Table(cfg)
    t.add("embed.weight", (cfg.vocab_size, cfg.dim), "bf16", 0)
    t.add("head.weight", (cfg.vocab_size, cfg.dim), "bf16", 0)
    t.add("norm.weight", (cfg.dim,), "bf16")
    if not cfg.is_v41:
        _head_collapse(t, "")
    for layer in range(cfg.n_layers):
        if cfg.is_v41:
            _block_v41(t, f"layers.{layer}", layer, backbone=True)
        else:
            _block(t, f"layers.{layer}", layer)
    if not include_mtp:
        return t.specs
    dspark = cfg.dspark_block_size > 0
    for i, layer in enumerate(cfg.mtp_layer_ids):
        p = f"mtp.{i}"
        if cfg.is_v41:
            _block_v41(t, p, layer, backbone=False)
        else:
            _block(t, p, layer, experts=_dspark_experts(cfg) if dspark else cfg.n_routed_experts)
        if dspark:
            _dspark_stage_extras(t, p, i)
            continue
        t.fp8_linear(f"{p}.e_proj", cfg.dim, cfg.dim)
        t.fp8_linear(f"{p}.h_proj", cfg.dim, cfg.dim)
        for n in ("enorm", "hnorm", "norm"):
            t.add(f"{p}.{n}.weight", (cfg.dim,), "bf16")
        _head_collapse(t, f"{p}.")
    return t.specs


# Parts of a checkpoint that the language model does not use; loading skips them with a note.
_SKIPPED = {"v41": ("vision.", "aligner.", "image_start", "image_end", "image_newline")}


def skipped_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Name prefixes present in real checkpoints that DeepInfer does not load (V4.1's vision tower)."""
    return _SKIPPED.get(cfg.family, ())


def scale_name(weight_name: str) -> str:
    """`x.y.weight` -> `x.y.scale` (the official companion name)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name} is not a weight tensor name")
    return weight_name[: -len(".weight")] + ".scale"
