"""Packed byte layouts of cached KV entries: what one token's (or one compressed entry's) key occupies.

Owns: `KVLayout` (a frozen description of one packed layout: byte width and the `store`/`load` codecs),
the registry of named layouts (`LAYOUTS`, `get_layout`), the family's bit-exact choice per cache role
(`layouts_for`) and the packed/reference bytes-per-token arithmetic of spec §4.2 / §10.9.
Must not: know where entries live (block tables, rings, paging are `cache/` storage's job) or compute
any model math. Pure torch, vectorised, device-agnostic (the same code runs on CPU and CUDA).

Contract: the oracle (reference/) holds every cached value as bf16 that has ALREADY been fake-quantised
(FP8/FP4 round trip). The engine must store exactly those values, so for the exact layouts
* `load(store(raw)) == oracle_fake_quant(raw)` bit for bit (store does the official kernel's quantisation:
  from the bf16 values upcast to fp32, pow2 scales by the exponent-bit trick, E4M3/E2M1 RNE), and
* `load(store(fq)) == fq` bit for bit when `fq` is already the oracle's value (wherever the oracle's
  fake-quant is itself idempotent, which is everywhere except FP4 with a *subnormal* E4M3 scale,
  i.e. V4.1 latent blocks with amax below ~0.09 -- see tests; the engine stores raw values once, so
  it never re-quantises a stored value).
Range: E8M0 layouts cover every finite bf16. The E4M3-scale layout (v41_latent_fp4) inherits
formats.fp4_act_quant_e4m3_scale's limit: a block amax above 6*448 = 2688 casts its scale to E4M3 NaN
(and the NaN byte differs between torch's CPU and CUDA casts); real latents are RMS-normed, far below.
Any re-quantisation with other blocks/scales (the seed's SM90 layouts below) is a noise source of
~3% per entry: it is here only to measure that.

Entry byte order: [quantised values | rope channels as raw bf16 | scales | zero padding].

| layout                 | real dims (512/64/128)                       | B/entry | exact | used for            |
|------------------------|----------------------------------------------|---------|-------|---------------------|
| v4_fp8_ds_mla          | 448 E4M3 + 64 bf16 rope (128) + 7 E8M0 + 1 pad | 584   | yes   | V4 window+compressed|
| v4_index_fp4           | 128 E2M1 (64) + 4 E8M0 per 32                 | 68      | yes   | V4 indexer keys     |
| v41_window_fp8         | 512 E4M3 + 16 E8M0 per 32                     | 528     | yes   | V4.1 window ring    |
| v41_latent_fp4         | 512 E2M1 (256) + 32 E4M3 scales per 16        | 288     | yes   | V4.1 latent         |
| v41_index_fp4          | as v4_index_fp4                               | 68      | yes   | V4.1 index keys     |
| bf16                   | 512 x 2                                       | 1024    | yes   | V4 `initial` revision (its FP8 fake-quant is a no-op) |
| seed_fp8_per128        | 512 E4M3 + 4 fp32 scales (amax/448) per 128   | 528     | NO    | seed SM90, comparison |
| seed_index_fp8_per128  | 128 E4M3 + 1 fp32 scale                       | 132     | NO    | seed SM90, comparison |

Bytes per token of the compressed caches (window rings are a fixed 128 entries per layer on top):
V4-Flash reference bf16 = 21*(1024+256)/4 + 20*1024/128 = 6 880 B; packed 21*(584+68)/4 + 20*584/128
= 3 514.25 B (spec §4.2). V4.1-Flash reference 3*1280/2 + 1280 = 3 200 B; packed 3*(288+68)/2 + 356 = 890 B
(spec §10.9). `compressed_bytes_per_token(cfg, packed)` recomputes these from a config.

Padding choice: only v4_fp8_ds_mla is padded, to a multiple of 8 bytes (real: 583 -> 584, the one pad
byte vLLM's fp8_ds_mla also has after its 7 scales; tiny 192/64: 192+128+3 = 323 -> 328), so an entry
stays 8-byte aligned in a contiguous pool. The others are unpadded because their documented widths
(68/528/288/132) are what the kernels address.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer import formats

_CODECS = ("fp8_e8m0", "fp4_e8m0", "fp4_e4m3", "fp8_fp32", "bf16")
_SEED_AMAX_FLOOR = 1e-4  # keeps all-zero blocks NaN-free in the seed codec (amax/448 would be 0)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _e8m0_bytes(pow2: torch.Tensor) -> torch.Tensor:
    """fp32 normal powers of two -> E8M0 bytes. The biased fp32 exponent IS the E8M0 byte; reading it
    directly avoids formats.float_to_e8m0's validity checks, which would sync a GPU stream."""
    return ((pow2.to(torch.float32).view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


@dataclass(frozen=True)
class KVLayout:
    """One packed entry layout. `dim` channels in; the last `rope_dim` of them are kept as raw bf16.

    bytes_per_token = round_up(value_bytes + 2*rope_dim + n_scales*scale_size, align), where
    value_bytes = quant_dim (FP8) or quant_dim/2 (FP4), n_scales = quant_dim/block, scale_size = 1
    (E8M0/E4M3) or 4 (fp32), quant_dim = dim - rope_dim.
    """

    name: str
    dim: int
    codec: str
    block: int = 1
    rope_dim: int = 0
    align: int = 1
    exact: bool = True  # load(store(raw)) equals the oracle's cached value bit for bit

    def __post_init__(self) -> None:
        if self.codec not in _CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; known: {_CODECS}")
        if self.codec != "bf16" and (self.quant_dim <= 0 or self.quant_dim % self.block):
            raise ValueError(f"{self.name}: {self.quant_dim} quantised channels not a multiple of {self.block}")

    @property
    def quant_dim(self) -> int:
        return 0 if self.codec == "bf16" else self.dim - self.rope_dim

    @property
    def raw_dim(self) -> int:
        """Channels stored as raw bf16 (the rope tail, or everything for the bf16 layout)."""
        return self.dim - self.quant_dim

    @property
    def n_scales(self) -> int:
        return self.quant_dim // self.block if self.quant_dim else 0

    @property
    def value_bytes(self) -> int:
        return self.quant_dim // 2 if self.codec.startswith("fp4") else self.quant_dim

    @property
    def scale_bytes(self) -> int:
        return self.n_scales * (4 if self.codec == "fp8_fp32" else 1)

    @property
    def bytes_per_token(self) -> int:
        return _round_up(self.value_bytes + 2 * self.raw_dim + self.scale_bytes, self.align)

    # ------------------------------------------------------------------ codecs
    def store(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] float -> uint8 [..., bytes_per_token] (same device).

        The input is rounded to bf16 first: the oracle's cached values are bf16 before they are
        fake-quantised, and quantising from fp32 would pick different codes near rounding ties."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: expected last dimension {self.dim}, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x = x.to(torch.bfloat16).reshape(-1, self.dim)
        parts = []
        if self.quant_dim:
            values, scales = self._encode(x[:, : self.quant_dim])
            parts.append(values)
        if self.raw_dim:
            parts.append(x[:, self.quant_dim :].contiguous().view(torch.uint8))
        if self.quant_dim:
            parts.append(scales)
        pad = self.bytes_per_token - sum(p.shape[-1] for p in parts)
        if pad:
            parts.append(torch.zeros(x.shape[0], pad, dtype=torch.uint8, device=x.device))
        return torch.cat(parts, dim=-1).reshape(*lead, self.bytes_per_token)

    def load(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 [..., bytes_per_token] -> bf16 [..., dim], the value the oracle holds in its cache."""
        if packed.dtype != torch.uint8 or packed.shape[-1] != self.bytes_per_token:
            raise ValueError(f"{self.name}: expected uint8 [..., {self.bytes_per_token}], "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        lead = packed.shape[:-1]
        p = packed.reshape(-1, self.bytes_per_token)
        v_end = self.value_bytes
        r_end = v_end + 2 * self.raw_dim
        parts = []
        if self.quant_dim:
            parts.append(self._decode(p[:, :v_end], p[:, r_end : r_end + self.scale_bytes]))
        if self.raw_dim:
            parts.append(p[:, v_end:r_end].contiguous().view(torch.bfloat16))
        return torch.cat(parts, dim=-1).reshape(*lead, self.dim)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 [N, quant_dim] -> (value bytes [N, value_bytes], scale bytes [N, scale_bytes])."""
        if self.codec == "fp8_e8m0":  # official act_quant(x, block, ue8m0), as the oracle's kv_fp8
            q, s = formats.act_quant(x, self.block)
            return q.view(torch.uint8), _e8m0_bytes(s)
        if self.codec == "fp4_e8m0":  # official fp4_act_quant(x, 32): pow2 scale, E2M1 RNE
            codes, s = formats.fp4_act_quant(x, self.block)
            return formats.pack_fp4(codes).view(torch.uint8), _e8m0_bytes(s)
        if self.codec == "fp4_e4m3":  # V4.1: scale = E4M3(amax/6) -- exact E4M3 values, so the cast is lossless
            codes, s = formats.fp4_act_quant_e4m3_scale(x, self.block)
            return formats.pack_fp4(codes).view(torch.uint8), s.to(torch.float8_e4m3fn).view(torch.uint8)
        # fp8_fp32 (seed SM90): one fp32 scale amax/448 per block, NOT a power of two
        xb = x.to(torch.float32).unflatten(-1, (-1, self.block))
        s = xb.abs().amax(dim=-1, keepdim=True).clamp(min=_SEED_AMAX_FLOOR) / formats.FP8_MAX
        q = (xb / s).clamp(-formats.FP8_MAX, formats.FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
        return q.view(torch.uint8), s.squeeze(-1).contiguous().view(torch.uint8)

    def _decode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The same fp32 products and final bf16 rounding as formats.*_fake_quant, hence bit-exact."""
        values, scales = values.contiguous(), scales.contiguous()
        if self.codec in ("fp8_e8m0", "fp8_fp32"):
            v = values.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            v = formats.fp4_codes_to_float(formats.unpack_fp4(values))
        if self.codec.endswith("e8m0"):  # raw E8M0 bytes -> 2**(b-127); never reinterpret them as fp32
            s = formats.e8m0_to_float(scales)
        elif self.codec == "fp4_e4m3":
            s = scales.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            s = scales.view(torch.float32)
        return (v.unflatten(-1, (-1, self.block)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- registry
V4_KV_BLOCK, V41_KV_BLOCK, INDEX_BLOCK, LATENT_BLOCK, SEED_BLOCK = 64, 32, 32, 16, 128

# name -> factory(head_dim, rope_dim, index_dim). Blocks are fixed by the layout name (the kernels' constants).
LAYOUTS: dict[str, Callable[[int, int, int], KVLayout]] = {
    "v4_fp8_ds_mla": lambda hd, rd, idx: KVLayout("v4_fp8_ds_mla", hd, "fp8_e8m0", V4_KV_BLOCK, rd, align=8),
    "v4_index_fp4": lambda hd, rd, idx: KVLayout("v4_index_fp4", idx, "fp4_e8m0", INDEX_BLOCK),
    "v41_window_fp8": lambda hd, rd, idx: KVLayout("v41_window_fp8", hd, "fp8_e8m0", V41_KV_BLOCK),
    "v41_latent_fp4": lambda hd, rd, idx: KVLayout("v41_latent_fp4", hd, "fp4_e4m3", LATENT_BLOCK),
    "v41_index_fp4": lambda hd, rd, idx: KVLayout("v41_index_fp4", idx, "fp4_e8m0", INDEX_BLOCK),
    "bf16": lambda hd, rd, idx: KVLayout("bf16", hd, "bf16"),
    "bf16_index": lambda hd, rd, idx: KVLayout("bf16_index", idx, "bf16"),
    "seed_fp8_per128": lambda hd, rd, idx: KVLayout("seed_fp8_per128", hd, "fp8_fp32", SEED_BLOCK, exact=False),
    "seed_index_fp8_per128": lambda hd, rd, idx: KVLayout(
        "seed_index_fp8_per128", idx, "fp8_fp32", SEED_BLOCK, exact=False),
}


def get_layout(name: str, cfg: Any) -> KVLayout:
    """Layout `name` for a config (anything with head_dim, rope_head_dim, index_head_dim)."""
    if name not in LAYOUTS:
        raise KeyError(f"unknown KV layout {name!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[name](cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim)


def layouts_for(cfg: Any, revision: str = "current") -> dict[str, KVLayout]:
    """The bit-exact layout of each cache role of a family.

    v4: window, compressed, index. The `initial` V4-Flash revision's FP8 fake-quant was a no-op (spec
    §4.2, §11), so its window/compressed values are plain bf16 and only the bf16 layout stores them exactly.
    v41: window, latent, index (revision is ignored, as in reference/numerics)."""
    if cfg.family == "v4":
        main = "bf16" if revision == "initial" else "v4_fp8_ds_mla"
        return {"window": get_layout(main, cfg), "compressed": get_layout(main, cfg),
                "index": get_layout("v4_index_fp4", cfg)}
    if cfg.family == "v41":
        return {"window": get_layout("v41_window_fp8", cfg), "latent": get_layout("v41_latent_fp4", cfg),
                "index": get_layout("v41_index_fp4", cfg)}
    raise ValueError(f"no KV layouts for family {cfg.family!r}")


def compressed_bytes_per_token(cfg: Any, packed: bool = True) -> float:
    """Compressed-cache bytes per token over all layers (window rings excluded), spec §4.2 / §10.9.

    packed=False gives the reference's bf16 storage of the same entries."""
    roles = layouts_for(cfg)
    main_l = roles["compressed"] if cfg.family == "v4" else roles["latent"]
    main = main_l.bytes_per_token if packed else 2 * main_l.dim
    index = roles["index"].bytes_per_token if packed else 2 * roles["index"].dim
    if cfg.family == "v4":  # every compressed layer owns its entries; r=4 layers also own indexer keys
        layers = [(cfg.compress_ratios[l], cfg.has_indexer(l)) for l in range(cfg.n_layers)]
    else:  # V4.1: only the kv source layers own a latent cache and its index keys (spec §10.9)
        layers = [(cfg.compress_ratios[l], True) for l in cfg.kv_source_layers]
    return sum((main + (index if has_index else 0)) / r for r, has_index in layers if r)
