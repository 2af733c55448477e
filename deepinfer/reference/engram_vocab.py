"""The Engram compressed vocabulary of V4.1-Flash (spec §10.5 step 1).

Owns: mapping every tokenizer id onto a smaller id space in which tokens that normalise alike
(" The", "the", "THE") share one id; the n-gram hashes of `reference/engram.py` are computed over
these compressed ids, and the hash multipliers depend on the compressed vocabulary's size.

Read from the official V4.1 `inference/engram.py`, function `build_compressed_token_map` (vendored copy
in tenstorrent/tt-metal `models/demos/deepseek_v3_d_p/reference/deepseek_v41/engram.py`, commit
702412b8). What it does, restated:
* decode each id alone with the raw Rust tokenizer (`backend_tokenizer.decode([id],
  skip_special_tokens=False)`, so no `clean_up_tokenization_spaces`), for ids 0..len(tokenizer)-1
  (`len` of an HF fast tokenizer = vocabulary size with added tokens);
* text containing U+FFFD (a partial UTF-8 byte token) is keyed by its raw vocabulary string;
  otherwise the key is the normalised text, or the text itself when normalisation empties it;
* the normaliser is a `tokenizers.normalizers.Sequence` of NFKC, NFD, StripAccents, Lowercase,
  Replace(regex `[ \\t\\r\\n]+` -> " "), Replace(regex `^ $` -> U+E000), Strip, Replace(U+E000 -> " ").
  We build the same sequence with the same library so that Unicode tables and regex semantics cannot
  drift from the official ones (a hand-written Python normaliser would use Python's Unicode database);
* keys receive new ids in order of first appearance (ascending token id).

For the real V4 tokenizer (129280 ids) the result has 99092 compressed ids, which the official code
asserts against `engram_compressed_vocab_size`. Building takes about a second; the result is cached per
tokenizer file in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as RustTokenizer

# Private-use sentinel: keeps a token that is exactly one space from being stripped to "" (which
# would then fall back to its raw text and stay distinct from the other whitespace tokens).
_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class CompressedVocab:
    token_map: torch.Tensor  # int64 [tokenizer vocab]: token id -> compressed id (treat as read-only)
    size: int  # number of compressed ids

    def __len__(self) -> int:
        return self.size


def engram_normalizer() -> normalizers.Normalizer:
    """The official normalisation sequence (see the module docstring)."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def token_key(backend: RustTokenizer, token_id: int, normalizer: normalizers.Normalizer | None = None) -> str:
    """The string under which one token id is grouped."""
    text = backend.decode([token_id], skip_special_tokens=False)
    if _REPLACEMENT_CHAR in text:
        return backend.id_to_token(token_id)
    normalized = (normalizer or engram_normalizer()).normalize_str(text)
    return normalized if normalized else text


def build_compressed_vocab(backend: RustTokenizer) -> CompressedVocab:
    """Compressed ids for every id of a raw `tokenizers.Tokenizer` (no caching)."""
    n = backend.get_vocab_size(with_added_tokens=True)
    normalizer = engram_normalizer()
    ids: dict[str, int] = {}
    lookup = [0] * n
    for token_id in range(n):
        key = token_key(backend, token_id, normalizer)
        lookup[token_id] = ids.setdefault(key, len(ids))
    return CompressedVocab(torch.tensor(lookup, dtype=torch.int64), len(ids))


@lru_cache(maxsize=4)
def _cached(path: str) -> CompressedVocab:
    return build_compressed_vocab(RustTokenizer.from_file(path))


def compressed_vocab(tokenizer=None) -> CompressedVocab:
    """Cached compressed vocabulary of a tokenizer.

    `tokenizer`: our `deepinfer.tokenizer.Tokenizer`, a path to a `tokenizer.json`, or None for the
    bundled V4 tokenizer. Cached in memory by resolved file path. A raw `tokenizers.Tokenizer` has no
    path and is built uncached through `build_compressed_vocab`.
    """
    if tokenizer is None:
        from deepinfer.tokenizer import default_tokenizer

        tokenizer = default_tokenizer()
    if isinstance(tokenizer, RustTokenizer):
        return build_compressed_vocab(tokenizer)
    path = tokenizer.path if hasattr(tokenizer, "path") else tokenizer
    return _cached(str(Path(path).resolve()))


__all__ = ["CompressedVocab", "engram_normalizer", "token_key", "build_compressed_vocab", "compressed_vocab"]
