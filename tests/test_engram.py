"""V4.1 Engram: compressed vocabulary, hash layout and hashing, table gather, gated stream update.

Anchors from spec §9b; hand-computed hashes and gates on tiny configurations.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.reference.engram import (
    DEAD, Engram, NgramHasher, engram_primes, gather_rows, hash_multipliers, is_prime, prepare_engram_params,
)
from deepinfer.reference.engram_vocab import (
    CompressedVocab, build_compressed_vocab, compressed_vocab, engram_normalizer,
)
from deepinfer.reference.numerics import Numerics

FIXTURES = Path(__file__).parent / "fixtures"
EXACT, OFFICIAL = Numerics("exact", act_block=32), Numerics("official", act_block=32)


@pytest.fixture(scope="module")
def v41():
    return ModelConfig.from_checkpoint(FIXTURES / "configs" / "v41-flash")


def small_cfg(v41, **kw):
    base = dict(engram_layer_ids=(3,), engram_num_embeddings=(), engram_vocab_size=10, engram_n_heads=2,
                engram_max_ngram_size=3, engram_compressed_vocab_size=6, engram_pad_id=0)
    return dataclasses.replace(v41, **{**base, **kw})


# ------------------------------------------------------------------ compressed vocabulary
def test_real_compressed_vocab_size_and_cache():
    v = compressed_vocab()
    assert v.size == 99092 and v.token_map.shape == (129280,)
    assert compressed_vocab() is v  # in-memory cache by tokenizer path
    assert v.token_map[:3].tolist() == [0, 1, 2]  # specials kept, each its own key
    from deepinfer.tokenizer import default_tokenizer

    tok = default_tokenizer()
    same = {int(v.token_map[tok.token_to_id(t)]) for t in ("ĠThe", "the", "The", "THE", "Ġthe")}
    assert len(same) == 1


def test_normalizer_semantics():
    n = engram_normalizer()
    assert n.normalize_str(" ") == " "  # a lone space survives Strip via the sentinel
    assert n.normalize_str(" \t\n ") == " "
    assert n.normalize_str("Ｔｈｅ") == "the"  # NFKC + lowercase
    assert n.normalize_str(" Café ") == "cafe"  # accents stripped, outer spaces stripped
    assert n.normalize_str("x\r\n\ty") == "x y"


def test_tiny_vocab_keys_and_first_seen_order():
    toks = ["<pad>", "ĠThe", "the", "THE", "Ã", "Ä", "Ġ", "ĠĠ", "Ċ", "ĠcafÃ©", "cafe", "<｜x｜>"]
    tk = RustTokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<pad>"))
    tk.decoder = decoders.ByteLevel()
    v = build_compressed_vocab(tk)
    # Ã / Ä are lone UTF-8 lead bytes (decode to U+FFFD): keyed by raw token, so they stay apart
    assert v.token_map.tolist() == [0, 1, 1, 1, 2, 3, 4, 4, 4, 5, 5, 6]
    assert v.size == 7


# ------------------------------------------------------------------ layout
def test_is_prime_matches_sieve():
    n = 5000
    sieve = np.ones(n, bool)
    sieve[:2] = False
    for i in range(2, int(n**0.5) + 1):
        sieve[i * i :: i] = False
    assert [is_prime(i) for i in range(n)] == sieve.tolist()
    assert is_prime(16000057) and not is_prime(16000057 * 16000079)


def test_real_primes_and_multipliers(v41):
    primes = engram_primes(v41.engram_layer_ids, 4, 8, 16000000)
    assert [sum(h for n in layer for h in n) for layer in primes] == [384006168, 384016682]
    assert list(v41.engram_num_embeddings) == [384006168, 384016682]
    assert primes[0][0][:3] == (16000057, 16000079, 16000081) and primes[1][0][:2] == (16000477, 16000487)
    flat = [h for layer in primes for n in layer for h in n]
    assert len(set(flat)) == 48 and all(is_prime(p) for p in flat)
    m = hash_multipliers((1, 14), 4, 99092)
    assert m.dtype == torch.int64
    assert m.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                          [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


def test_small_primes_restart_but_skip_used(v41):
    # vocab 10: n=2 draws 11, 13; n=3 restarts at 9 and skips them: 17, 19; next layer 23, 29 / 31, 37
    assert engram_primes((3, 5), 3, 2, 10) == (((11, 13), (17, 19)), ((23, 29), (31, 37)))


# ------------------------------------------------------------------ hashing
def tiny_hasher(v41, max_seq_len=16):
    cfg = small_cfg(v41)
    vocab = CompressedVocab(torch.tensor([0, 1, 2, 3, 4, 5, 3, 4]), 6)  # ids 6, 7 alias 3, 4
    h = NgramHasher(cfg, 2, max_seq_len, vocab=vocab)
    h.multipliers = torch.tensor([[3, 5, 7]])  # small multipliers: hashes by hand
    return h


def test_hand_computed_hashes(v41):
    h = tiny_hasher(v41)
    out = h(torch.tensor([[1, 2, 7]]), 0)
    assert out.shape == (1, 3, 1, 4)
    # primes (11, 13 | 17, 19), offsets 0, 11, 24, 41; pad = map[0] = 0
    # p0: tokens (1, pad, pad) -> products (3, 0, 0): 2-gram 3, 3-gram 3
    # p1: tokens (2, 1, pad) -> (6, 5, 0): 2-gram 6^5 = 3, 3-gram 3^0 = 3
    # p2: tokens (4, 2, 1) -> (12, 10, 7): 2-gram 12^10 = 6, 3-gram 6^7 = 1
    assert out[0, :, 0].tolist() == [[3, 14, 27, 44], [3, 14, 27, 44], [6, 17, 25, 42]]


def reference_hashes(hist_rows, positions, pad, mult, primes):
    """Direct formula over Python ints with int64 wrap-around like numpy/torch."""
    def wrap(v):
        return (v + 2**63) % 2**64 - 2**63

    out = []
    for row, p in zip(hist_rows, positions):
        toks, blocked = [], False
        for s in range(len(mult)):
            blocked = blocked or p < s or row[p - s] == DEAD
            toks.append(pad if blocked else row[p - s])
        prods = [wrap(t * m) for t, m in zip(toks, mult)]
        rolling, hashes, off = prods[0], [], 0
        for n in range(1, len(mult)):
            rolling ^= prods[n]
            for q in primes[n - 1]:
                hashes.append(rolling % q + off)
                off += q
        out.append(hashes)
    return out


def test_dead_tokens_block_lookback(v41):
    h = tiny_hasher(v41)
    ids = torch.tensor([[1, 2, 3, 4, 5, 1]])
    mask = torch.tensor([[True, True, False, True, True, True]])
    out = h(ids, 0, mask)[0, :, 0].tolist()
    row = [1, 2, DEAD, 4, 5, 1]
    assert out == reference_hashes([row] * 6, range(6), 0, [3, 5, 7], ((11, 13), (17, 19)))
    # position 3 sees (4, pad, pad): the DEAD token and everything before it is gone
    assert out[3] == [12 % 11, 12 % 13 + 11, 12 % 17 + 24, 12 % 19 + 41]
    assert out[2] == [0, 11, 24, 41]  # a dead token hashes all-pad (its gate is closed anyway)


def test_real_hashes_match_direct_formula_with_wraparound(v41):
    """Real layout, map and multipliers; then multipliers whose products wrap int64 (never with the real ones)."""
    vocab = compressed_vocab()
    h = NgramHasher(v41, 1, 32, vocab=vocab)
    ids = torch.randint(0, 129280, (1, 20), generator=torch.Generator().manual_seed(0))
    out = h(ids, 0)
    row = vocab.token_map[ids[0]].tolist()
    primes = engram_primes(v41.engram_layer_ids, 4, 8, 16000000)
    for li in range(2):
        ref = reference_hashes([row] * 20, range(20), h.pad, h.multipliers[li].tolist(), primes[li])
        assert out[0, :, li].tolist() == ref
    assert int(out[..., 0, :].max()) < 384006168 and int(out[..., 1, :].max()) < 384016682
    h.multipliers = torch.full((2, 4), 2**62 + 1)  # wrapping products: still the int64 semantics
    out = h(ids, 0)
    ref = reference_hashes([row] * 20, range(20), h.pad, [2**62 + 1] * 4, primes[0])
    assert out[0, :, 0].tolist() == ref


def test_history_carried_across_prefill_and_decode(v41):
    ids = torch.randint(0, 8, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 4] = False
    full = tiny_hasher(v41)(ids, 0, mask)
    h = tiny_hasher(v41)
    parts = [h(ids[:, :6], 0, mask[:, :6])] + [h(ids[:, i : i + 1], i, mask[:, i : i + 1]) for i in range(6, 10)]
    assert torch.equal(torch.cat(parts, dim=1), full)


def test_vocab_size_mismatch_is_refused(v41):
    with pytest.raises(ValueError, match="compressed vocabulary"):
        NgramHasher(small_cfg(v41, engram_compressed_vocab_size=7), 1, 4,
                    vocab=CompressedVocab(torch.arange(6), 6))


# ------------------------------------------------------------------ table
def random_table(rows, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, head_dim, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(110, 135, (rows, head_dim // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return w, s


class RowRecorder:
    """A table that logs which rows were read (stands in for a memory-mapped tensor)."""

    def __init__(self, t):
        self.t, self.shape, self.read = t, t.shape, []

    def __getitem__(self, rows):
        self.read.append(rows.clone())
        return self.t[rows]


@pytest.mark.parametrize("num", [EXACT, OFFICIAL], ids=["exact", "official"])
def test_gather_rows_equals_full_dequant_and_reads_only_asked_rows(num):
    w, s = random_table(50, 64)
    full = w.to(torch.float64) * formats.e8m0_to_float(s).to(torch.float64).repeat_interleave(32, dim=1)
    rows = torch.tensor([[7, 3, 7], [49, 0, 3]])
    got = gather_rows(w, s, rows, num)
    assert got.dtype == num.act and got.shape == (2, 3, 64)
    assert torch.equal(got, full[rows].to(num.act))
    rw, rs = RowRecorder(w), RowRecorder(s)
    assert torch.equal(gather_rows(rw, rs, rows, num), got)
    for rec in (rw, rs):
        assert sorted(torch.cat(rec.read).tolist()) == [0, 3, 7, 49]
    with pytest.raises(IndexError):
        gather_rows(w, s, torch.tensor([50]), num)


# ------------------------------------------------------------------ the layer
def engram_setup(v41, kv_column, num, hc=2, dim=32):
    """Table row 0 = e_0 (fp8 1.0, scale 2**0), so kv = wkv[:, 0] = `kv_column`; other rows random."""
    cfg = small_cfg(v41, hc_mult=hc, dim=dim, engram_head_dim=32, engram_n_heads=1, engram_max_ngram_size=2,
                    engram_num_embeddings=(5,))
    w, s = random_table(5, 32, seed=3)
    w[0] = torch.zeros(32).to(torch.float8_e4m3fn)
    w[0, 0] = torch.tensor(1.0).to(torch.float8_e4m3fn)
    s[0] = torch.tensor([127], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    wkv = torch.randn((hc + 1) * dim, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.1
    wkv[:, 0] = kv_column
    qk = torch.linspace(0.5, 1.5, hc * dim, dtype=torch.float64).view(hc, dim)
    params = {"embed.weight": w, "embed.scale": s, "wkv.weight": wkv.to(num.acc), "q_weight": qk.to(num.acc),
              "k_weight": torch.ones(hc, dim, dtype=num.acc)}
    return Engram(params, cfg, num, 3), qk


def test_gate_hand_cases(v41):
    dim = 32
    g = torch.Generator().manual_seed(5)
    key = torch.randn(2, dim, generator=g, dtype=torch.float64)
    value = torch.randn(dim, generator=g, dtype=torch.float64)
    eng, qk = engram_setup(v41, torch.cat([key.flatten(), value]), EXACT)
    x = torch.stack([key[0] / qk[0], -key[1] / qk[1]])  # so that wgt*x = +key_c and -key_c
    x = x.view(1, 1, 2, dim)
    out = eng(x, torch.zeros(1, 1, 1, dtype=torch.long))
    for c, sign in enumerate((1, -1)):
        xc, kc = x[0, 0, c], key[c]
        dot = float((xc * qk[c] * kc).sum()) / math.sqrt(float((xc**2).mean()) + 1e-20) \
            / math.sqrt(float((kc**2).mean()) + 1e-20) / math.sqrt(dim)
        assert dot * sign > 0
        gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(abs(dot)), dot)))
        torch.testing.assert_close(out[0, 0, c], xc + gate * value, rtol=1e-13, atol=1e-13)
    # dot exactly 0 (x orthogonal to key): copysign(+0) -> sigmoid(+sqrt(1e-6)), not sigmoid(0)
    key0 = torch.zeros(2, dim, dtype=torch.float64)
    key0[:, 0] = 1.0
    eng, _ = engram_setup(v41, torch.cat([key0.flatten(), value]), EXACT)
    x = torch.zeros(1, 1, 2, dim, dtype=torch.float64)
    x[..., 1] = 2.0
    out = eng(x, torch.zeros(1, 1, 1, dtype=torch.long))
    gate = 1 / (1 + math.exp(-1e-3))
    torch.testing.assert_close(out[0, 0], x[0, 0] + gate * value, rtol=1e-13, atol=1e-13)


def test_official_numerics_close_to_exact_and_mask_is_identity(v41):
    g = torch.Generator().manual_seed(6)
    column = torch.randn(3 * 32, generator=g, dtype=torch.float64)
    ex, _ = engram_setup(v41, column, EXACT)
    of, _ = engram_setup(v41, column, OFFICIAL)
    x = torch.randn(2, 3, 2, 32, generator=g).to(torch.bfloat16)
    hashes = torch.randint(0, 5, (2, 3, 1), generator=g)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    y_of, y_ex = of(x, hashes, mask), ex(x.double(), hashes, mask)
    assert y_of.dtype == torch.bfloat16 and y_ex.dtype == torch.float64
    torch.testing.assert_close(y_of.double(), y_ex, rtol=0.03, atol=0.03)
    assert torch.equal(y_of[~mask], x[~mask]) and torch.equal(y_ex[~mask], x.double()[~mask])
    assert not torch.equal(y_of[mask], x[mask])


def test_checkpoint_names_and_prepare(v41):
    lines = (FIXTURES / "index" / "v41-flash.names.txt").read_text().splitlines()
    found = {}
    for line in lines:
        m = re.match(r"layers\.\{L\}\.engram\.(\S+)\s+(\S+)\s+\[([\d, ]+)\]\s+L=(\S+)", line)
        if m:
            shape = tuple(int(v) for v in m.group(3).split(","))
            for layer in m.group(4).split(","):
                found[(int(layer), m.group(1))] = (m.group(2), shape)
    cols = (v41.engram_max_ngram_size - 1) * v41.engram_n_heads * v41.engram_head_dim
    for i, layer in enumerate(v41.engram_layer_ids):
        rows = v41.engram_num_embeddings[i]
        assert {k[1]: v for k, v in found.items() if k[0] == layer} == {
            "embed.weight": ("F8_E4M3", (rows, 256)), "embed.scale": ("F8_E8M0", (rows, 8)),
            "wkv.weight": ("F8_E4M3", (5 * v41.dim, cols)), "wkv.scale": ("F8_E8M0", (5 * v41.dim // 32, cols // 32)),
            "q_weight": ("BF16", (4, v41.dim)), "k_weight": ("BF16", (4, v41.dim)),
        }
    # prepare: table passed through untouched (mappable), wkv dequantised with 32x32 blocks
    cfg = small_cfg(v41, hc_mult=2, dim=32, engram_head_dim=32, engram_n_heads=1, engram_max_ngram_size=2)
    w, s = random_table(5, 32)
    wkv_q, wkv_s = formats.quant_fp8_blocks(torch.randn(96, 32), 32)
    p = "layers.3.engram."
    ones = torch.ones(2, 32, dtype=torch.bfloat16)
    raw = {p + "embed.weight": w, p + "embed.scale": s, p + "wkv.weight": wkv_q, p + "wkv.scale": wkv_s,
           p + "q_weight": ones, p + "k_weight": ones}
    params = prepare_engram_params(raw, cfg, OFFICIAL, 3)
    assert params["embed.weight"] is w and params["embed.scale"] is s
    assert torch.equal(params["wkv.weight"], formats.dequant_fp8_blocks(wkv_q, wkv_s, 32))
    eng = Engram(params, cfg, OFFICIAL, 3)
    assert eng(torch.ones(1, 2, 2, 32, dtype=torch.bfloat16), torch.tensor([[[1], [4]]])).shape == (1, 2, 2, 32)
