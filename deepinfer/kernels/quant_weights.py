"""Quantised weight containers for the GPU kernels, and their torch twins (the ops' reference math).

Owns:
* `QuantLinearWeight`: one FP8 E4M3 linear weight [N, K] with its 2-D block scales (decoded to fp32), the
  weight block edge (128 in V4, 32 in V4.1) and the activation quantisation block used before the GEMM.
* `FP4ExpertBank`: every routed expert of one MoE layer, stacked and still packed in FP4 E2M1 (half the bytes
  of FP8): `w13` = gate (w1) rows then up (w3) rows, `w2` the down projection; per-32 E8M0 scales as raw
  uint8 bytes (value 2**(byte-127); a quarter of the bytes of fp32 scales, decoded inside the kernels), each
  scale row starting on a 16-byte boundary (`sixteen_byte_rows`: the TMA kernel's tensor maps).
* `fp8_linear_torch` / `fp4_moe_torch`: the torch twins of ops "fp8_linear" / "fp4_moe". They compute with
  the exact dequantised weights, like `kernels.official.qlinear` and `model/moe.py::_forward_official`, so
  on CPU they are bit-identical to the engine's official numerics; the Triton kernels are tested against
  them (differences are fp32 summation order only).

Must not: import triton, know tensor names beyond one layer's expert/linear suffixes, or hold per-batch state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.kernels import official
from deepinfer.kernels.bf16_gemm import grouped_proj_bf16_torch

_FP4_STORAGE = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
_E8M0_STORAGE = (torch.float8_e8m0fnu, torch.uint8)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# FP8 linear weights
# ----------------------------------------------------------------------------------------------
@dataclass
class QuantLinearWeight:
    """FP8 E4M3 weight [N, K] with fp32 block scales [ceil(N/block), ceil(K/block)] (E8M0 values decoded)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: int
    act_block: int
    _dequantised: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _scale_exponent_max: int | None = field(default=None, init=False, repr=False, compare=False)
    # the serial split-K's per-tile counters of the decode linear (fp8_gemm.serial_counters): made once, never
    # replaced, since a captured CUDA graph keeps their address
    _split_counters: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2:
            raise ValueError(f"QuantLinearWeight.data must be a 2-D float8_e4m3fn tensor, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")
        if self.scale.dtype != torch.float32:
            raise ValueError(f"QuantLinearWeight.scale must hold decoded fp32 scales, got {self.scale.dtype}")
        n, k = self.data.shape
        expected = (_ceil_div(n, self.block), _ceil_div(k, self.block))
        if tuple(self.scale.shape) != expected:
            raise ValueError(f"QuantLinearWeight.scale shape {tuple(self.scale.shape)} does not match weight "
                             f"[{n}, {k}] with {self.block}x{self.block} blocks: expected {expected}")
        if k % self.act_block:
            raise ValueError(f"QuantLinearWeight in_features {k} is not a multiple of act_block {self.act_block}")
        if self.scale.device != self.data.device:
            raise ValueError(f"QuantLinearWeight data on {self.data.device} but scale on {self.scale.device}")

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, scale: torch.Tensor, cfg: ModelConfig) -> "QuantLinearWeight":
        """From the stored tensors: E4M3 weight and its E8M0 (float8_e8m0fnu or uint8) block scale."""
        if scale.dtype not in _E8M0_STORAGE:
            raise ValueError(f"checkpoint FP8 block scales must be E8M0, got {scale.dtype}")
        return cls(weight.contiguous(), formats.e8m0_to_float(scale).contiguous(), cfg.weight_block, cfg.act_block)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    def to(self, device: torch.device | str) -> "QuantLinearWeight":
        return QuantLinearWeight(self.data.to(device), self.scale.to(device), self.block, self.act_block)

    def scale_exponent_max(self) -> int:
        """`fp8_scale_exponent_max(self.scale)`, cached (one host sync per weight, like `dequant`): kernels whose
        exact expansion has a range (kernels/cuda/fp8_linear_mma) check it without a sync inside a step."""
        if self._scale_exponent_max is None:
            self._scale_exponent_max = fp8_scale_exponent_max(self.scale)
        return self._scale_exponent_max

    def dequant(self) -> torch.Tensor:
        """The exact fp32 weight (E4M3 x pow2 scale), cached: the twin's operand."""
        if self._dequantised is None:
            self._dequantised = formats.dequant_fp8_blocks(self.data, self.scale, self.block)
        return self._dequantised


# The CUDA kernels' exact E4M3 -> bf16 expansion (kernels/cuda/fp8_linear_mma.cu, fp8_linear_wgmma.cu): the
# codes as bf16 bit patterns E4M3 x 2^-120 times one bf16 2^120 x scale, which must be a finite bf16
E4M3_EXPANSION_EXP_MAX = 134  # fp32 exponent field of the largest such scale (2^7)


def check_e4m3_expansion(w: "QuantLinearWeight", who: str, scale_max_exp: int | None = None) -> None:
    """ValueError (naming `who`) unless the weight's scales are powers of two up to 2^7 (`scale_max_exp`: the
    exponent field if the caller knows it, else the weight's cached `scale_exponent_max`, one host sync)."""
    exp = w.scale_exponent_max() if scale_max_exp is None else scale_max_exp
    if exp > E4M3_EXPANSION_EXP_MAX:
        raise ValueError(f"{who}: the E4M3 expansion is exact for weight scales up to 2^7 (fp32 exponent field "
                         f"{E4M3_EXPANSION_EXP_MAX}); this weight has a scale 2^{exp - 127}")


def e4m3_expansion_exact(w: "QuantLinearWeight") -> bool:
    """`check_e4m3_expansion` as a yes / no (scales not powers of two: no)."""
    try:
        check_e4m3_expansion(w, "")
    except ValueError:
        return False
    return True


def fp8_scale_exponent_max(scale: torch.Tensor) -> int:
    """The largest fp32 exponent field of decoded FP8 block scales (one host sync). ValueError if a scale is
    not a non-negative power of two (what E8M0 decodes to; 0 allowed)."""
    if scale.numel() == 0:
        return 0
    mant, e = torch.frexp(scale.float())
    if not bool(((mant == 0.5) | (scale == 0)).all()):
        raise ValueError("FP8 weight scales must be non-negative powers of two (decoded E8M0)")
    return max(int(e.max()) - 1 + 127, 0)  # 2^p has exponent field p + 127 (0: subnormal)


def fp8_linear_torch(x: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Twin of op "fp8_linear": official act_quant of x (pow2 scale per w.act_block) then the FP8 block-scaled
    GEMM with fp32 accumulation, bf16 out. x bf16 [M, K] -> bf16 [M, N]."""
    _check_activation("fp8_linear", x, w.in_features)
    return official.qlinear(x, w.dequant(), w.act_block)


def check_grouped_proj_fp8(o: torch.Tensor, w: QuantLinearWeight) -> int:
    """R, the rows of wo_a per group, after checking o bf16 [T, G, d] against w [G * R, d] (ValueError naming
    what does not fit)."""
    if not isinstance(w, QuantLinearWeight):
        raise ValueError(f"grouped_proj_fp8: the weight must be a QuantLinearWeight, got {type(w).__name__}")
    if o.dtype != torch.bfloat16 or o.dim() != 3:
        raise ValueError(f"grouped_proj_fp8: o must be bf16 [T, G, d], got {o.dtype} {tuple(o.shape)}")
    T, G, d = o.shape
    if w.in_features != d or G == 0 or w.out_features % G:
        raise ValueError(f"grouped_proj_fp8: o {tuple(o.shape)} does not fit the weight [{w.out_features}, "
                         f"{w.in_features}] (want [G * R, d] with G = {G}, d = {d})")
    if o.device != w.data.device:
        raise ValueError(f"grouped_proj_fp8: o on {o.device}, the weight on {w.data.device}")
    return w.out_features // G


def grouped_proj_fp8_torch(o: torch.Tensor, w: QuantLinearWeight) -> torch.Tensor:
    """Twin of op "grouped_proj_fp8": the official grouped output LoRA `einsum("tgd,grd->tgr", o, wo_a)` on
    bf16 operands, with wo_a held as its checkpoint FP8 bytes + block scales instead of convert.py's bf16
    dequantisation. The bf16 weight is convert.py's `bf16(fp32(E4M3) x scale)` (exact: 4 significant bits x
    a power of two), the products of bf16 values are exact in fp32, summed in fp32, one bf16 rounding:
    `bf16_gemm.grouped_proj_bf16_torch` on those values. o bf16 [T, G, d], w [G * R, d] -> bf16 [T, G, R]."""
    R = check_grouped_proj_fp8(o, w)
    G, d = o.shape[1], o.shape[2]
    return grouped_proj_bf16_torch(o, w.dequant().to(torch.bfloat16).view(G, R, d))


def _check_activation(op: str, x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{op}: x must be bf16 (the official activations), got {x.dtype}")


# ----------------------------------------------------------------------------------------------
# FP4 routed experts
# ----------------------------------------------------------------------------------------------
def _fp4_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in _FP4_STORAGE:
        raise ValueError(f"{name}: routed expert weights must be packed FP4 (int8/uint8/float4_e2m1fn_x2), "
                         f"got {t.dtype}")
    return t.view(torch.uint8)


def _e8m0_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in _E8M0_STORAGE:
        raise ValueError(f"{name}: FP4 expert scales must be E8M0 (float8_e8m0fnu or uint8), got {t.dtype}")
    return t.view(torch.uint8)


SCALE_ROW_ALIGN = 16  # bytes: a TMA tensor map's strides must be multiples of 16


def sixteen_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """t [E, N, C] uint8 -> the same values as a view whose rows start every ceil16(C) bytes (a zero-filled
    [E, N, ceil16(C)] buffer), t itself where its rows already are. Why: the TMA expert kernel reads the
    scales through a tensor map, whose strides must be multiples of 16 bytes; V4.1-Flash's w2 scales are 72
    bytes a row (I = 2304 / 32). Every other kernel takes the row stride as an argument."""
    e, n, c = t.shape
    width = _ceil_div(c, SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN
    if t.stride(2) == 1 and t.stride(1) % SCALE_ROW_ALIGN == 0 and t.stride(0) % SCALE_ROW_ALIGN == 0 \
            and t.data_ptr() % SCALE_ROW_ALIGN == 0:
        return t
    rows = torch.zeros((e, n, width), dtype=t.dtype, device=t.device)
    rows[:, :, :c] = t
    return rows[:, :, :c]


def _stored(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind a `sixteen_byte_rows` view (its padding included), t itself otherwise."""
    if t.dim() == 3 and t.stride(2) == 1 and t.stride(1) > t.shape[2] and t.numel():
        return t.as_strided((t.shape[0], t.shape[1], t.stride(1)), t.stride())
    return t


@dataclass
class FP4ExpertBank:
    """All routed experts of one layer, packed FP4 (two E2M1 codes per byte, low nibble = even K index).

    w13 uint8 [E, 2I, D/2] (rows 0..I-1 gate = w1, rows I..2I-1 up = w3), w13_scale uint8 E8M0 [E, 2I, D/32];
    w2 uint8 [E, D, I/2], w2_scale uint8 E8M0 [E, D, I/32]. act_block: activation quantisation block
    before each expert GEMM (128 in V4, 32 in V4.1). The scales are kept as `sixteen_byte_rows` views (a
    copy at construction only where a row is not already 16-byte strided: V4.1's w2, 72 bytes a row).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    act_block: int
    # the layer's whole expert count when this bank is one expert-parallel shard (0: this bank's own count):
    # the Triton op picks its tiles and split-K from the routing density over it, so a shard's call runs the
    # same launch plan, and gives the same bits, as the whole bank's
    tile_experts: int = 0
    # the largest E8M0 scale byte (None: read from the scales here, at load time), so kernels whose exact
    # expansion has a range (fp4_moe expand 6: bytes <= 128) can check it without a host sync inside a step;
    # `to` carries it over instead of reading the scales again
    scale_max: int | None = None

    def __post_init__(self) -> None:
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            t = getattr(self, name)
            if t.dtype != torch.uint8 or t.dim() != 3:
                raise ValueError(f"FP4ExpertBank.{name} must be a 3-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        e, two_i, half_d = self.w13.shape
        d, inter = half_d * 2, two_i // 2
        expected = {"w13_scale": (e, two_i, d // formats.FP4_BLOCK), "w2": (e, d, inter // 2),
                    "w2_scale": (e, d, inter // formats.FP4_BLOCK)}
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"FP4ExpertBank.{name} shape {tuple(getattr(self, name).shape)} != {shape} "
                                 f"(from w13 {tuple(self.w13.shape)}: E={e}, I={inter}, D={d})")
        if two_i % 2 or d % formats.FP4_BLOCK or inter % formats.FP4_BLOCK:
            raise ValueError(f"FP4ExpertBank dims must be multiples of {formats.FP4_BLOCK}: D={d}, I={inter}")
        if d % self.act_block or inter % self.act_block:
            raise ValueError(f"FP4ExpertBank dims D={d}, I={inter} must be multiples of act_block {self.act_block}")
        self.w13_scale, self.w2_scale = sixteen_byte_rows(self.w13_scale), sixteen_byte_rows(self.w2_scale)
        if self.scale_max is None:
            self.scale_max = max([int(t.max()) for t in (self.w13_scale, self.w2_scale) if t.numel()] or [0])

    @classmethod
    def from_checkpoint(cls, raw: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig,
                        experts: range | None = None) -> "FP4ExpertBank":
        """Stack `{prefix}experts.{e}.{w1,w3,w2}.{weight,scale}` for e in `experts` (default: all
        cfg.n_routed_experts), at bank index e - experts.start (expert parallelism: one rank's shard).
        `prefix` is the MoE module's name with its dot, e.g. "layers.3.ffn."."""
        w13, w13_s, w2, w2_s = [], [], [], []
        for e in range(cfg.n_routed_experts) if experts is None else experts:
            def get(part: str) -> torch.Tensor:
                name = f"{prefix}experts.{e}.{part}"
                if name not in raw:
                    raise KeyError(f"FP4ExpertBank.from_checkpoint: missing {name!r}")
                return raw[name]

            w13.append(torch.cat([_fp4_bytes(get("w1.weight"), "w1"), _fp4_bytes(get("w3.weight"), "w3")]))
            w13_s.append(torch.cat([_e8m0_bytes(get("w1.scale"), "w1.scale"), _e8m0_bytes(get("w3.scale"), "w3.scale")]))
            w2.append(_fp4_bytes(get("w2.weight"), "w2"))
            w2_s.append(_e8m0_bytes(get("w2.scale"), "w2.scale"))
        return cls(torch.stack(w13), torch.stack(w13_s), torch.stack(w2), torch.stack(w2_s), cfg.act_block,
                   cfg.n_routed_experts if experts is not None else 0)

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def plan_experts(self) -> int:
        """The expert count launch plans are made for (`tile_experts`, else this bank's)."""
        return self.tile_experts or self.n_experts

    @property
    def dim(self) -> int:
        return self.w13.shape[2] * 2

    @property
    def inter_dim(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def stored(self) -> tuple[torch.Tensor, ...]:
        """The tensors as stored, the scales' row padding included (memory accounting)."""
        return self.w13, _stored(self.w13_scale), self.w2, _stored(self.w2_scale)

    def to(self, device: torch.device | str) -> "FP4ExpertBank":
        """The bank on `device`; padded scale rows move with their padding (no second copy there)."""
        def scales(t: torch.Tensor) -> torch.Tensor:
            return _stored(t).to(device)[:, :, : t.shape[2]]

        return FP4ExpertBank(self.w13.to(device), scales(self.w13_scale), self.w2.to(device),
                             scales(self.w2_scale), self.act_block, self.tile_experts, self.scale_max)

    def dequant_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exact fp32 (w1 [I, D], w3 [I, D], w2 [D, I]) of expert e."""
        w13 = formats.dequant_fp4(self.w13[e], self.w13_scale[e])
        return w13[: self.inter_dim], w13[self.inter_dim:], formats.dequant_fp4(self.w2[e], self.w2_scale[e])


@dataclass(frozen=True)
class PreRouted:
    """Routing an `fp4_moe` call gets ready-made (op "moe_route" on CUDA makes it in the gate's launch):
    `align_by_expert(topk_ids, E, block_m)`'s outputs sorted_slots int32 [n_blocks * block_m] and
    block_expert int32 [n_blocks] for the call's topk_ids, and xa = act_quant_dequant_bf16(x, act_block)
    (bf16 [T, D], q * s exactly). The op's forms that route in blocks of block_m with bf16 activations use
    them instead of making them again; the others, and the twins, ignore them (same results either way)."""

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    xa: torch.Tensor
    act_block: int


def check_routing(op: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  bank: FP4ExpertBank) -> None:
    """Shape/dtype checks shared by the twin and the Triton op (ids are range-checked by the twin only:
    a device-side check would force a host sync)."""
    _check_activation(op, x, bank.dim)
    t = x.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: topk_ids must be int32/int64 [{t}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or topk_weights.dtype != torch.float32:
        raise ValueError(f"{op}: topk_weights must be fp32 {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")


def check_shared(op: str, x: torch.Tensor, shared: torch.Tensor) -> None:
    """The shared expert's rows of an fp4_moe_shared call: bf16, contiguous, x's shape and device."""
    if (shared.shape != x.shape or shared.dtype != torch.bfloat16 or shared.device != x.device
            or not shared.is_contiguous()):
        raise ValueError(f"{op}: shared must be bf16, contiguous, {tuple(x.shape)} on {x.device} like x, got "
                         f"{shared.dtype} {tuple(shared.shape)} on {shared.device}"
                         f"{'' if shared.is_contiguous() else ' (not contiguous)'}")


def fp4_moe_shared_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: FP4ExpertBank,
                         swiglu_limit: float, shared: torch.Tensor, ready=None,
                         routed: PreRouted | None = None) -> torch.Tensor:
    """Twin of op "fp4_moe_shared": the routed experts' fp32 sum (`fp4_moe_torch`), the shared expert's bf16
    rows added last (upcast inside the add: exact), rounded to bf16 once: `V4MoE._forward_fast`'s steps.
    ready: called once before `shared` is read (the caller's stream join). routed: ignored (a `PreRouted`
    only saves the CUDA op work; its contents are what this twin computes anyway)."""
    if ready is not None:
        ready()
    check_shared("fp4_moe_shared", x, shared)
    return fp4_moe_torch(x, topk_ids, topk_weights, bank, swiglu_limit).add_(shared).to(torch.bfloat16)


def fp4_moe_torch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, bank: FP4ExpertBank,
                  swiglu_limit: float) -> torch.Tensor:
    """Twin of op "fp4_moe": the routed experts of `_forward_official`, fp32 [T, D] (the caller adds the
    shared expert and rounds to bf16). Per expert in ascending id order: gate/up = qlinear(x) -> bf16;
    fp32 clamp (limit > 0), silu(gate) * up * routing weight; down = qlinear(bf16(h)) -> bf16; y += down."""
    check_routing("fp4_moe", x, topk_ids, topk_weights, bank)
    if bool(((topk_ids < 0) | (topk_ids >= bank.n_experts)).any()):
        raise ValueError(f"fp4_moe: topk_ids outside [0, {bank.n_experts})")
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in sorted(set(topk_ids.flatten().tolist())):
        rows, slot = torch.where(topk_ids == e)
        w1, w3, w2 = bank.dequant_expert(e)
        xe = x[rows]
        gate = official.qlinear(xe, w1, bank.act_block).to(torch.float32)
        up = official.qlinear(xe, w3, bank.act_block).to(torch.float32)
        if swiglu_limit > 0:
            up = up.clamp(-swiglu_limit, swiglu_limit)
            gate = gate.clamp(max=swiglu_limit)
        h = topk_weights[rows, slot, None] * (F.silu(gate) * up)
        y[rows] += official.qlinear(h.to(torch.bfloat16), w2, bank.act_block).to(torch.float32)
    return y
