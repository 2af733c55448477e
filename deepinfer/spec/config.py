"""`SpeculativeConfig`: which drafter proposes how many tokens per step. Frozen, validated on construction.

`LLM(..., speculative={"method": "mtp", "num_speculative_tokens": 2})` and `deepinfer serve --speculative`
build one with `SpeculativeConfig.parse`. Must not: load weights or know the model (the drafter does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

METHODS = ("mtp", "dspark", "custom")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "mtp" (family v4), "dspark" (v41, V4-Flash-0731) or "custom" (a Proposer instance given)
    num_speculative_tokens: int = 1
    proposer: Any = None  # method "custom" only: a spec.proposer.Proposer

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if (self.method == "custom") != (self.proposer is not None):
            raise ValueError("speculative: a 'proposer' is given exactly when method is 'custom'")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")

    def check_model(self, cfg) -> None:
        """Clear errors for a drafter the checkpoint cannot run (cfg: config.ModelConfig)."""
        if self.method == "mtp" and cfg.is_v41:
            raise ValueError("speculative method 'mtp' is for family v4; V4.1 checkpoints draft with 'dspark'")
        if self.method == "mtp" and cfg.dspark_block_size:
            raise ValueError("speculative method 'mtp': this checkpoint's mtp.* stages are DSpark stages "
                             "(V4-Flash-0731); draft with 'dspark'")
        if self.method == "mtp" and cfg.n_mtp_layers < 1:
            raise ValueError("speculative method 'mtp': the checkpoint has no MTP layer (n_mtp_layers = 0)")
        if self.method == "dspark" and not cfg.dspark_block_size:
            raise ValueError("speculative method 'dspark': the checkpoint has no DSpark stages "
                             "(dspark_block_size = 0); V4 checkpoints without them draft with 'mtp'")
        if self.method == "dspark" and self.num_speculative_tokens > cfg.dspark_block_size:
            raise ValueError(f"speculative method 'dspark' proposes at most dspark_block_size = "
                             f"{cfg.dspark_block_size} tokens per step, num_speculative_tokens = "
                             f"{self.num_speculative_tokens} asked")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | Mapping[str, Any] | None") -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or a mapping with `method` and optional `num_speculative_tokens`."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative must be a dict like {{'method': 'mtp', 'num_speculative_tokens': 2}}, "
                             f"got {type(value).__name__}")
        unknown = set(value) - {"method", "num_speculative_tokens", "proposer"}
        if unknown:
            raise ValueError(f"speculative: unknown keys {sorted(unknown)} (have method, num_speculative_tokens, "
                             f"proposer)")
        if "method" not in value:
            raise ValueError("speculative: 'method' is required ('mtp', 'dspark' or 'custom')")
        return cls(value["method"], value.get("num_speculative_tokens", 1), value.get("proposer"))
