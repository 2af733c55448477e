"""Speculative decoding: draft proposers, verification of drafts against the target's logits rows,
rollback of per-sequence cache state after a rejection, and acceptance statistics.

Layer: `engine | spec` (spec may import model, scheduler, sampling, cache; the engine imports spec).
"""
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.metrics import AcceptanceStats

__all__ = ["SpeculativeConfig", "AcceptanceStats"]
