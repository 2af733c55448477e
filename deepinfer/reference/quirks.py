"""Every known behaviour of the official reference code that differs from what the model intends.

The oracle implements the intended behaviour by default (`quirks="intended"`) and the official behaviour
under `quirks="official"`; the engine always follows the intended behaviour; the parity tools use this
list to explain a difference that a quirk causes. One place, one entry per quirk.
"""
from __future__ import annotations

from dataclasses import dataclass

QUIRK_MODES = ("intended", "official")


@dataclass(frozen=True)
class Quirk:
    name: str
    family: str  # v4 | v41
    where: str  # official file and function
    official: str  # what the official code does
    intended: str  # what the oracle does by default (and the engine always)
    effect: str  # when it changes logits, and how much


QUIRKS: tuple[Quirk, ...] = (
    Quirk(
        name="compressor-state-not-reset",
        family="v4",
        where="inference/model.py Compressor.forward (kv_state / score_state buffers)",
        official=(
            "The partial-block state of every compressor is allocated once and never reset; a prefill at "
            "start_pos 0 overwrites only the rows it writes."
        ),
        intended="State is reset (kv 0, score -inf) at every prefill, which is what a freshly built model does.",
        effect=(
            "Only a second sequence in the same model object whose prompt is shorter than 4 tokens at a ratio-4 "
            "layer (overlapping compressor): its first compressed entry pools the previous sequence's last block "
            "A-half rows. Ratio-128 layers are unaffected (stale rows are overwritten before they are pooled)."
            " V4.1's compressors keep the same habit but never pool stale rows (no overlap)."
        ),
    ),
    Quirk(
        name="index-key-sharing-on-incomplete-groups",
        family="v41",
        where="V4.1 inference/model.py Indexer.forward (shared_attn.index_k), read in the vendored copy",
        official=(
            "An index-key owner publishes its key cache to the shared slot only on a call in which its "
            "compressor emitted a new entry. On decode steps where a ratio-2 owner's group is incomplete the "
            "slot still points at the last publisher (the ratio-1 source, layer 20 in the real model, from the "
            "previous step), so the ratio-2 layers 2-19, owners included, score against that layer's keys."
        ),
        intended="Every indexer scores against the key cache of its own kv source (kv_source_of(layer)).",
        effect=(
            "Decode only, at even positions (P+1 odd) once a ratio-2 layer has more compressed entries than "
            "index_topk (real model: from about position 1026; tiny model: from 10); the changed top-k then "
            "propagates through the cache. Prefill is unaffected."
        ),
    ),
)


def check_mode(mode: str) -> str:
    if mode not in QUIRK_MODES:
        raise ValueError(f"quirks must be one of {QUIRK_MODES}, got {mode!r}")
    return mode


def describe(family: str | None = None) -> str:
    """Human-readable list for docs and `deepinfer parity` reports."""
    lines = []
    for q in QUIRKS:
        if family and q.family != family:
            continue
        lines.append(f"- {q.name} [{q.family}] ({q.where})\n  official: {q.official}\n  intended: {q.intended}\n"
                     f"  effect: {q.effect}")
    return "\n".join(lines)
