"""Model configuration of the DeepSeek-V4 family, read from a checkpoint's own config files.

Owns: `ModelConfig` (frozen) with every field of the official `ModelArgs` (spec §1.1, §10.1), the family
(`v4` = V4-Flash / V4-Pro / V4-Flash-0731, `v41` = V4.1-Flash), and the derived layer schedule
(compression ratio, hash routing, KV/index source layers, RoPE choice, MTP/DSpark layers).
Reads the HF `config.json` (HF key names) and/or `inference/config.json` (ModelArgs names); when both are
present every field they share must agree.

Must not: touch tensors or files other than the two JSON configs.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from deepinfer.config_keys import HF_TO_ARGS, V41_ONLY_KEYS, read_hf_config


class ConfigError(ValueError):
    """A checkpoint's configuration is missing a key, has a wrong value, or is of an unknown family."""


FAMILIES = ("v4", "v41")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_hash_layers: int = 0
    n_mtp_layers: int = 1
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    norm_eps: float = 1e-6
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    beta_fast: int = 32
    beta_slow: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    dtype: str = "fp8"
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str | None = None
    scale_dtype: str = "fp8"
    bos_token_id: int = 0
    eos_token_id: int = 1
    # ---- V4.1 only (spec §10.1) ----
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    # ---- DSpark drafting (V4.1, V4-Flash-0731) ----
    dspark_block_size: int = 0
    dspark_noise_token_id: int = -1
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # keys we read but do not model (vision tower etc.), kept for `inspect`
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(msg)

        if self.family not in FAMILIES:
            bad(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        total = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != total:
            bad(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers"
                f" = {self.n_layers} + {self.n_mtp_layers} = {total}"
            )
        allowed = {0, 4, 128} if self.family == "v4" else {0, 1, 2}
        wrong = sorted({r for r in self.compress_ratios if r not in allowed})
        if wrong:
            bad(f"compress_ratios contains {wrong}; family {self.family} allows {sorted(allowed)}")
        if self.rope_head_dim >= self.head_dim or self.rope_head_dim % 2:
            bad(f"rope_head_dim {self.rope_head_dim} must be even and smaller than head_dim {self.head_dim}")
        if self.n_heads % self.o_groups:
            bad(f"n_heads {self.n_heads} is not divisible by o_groups {self.o_groups}")
        if self.n_activated_experts > self.n_routed_experts:
            bad(f"n_activated_experts {self.n_activated_experts} > n_routed_experts {self.n_routed_experts}")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            bad(f"unknown score_func {self.score_func!r}")
        b = self.act_block
        for name in ("dim", "q_lora_rank", "moe_inter_dim", "o_lora_rank"):
            if getattr(self, name) % b:
                bad(f"{name} = {getattr(self, name)} must be a multiple of the activation block {b}")
        if (self.head_dim - self.rope_head_dim) % self.kv_quant_block:
            bad(f"nope dims {self.head_dim - self.rope_head_dim} not a multiple of {self.kv_quant_block}")
        if self.family == "v4" and self.n_hash_layers > self.n_layers:
            bad(f"n_hash_layers {self.n_hash_layers} > n_layers {self.n_layers}")
        if self.family == "v41":
            self._check_v41(bad)

    def _check_v41(self, bad) -> None:
        for name in ("kv_source_layers", "index_source_layers"):
            for layer in getattr(self, name):
                if not 0 <= layer < self.n_layers or self.compress_ratios[layer] == 0:
                    bad(f"{name} lists layer {layer}, which is not a compressed backbone layer")
        for layer in range(self.n_layers):
            if self.compress_ratios[layer] and self.kv_source_of(layer) is None:
                bad(f"compressed layer {layer} has no kv source layer at or before it")
        if len(self.engram_num_embeddings) not in (0, len(self.engram_layer_ids)):
            bad("engram_num_embeddings must have one entry per engram layer")

    # ------------------------------------------------------------------ derived facts
    @property
    def is_v41(self) -> bool:
        return self.family == "v41"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def weight_block(self) -> int:
        """FP8 weight block edge: 128x128 in V4, 32x32 in V4.1 (spec §10.1)."""
        return 32 if self.is_v41 else 128

    @property
    def act_block(self) -> int:
        """Activation quantisation block before FP8/FP4 GEMMs: 128 in V4, 32 in V4.1."""
        return 32 if self.is_v41 else 128

    @property
    def kv_quant_block(self) -> int:
        """Window/compressed KV FP8 fake-quant block: 64 over the nope channels (V4), 32 over all (V4.1)."""
        return 32 if self.is_v41 else 64

    @property
    def fp4_experts(self) -> bool:
        return self.expert_dtype == "fp4"

    @property
    def num_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return not self.is_v41 and layer < self.n_hash_layers

    def has_indexer(self, layer: int) -> bool:
        """V4: the ratio-4 layers. V4.1: the index source layers (others reuse a source's top-k)."""
        if self.is_v41:
            return layer in self.index_source_layers
        return self.compress_ratios[layer] == 4

    def uses_yarn(self, layer: int) -> bool:
        """Compressed layers use compress_rope_theta with YaRN; window-only layers plain rope_theta."""
        return self.compress_ratios[layer] > 0

    def rope_base(self, layer: int) -> float:
        return self.compress_rope_theta if self.uses_yarn(layer) else self.rope_theta

    def _latest_at_or_before(self, sources: tuple[int, ...], layer: int) -> int | None:
        if self.compress_ratios[layer] == 0:
            return None
        before = [s for s in sources if s <= layer]
        return max(before) if before else None

    def kv_source_of(self, layer: int) -> int | None:
        """Layer whose compressed KV this layer attends (itself in V4; the latest source in V4.1)."""
        if not self.is_v41:
            return layer if self.compress_ratios[layer] else None
        return self._latest_at_or_before(self.kv_source_layers, layer)

    def index_source_of(self, layer: int) -> int | None:
        """Layer whose top-k indices this layer uses (V4: ratio-4 layers themselves)."""
        if not self.is_v41:
            return layer if self.compress_ratios[layer] == 4 else None
        return self._latest_at_or_before(self.index_source_layers, layer)

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers, self.n_layers + self.n_mtp_layers))

    def schedule(self) -> list[dict[str, Any]]:
        """One row per layer (backbone then MTP/DSpark) for `deepinfer inspect` and docs."""
        rows = []
        for layer in range(self.num_total_layers):
            rows.append(
                {
                    "layer": layer,
                    "kind": "mtp" if layer >= self.n_layers else "backbone",
                    "ratio": self.compress_ratios[layer],
                    "indexer": layer < self.n_layers and self.has_indexer(layer),
                    "hash_routed": self.is_hash_layer(layer),
                    "kv_source": self.kv_source_of(layer) if layer < self.n_layers else None,
                    "index_source": self.index_source_of(layer) if layer < self.n_layers else None,
                    "engram": layer in self.engram_layer_ids,
                    "rope_base": self.rope_base(layer),
                }
            )
        return rows

    def to_inference_json(self) -> dict[str, Any]:
        """The `inference/config.json` (ModelArgs) form of this config, V4.1 keys only for v41 (and, for v4,
        those that differ from their defaults: the DSpark keys of V4-Flash-0731 / V4-Pro-0813)."""
        out = {}
        for f in fields(self):
            if f.name in ("family", "extra", "bos_token_id", "eos_token_id"):
                continue
            if not self.is_v41 and f.name in V41_ONLY_KEYS and getattr(self, f.name) == f.default:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, args: dict[str, Any], family: str | None = None, extra: dict | None = None) -> "ModelConfig":
        """Build from ModelArgs-named keys. Missing required keys and unknown families raise ConfigError."""
        family = family or detect_family(args)
        known = {f.name: f for f in fields(cls)}
        required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING and n != "family"]
        missing = [n for n in required if n not in args]
        if missing:
            raise ConfigError(f"config is missing required keys: {', '.join(missing)}")
        kwargs: dict[str, Any] = {"family": family}
        unknown: dict[str, Any] = dict(extra or {})
        for key, value in args.items():
            if key not in known or key in ("family", "extra"):
                unknown[key] = value
                continue
            if isinstance(value, list):
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs, extra=unknown)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (HF) and/or `inference/config.json` (ModelArgs) from a checkpoint dir."""
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"checkpoint directory {root} does not exist")
        hf_path, inf_path = root / "config.json", root / "inference" / "config.json"
        if not hf_path.exists() and not inf_path.exists():
            raise ConfigError(f"{root} has neither config.json nor inference/config.json")
        hf_args, hf_extra = read_hf_config(_read_json(hf_path)) if hf_path.exists() else ({}, {})
        inf_args = _read_json(inf_path) if inf_path.exists() else {}
        if hf_args and inf_args:
            _check_agreement(hf_args, inf_args, hf_path, inf_path)
        merged = {**hf_args, **inf_args}
        if "n_mtp_layers" not in inf_args and "compress_ratios" in merged and "n_layers" in merged:
            if len(merged["compress_ratios"]) >= merged["n_layers"]:  # else keep the default and fail the length check
                merged["n_mtp_layers"] = len(merged["compress_ratios"]) - merged["n_layers"]
        try:
            return cls.from_dict(merged, extra=hf_extra)
        except ConfigError as e:
            raise ConfigError(f"{root}: {e}") from None


def detect_family(args: dict[str, Any]) -> str:
    """`v41` when any V4.1-only architectural key is present, else `v4` (explicit `family` wins)."""
    if "family" in args:
        return str(args["family"])
    return "v41" if any(k in args for k in ("kv_source_layers", "engram_layer_ids", "index_source_layers")) else "v4"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _check_agreement(hf: dict, inf: dict, hf_path: Path, inf_path: Path) -> None:
    for key in sorted(set(hf) & set(inf)):
        a, b = hf[key], inf[key]
        a = list(a) if isinstance(a, tuple) else a
        b = list(b) if isinstance(b, tuple) else b
        if isinstance(a, float) or isinstance(b, float):  # relative only: eps values like 1e-20 must be compared
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
            same = numeric and math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
        else:
            same = a == b
        if not same:
            raise ConfigError(f"{hf_path} and {inf_path} disagree on {key}: {a!r} vs {b!r}")


__all__ = ["ConfigError", "ModelConfig", "FAMILIES", "HF_TO_ARGS", "detect_family", "asdict"]
