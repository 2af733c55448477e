"""Engram of V4.1-Flash: n-gram hash memory added into the 4-stream residual before blocks 1 and 14
(spec §10.5).

Owns: the hash layout (primes, offsets, multipliers), the per-sequence token history that the hashes
read (`NgramHasher`, carried across prefill and decode), the row gather + dequantisation of the FP8 hash
tables, and the gated update of the residual streams (`Engram`). The compressed vocabulary the hashes
run over lives in `reference/engram_vocab.py`.

Official code read (V4.1-Flash HF revision dba1be0a, vendored byte-identical in tenstorrent/tt-metal
`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`, commit 702412b8):
* `engram.py`: `find_next_prime`, `compute_hash_multipliers`, `EngramLayout.from_args`,
  `NgramHashState.__init__/forward`, `build_compressed_token_map` (-> engram_vocab.py);
* `model.py`: `ParallelEngramEmbedding.forward` (row gather, fp32 `fp8 * scale` per 32 -> bf16),
  `Engram.__init__/forward` (wkv an fp8 `Linear`, key/value split, gate), `Block.__init__` (tensor
  names `layers.{L}.engram.{embed.weight, embed.scale, wkv.weight, wkv.scale, q_weight, k_weight}`),
  `Transformer.forward` (hashes computed once per call for all engram layers; engram applied to the
  streams before the block; mask = text tokens, i.e. `token_types < 0`).
Where the spec's summary is loose, the code wins: the gate uses `copysign(sqrt(max(|dot|, 1e-6)), dot)`,
so dot == +0 gives sigmoid(+1e-3), not sigmoid(0); the remainder is torch's (non-negative) `%`.

Deviation (misuse only): the official history cache is `torch.empty` (garbage where never written);
ours starts as DEAD, so reading history that no call wrote yields pad ids instead of garbage.

Placing the real tables (layers 1 and 14: 768M rows of 256 E4M3 = 183 GiB, plus 5.7 GiB of E8M0
scales): keep them on the host, memory-mapped from the safetensors shards (e.g. `safe_open(...)
.get_tensor` / `safetensors.torch.load_file`, which map the file), and hand the mapped tensors to `Engram`
untouched: each step gathers only the rows its hashes name (`torch.index_select` on dim 0 touches only
those pages) and dequantises just those rows; never dequantise a whole table (`prepare_engram_params`
passes it through). On GPUs the official code shards the rows like `ParallelEngramEmbedding`
(`ceil(rows/world)` rows per rank, foreign rows zeroed, all-reduce); choosing GPU vs host placement and
sharding is the engine's job (a later issue), not the oracle's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import numpy as np
import torch

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.reference.engram_vocab import CompressedVocab, compressed_vocab
from deepinfer.reference.numerics import Numerics

DEAD = -1  # history entry of an image-span token: no n-gram reaches across it
GATE_CLAMP = 1e-6  # |dot| floor before the signed square root
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


# ------------------------------------------------------------------------------------------ layout
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24; the table moduli are ~1.6e7)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, used: set[int]) -> int:
    """Smallest prime strictly above `start` that is not in `used`."""
    n = start + 1
    while n in used or not is_prime(n):
        n += 1
    return n


@lru_cache(maxsize=8)
def engram_primes(
    layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket moduli [engram layer][n-gram size 2..max_ngram][head].

    For every (layer, n) the search restarts at vocab_size - 1 but skips every prime already handed out,
    so all (layer, n, head) ranges get distinct primes, drawn in this loop order.
    """
    used: set[int] = set()
    layers = []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            current, heads = vocab_size - 1, []
            for _ in range(n_heads):
                current = next_prime(current, used)
                used.add(current)
                heads.append(current)
            per_n.append(tuple(heads))
        layers.append(tuple(per_n))
    return tuple(layers)


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_size: int) -> torch.Tensor:
    """int64 [n engram layers, max_ngram]: odd multipliers, one per look-back, from numpy PCG64.

    The bound keeps token * multiplier inside int64 for every compressed id.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_size) // 2)
    rows = []
    for layer in layer_ids:
        draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(torch.from_numpy(draws * 2 + 1))
    return torch.stack(rows)


# ------------------------------------------------------------------------------------------ hashing
class NgramHasher:
    """Hash ids of the n-grams ending at each new position, for every engram layer at once.

    Keeps a history [max_batch_size, max_seq_len] of compressed ids (DEAD for masked tokens), written at
    `start_pos..start_pos+S` by each call, so decode steps see the prefill's tokens.
    """

    def __init__(
        self, cfg: ModelConfig, max_batch_size: int, max_seq_len: int, tokenizer=None,
        vocab: CompressedVocab | None = None,
    ) -> None:
        vocab = vocab if vocab is not None else compressed_vocab(tokenizer)
        if vocab.size != cfg.engram_compressed_vocab_size:
            # every multiplier derives from this size: a mismatch silently rehashes the whole table
            raise ValueError(
                f"compressed vocabulary has {vocab.size} ids, config says {cfg.engram_compressed_vocab_size}"
            )
        self.layer_ids = tuple(cfg.engram_layer_ids)
        self.max_ngram = cfg.engram_max_ngram_size
        self.token_map = vocab.token_map
        self.pad = int(vocab.token_map[cfg.engram_pad_id])
        primes = engram_primes(self.layer_ids, self.max_ngram, cfg.engram_n_heads, cfg.engram_vocab_size)
        self.primes = torch.tensor(primes, dtype=torch.int64)  # [nL, max_ngram-1, heads]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, dim=1) - flat  # exclusive cumsum in (n, head) order
        self.multipliers = hash_multipliers(self.layer_ids, self.max_ngram, vocab.size)
        self.history = torch.full((max_batch_size, max_seq_len), DEAD, dtype=torch.int64)

    def layer_index(self, layer_id: int) -> int:
        return self.layer_ids.index(layer_id)

    def __call__(self, ids: torch.Tensor, start_pos: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, S] -> hash ids int64 [B, S, n engram layers, (max_ngram-1)*n_heads].

        token_mask [B, S]: False for tokens that take no part in any n-gram (image spans).
        """
        B, S = ids.shape
        comp = self.token_map[ids.long()]
        if token_mask is not None:
            comp = torch.where(token_mask, comp, DEAD)
        self.history[:B, start_pos : start_pos + S] = comp
        pos = torch.arange(start_pos, start_pos + S).expand(B, S)
        blocked = torch.zeros(B, S, dtype=torch.bool)
        tokens = []
        for shift in range(self.max_ngram):
            src = self.history[:B].gather(1, (pos - shift).clamp_min(0))
            # cumulative: once the look-back hits the start or a DEAD token, every longer shift pads too
            blocked = blocked | (pos < shift) | (src == DEAD)
            tokens.append(torch.where(blocked, self.pad, src))
        products = torch.stack(tokens, -1).unsqueeze(2) * self.multipliers  # [B, S, nL, max_ngram]
        rolling, out = products[..., 0], []
        for n in range(1, self.max_ngram):
            rolling = rolling ^ products[..., n]  # hash of the (n+1)-gram
            out.append(torch.remainder(rolling.unsqueeze(-1), self.primes[:, n - 1]))
        return torch.cat(out, dim=-1) + self.offsets


# ------------------------------------------------------------------------------------------ table
def _take_rows(table, rows: torch.Tensor) -> torch.Tensor:
    if isinstance(table, torch.Tensor):
        return torch.index_select(table, 0, rows)  # reads only these rows of a mapped file
    return table[rows]  # any row source with fancy indexing along dim 0


def gather_rows(weight, scale, rows: torch.Tensor, num: Numerics) -> torch.Tensor:
    """Dequantised table rows for hash ids `rows` (any shape) -> [*rows.shape, head_dim] in num.act.

    weight [R, hd] E4M3 and scale [R, hd/block] E8M0 are read only at the distinct requested rows.
    official: fp32 `fp8 * scale` rounded to bf16; exact: the same product in float64 (no rounding).
    """
    n_rows, head_dim = weight.shape
    block = head_dim // scale.shape[1]
    flat = rows.reshape(-1).long()
    uniq, inverse = torch.unique(flat, return_inverse=True)
    if uniq.numel() and (int(uniq[0]) < 0 or int(uniq[-1]) >= n_rows):
        raise IndexError(f"engram hash ids outside the table's {n_rows} rows")
    w = _take_rows(weight, uniq).to(num.acc)
    s = formats.scale_to_float(_take_rows(scale, uniq)).to(num.acc)
    values = (w.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(num.act)
    return values[inverse].reshape(*rows.shape, head_dim)


# ------------------------------------------------------------------------------------------ layer
def prepare_engram_params(
    raw: Mapping[str, torch.Tensor], cfg: ModelConfig, num: Numerics, layer_id: int
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (full names) -> `Engram` params: table left raw (mappable), wkv dequantised."""
    from deepinfer.reference.params import dequant_weight

    p = f"layers.{layer_id}.engram."
    return {
        "embed.weight": raw[p + "embed.weight"],
        "embed.scale": raw[p + "embed.scale"],
        "wkv.weight": dequant_weight(p + "wkv.weight", raw[p + "wkv.weight"], raw.get(p + "wkv.scale"), cfg).to(
            num.acc
        ),
        "q_weight": raw[p + "q_weight"].to(num.acc),
        "k_weight": raw[p + "k_weight"].to(num.acc),
    }


class Engram:
    """The engram update of one layer: X [B, S, hc, D] -> X with a gated table readout added per stream."""

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: ModelConfig, num: Numerics, layer_id: int) -> None:
        self.num, self.layer_id = num, layer_id
        self.index = tuple(cfg.engram_layer_ids).index(layer_id)
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.table, self.table_scale = params["embed.weight"], params["embed.scale"]
        rows, head_dim = self.table.shape
        if head_dim != cfg.engram_head_dim or self.table_scale.shape[0] != rows or head_dim % self.table_scale.shape[1]:
            raise ValueError(f"layer {layer_id}: engram table {tuple(self.table.shape)} / scale "
                             f"{tuple(self.table_scale.shape)} do not fit head_dim {cfg.engram_head_dim}")
        if cfg.engram_num_embeddings and rows != cfg.engram_num_embeddings[self.index]:
            raise ValueError(f"layer {layer_id}: engram table has {rows} rows, config says "
                             f"{cfg.engram_num_embeddings[self.index]}")
        self.wkv = params["wkv.weight"]
        expected = ((self.hc + 1) * self.dim, self.cols * head_dim)
        if tuple(self.wkv.shape) != expected:
            raise ValueError(f"layer {layer_id}: engram wkv is {tuple(self.wkv.shape)}, expected {expected}")
        # the official code only ever uses the product, formed in fp32
        self.wgt = params["q_weight"].to(num.acc) * params["k_weight"].to(num.acc)  # [hc, D]

    def __call__(self, x: torch.Tensor, hashes: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,S,hc,D]; hashes [B,S,cols] (or the hasher's [B,S,nL,cols]); token_mask [B,S], False = no update."""
        num = self.num
        if hashes.dim() == 4:
            hashes = hashes[:, :, self.index]
        emb = gather_rows(self.table, self.table_scale, hashes, num)  # [B, S, cols, hd]
        kv = num.qlinear(emb.flatten(-2), self.wkv)  # FP8 linear: act_quant per 32, bf16 out
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.to(num.acc).unflatten(-1, (self.hc, self.dim))
        h = x.to(num.acc)
        # normalised per (token, stream) over D, not jointly over the streams
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * self.wgt * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        return num.round(h + gate.unsqueeze(-1) * value.to(num.acc).unsqueeze(-2))


__all__ = [
    "DEAD", "GATE_CLAMP", "is_prime", "next_prime", "engram_primes", "hash_multipliers", "NgramHasher",
    "gather_rows", "prepare_engram_params", "Engram",
]
