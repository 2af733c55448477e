"""The DeepSeek-V4 engine model: a varlen batch of sequences, each extending its cached state by any
number of new tokens at any position (prefill chunks, decode tokens, multi-token extends) in one forward.

Owns: embedding, the blocks (manifold-constrained hyper-connections around attention and MoE), the head
collapse, final norm and the head on the requested rows only (spec §3). Caches live in `V4Cache`; the
batch layout in the `ForwardContext` (entered with `forward_context`).
Numerics: `exact` (float64 everywhere, no activation or KV quantisation) or `official` (emulates the
official kernels: bf16 activations, FP8 activation quantisation before FP8/FP4 GEMMs, fp32 norms / hc
mixes / Sinkhorn / gate / compressor / RoPE / head, KV fake-quant through the cache's packed layouts per
`revision`: "current" = FP8 nope channels and a clamped shared expert, "initial" = bf16 KV and an
unclamped shared expert). Official needs params from `prepare_params(..., numerics="official")` and a
`V4Cache(..., numerics="official", revision=...)` of the same revision.
`fast`: the official rounding points BATCHED (no one-sequence-per-call), FP8 weights and FP4 experts kept
quantised (`params_fast.prepare_params_fast`), every op from the registry for the params' device (Triton on
cuda once registered). Any numerics runs on the device its params and cache live on: token ids and
positions move there once per forward; the logits stay there (the engine samples there).
Must not: import the reference oracle (it is the independent implementation this one is checked against).
"""
from __future__ import annotations

import contextlib

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.model.attention import V4Attention, _sub
from deepinfer.model.cache import V4Cache
from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext, check_batch, forward_context, get_forward_context
from deepinfer.model.extend_metadata import build_extend_rows, extend_step
from deepinfer.model.moe import V4MoE

SUPPORTED_NUMERICS = ("exact", "official", "fast")
REVISIONS = ("current", "initial")


class PendingPost:
    """A sublayer's output whose hc_post is not yet applied: the residual streams x = hc_post_fused(f,
    residual, post, comb). The next sublayer's hc_pre takes it whole (op `hc_post_pre_fused`: on cuda the mix
    kernel makes x's columns itself, one launch fewer per sublayer); `resolve` makes x (fast numerics only)."""

    __slots__ = ("f", "residual", "post", "comb")

    def __init__(self, f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
        self.f, self.residual, self.post, self.comb = f, residual, post, comb

    def resolve(self, kdev: str) -> torch.Tensor:
        return kernels.get("hc_post_fused", kdev)(self.f, self.residual, self.post, self.comb)


def resolved(x: "torch.Tensor | PendingPost", kdev: str) -> torch.Tensor:
    """x itself, or the residual streams a PendingPost stands for."""
    return x.resolve(kdev) if isinstance(x, PendingPost) else x


class V4Block:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig, official: bool = False,
                 shared_clamp: bool = True, fast: bool = False, comm=None) -> None:
        self.p, self.cfg, self.official, self.fast = params, cfg, official or fast, fast
        self.kdev = params["attn_norm.weight"].device.type if fast else "cpu"  # whose kernels (see V4Attention)
        self.attn = V4Attention(layer, _sub(params, "attn."), cfg, official, fast, comm)
        self.ffn = V4MoE(layer, _sub(params, "ffn."), cfg, shared_clamp, official, fast, comm)

    def _hc(self, x: "torch.Tensor | PendingPost", which: str, sub, *args,
            defer: bool = False) -> "torch.Tensor | PendingPost":
        """One hyper-connected sublayer: collapse the hc streams, norm, sublayer, mix back. x [T, hc, D].
        defer (fast numerics): return the mix-back as a PendingPost for the next sublayer's hc_pre to apply."""
        cfg, p = self.cfg, self.p
        if self.fast and "hc_pre_fused" in kernels.ops():
            return self._hc_fused(x, which, sub, *args, defer=defer)
        x = resolved(x, self.kdev)
        if self.official:
            return self._hc_official(x, which, sub, *args)
        mixes = kernels.get("hc_mix")(x, p[f"hc_{which}_fn"], cfg.norm_eps)
        pre, post, comb = kernels.get("hc_split_sinkhorn")(
            mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        )
        y = kernels.get("rms_norm")(kernels.get("hc_collapse")(x, pre), p[f"{which}_norm.weight"], cfg.norm_eps)
        return kernels.get("hc_post")(sub(y, *args), x, post, comb)

    def _hc_official(self, x: torch.Tensor, which: str, sub, *args) -> torch.Tensor:
        """x [T, hc, D] bf16: mixes, Sinkhorn, collapse, norm and the mix-back in fp32, rounded to bf16."""
        cfg, p = self.cfg, self.p

        def k(name: str):
            return kernels.get(name, self.kdev)

        xf = x.to(torch.float32)
        mixes = k("hc_mix")(xf, p[f"hc_{which}_fn"], cfg.norm_eps)
        pre, post, comb = k("hc_split_sinkhorn")(
            mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        )
        y = k("hc_collapse")(xf, pre).to(torch.bfloat16).to(torch.float32)
        y = k("rms_norm")(y, p[f"{which}_norm.weight"], cfg.norm_eps).to(torch.bfloat16)
        f = sub(y, *args).to(torch.float32)
        return k("hc_post")(f, xf, post, comb).to(torch.bfloat16)

    def _hc_fused(self, x: "torch.Tensor | PendingPost", which: str, sub, *args,
                  defer: bool = False) -> "torch.Tensor | PendingPost":
        """`_hc_official` as fused ops (fast numerics on a device: one or two kernels each side of the
        sublayer); their torch twins run exactly `_hc_official`'s rounding points. A PendingPost x (the
        previous sublayer's deferred mix-back) goes through `hc_post_pre_fused` with this hc_pre."""
        pre = self.hc_pre_args(which)
        if isinstance(x, PendingPost):
            x, y, post, comb = kernels.get("hc_post_pre_fused", self.kdev)(x.f, x.residual, x.post, x.comb, *pre)
        else:
            y, post, comb = kernels.get("hc_pre_fused", self.kdev)(x, *pre)
        pending = PendingPost(sub(y, *args), x, post, comb)
        return pending if defer else pending.resolve(self.kdev)

    def hc_pre_args(self, which: str) -> tuple:
        """The arguments after x of the fused hc_pre ops (`hc_pre_fused`, `hc_post_pre_fused`) for sublayer
        `which` ("attn" / "ffn")."""
        cfg, p = self.cfg, self.p
        return (p[f"hc_{which}_fn"], p[f"hc_{which}_scale"], p[f"hc_{which}_base"], p[f"{which}_norm.weight"],
                cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def __call__(self, x: "torch.Tensor | PendingPost", ids: torch.Tensor, ctx: ForwardContext, cache: V4Cache,
                 tap=None, name: str = "", defer: bool = False) -> "torch.Tensor | PendingPost":
        """defer (fast numerics, no tap): the block's last mix-back is returned as a PendingPost (and a
        PendingPost x is taken), so each sublayer's hc_post runs inside the next one's hc_pre."""
        defer = defer and self.fast and not tap
        x = self._hc(x, "attn", self.attn, ctx, cache, defer=defer)
        if tap:
            tap(f"{name}.attn", x)
        x = self._hc(x, "ffn", self.ffn, ids, defer=defer)
        if tap:
            tap(f"{name}.ffn", x)
        return x


class V4EngineModel:
    """V4 backbone + head over a paged `V4Cache` (exact or official numerics)."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], cache: V4Cache,
                 numerics: str = "exact", revision: str | None = None, comm=None) -> None:
        """comm: a `deepinfer.distributed.Communicator` when params are one rank's slices (None: one process)."""
        if cfg.is_v41:
            raise ValueError("V4EngineModel is the family v4 model; this checkpoint is v41")
        if numerics not in SUPPORTED_NUMERICS:
            raise NotImplementedError(f"numerics {numerics!r} not implemented yet (have {SUPPORTED_NUMERICS})")
        revision = cache.revision if revision is None else revision
        if revision not in REVISIONS:
            raise ValueError(f"revision must be one of {REVISIONS}, got {revision!r}")
        if cache.numerics != numerics or (numerics != "exact" and cache.revision != revision):
            raise ValueError(f"cache was built for numerics {cache.numerics!r} revision {cache.revision!r}, "
                             f"model asks for {numerics!r} {revision!r}")
        official, fast = numerics == "official", numerics == "fast"
        if official and params["embed.weight"].dtype != torch.bfloat16:
            raise ValueError("official numerics need params from prepare_params(..., numerics='official')")
        if fast and "layers.0.ffn.experts" not in params:
            raise ValueError("fast numerics need params from params_fast.prepare_params_fast (quantised weights)")
        self.device = params["embed.weight"].device
        if cache.layers and cache.layers[0].ring.device != self.device:
            raise ValueError(f"cache is on {cache.layers[0].ring.device}, params on {self.device}")
        self.cfg, self.p, self.cache, self.numerics, self.revision = cfg, params, cache, numerics, revision
        self.official, self.fast = official or fast, fast  # `official`: the official rounding points
        self.kdev = self.device.type if fast else "cpu"
        shared_clamp = revision == "current"  # the initial release left the shared expert unclamped
        self.comm = comm
        self.layers = [V4Block(i, _sub(params, f"layers.{i}."), cfg, official, shared_clamp, fast, comm)
                       for i in range(cfg.n_layers)]
        # Debug tap for the parity tools: tap(name, x, seq_index) gets the FULL 4-stream residual [S, hc, D]
        # of one sequence of the batch after the embedding and after every sublayer (never a sublayer
        # output alone), and the normed final hidden [S, D] ("final"). Only this model instance is tapped:
        # the runner's KV-sizing warm-up runs on a scratch instance, so it can never reach a dump.
        self.tap = None

    def _check(self, token_ids: torch.Tensor, ctx: ForwardContext) -> None:
        check_batch(token_ids, ctx, self.cfg, self.cache)

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The final 4-stream residual [T, hc, D] of the current ForwardContext's batch.
        (Official numerics: `forward` calls this one sequence at a time, see there; called directly on a
        batch it is correct but only chaotically close to the oracle's batch-1 bits.)"""
        token_ids, ctx = self.start_step(token_ids, get_forward_context())
        x = self.embed(token_ids)
        tap = self._per_sequence_tap(ctx) if self.tap else None
        if tap:
            tap("embed", x)
        with self.extend_rows(ctx):  # fast numerics: the rows every layer reads, built once per step
            for i, block in enumerate(self.layers):  # (defer: each hc_post inside the next hc_pre where it can)
                x = block(x, token_ids, ctx, self.cache, tap, f"layers.{i}", defer=True)
        return resolved(x, self.kdev)

    def start_step(self, token_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, ForwardContext]:
        """Check the batch, move its ids and positions to the device, start the cache's step (fresh
        sequences' slots reset: nothing of a slot's previous owner may leak in) -> (ids, ctx) on the device."""
        self._check(token_ids, ctx)  # on the ids as given (the runner passes host ids: no device sync)
        token_ids, ctx = host_to_device(token_ids, self.device), ctx.on(self.device)
        self.cache.begin_step()
        self.cache.reset_fresh(ctx.seqs)
        return token_ids, ctx

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """ids [T] on the device -> the embedding in every hc stream [T, hc, D]."""
        table = self.p["embed.weight"]
        x = table[token_ids] if self.comm is None else self.comm.embed(table, token_ids)  # vocab-parallel
        # (cat, not repeat: repeat's broadcast copy is a non-vectorised elementwise kernel on cuda, 317 us at an
        # 8k prefill on the H100; the same values)
        return torch.cat((x.unsqueeze(1),) * self.cfg.hc_mult, dim=1)

    def extend_rows(self, ctx: ForwardContext):
        """A context entering the step's `ExtendRows` (built once, read by every layer; `as` gives them), or
        a null one giving None outside the batched extend path (not fast numerics, or its reference off)."""
        if not self.fast or not V4Attention.batched_extend:
            return contextlib.nullcontext()
        cfg = self.cfg
        ratios = tuple(sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r}))
        rows = build_extend_rows(ctx, cfg.window_size, self.cache.block_size, ratios, self.device)
        return extend_step(ctx, rows)

    def _per_sequence_tap(self, ctx: ForwardContext):
        """Split the flat batch so each recorded tensor holds exactly one sequence's rows."""
        def tap(name: str, x: torch.Tensor) -> None:
            for i in range(len(ctx.seqs)):
                self.tap(name, x[ctx.rows(i)], i)
        return tap

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Head on x [N, hc, D] rows: learned 4->1 collapse, final norm, head -> [N, vocab]."""
        cfg, p = self.cfg, self.p

        def k(name: str):
            return kernels.get(name, self.kdev)

        if self.fast:  # the official steps below in one op (two Triton launches on cuda; the twin elsewhere),
            # then the checkpoint's bf16 head with fp32 sums and logits
            y = k("hc_head_fused")(x, p["hc_head_fn"], p["hc_head_scale"], p["hc_head_base"], p["norm.weight"],
                                   cfg.hc_eps, cfg.norm_eps)
            logits = k("linear_f32")(y, p["head.weight"])
        else:
            if self.official:  # fp32 mixes and head, bf16 rounding after the collapse and the norm
                x = x.to(torch.float32)
            mixes = k("hc_mix")(x, p["hc_head_fn"], cfg.norm_eps)
            pre = torch.sigmoid(mixes * p["hc_head_scale"] + p["hc_head_base"]) + cfg.hc_eps
            y = k("hc_collapse")(x, pre)
            if self.official:
                y = y.to(torch.bfloat16).to(torch.float32)
                y = k("rms_norm")(y, p["norm.weight"], cfg.norm_eps).to(torch.bfloat16).to(torch.float32)
            else:
                y = kernels.get("rms_norm")(y, p["norm.weight"], cfg.norm_eps)
            logits = y @ p["head.weight"].T
        return logits if self.comm is None else self.comm.gather_vocab(logits)  # vocab-parallel head

    def idle_moe(self) -> None:
        """A data-parallel rank with no sequence this step still joins every layer's MoE token exchange."""
        dtype = self.p["embed.weight"].dtype
        x = torch.zeros(0, self.cfg.dim, dtype=dtype, device=self.device)
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        for block in self.layers:
            block.ffn(x, ids)

    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """token_ids [T] flat -> logits [num_seqs, vocab] of each sequence's last new token
        (or [T, vocab] with ctx.all_logits). Without `ctx`, uses the one entered with `forward_context`."""
        if ctx is None:
            ctx = get_forward_context()
        if self.official and not self.fast and len(ctx.seqs) > 1:
            # Official numerics runs the sequences of a batch one at a time. CPU torch's vectorised
            # elementwise ops (bf16 rsqrt of the q head norm, exp, silu...) and GEMMs round the last bit
            # differently depending on a tensor's shape (measured: the head norm of the same 17 rows
            # differs inside a 57-row batch), and quantised V4 amplifies a last-bit difference into
            # percent-level logit differences (batched over 8 prompts: median cos 0.9995, min 0.965,
            # 80/84 argmax agreement at margin >= 2). One sequence per call has the shapes of the oracle's
            # batch-1 calls and reproduces them bit for bit. The caches are per sequence either way.
            out = [self.forward(token_ids[ctx.rows(i)], ForwardContext((s,), ctx.all_logits))
                   for i, s in enumerate(ctx.seqs)]
            return torch.cat(out)
        with forward_context(ctx):
            x = self.hidden(token_ids)
        return self.logits(x[host_to_device(ctx.logit_rows(), self.device)])  # only the needed rows: the head is vocab x dim

    __call__ = forward
