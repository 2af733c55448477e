"""Parameters of the V4 engine in fast numerics: the checkpoint's quantised weights kept quantised, on a device.

Owns: turning checkpoint tensors (`weights.load_tensors`, or any in-memory dict of checkpoint-format
tensors, e.g. `tiny.make_tensors`) into what the fast path computes with:
* every FP8 linear (attention wq_a/wq_b/wkv/wo_b, indexer wq_b, shared experts) -> `QuantLinearWeight`
  (E4M3 data + fp32 block scales: the checkpoint's bytes, never a dequantised copy);
* the routed experts of each MoE layer -> one `FP4ExpertBank` under `layers.{i}.ffn.experts` (packed FP4 +
  E8M0 bytes, stacked); with expert parallelism only this rank's shard, at local indices (the MoE maps
  global ids: `model/expert_parallel_fast.py`);
* `attn.wo_a` -> its bf16 value (the official convert.py dequantises it to bf16; the official grouped output
  einsum runs on bf16 operands, so does ours: op "grouped_proj_bf16");
* `head.weight` -> the checkpoint's bf16 (official holds it as fp32 of the same values; op "linear_f32"
  multiplies bf16 operands with fp32 accumulation and output: the same math, half the bytes per step);
* the bf16 GEMM weights `BF16_GEMM_WEIGHTS` (compressor wkv/wgate, MoE gate, indexer weights_proj) -> the
  checkpoint's bf16 (the official fp32 copies hold the same values; ops "linear_f32" / "blinear");
  each compressor's wkv and wgate stacked into one `compressor.wkv_wgate.weight` [2 n, dim], with the two
  names as row views of it (no copy): both project the same x, so a step runs one GEMM per compressor
  instead of two (`compressor.project`; 6 GEMM launches, plus cuBLAS's split-K reduces, fewer per step in
  the 4-layer V4-Flash slice);
* small tensors as the official numerics hold them: embedding bf16, every other float tensor fp32 (norms,
  hc, sinks, compressor ape, gate bias), `tid2eid` int64.
Memory is about the checkpoint's own size (plus small fp32 tensors).
Both families: V4 (128x128 weight blocks, activations quantised per 128) and V4.1 (32x32 blocks, per 32: the
containers carry cfg.weight_block / cfg.act_block). V4.1's engram tensors are not params here: the model's
EngramLayer takes them from the checkpoint (`model/engram.py::engram_params`, tables left on the host).
Must not: import the reference oracle, or dequantise an FP8/FP4 weight other than `wo_a`.
"""
from __future__ import annotations

from typing import Mapping

import torch

from deepinfer import formats
from deepinfer.config import ModelConfig
from deepinfer.kernels.quant_weights import FP4ExpertBank, QuantLinearWeight

ParamValue = torch.Tensor | QuantLinearWeight | FP4ExpertBank

# bf16 checkpoint weights that only feed GEMMs of bf16 activations: the compressors' projections and the MoE
# gate (official: fp32 matmuls of the bf16 values, op "linear_f32") and the indexer's weights_proj (official:
# a bf16 linear, op "blinear"); kept bf16 they take the tensor cores and half the bytes
BF16_GEMM_WEIGHTS = ("compressor.wkv.weight", "compressor.wgate.weight", "ffn.gate.weight",
                     "indexer.weights_proj.weight")


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
        if name.endswith("attn.wo_a.weight"):  # exact: E4M3 x pow2 fits bf16 (the official conversion)
            out[name] = formats.dequant_fp8_blocks(w, s, cfg.weight_block).to(torch.bfloat16)
        else:
            out[name] = QuantLinearWeight.from_checkpoint(w, s, cfg)
    _stack_compressor_projections(out)
    return out


STACKED = "wkv_wgate.weight"  # a compressor's stacked projection weight; wkv / wgate are its row views


def _stack_compressor_projections(out: dict[str, ParamValue]) -> None:
    """Every compressor whose wkv and wgate are bf16 of one shape: stack them as `STACKED` and make the two
    names views of its halves (wkv rows first), so memory holds each weight once."""
    for name in [n for n in out if n.endswith("compressor.wkv.weight")]:
        prefix = name[: -len("wkv.weight")]
        wkv, wgate = out[name], out.get(prefix + "wgate.weight")
        if not (isinstance(wgate, torch.Tensor) and wkv.dtype == wgate.dtype == torch.bfloat16
                and wkv.shape == wgate.shape and wkv.device == wgate.device):
            continue
        both = torch.cat([wkv, wgate])
        n = wkv.shape[0]
        out[prefix + STACKED], out[name], out[prefix + "wgate.weight"] = both, both[:n], both[n:]


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
    """Bytes the parameters occupy (containers counted by their stored tensors; the row views of a stacked
    compressor weight not again): the memory check."""
    total = 0
    for name, v in params.items():
        if name.endswith(("compressor.wkv.weight", "compressor.wgate.weight")) \
                and name.rsplit(".", 2)[0] + "." + STACKED in params:
            continue
        if isinstance(v, QuantLinearWeight):
            tensors = (v.data, v.scale)
        elif isinstance(v, FP4ExpertBank):
            tensors = (v.w13, v.w13_scale, v.w2, v.w2_scale)
        else:
            tensors = (v,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
