"""Engram of the V4.1 engine (spec §10.5): compressed vocabulary, n-gram hashing with per-slot history,
table row gather and the gated residual update, over a flat varlen batch.

Owns: the engine's own copy of the hashing math (primes, offsets, odd PCG64 multipliers over the
compressed vocabulary), `EngramHistory` (the last max_ngram-1 compressed ids of every state slot, so a
sequence's n-grams reach across calls of any length; DEAD after a reset) and `EngramLayer` (exact
numerics: float64, no FP8 rounding of activations; official numerics: table rows dequantised in fp32 and
rounded to bf16, wkv an FP8 linear with activation quantisation per cfg.act_block, gate in fp32, the
updated residual rounded to bf16; fast numerics: the same with wkv kept FP8 as a `QuantLinearWeight` run by
the `fp8_linear` op of its device).
Devices: the hashes are computed on the host (from the host token ids) and the TABLES STAY ON THE HOST,
memory-mapped by the loader (`weights/loader.py`): a step gathers its unique rows there (FP8 bytes + E8M0
scales, never a dequantised table) and moves only those rows to the model's device, where they are
dequantised. Why: the real V4.1-Flash tables are ~183 GiB, more than one GPU holds beside the model, and a
step reads a few thousand rows (a few MiB moved); placing them on GPUs (row shards per rank, as the
official `ParallelEngramEmbedding`) belongs with parallel serving, which V4.1 fast numerics does not do yet.
Must not: import the reference oracle (tests check this copy against the oracle's hasher).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from deepinfer import formats, kernels
from deepinfer.config import ModelConfig
from deepinfer.devices import host_to_device
from deepinfer.kernels.quant_weights import QuantLinearWeight
from deepinfer.model.context import ForwardContext

DEAD = -1  # history entry that no n-gram reaches across (never written / reset)
GATE_CLAMP = 1e-6
_SENTINEL, _REPLACEMENT_CHAR = "\ue000", "\ufffd"


# ------------------------------------------------------------------------------------------ vocabulary
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])


@lru_cache(maxsize=4)
def _token_map_of_file(path: str) -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer as RustTokenizer

    backend = RustTokenizer.from_file(path)
    norm, keys = _normalizer(), {}
    lookup = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHAR in text:
            key = backend.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return torch.tensor(lookup, dtype=torch.int64), len(keys)


def compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """(token id -> compressed id [vocab] int64, compressed size) for a Tokenizer (has .path) or a path."""
    path = tokenizer.path if hasattr(tokenizer, "path") else tokenizer
    return _token_map_of_file(str(Path(path).resolve()))


# ------------------------------------------------------------------------------------------ layout
def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def primes(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab_size: int) -> torch.Tensor:
    """int64 [n layers, max_ngram-1, heads]: distinct primes, each search restarting at vocab_size-1."""
    used: set[int] = set()
    out = []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            cur, heads = vocab_size - 1, []
            for _ in range(n_heads):
                cur += 1
                while cur in used or not _is_prime(cur):
                    cur += 1
                used.add(cur)
                heads.append(cur)
            per_n.append(heads)
        out.append(per_n)
    return torch.tensor(out, dtype=torch.int64)


def multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_size: int) -> torch.Tensor:
    bound = max(1, (np.iinfo(np.int64).max // compressed_size) // 2)
    rows = [torch.from_numpy(np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,),
                                                                           dtype=np.int64) * 2 + 1)
            for layer in layer_ids]
    return torch.stack(rows)


class EngramHasher:
    """Hash ids [T, n layers, (max_ngram-1)*heads] of a flat batch; history kept per state slot."""

    def __init__(self, cfg: ModelConfig, max_num_seqs: int, token_map: torch.Tensor, compressed_size: int) -> None:
        if compressed_size != cfg.engram_compressed_vocab_size:
            raise ValueError(f"compressed vocabulary has {compressed_size} ids, config says "
                             f"{cfg.engram_compressed_vocab_size}")
        self.layer_ids = tuple(cfg.engram_layer_ids)
        self.n = cfg.engram_max_ngram_size
        self.token_map = token_map
        self.pad = int(token_map[cfg.engram_pad_id])
        self.primes = primes(self.layer_ids, self.n, cfg.engram_n_heads, cfg.engram_vocab_size)
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, dim=1) - flat
        self.mult = multipliers(self.layer_ids, self.n, compressed_size)
        self.history = torch.full((max_num_seqs, self.n - 1), DEAD, dtype=torch.int64)  # last n-1 ids

    def reset(self, slot: int) -> None:
        self.history[slot] = DEAD

    def __call__(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = []
        h = self.n - 1
        for i, s in enumerate(ctx.seqs):
            comp = self.token_map[ids[ctx.rows(i)].long()]  # [S]
            seq = torch.cat([self.history[s.state_slot], comp])  # index k <-> position start_pos - h + k
            self.history[s.state_slot] = seq[-h:]
            # row j: the ids of positions start_pos + j - h .. start_pos + j
            out.append(self._hash(seq.unfold(0, self.n, 1), torch.arange(s.start_pos, s.end_pos)))
        return torch.cat(out)

    def decode_hashes(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`__call__` of a pure-decode batch (one new token per sequence) without its per-sequence loop: ids,
        slots (distinct state slots), positions [B] (host int64) -> hash ids [B, n layers, cols]; the slots'
        histories advance by the token."""
        comp = self.token_map[ids.long()]  # [B]
        seq = torch.cat([self.history[slots], comp.unsqueeze(1)], dim=1)  # [B, n]: column k <-> position p - h + k
        self.history[slots] = seq[:, -(self.n - 1):]
        return self._hash(seq, positions)

    def _hash(self, window: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """window [R, n]: per row the compressed ids of positions p - n + 1 .. p (DEAD where unknown), positions
        [R] = p -> hash ids [R, n layers, cols]: token_s = the id at p - s unless p < s or any id of p - s .. p
        is DEAD (then the pad id); the rolling XOR of token_s * multiplier_s modulo each head's prime, plus the
        column's table offset."""
        h = self.n - 1
        blocked = torch.zeros(window.shape[0], dtype=torch.bool)
        tokens = []
        for shift in range(self.n):
            src = window[:, h - shift]
            blocked = blocked | (positions < shift) | (src == DEAD)
            tokens.append(torch.where(blocked, self.pad, src))
        products = torch.stack(tokens, -1).unsqueeze(1) * self.mult  # [R, nL, n]
        rolling, cols = products[..., 0], []
        for k in range(1, self.n):
            rolling = rolling ^ products[..., k]
            cols.append(torch.remainder(rolling.unsqueeze(-1), self.primes[:, k - 1]))
        return torch.cat(cols, dim=-1) + self.offsets

    def layer_index(self, layer: int) -> int:
        return self.layer_ids.index(layer)


# ------------------------------------------------------------------------------------------ layer
def engram_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, layer: int,
                  dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu",
                  fast: bool = False) -> dict:
    """Checkpoint tensors -> engine engram params: table + scale left as stored on the host, wkv dequantised
    (fast: kept FP8 as a QuantLinearWeight) and the gate weight on `device`."""
    p = f"layers.{layer}.engram."
    w, scale = raw[p + "wkv.weight"], raw.get(p + "wkv.scale")
    if fast:
        if scale is None or w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{p}wkv: fast numerics expects an FP8 E4M3 weight with a block scale, got {w.dtype}")
        wkv = QuantLinearWeight.from_checkpoint(w.to(device), scale.to(device), cfg)
    else:
        wkv = formats.dequant_fp8_blocks(w, scale, cfg.weight_block) if scale is not None else w.to(torch.float32)
        wkv = wkv.to(device, dtype)
    wgt = (raw[p + "q_weight"].to(dtype) * raw[p + "k_weight"].to(dtype)).to(device)
    return {"embed.weight": raw[p + "embed.weight"], "embed.scale": raw[p + "embed.scale"], "wkv.weight": wkv,
            "wgt": wgt}


class EngramLayer:
    """x [T, hc, D] -> x + gate * value, gate per (token, stream) from the table rows the hashes name."""

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: ModelConfig, official: bool = False,
                 comm=None, layer: int | None = None, fast: bool = False) -> None:
        """comm (with `layer`): the table holds this tp rank's rows only (`ParallelConfig.engram_rows`);
        foreign rows read as zero and the tp group sums the looked-up rows (spec §10.5).
        fast: official rounding points, wkv a QuantLinearWeight (`engram_params(..., fast=True)`)."""
        self.p, self.hc, self.dim, self.eps = params, cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.official, self.fast, self.act_block = official or fast, fast, cfg.act_block
        self.device = params["wgt"].device  # the model's device; the table stays where it is (host)
        self.comm = comm
        n = params["embed.weight"].shape[0]
        self.row_start, self.total_rows = 0, n
        if comm is not None:
            self.total_rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
            self.row_start, end = comm.parallel.engram_rows(self.total_rows)
            if end - self.row_start != n:
                raise ValueError(f"engram layer {layer}: table holds {n} rows, this rank owns "
                                 f"[{self.row_start}, {end}) of {self.total_rows}")

    def _check_rows(self, lo: int, hi: int) -> None:
        """IndexError unless hash ids lo..hi (the smallest and largest of a step's) name rows of the table."""
        if lo < 0 or hi >= self.total_rows:
            raise IndexError(f"engram hash ids outside the table's {self.total_rows} rows")

    def rows(self, hashes: torch.Tensor) -> torch.Tensor:
        """hashes [T, cols] (host) -> dequantised rows [T, cols, hd] on the model's device."""
        table, scale = self.p["embed.weight"], self.p["embed.scale"]
        n_rows, hd = table.shape
        flat = hashes.reshape(-1).long().to(table.device)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        if uniq.numel():  # (sorted: its ends are the extremes)
            self._check_rows(int(uniq[0]), int(uniq[-1]))
        foreign = None
        if self.comm is not None:  # rows of other ranks: read row 0, zeroed below, summed in by their owner
            uniq = uniq - self.row_start
            foreign = (uniq < 0) | (uniq >= n_rows)
            uniq = uniq.masked_fill(foreign, 0)
        # gathered where the table lives, only the step's unique rows move (stored bytes: E4M3 + E8M0), pinned
        # and non-blocking (`host_to_device`: a plain copy from pageable memory would wait for the stream, i.e.
        # for every kernel the step has queued before this layer)
        vals = self.dequant(host_to_device(torch.index_select(table, 0, uniq), self.device),
                            host_to_device(torch.index_select(scale, 0, uniq), self.device))
        if foreign is not None:
            vals = self.comm.engram_sum(vals.masked_fill(host_to_device(foreign, self.device).unsqueeze(-1), 0))
        return vals[host_to_device(inverse, self.device)].reshape(*hashes.shape, hd)

    def stored_rows(self, hashes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hashes [T, cols] (host) -> the table's stored rows they name, (values [T, cols, hd], scale bytes
        [T, cols, hd / 32]), still on the host and one row per hash (no dedup: fixed shapes, for the batched
        decode path's static buffers; `dequant` of them on the device is what `rows` returns). One process only."""
        if self.comm is not None:
            raise NotImplementedError("stored_rows reads a whole table (one process)")
        table, scale = self.p["embed.weight"], self.p["embed.scale"]
        flat = hashes.reshape(-1).long()
        if flat.numel():
            self._check_rows(int(flat.min()), int(flat.max()))
        return (torch.index_select(table, 0, flat).unflatten(0, hashes.shape),
                torch.index_select(scale, 0, flat).unflatten(0, hashes.shape))

    def dequant(self, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Stored table rows (E4M3 values [..., hd], E8M0 scale bytes [..., hd / 32]) on the model's device ->
        their values: official / fast `bf16(fp32 fp8 * scale)`, exact float64."""
        acc = torch.float32 if self.official else torch.float64
        s = formats.scale_to_float(s).to(acc)
        vals = (w.to(acc).unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
        return vals.to(torch.bfloat16) if self.official else vals  # official: fp32 `fp8 * scale` rounded to bf16

    def _official(self, x: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        return self.update_official(x, self.rows(hashes))

    def update_official(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """x [T, hc, D] bf16, emb [T, cols, hd] bf16 (the looked-up rows) -> the updated residual (official /
        fast numerics)."""
        f32 = torch.float32
        if self.fast:
            kv = kernels.get("fp8_linear", self.device.type)(emb.flatten(-2), self.p["wkv.weight"])  # bf16
        else:
            kv = kernels.get("qlinear")(emb.flatten(-2), self.p["wkv.weight"], self.act_block)  # bf16
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.to(f32).unflatten(-1, (self.hc, self.dim))
        h = x.to(f32)
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * self.p["wgt"] * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.to(f32).unsqueeze(-2)).to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        if self.official:
            return self._official(x, hashes)
        emb = self.rows(hashes)  # [T, cols, hd]
        kv = emb.flatten(-2) @ self.p["wkv.weight"].T
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.unflatten(-1, (self.hc, self.dim))
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * self.p["wgt"] * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        return x + gate.unsqueeze(-1) * value.unsqueeze(-2)
