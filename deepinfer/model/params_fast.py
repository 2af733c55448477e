"""Parameters of the V4 engine in fast numerics: the checkpoint's quantised weights kept quantised, on a device.

Owns: turning checkpoint tensors (`weights.load_tensors`, or any in-memory dict of checkpoint-format
tensors, e.g. `tiny.make_tensors`) into what the fast path computes with:
* every FP8 linear (attention wq_a/wq_b/wkv/wo_b, indexer wq_b, shared experts) -> `QuantLinearWeight`
  (E4M3 data + fp32 block scales: the checkpoint's bytes, never a dequantised copy);
* the routed experts of each MoE layer -> one `FP4ExpertBank` under `layers.{i}.ffn.experts` (packed FP4 +
  E8M0 bytes, stacked); with expert parallelism only this rank's shard, at local indices (the MoE maps
  global ids: `model/expert_parallel_fast.py`);
* `attn.wo_a` -> a `QuantLinearWeight` of its checkpoint bytes (the official convert.py dequantises it to
  bf16, exactly, and the official grouped output einsum runs on bf16 operands; op "grouped_proj_fp8" forms
  the same bf16 values inside the kernel, in half the memory); under DEEPINFER_WO_A_FP8=0 that bf16 value
  (op "grouped_proj_bf16"); `model/out_lora.py` picks the op by the form;
* `head.weight` -> the checkpoint's bf16 (official holds it as fp32 of the same values; op "linear_f32"
  multiplies bf16 operands with fp32 accumulation and output: the same math, half the bytes per step);
* the bf16 GEMM weights `BF16_GEMM_WEIGHTS` (compressor wkv/wgate, MoE gate, indexer weights_proj) -> the
  checkpoint's bf16 (the official fp32 copies hold the same values; ops "linear_f32" / "blinear");
* weight pairs that multiply the same activation stacked into one weight, the two names row views of it
  (no copy; `STACKS`): each compressor's wkv / wgate (`compressor.project`), the attention's wq_a / wkv and
  the shared expert's w1 / w3, so a step runs one GEMM for each pair instead of two;
* small tensors as the official numerics hold them: embedding bf16, every other float tensor fp32 (norms,
  hc, sinks, compressor ape, gate bias), `tid2eid` int64.
Memory is about the checkpoint's own size (plus small fp32 tensors).
Both families: V4 (128x128 weight blocks, activations quantised per 128) and V4.1 (32x32 blocks, per 32: the
containers carry cfg.weight_block / cfg.act_block). V4.1's engram tensors are not params here: the model's
EngramLayer takes them from the checkpoint (`model/engram.py::engram_params`, tables left on the host).
Must not: import the reference oracle, or dequantise an FP8/FP4 weight other than `wo_a` (and that one only
under DEEPINFER_WO_A_FP8=0).
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer import env, formats
from deepinfer.config import ModelConfig
from deepinfer.kernels.quant_weights import FP4ExpertBank, QuantLinearWeight

ParamValue = torch.Tensor | QuantLinearWeight | FP4ExpertBank

# bf16 checkpoint weights that only feed GEMMs of bf16 activations: the compressors' projections and the MoE
# gate (official: fp32 matmuls of the bf16 values, op "linear_f32") and the indexer's weights_proj and V4.1's
# index-key projection wk (official: bf16 linears, op "blinear"); kept bf16 they take the tensor cores (or the
# one-launch GEMV at decode) and half the bytes. An fp32 copy of V4.1's wk went to cuBLAS's fp32 path: at batch
# 8, 2 x 51 us a step on an H100 (results/bench_v41_decode_topk_h100_2026-12-06_s26.log, sm80_xmma_gemm_f32f32)
BF16_GEMM_WEIGHTS = ("compressor.wkv.weight", "compressor.wgate.weight", "ffn.gate.weight",
                     "indexer.weights_proj.weight", "indexer.wk.weight")


def _expert_prefix(name: str) -> str | None:
    """'layers.3.ffn.experts.17.w1.weight' -> 'layers.3.ffn.' (routed experts only, not shared_experts)."""
    head, sep, _ = name.partition(".ffn.experts.")
    return head + ".ffn." if sep else None


def prepare_params_fast(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, device: torch.device | str = "cpu",
                        skip_mtp: bool = True) -> dict[str, ParamValue]:
    """name -> tensor or quantised container on `device` (see the module doc). skip_mtp: the backbone does
    not need the MTP block."""
    device = torch.device(device)
    dequantised = getattr(raw, "dequantised", set())
    wo_a_fp8 = env.wo_a_fp8_enabled()
    out: dict[str, ParamValue] = {}
    for name, t in raw.items():
        if name.endswith(".scale") or (skip_mtp and name.startswith("mtp.")) or ".engram." in name:
            continue
        prefix = _expert_prefix(name)
        if prefix is not None:
            if prefix + "experts" not in out:
                out[prefix + "experts"] = _expert_bank(raw, prefix, cfg, device)
            continue
        if name.endswith("tid2eid"):
            out[name] = t.to(device, torch.int64)
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is None or name in dequantised:
            bf16_kept = name in ("embed.weight", "head.weight") or name.endswith("attn.wo_a.weight")
            if name == "head.weight" and t.dtype != torch.bfloat16:  # keeping it bf16 must not round it
                raise ValueError(f"head.weight: fast numerics keeps the checkpoint's bf16 head, got {t.dtype}")
            # GEMM weights the checkpoint stores in bf16 stay bf16 (their exact values): the ops multiply bf16
            # operands with fp32 accumulation (`linear_f32`, `blinear`), so no fp32 copy is needed
            bf16_kept = bf16_kept or (t.dtype == torch.bfloat16 and name.endswith(BF16_GEMM_WEIGHTS))
            wanted = torch.bfloat16 if bf16_kept else torch.float32
            out[name] = t.to(device, wanted)
            continue
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: fast numerics expects an FP8 E4M3 weight with a block scale, got {t.dtype}")
        w, s = t.to(device), scale.to(device)
        if name.endswith("attn.wo_a.weight") and not wo_a_fp8:  # exact: E4M3 x pow2 fits bf16 (convert.py)
            out[name] = formats.dequant_fp8_blocks(w, s, cfg.weight_block).to(torch.bfloat16)
        else:
            out[name] = QuantLinearWeight.from_checkpoint(w, s, cfg)
    if env.stack_weights():
        _stack_pairs(out)
    return out


STACKED = "wkv_wgate.weight"  # a compressor's stacked projection weight; wkv / wgate are its row views
# Weight pairs that multiply the same activation, stacked into one weight (first's rows first) whose halves the
# two names become views of: one GEMM where two ran (the compressor's bf16 wkv / wgate: op "linear_f32"; the
# attention's FP8 wq_a / wkv on the normed x and the shared expert's FP8 w1 / w3: op "fp8_linear"). Each
# output element is the same dot product of the same values; only the GEMM's plan (split-K, tiles) for the
# taller weight can change the fp32 summation order.
STACKS = {  # stacked name suffix -> (first, second)
    "compressor." + STACKED: ("compressor.wkv.weight", "compressor.wgate.weight"),
    "attn.wq_a_wkv.weight": ("attn.wq_a.weight", "attn.wkv.weight"),
    "shared_experts.w13.weight": ("shared_experts.w1.weight", "shared_experts.w3.weight"),
}


def _stack(a: ParamValue, b: ParamValue) -> tuple[ParamValue, ParamValue, ParamValue] | None:
    """(stacked, view of a, view of b), or None where the two cannot share one GEMM: bf16 tensors of one
    shape, or QuantLinearWeights of one K, block and activation block whose first has whole scale blocks."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if not (a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape and a.device == b.device):
            return None
        both = torch.cat([a, b])
        return both, both[: a.shape[0]], both[a.shape[0]:]
    if isinstance(a, QuantLinearWeight) and isinstance(b, QuantLinearWeight):
        n = a.out_features
        if (a.in_features != b.in_features or (a.block, a.act_block) != (b.block, b.act_block) or n % a.block
                or a.data.device != b.data.device):
            return None
        both = QuantLinearWeight(torch.cat([a.data, b.data]), torch.cat([a.scale, b.scale]), a.block, a.act_block)
        rows = n // a.block
        return (both, QuantLinearWeight(both.data[:n], both.scale[:rows], a.block, a.act_block),
                QuantLinearWeight(both.data[n:], both.scale[rows:], a.block, a.act_block))
    return None


def _stack_pairs(out: dict[str, ParamValue]) -> None:
    """Every `STACKS` pair present in out: stacked under its name, the two names views of its halves."""
    for suffix, (first, second) in STACKS.items():
        for name in [n for n in out if n.endswith(first)]:
            prefix = name[: -len(first)]
            if prefix + second not in out:
                continue
            stacked = _stack(out[name], out[prefix + second])
            if stacked is not None:
                out[prefix + suffix], out[name], out[prefix + second] = stacked


def stacked_view(name: str, params: Mapping[str, ParamValue]) -> bool:
    """Whether params[name] is a view of a stacked weight in params (counted once, by the stacked name)."""
    for suffix, pair in STACKS.items():
        for part in pair:
            if name.endswith(part) and name[: -len(part)] + suffix in params:
                return True
    return False


def _expert_bank(raw: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig, device: torch.device) -> FP4ExpertBank:
    layer = {k: v for k, v in raw.items() if k.startswith(prefix + "experts.")}
    held = _held_experts(layer, prefix, cfg)
    first = f"{prefix}experts.{held.start}.w1."  # the first expert this rank holds (0 without expert parallel)
    w1 = raw.get(first + "weight")
    if w1 is None or w1.dtype == torch.float8_e4m3fn or first + "scale" not in raw:
        got = None if w1 is None else w1.dtype
        raise ValueError(f"{prefix}experts: fast numerics keeps routed experts as packed FP4 with E8M0 scales "
                         f"(an FP4ExpertBank); this checkpoint holds {got} experts")
    if all(v.device == device for v in layer.values()):
        return FP4ExpertBank.from_checkpoint(layer, prefix, cfg, held)
    # Stack one layer at a time on the host, then move: the device only ever holds the packed bank.
    return FP4ExpertBank.from_checkpoint(layer, prefix, cfg, held).to(device)


def _held_experts(layer: Mapping[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> range:
    """The routed experts these tensors hold: all of them, or (expert parallelism, `distributed.sharding`)
    one rank's contiguous shard [first, first + n_local), stacked at local indices 0..n_local-1."""
    start = len(prefix + "experts.")
    held = sorted({int(k[start:].split(".", 1)[0]) for k in layer})
    if not held or held != list(range(held[0], held[-1] + 1)) or cfg.n_routed_experts % len(held) \
            or held[0] % len(held):
        raise ValueError(f"{prefix}experts: fast numerics stacks all {cfg.n_routed_experts} routed experts or "
                         f"one expert-parallel shard (a contiguous, aligned range), got experts {held[:8]}"
                         f"{'...' if len(held) > 8 else ''} ({len(held)})")
    return range(held[0], held[-1] + 1)


def param_bytes(params: Mapping[str, ParamValue]) -> int:
    """Bytes the parameters occupy (containers counted by their stored tensors; the views of a stacked
    weight not again): the memory check."""
    total = 0
    for name, v in params.items():
        if stacked_view(name, params):
            continue
        if isinstance(v, QuantLinearWeight):
            tensors = (v.data, v.scale)
        elif isinstance(v, FP4ExpertBank):
            tensors = v.stored
        else:
            tensors = (v,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
