"""Warm the L2 with the weights a decode layer's next GEMMs will stream, while its main chain runs the
latency-bound kernels in between (opt-in: DEEPINFER_L2_PREFETCH_MB, the bytes per window).

Why: at small decode batches a V4 layer is ~40-50 kernels. The GEMMs stream their weights from HBM, and
short ones do not reach the copy rate (the eighteenth session's b1 anatomy: wq_b's 33.5 MB in 14 us, ~2.4
TB/s); the kernels between them (hc mixes, norms, RoPE, the attention, routing) leave HBM idle. A prefetch
kernel on a stream of its own, queued after the GEMM that opens a window, asks the L2 for the next GEMMs'
weights (`kernels/cuda/l2_prefetch`: bulk prefetches, no values read or written), so those GEMMs find part
of their bytes in L2. Forks of vLLM do the same for GLM-5.3 and Kimi-K3 decode (local-inference-lab/vllm
#576, #586, #592: +7% C1 steps/s with a 128 MB L2).

Windows of one decode layer (`decode_step.decode_hidden`, `decode_attention.decode_attention`):
* "layer", before the attention sublayer's hc_pre (after the previous layer's MoE): wq_a / wkv, wq_b, then
  the side chain's weights (the compressors' projections, the indexer's wq_b and weights_proj);
* "attn", after wq_b: wo_a, wo_b;
* "ffn", before the MoE sublayer's hc_pre (after wo_b): the gate, the shared expert. The routed experts are
  known only after routing, and at small batches their GEMMs follow it at once: not prefetched.
With DEEPINFER_L2_PREFETCH_EVICT_LAST=1 the prefetched lines carry the evict_last policy and the device's
persisting-L2 set-aside is sized to the budget (once, at the first forward: `set_aside`), so the streaming
reads between a window and its GEMMs (the routed experts above all) evict them last.
Each window asks for at most the budget's bytes, in the order listed (what the layer reads first, first).
The H200's L2 is 50 MB, so a budget near it evicts the window's own first bytes: the device measures it.

Streams and graphs: the prefetch stream waits for the current stream at each window (`wait_stream`: after
everything queued so far) and `scope` joins it back at the end of the forward, so a CUDA-graph capture
holds it as one more branch (as the side streams, model/side_stream.py). Nothing waits for a prefetch but
that join. Numerics: none (cache hints only); every value is the same with the prefetch on or off.
Must not: read or write a tensor's values; be used outside a forward's `scope` (a window there is a no-op).
"""
from __future__ import annotations

import contextlib

import torch

from deepinfer import env
from deepinfer.kernels.quant_weights import QuantLinearWeight

_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the prefetch stream
_ACTIVE: dict[int, "_Scope"] = {}  # device index -> the forward in progress


class _Scope:
    def __init__(self, device: torch.device, budget: int, evict_last: bool) -> None:
        self.device, self.budget, self.evict_last = device, budget, evict_last
        self.main = torch.cuda.current_stream(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _STREAMS:
            _STREAMS[index] = torch.cuda.Stream(device=index)
        self.stream = _STREAMS[index]
        self.used = False


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def scope(device: torch.device | str):
    """One forward's windows: active on a CUDA device (compute capability >= 9.0, NVRTC) when
    DEEPINFER_L2_PREFETCH_MB > 0; the prefetch stream joins the current stream when the block ends."""
    device = torch.device(device)
    budget = env.l2_prefetch_bytes()
    if device.type != "cuda" or budget <= 0 or _index(device) in _ACTIVE:
        yield
        return
    from deepinfer.kernels.cuda import l2_prefetch as kernel

    if not kernel.usable(device):
        yield
        return
    index = _index(device)
    evict_last = env.l2_prefetch_evict_last()
    if evict_last and not torch.cuda.is_current_stream_capturing():  # the policy keeps lines only in the set-aside
        kernel.set_aside(device, budget)
    state = _ACTIVE[index] = _Scope(device, budget, evict_last)
    try:
        yield
    finally:
        del _ACTIVE[index]
        if state.used:
            state.main.wait_stream(state.stream)


def window(device: torch.device, pick, owner) -> int:
    """Prefetch the first budget bytes of `pick(owner)`'s tensors (in order) on the prefetch stream, after
    everything queued on the current stream so far; a no-op outside an active `scope` (`pick` is not even
    called: no host work when the prefetch is off). Returns the bytes asked for."""
    state = _ACTIVE.get(_index(device)) if device.type == "cuda" else None
    if state is None:
        return 0
    tensors = pick(owner)
    if not tensors:
        return 0
    from deepinfer.kernels.cuda import l2_prefetch as kernel

    state.stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(state.stream):
        asked = kernel.prefetch(tensors, state.budget, device, evict_last=state.evict_last)
    state.used = True
    return asked


def weights(p: dict, *names: str) -> list[torch.Tensor]:
    """The tensors behind params `names` in order: a name's tensor, or a `QuantLinearWeight`'s codes then its
    scales. Absent names and strided views (a prefetch span must be the tensor's own bytes) are skipped."""
    out = []
    for name in names:
        w = p.get(name)
        parts = [w.data, w.scale] if isinstance(w, QuantLinearWeight) else [w]
        out.extend(t for t in parts if isinstance(t, torch.Tensor) and t.is_contiguous())
    return out


def stacked(p: dict, name: str, *halves: str) -> list[torch.Tensor]:
    """`weights` of a stacked pair (one GEMM, `model/stacked.py`) where the params hold it, else of its halves."""
    return weights(p, name) if name in p else weights(p, *halves)


def layer_start(attn) -> list[torch.Tensor]:
    """Window "layer" of a `V4Attention`: the query path's weights, then the side chain's."""
    out = stacked(attn.p, "wq_a_wkv.weight", "wq_a.weight", "wkv.weight") + weights(attn.p, "wq_b.weight")
    if attn.ratio:
        out += stacked(attn.comp_p, "wkv_wgate.weight", "wkv.weight", "wgate.weight")
    if attn.has_indexer:
        out += weights(attn.idx_p, "wq_b.weight", "weights_proj.weight")
        out += stacked(attn.idx_comp_p, "wkv_wgate.weight", "wkv.weight", "wgate.weight")
    return out


def attn_out(attn) -> list[torch.Tensor]:
    """Window "attn" (after wq_b): the attention's output projections."""
    return weights(attn.p, "wo_a.weight", "wo_b.weight")


def ffn_start(moe) -> list[torch.Tensor]:
    """Window "ffn": the gate, then the shared expert (stacked w1 / w3 where the params hold it, then w2)."""
    s = "shared_experts."
    return (weights(moe.p, "gate.weight") + stacked(moe.p, s + "w13.weight", s + "w1.weight", s + "w3.weight")
            + weights(moe.p, s + "w2.weight"))
