"""Which reference the parity commands compare the engine against (`--ref`):

* `oracle` (default): this package's independent oracle (`deepinfer.reference`), exact or official numerics;
* `official:PATH`: the official DeepSeek `inference/` folder at PATH, run unmodified (`official_ref.py`);
* `transformers`: transformers' DeepseekV4ForCausalLM on the same checkpoint (`transformers_ref.py`).

Every backend returned by `make_reference` has `forward(ids [1, S], start_pos) -> logits [1, V]` (last
position, fp32), a `tap` attribute for the full residual state per sublayer (when it has one, see
`TAPPABLE`) and `embed_transform` (a function applied to the embedding output; the layers floor uses it).

Must not: compare anything (the command modules do), or let a backend run numerics other than its own:
the official code and transformers have one numerics each, and a request for another is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepinfer.reference import load_reference

KINDS = ("oracle", "official", "transformers")


@dataclass(frozen=True)
class RefSpec:
    kind: str = "oracle"
    path: str | None = None  # the official inference folder

    @property
    def label(self) -> str:
        return f"official:{self.path}" if self.kind == "official" else self.kind


def parse_ref(text: str | None) -> RefSpec:
    """`oracle` | `official:PATH` | `transformers` -> RefSpec (ValueError naming the accepted forms)."""
    if not text or text == "oracle":
        return RefSpec()
    if text == "transformers":
        return RefSpec("transformers")
    if text.startswith("official:") and len(text) > len("official:"):
        return RefSpec("official", text[len("official:"):])
    raise ValueError(f"--ref {text!r}: expected 'oracle', 'official:PATH' (the official inference/ folder) "
                     "or 'transformers'")


class _OracleAdapter:
    """The oracle with the backend interface: `embed_transform` wraps its embedding lookup."""

    def __init__(self, oracle) -> None:
        self.oracle = oracle
        embed = oracle.embed
        self.embed_transform = None
        oracle.embed = lambda ids: (self.embed_transform or (lambda e: e))(embed(ids))

    @property
    def tap(self):
        return self.oracle.tap

    @tap.setter
    def tap(self, fn) -> None:
        self.oracle.tap = fn

    def forward(self, ids, start_pos: int = 0, all_logits: bool = False):
        return self.oracle.forward(ids, start_pos, all_logits=all_logits)


def make_reference(spec: RefSpec, model_dir: str | Path, numerics: str, max_seq_len: int):
    """A fresh reference (fresh caches) for one sequence of up to max_seq_len tokens."""
    if spec.kind == "oracle":
        return _OracleAdapter(load_reference(model_dir, numerics=numerics, max_batch_size=1,
                                             max_seq_len=max_seq_len, progress=False))
    if numerics != "official":
        raise ValueError(f"--ref {spec.label} runs its own (official) numerics: pass --numerics official "
                         f"(got {numerics!r})")
    if spec.kind == "official":
        from deepinfer.parity.official_ref import OfficialReference

        return OfficialReference(spec.path, model_dir, max_batch_size=1, max_seq_len=max_seq_len)
    from deepinfer.parity.transformers_ref import TransformersReference

    return TransformersReference(model_dir, max_seq_len=max_seq_len)
