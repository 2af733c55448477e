"""The DeepSeek-V4.1-Flash engine model: a varlen batch of sequences, each extending its cached state by any
number of new tokens at any position (prefill chunks, decode tokens, multi-token extends) in one forward.

Owns: embedding, Engram before its layers (hashes from the per-slot n-gram history), the blocks with
hyper-connections and the DEFERRED pre mix (each sublayer collapses its input with the `pre` the previous
sublayer's mixes produced; the first uses one-hot [1, 0, ..]), the final collapse with the last block's
`pre`, final norm and head on the requested rows only (spec §10). Caches live in `V41Cache`; the batch
layout in the `ForwardContext`; cross-layer sharing of top-k and candidate masks in a per-forward dict.
Numerics: `exact` (float64, no quantisation) or `official` (the official V4.1 kernels' numerics: bf16
activations, FP8 activation quantisation per cfg.act_block before FP8/FP4 GEMMs, fp32 mixes / Sinkhorn /
collapse / norms (eps as configured) / gate / ratio-2 compressor / RoPE / head, packed FP8/FP4 caches; needs
`prepare_params(..., numerics="official")` and `V41Cache(..., numerics="official")`). Official runs the
sequences of a batch one per call (shapes of the oracle's batch-1 calls, hence its bits; see V4EngineModel).
`fast`: the official rounding points BATCHED (no one-sequence-per-call), FP8 weights (32x32 blocks) and FP4
experts kept quantised (`params_fast.prepare_params_fast`; engram wkv FP8 too), every op from the registry
for the params' device (Triton on cuda once registered); the head is the checkpoint's bf16 with fp32
accumulation and logits (`linear_f32`). Any numerics runs on the device its params and cache live on:
token ids and positions move there once per forward, the engram hashes and table rows are computed and
gathered on the host (model/engram.py says why), the logits stay on the device (the engine samples there).
Pure-decode steps of fast numerics take the batched decode path instead (model/v41_decode.py, through
`decode_step.DecodeRunner`: eager or CUDA graphs); every other step takes this general varlen path, whose
attention in fast numerics runs every sequence at once (model/v41_extend.py).
Debug tap: `tap(name, x, seq_index)` receives, per sequence of the ForwardContext, that sequence's rows of
the FULL 4-stream residual [S, hc, D] after the embedding ("embed"), each engram update
("layers.{i}.engram") and each sublayer's hc_post ("layers.{i}.attn", "layers.{i}.ffn"), and the normed
final hidden [S, D] ("final"). Must not: import the reference oracle.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from deepinfer import kernels
from deepinfer.config import ModelConfig
from deepinfer.devices import host_to_device
from deepinfer.model.context import ForwardContext, check_batch, forward_context, get_forward_context, resolve_device
from deepinfer.model.engram import EngramHasher, EngramLayer, compressed_token_map, engram_params
from deepinfer.model.v41_attention import V41Attention, _sub
from deepinfer.model.v41_cache import V41Cache
from deepinfer.model.v41_moe import V41MoE

SUPPORTED_NUMERICS = ("exact", "official", "fast")
Tap = Callable[[str, torch.Tensor, int], None]
F32, BF16 = torch.float32, torch.bfloat16


class V41Block:
    def __init__(self, layer: int, params: dict[str, torch.Tensor], cfg: ModelConfig,
                 all_params: dict[str, torch.Tensor], official: bool = False, comm=None, fast: bool = False) -> None:
        self.p, self.cfg = _sub(params, f"layers.{layer}."), cfg
        self.official, self.fast = official or fast, fast
        self.kdev = self.p["attn_norm.weight"].device.type if fast else "cpu"  # whose kernels (see V41Attention)
        self.attn = V41Attention(layer, _sub(self.p, "attn."), cfg, all_params, official, comm, fast)
        self.ffn = V41MoE(layer, _sub(self.p, "ffn."), cfg, official, comm, fast)

    def _k(self, name: str):
        return kernels.get(name, self.kdev)

    def _mixes(self, x: torch.Tensor, which: str):
        cfg, p = self.cfg, self.p
        mixes = self._k("hc_mix")(x, p[f"hc_{which}_fn"], cfg.norm_eps)
        return self._k("hc_split_sinkhorn")(mixes, p[f"hc_{which}_scale"], p[f"hc_{which}_base"], cfg.hc_mult,
                                            cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def __call__(self, x, pre_mix, ctx: ForwardContext, cache: V41Cache, shared: dict, tap=None, name: str = ""):
        """x [T, hc, D], pre_mix [T, hc] -> (x, the pre mix for the next sublayer)."""
        if self.official:
            return self.official_block(x, pre_mix, lambda y: self.attn(y, ctx, cache, shared), tap, name)
        rms, collapse, post_fn, eps = kernels.get("rms_norm"), kernels.get("hc_collapse"), kernels.get("hc_post"), \
            self.cfg.norm_eps
        attn_pre, post, comb = self._mixes(x, "attn")
        y = rms(collapse(x, pre_mix), self.p["attn_norm.weight"], eps)
        x = post_fn(self.attn(y, ctx, cache, shared), x, post, comb)
        if tap:
            tap(f"{name}.attn", x)
        ffn_pre, post, comb = self._mixes(x, "ffn")
        y = rms(collapse(x, attn_pre), self.p["ffn_norm.weight"], eps)
        x = post_fn(self.ffn(y), x, post, comb)
        if tap:
            tap(f"{name}.ffn", x)
        return x, ffn_pre

    def official_block(self, x, pre_mix, attention: Callable[[torch.Tensor], torch.Tensor], tap=None, name: str = ""):
        """x [T, hc, D] bf16, pre_mix [T, hc] fp32: mixes, Sinkhorn, collapse, norm and mix-back in fp32,
        rounded to bf16 after the collapse, the norm and the mix-back (fast: the mix-back as the fused
        `hc_post_fused` op, whose twin is exactly these steps). `attention(y)`: the attention sublayer on the
        normed rows (the varlen path's `V41Attention`, or the batched decode path's, model/v41_decode.py)."""
        y, attn_pre, post, comb = self.hc_pre(x, pre_mix, "attn")
        x = self.mix_back(attention(y), x, post, comb)
        if tap:
            tap(f"{name}.attn", x)
        y, ffn_pre, post, comb = self.hc_pre(x, attn_pre, "ffn")
        x = self.mix_back(self.ffn(y), x, post, comb)
        if tap:
            tap(f"{name}.ffn", x)
        return x, ffn_pre

    def hc_pre(self, x: torch.Tensor, pre_mix: torch.Tensor, which: str):
        """Official numerics: x [T, hc, D], the previous sublayer's pre [T, hc] -> (the sublayer's normed input
        [T, D] bf16, this sublayer's pre, post, comb). Mixes, Sinkhorn, collapse with the previous pre, norm:
        one op (two launches on cuda, where the separate ops were ~90: the Sinkhorn's reductions one launch
        each); its twin is those ops."""
        cfg, p = self.cfg, self.p
        return self._k("hc_pre_deferred_fused")(x, pre_mix, p[f"hc_{which}_fn"], p[f"hc_{which}_scale"],
                                                p[f"hc_{which}_base"], p[f"{which}_norm.weight"], cfg.hc_mult,
                                                cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)

    def mix_back(self, f: torch.Tensor, residual: torch.Tensor, post, comb) -> torch.Tensor:
        """Official numerics: the sublayer's output f [T, D] mixed back into the residual streams [T, hc, D]."""
        if self.fast:  # f and the residual bf16, fp32 arithmetic inside, bf16 out
            return self._k("hc_post_fused")(f, residual, post, comb)
        return self._k("hc_post")(f.to(F32), residual.to(F32), post, comb).to(BF16)


class V41EngineModel:
    """V4.1 backbone + head over a paged `V41Cache` (exact, official or fast numerics).

    params: `prepare_params` output (fast: `prepare_params_fast`; engram tensors are skipped by both) on the
    model's device; `raw`: the checkpoint tensors (host), from
    which the engram tables/wkv are taken (needed when cfg has engram layers); `tokenizer` (or a path to a
    tokenizer.json): the compressed vocabulary the n-gram hashes run over.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], cache: V41Cache,
                 raw: Mapping[str, torch.Tensor] | None = None, tokenizer=None, numerics: str = "exact",
                 comm=None) -> None:
        if not cfg.is_v41:
            raise ValueError("V41EngineModel is the family v41 model; this checkpoint is v4")
        if numerics not in SUPPORTED_NUMERICS:
            raise NotImplementedError(f"numerics {numerics!r} not implemented yet (have {SUPPORTED_NUMERICS})")
        if getattr(cache, "numerics", "exact") != numerics:
            raise ValueError(f"cache was built for numerics {cache.numerics!r}, model asks for {numerics!r}")
        official, fast = numerics == "official", numerics == "fast"
        if official and params["embed.weight"].dtype != BF16:
            raise ValueError("official numerics need params from prepare_params(..., numerics='official')")
        if fast and "layers.0.ffn.experts" not in params:
            raise ValueError("fast numerics need params from params_fast.prepare_params_fast (quantised weights)")
        self.device = params["embed.weight"].device
        ring_device = cache.layers[0].ring.device if cache.layers else self.device
        if ring_device != self.device:
            raise ValueError(f"cache is on {ring_device}, params on {self.device}")
        self.cfg, self.p, self.cache, self.numerics = cfg, params, cache, numerics
        self.official, self.fast = official or fast, fast  # `official`: the official rounding points
        self.kdev = self.device.type if fast else "cpu"  # exact/official: the torch twins on any device
        self.comm = comm  # a deepinfer.distributed.Communicator when params/raw are one rank's slices
        self.layers = [V41Block(i, params, cfg, params, official, comm, fast) for i in range(cfg.n_layers)]
        # Debug tap (parity tools): tap(name, x, seq_index), see the module doc. Only this instance is
        # tapped: the runner's KV-sizing warm-up runs on a scratch instance.
        self.tap: Tap | None = None
        self._seq_base = 0  # index in the caller's ForwardContext of seqs[0] (official per-sequence calls)
        self.engrams: dict[int, EngramLayer] = {}
        self.hasher = None
        if cfg.engram_layer_ids:
            if raw is None or tokenizer is None:
                raise ValueError("a V4.1 checkpoint with engram layers needs `raw` tensors and a `tokenizer`")
            dtype = F32 if self.official else torch.float64
            self.engrams = {i: EngramLayer(engram_params(raw, cfg, i, dtype, self.device, fast), cfg, official, comm,
                                           i, fast)
                            for i in cfg.engram_layer_ids}
            token_map, size = compressed_token_map(tokenizer)
            self.hasher = EngramHasher(cfg, cache.max_num_seqs, token_map, size)
            cache.hasher = self.hasher

    def _check(self, token_ids: torch.Tensor, ctx: ForwardContext) -> None:
        check_batch(token_ids, ctx, self.cfg, self.cache)

    def start_step(self, token_ids: torch.Tensor, ctx: ForwardContext):
        """Check the batch, reset fresh sequences' slots (nothing of a slot's previous owner may leak in), hash
        the engram n-grams on the host (per-slot history and table rows live there), move ids and positions to
        the device, start the cache's step -> (ids, ctx) on the device and the hashes (None: no engram)."""
        self._check(token_ids, ctx)  # on the ids as given (the runner passes host ids: no device sync)
        self.cache.reset_fresh(ctx.seqs)
        hashes = self.hasher(token_ids.cpu(), ctx) if self.hasher is not None else None
        token_ids, ctx = host_to_device(token_ids, self.device), ctx.on(self.device)  # pinned: no stream sync
        self.cache.begin_step()
        return token_ids, ctx, hashes

    def engram_hashes(self, hashes: torch.Tensor, layer: int) -> torch.Tensor:
        """The step's hash ids [T, cols] of engram layer `layer`."""
        return hashes[:, self.hasher.layer_index(layer)]

    def hidden(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final 4-stream residual [T, hc, D] and the last block's pre mix [T, hc]."""
        token_ids, ctx, hashes = self.start_step(token_ids, get_forward_context())
        x, pre_mix = self.embed(token_ids)
        tap = self._per_sequence_tap(ctx) if self.tap else None
        if tap:
            tap("embed", x)
        shared: dict = {}
        for i, block in enumerate(self.layers):
            if i in self.engrams:
                x = self.engrams[i](x, self.engram_hashes(hashes, i))
                if tap:
                    tap(f"layers.{i}.engram", x)
            x, pre_mix = block(x, pre_mix, ctx, self.cache, shared, tap, f"layers.{i}")
        return x, pre_mix

    def embed(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] on the device -> (the embedding in every hc stream [T, hc, D], the first block's pre mix
        [T, hc]: stream 0 alone). The varlen path's and the batched decode path's start."""
        table, hc = self.p["embed.weight"], self.cfg.hc_mult
        x = table[token_ids] if self.comm is None else self.comm.embed(table, token_ids)  # vocab-parallel
        x = torch.cat((x.unsqueeze(1),) * hc, dim=1)  # (V4EngineModel.embed says why not repeat)
        pre_mix = torch.zeros(token_ids.shape[0], hc, dtype=F32 if self.official else x.dtype, device=self.device)
        pre_mix[:, 0] = 1.0
        return x, pre_mix

    def _per_sequence_tap(self, ctx: ForwardContext):
        """Split the flat batch: each call gets one sequence's rows and its index in the caller's context."""
        def tap(name: str, x: torch.Tensor) -> None:
            for i in range(len(ctx.seqs)):
                self.tap(name, x[ctx.rows(i)], self._seq_base + i)
        return tap

    def final_hidden(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Collapse with the last block's pre mix and the final norm: [N, hc, D] -> [N, D]
        (official: fp32 math, bf16 after the collapse and after the norm)."""
        rms, collapse, eps = kernels.get("rms_norm", self.kdev), kernels.get("hc_collapse", self.kdev), \
            self.cfg.norm_eps
        if self.official:
            y = collapse(x.to(F32), pre_mix).to(BF16).to(F32)
            return rms(y, self.p["norm.weight"], eps).to(BF16)
        return rms(collapse(x, pre_mix), self.p["norm.weight"], eps)

    def logits(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_hidden(x, pre_mix))

    def head(self, y: torch.Tensor) -> torch.Tensor:
        if self.fast:  # bf16 normed rows times the checkpoint's bf16 head, fp32 sums and logits
            logits = kernels.get("linear_f32", self.kdev)(y, self.p["head.weight"])
        else:
            logits = (y.to(F32) if self.official else y) @ self.p["head.weight"].T
        return logits if self.comm is None else self.comm.gather_vocab(logits)  # vocab-parallel head

    def idle_moe(self) -> None:
        """A data-parallel rank with no sequence this step still joins every layer's MoE token exchange."""
        x = torch.zeros(0, self.cfg.dim, dtype=self.p["embed.weight"].dtype, device=self.device)
        for block in self.layers:
            block.ffn(x)

    def forward(self, token_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """token_ids [T] flat -> logits [num_seqs, vocab] of each sequence's last new token (or [T, vocab]
        with ctx.all_logits). Without `ctx`, uses the one entered with `forward_context`."""
        if ctx is None:
            ctx = get_forward_context()
        if self.official and not self.fast and len(ctx.seqs) > 1:
            # One sequence per call, as V4EngineModel does: CPU torch rounds the last bit of GEMMs and
            # vectorised elementwise ops depending on a tensor's shape, and the quantised model amplifies
            # a last-bit difference chaotically; batch-1 shapes reproduce the oracle bit for bit.
            out, base = [], self._seq_base
            try:
                for i, s in enumerate(ctx.seqs):
                    self._seq_base = base + i
                    out.append(self.forward(token_ids[ctx.rows(i)], ForwardContext((s,), ctx.all_logits)))
            finally:
                self._seq_base = base
            return torch.cat(out)
        with forward_context(ctx):
            x, pre_mix = self.hidden(token_ids)
        rows = host_to_device(ctx.logit_rows(), self.device)
        if self.tap:  # "final" covers every row, like the oracle's
            y = self.final_hidden(x, pre_mix)
            self._per_sequence_tap(ctx)("final", y)
            return self.head(y[rows])
        return self.logits(x[rows], pre_mix[rows])

    __call__ = forward


def v41_params(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, numerics: str,
               device: torch.device | str = "cpu") -> dict:
    """Params for `numerics` on `device`: fast keeps the weights quantised (params_fast: FP8 linears as
    QuantLinearWeight with 32x32 blocks, one FP4ExpertBank per layer); exact and official dequantise on the
    host (their reference forms), then move."""
    from deepinfer.model.params import prepare_params
    from deepinfer.model.params_fast import prepare_params_fast

    if numerics not in SUPPORTED_NUMERICS:
        raise NotImplementedError(f"the V4.1 engine runs {SUPPORTED_NUMERICS} numerics only, got {numerics!r}")
    if numerics == "fast":
        return prepare_params_fast(raw, cfg, device)
    params = prepare_params(raw, cfg, torch.float64, numerics=numerics)
    return {name: t.to(device) for name, t in params.items()}


def build_v41_model(cfg: ModelConfig, raw: Mapping[str, torch.Tensor], tokenizer=None, numerics: str = "fast",
                    device: torch.device | str = "cpu", num_blocks: int = 16, block_size: int = 128,
                    max_num_seqs: int = 8, params: dict | None = None, comm=None) -> V41EngineModel:
    """A ready V41EngineModel over a fresh paged cache on `device` (the V4.1 counterpart of
    factory.build_v4_model). `params`: already prepared ones to share (e.g. the runner's warm-up)."""
    device = resolve_device(device) if torch.device(device).type == "cuda" else torch.device(device)
    if params is None:
        params = v41_params(raw, cfg, numerics, device)
    dtype = torch.float64 if numerics == "exact" else F32  # cache value dtype (official/fast: packed + fp32 state)
    cache = V41Cache(cfg, num_blocks, block_size, max_num_seqs, dtype, numerics, device)
    return V41EngineModel(cfg, params, cache, raw, tokenizer, numerics, comm)


def build_for_runner(config, cfg: ModelConfig, comm=None, load=None, decode_scratch: bool = False,
                     extend_graph_tokens: int = 0):
    """The engine runner's V4.1 model: (params, num_blocks, model, extend graphs or None) for an
    `EngineConfig`-like `config` (model, numerics, num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
    max_model_len, device, kv_cache_bytes, gpu_memory_utilization). The KV budget is sized like the V4 runner:
    one worst-case warm-up forward on a throwaway cache, the rest of the budget to blocks (on cuda: free memory,
    and no more blocks than every sequence slot at max_model_len can use). decode_scratch: the model's cache gets
    one slot and one block more than the scheduler hands out (slot max_num_seqs, block num_blocks: the batched
    decode path's padding rows). extend_graph_tokens > 0 (fast numerics on cuda, one process): the extend
    steps' piecewise graphs (model/v41_extend_graphs.py) up to that many tokens, captured on the sizing model
    before its warm-up (so that their pool is counted), bound to the returned model."""
    from deepinfer.model.context import SeqContext
    from deepinfer.tokenizer import Tokenizer
    from deepinfer.weights import load_tensors

    numerics = config.numerics
    if numerics not in SUPPORTED_NUMERICS:
        raise NotImplementedError(f"the V4.1 engine runs {SUPPORTED_NUMERICS} numerics only, got {numerics!r}")
    if numerics == "fast" and comm is not None:
        raise NotImplementedError("V4.1 fast numerics runs in one process (tensor/expert/data parallel: use "
                                  "numerics 'exact' or 'official')")
    device = resolve_device(config.device)
    if load is not None:  # e.g. one rank's slices, read a layer at a time (engine/distributed_load.py)
        raw = load(config.model, cfg)
    else:
        raw = load_tensors(config.model, cfg, progress=False)
        if comm is not None:  # this rank's slices (tensor/expert parallel), before anything is dequantised
            from deepinfer.distributed import shard_checkpoint

            raw = shard_checkpoint(raw, cfg, comm.parallel)
    params = v41_params(raw, cfg, numerics, device)
    dtype = torch.float64 if numerics == "exact" else F32  # cache value dtype (official/fast: packed + fp32 state)
    tok = Tokenizer.from_checkpoint(config.model) if cfg.engram_layer_ids else None
    c = config

    def model(num_blocks: int, max_num_seqs: int) -> V41EngineModel:
        return build_v41_model(cfg, raw, tok, numerics, device, num_blocks, c.block_size, max_num_seqs, params, comm)

    graphs = None
    if extend_graph_tokens and (numerics != "fast" or comm is not None):
        raise ValueError("the V4.1 extend graphs run fast numerics in one process")
    num_blocks = c.num_blocks
    if not num_blocks:
        tokens = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-tokens // c.block_size)
        scratch = model(blocks, 1)
        ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if extend_graph_tokens:  # its graphs hold no cache tensor: bound to the serving model below
            from deepinfer.model.v41_extend_graphs import V41ExtendGraphs

            graphs = V41ExtendGraphs(scratch, extend_graph_tokens)
        scratch.forward(ids, ForwardContext((SeqContext(0, tokens, 0, 0, tuple(range(blocks))),)))
        del scratch
        fixed = V41Cache.bytes_per_sequence(cfg, dtype, numerics) * c.max_num_seqs
        if device.type == "cuda":
            _, total = torch.cuda.mem_get_info(device)
            budget = int(total * c.gpu_memory_utilization) - torch.cuda.max_memory_allocated(device) - fixed
        else:
            budget = c.kv_cache_bytes - fixed
        per_block = V41Cache.bytes_per_block(cfg, c.block_size, dtype, numerics)
        num_blocks = budget // per_block if per_block else 1
        if comm is not None:  # every rank must hold the blocks the one scheduler hands out
            num_blocks = comm.min_over_world(int(num_blocks))
        need = -(-c.max_model_len // c.block_size)
        # no more blocks than every sequence slot at max_model_len can use (a GPU's free memory would
        # otherwise give millions of blocks to the host-side block pool)
        num_blocks = min(num_blocks, need * c.max_num_seqs)
        if num_blocks < need:
            raise ValueError(f"KV budget holds {num_blocks} blocks but one sequence of max_model_len "
                             f"{c.max_model_len} needs {need}: raise kv_cache_bytes or lower max_model_len")
    extra = 1 if decode_scratch else 0
    serving = model(int(num_blocks) + extra, c.max_num_seqs + extra)
    if extend_graph_tokens:
        if graphs is None:  # (num_blocks given: no sizing ran)
            from deepinfer.model.v41_extend_graphs import V41ExtendGraphs

            graphs = V41ExtendGraphs(serving, extend_graph_tokens)
        graphs.bind(serving)
    return params, int(num_blocks), serving, graphs
