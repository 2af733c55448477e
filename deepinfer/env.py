"""Every DEEPINFER_* environment variable, typed, read here and nowhere else."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """DEEPINFER_CACHE_DIR: where the embedded default model is generated (default ~/.cache/deepinfer)."""
    value = os.environ.get("DEEPINFER_CACHE_DIR")
    return Path(value) if value else Path.home() / ".cache" / "deepinfer"


def progress_enabled() -> bool:
    """DEEPINFER_NO_PROGRESS=1 turns progress bars off (they are also off when stderr is not a terminal)."""
    return os.environ.get("DEEPINFER_NO_PROGRESS", "") not in ("1", "true", "yes")


def cuda_graphs_enabled() -> bool:
    """DEEPINFER_CUDA_GRAPHS=0 turns the fast engine's decode CUDA graphs off (EngineConfig(cuda_graphs=False)
    does the same per engine); default on."""
    return os.environ.get("DEEPINFER_CUDA_GRAPHS", "1") not in ("0", "false", "no")


def extend_graph_tokens() -> int:
    """DEEPINFER_EXTEND_GRAPH_TOKENS: the most tokens of an extend step (prefill chunk, mixed step's extend
    half) the fast CUDA engine replays through its piecewise CUDA graphs (model/extend_graphs.py; V4.1:
    model/v41_extend_graphs.py), capped by max_num_batched_tokens; 0 runs every extend step eagerly. Default 2048 (above it the steps are bound
    by the device, not by the host's launches). The decode graphs' switches (DEEPINFER_CUDA_GRAPHS=0,
    EngineConfig(cuda_graphs=False)) turn these off too."""
    value = os.environ.get("DEEPINFER_EXTEND_GRAPH_TOKENS", "2048").strip()
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"DEEPINFER_EXTEND_GRAPH_TOKENS={value!r}: want a token count >= 0 (0: off)")
    return tokens


def batched_decode_enabled() -> bool:
    """DEEPINFER_BATCHED_DECODE=0 sends the fast engine's pure-decode steps through the general varlen path
    instead of the batched decode path (model/decode_step.py), in one process and in a parallel group: the
    A/B of that path; default on."""
    return os.environ.get("DEEPINFER_BATCHED_DECODE", "1") not in ("0", "false", "no")


def parallel_cuda_graphs() -> bool:
    """DEEPINFER_PARALLEL_CUDA_GRAPHS=1 captures the batched decode path's CUDA graphs in a parallel group too
    (dp = 1: its collectives are tensor collectives on the device; with dp > 1 the MoE exchange reads row
    counts on the host). Off by default: never run on several GPUs (no multi-GPU machine lent, issue 10)."""
    return os.environ.get("DEEPINFER_PARALLEL_CUDA_GRAPHS", "0") in ("1", "true", "yes")


SAMPLE_ON_CHOICES = ("device", "host")


def sample_on() -> str:
    """DEEPINFER_SAMPLE_ON: where the engine samples: "device" (the default: on the runner's device, where the
    logits are) or "host" (the logits copied to the CPU first: the engine before 2026-12-03, kept for A/B
    measurements, `benchmarks/bench_engine_step.py`). Anything else is a ValueError naming the choices."""
    value = os.environ.get("DEEPINFER_SAMPLE_ON", "device").strip().lower() or "device"
    if value not in SAMPLE_ON_CHOICES:
        raise ValueError(f"DEEPINFER_SAMPLE_ON={value!r}: expected one of {SAMPLE_ON_CHOICES}")
    return value


DECODE_KERNEL_CHOICES = ("auto", "mma", "triton")
MOE_DECODE_KERNEL_CHOICES = ("auto", "tma", "mma", "triton")
MOE_PREFILL_KERNEL_CHOICES = ("auto", "wgmma", "triton")
DECODE_ATTN_SPLIT_CHOICES = ("auto", "off")


def _kernel_choice(name: str, choices: tuple[str, ...] = DECODE_KERNEL_CHOICES, default: str = "auto") -> str:
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")
    return value


def linear_decode_kernel() -> str:
    """DEEPINFER_LINEAR_DECODE_KERNEL: which kernel runs op fp8_linear for up to 8 rows (decode) on CUDA: "mma"
    (the mma.sync CUDA kernel, kernels/cuda/fp8_linear_mma.cu, where it can run), "triton" (the Triton bf16
    form), "auto" (the default: kernels/triton/fp8_gemm.py DECODE_LINEAR_FORM). Else a ValueError."""
    return _kernel_choice("DEEPINFER_LINEAR_DECODE_KERNEL")


def moe_decode_kernel() -> str:
    """DEEPINFER_MOE_DECODE_KERNEL: which kernels run the routed experts' GEMMs at decode (up to 16 slots per
    expert) on CUDA: "tma" (the TMA-fed CUDA kernel, kernels/cuda/fp4_moe_tma.cu, on sm_90+ where it can
    run, else "mma"), "mma" (the mma.sync CUDA kernel, kernels/cuda/fp4_moe_mma.cu, where it can run),
    "triton" (the Triton v2 kernels), "auto" (the default: the measured faster one, see
    kernels/triton/fp4_moe.py DECODE_FORM). Anything else is a ValueError naming the choices."""
    return _kernel_choice("DEEPINFER_MOE_DECODE_KERNEL", MOE_DECODE_KERNEL_CHOICES)


def moe_prefill_kernel() -> str:
    """DEEPINFER_MOE_PREFILL_KERNEL: which kernels run the routed experts' GEMMs above 16 slots per expert
    (prefill) on CUDA: "wgmma" (the warpgroup-MMA CUDA kernel, kernels/cuda/fp4_moe_wgmma.cu, on sm_90 where
    it can run, else Triton), "triton" (the Triton v2 prefill plan), "auto" (the default: kernels/triton/
    fp4_moe.py PREFILL_FORM). Anything else is a ValueError naming the choices."""
    return _kernel_choice("DEEPINFER_MOE_PREFILL_KERNEL", MOE_PREFILL_KERNEL_CHOICES)


def decode_attn_split() -> str:
    """DEEPINFER_DECODE_ATTN_SPLIT: "auto" (the default) lets the batched decode step's sparse attention split
    a small batch's index rows over programs (flash-decoding, kernels/triton/sparse_attn_paged.py
    `split_plan`), which makes a row's last bits depend on the batch size's plan; "off" keeps one program
    per row and head block (the pool kernel's bits at any batch size, slower at small batches). Anything
    else is a ValueError naming the choices."""
    return _kernel_choice("DEEPINFER_DECODE_ATTN_SPLIT", DECODE_ATTN_SPLIT_CHOICES)


LINEAR_BATCH_FORM_CHOICES = ("auto", "swap", "bf16")


def linear_batch_form() -> str:
    """DEEPINFER_LINEAR_BATCH_FORM: "auto" (the default) lets op fp8_linear run the wgmma CUDA kernel at
    17..256 rows where it can (kernels/cuda/fp8_linear_wgmma.cu: sm_90, NVRTC), else the Triton "swap" form
    where an H200 sweep measured it faster (large weights: kernels/triton/fp8_linear_swap.py `takes`);
    "swap" skips the wgmma kernel (the default before 2026-12-04), "bf16" keeps the bf16 form there (before
    2026-12-03); both for A/B runs. Else a ValueError."""
    return _kernel_choice("DEEPINFER_LINEAR_BATCH_FORM", LINEAR_BATCH_FORM_CHOICES)


LINEAR_PREFILL_KERNEL_CHOICES = ("auto", "wgmma", "triton")


def linear_prefill_kernel() -> str:
    """DEEPINFER_LINEAR_PREFILL_KERNEL: which kernel runs op fp8_linear's FP8 form from FP8_MMA_MIN_M rows
    (prefill) on CUDA: "wgmma" (the TMA-fed warpgroup-MMA CUDA kernel, kernels/cuda/fp8_linear_prefill.cu, on
    sm_90 for V4's 128-blocks where it can run, else Triton), "triton" (the Triton "fp8" form), "auto" (the
    default: kernels/triton/fp8_gemm.py PREFILL_LINEAR_FORM). The two forms give the same bits. Else a
    ValueError naming the choices."""
    return _kernel_choice("DEEPINFER_LINEAR_PREFILL_KERNEL", LINEAR_PREFILL_KERNEL_CHOICES)


def stack_weights() -> bool:
    """DEEPINFER_STACK_WEIGHTS=0 keeps the fast params' weight pairs apart (model/params_fast.py `STACKS`:
    two GEMMs per pair as before 2026-12-03, for A/B runs); default on (one GEMM per pair)."""
    return os.environ.get("DEEPINFER_STACK_WEIGHTS", "1") not in ("0", "false", "no")


def side_streams_enabled() -> bool:
    """DEEPINFER_SIDE_STREAMS=0 runs a CUDA layer's independent branches (the shared expert; the compressors
    and the indexer) inline on the main stream instead of on a second stream beside it (model/side_stream.py;
    for A/B runs); default on."""
    return os.environ.get("DEEPINFER_SIDE_STREAMS", "1") not in ("0", "false", "no")


def attn_fusions_enabled() -> bool:
    """DEEPINFER_ATTN_FUSIONS=0 makes the attention paths' fused Triton ops of 2026-12-05 (the nineteenth
    session: `qkv_norm_rope_store`, `head_rms_norm_rope`, `sparse_attn_sink_paged_rope`, `indexer_q_rotate`,
    `index_key_rotate_store`, `decode_select_rows`, `hc_post_pre_fused`) run the separate kernels they replace,
    with the same results: the A/B switch of their timing and a way back should one misbehave on a GPU.
    Default on."""
    return os.environ.get("DEEPINFER_ATTN_FUSIONS", "1") not in ("0", "false", "no")


def attn_qnorm_in_kernel() -> bool:
    """DEEPINFER_ATTN_QNORM=launch runs V4's per-head query norm and RoPE as `head_rms_norm_rope`'s own launch
    before the attention instead of inside the attention kernels ("kernel", the default since the fortieth
    session, 2026-12-07): at decode on the paged Triton kernel's q load (`sparse_attn_sink_paged_rope`'s
    q_norm_eps: one launch off the step's main chain), at prefill in the CUDA wgmma kernel's shared memory (op
    `sparse_attn_sink_qnorm`: no full write and re-read of q). H100: the 8k prefill's blocks 54.7 / 54.4 ->
    54.0 / 53.4 ms (alternated in one process); GPU tests passed. DEEPINFER_ATTN_FUSIONS=0 runs it apart too."""
    return _kernel_choice("DEEPINFER_ATTN_QNORM", ("kernel", "launch"), "kernel") == "kernel"


def compress_store_fused() -> bool:
    """DEEPINFER_COMPRESS_STORE=apart runs the decode step's KV compressors in three launches
    (compress_decode_step, rope32, kv_encode_into) instead of one through to the cache ("fused", the default
    since the fortieth session, 2026-12-07: op `compress_decode_store`, the entries' RoPE and packed store in the
    compressor kernel's epilogue; the same bytes, GPU tests passed). The A/B switch of its timing."""
    return _kernel_choice("DEEPINFER_COMPRESS_STORE", ("fused", "apart"), "fused") == "fused"


def topk_rows_fused() -> bool:
    """DEEPINFER_TOPK_ROWS=apart runs an indexer layer's decode selection in two launches (stable_topk,
    decode_select_rows) instead of one ("fused", the default since the fortieth session, 2026-12-07: op
    `stable_topk_rows`, the top-k kernel maps its sorted picks to the attention's index rows; the same integers,
    GPU tests passed). The A/B switch of its timing."""
    return _kernel_choice("DEEPINFER_TOPK_ROWS", ("fused", "apart"), "fused") == "fused"


SPLIT_SUM_DEFAULT = "kernel"  # DEEPINFER_SPLIT_SUM's default (`split_sum_consumers`)
SPLIT_SUM_CONSUMERS = ("qkv", "post", "swiglu")


def split_sum_consumers() -> frozenset[str]:
    """DEEPINFER_SPLIT_SUM: which consumers the batched decode step leaves a split-K linear's partials to (op
    `fp8_linear_unsummed`, kernels/split_k.py; the same bits, one launch fewer each where the linear splits
    K), '+'-joined: "qkv" (V4's stacked wq_a | wkv, added by `qkv_norm_rope_store`), "post" (V4's wo_b, added
    by the next hc_pre's mix kernel, `hc_post_pre_fused`), "swiglu" (the shared expert's stacked w1 | w3,
    added by `swiglu_bf16`); "consumer" (all of them), "kernel" (none: `_split_sum_kernel` adds them first;
    the default, SPLIT_SUM_DEFAULT). Else a ValueError naming the choices."""
    value = os.environ.get("DEEPINFER_SPLIT_SUM", SPLIT_SUM_DEFAULT).strip().lower() or SPLIT_SUM_DEFAULT
    if value == "kernel":
        return frozenset()
    if value == "consumer":
        return frozenset(SPLIT_SUM_CONSUMERS)
    names = frozenset(value.split("+"))
    if not names <= set(SPLIT_SUM_CONSUMERS):
        raise ValueError(f"DEEPINFER_SPLIT_SUM={value!r}: expected kernel, consumer or a '+'-joined subset of "
                         f"{SPLIT_SUM_CONSUMERS}")
    return names


def qkv_programs() -> str:
    """DEEPINFER_QKV_PROGRAMS: programs a token of the fused `qkv_norm_rope_store` kernel: "2" (the q row and
    the kv row in two programs, side by side), "1" (one after the other in one), "auto" (the default: 2 where
    it adds split-K partials, 1 otherwise; attn_norm_rope.QKV_TWO_PROGRAMS). The same bits either way; the A/B
    switch of its timing. Else a ValueError."""
    return _kernel_choice("DEEPINFER_QKV_PROGRAMS", ("auto", "1", "2"))


def indexer_lanes_enabled() -> bool:
    """DEEPINFER_INDEXER_LANES=0 keeps a decode step's indexer layers' side work as one chain on one side stream
    instead of splitting it over three (the indexer's weights and the main compressor; the index-key
    compressor; the indexer's query, scores and selection: model/decode_attention.py). Default on since the
    H200 ran its bit-identity test and timed it (2026-12-05: back-to-back 4-layer steps b1 1.045 -> 1.032 ms,
    b32 2.917 -> 2.883, b128 4.761 -> 4.733; BENCHMARKS.md)."""
    return os.environ.get("DEEPINFER_INDEXER_LANES", "1") not in ("0", "false", "no")


def linear_cluster_split() -> bool:
    """DEEPINFER_LINEAR_CLUSTER_SPLIT=0 makes the mma.sync decode form of op fp8_linear (and wo_a's grouped form
    on it) add its split-K partials in fp8_gemm._split_sum_kernel instead of inside the kernel, where the S split
    CTAs of a tile are one thread-block cluster (kernels/cuda/fp8_linear_mma.cu CLUSTER_SPLIT: the same bits,
    one launch instead of two; `fp8_gemm.use_cluster` says where: up to 4 splits). Default on since the H200
    and the H100 ran its test and timed it (2026-12-05: wq_b at M=1 15.0 -> 12.8 us and 18.2 -> 17.2;
    BENCHMARKS.md)."""
    return os.environ.get("DEEPINFER_LINEAR_CLUSTER_SPLIT", "1") not in ("0", "false", "no")


def linear_serial_split() -> bool:
    """DEEPINFER_LINEAR_SERIAL_SPLIT=1 makes the mma.sync decode form of op fp8_linear (and wo_a's grouped form
    on it) at one row of x add the split-K partials that no cluster adds (more than 4 splits:
    `fp8_gemm.use_cluster`) in the tile's last split CTA (serial split-K: kernels/cuda/fp8_linear_mma.cu
    SERIAL_SPLIT; the same bits; the rule: `fp8_gemm.serial_counters`) instead of in fp8_gemm._split_sum_kernel,
    a second launch. Off by default: the H100 (2026-12-07) could not tell it apart from the separate sum at
    b1 (back-to-back steps 1.035 -> 1.053 ms, replays with a sync 1.066 -> 1.044, the seven projections alone
    61.5 -> 61.9 us: single draws whose noise is ~2%)."""
    return os.environ.get("DEEPINFER_LINEAR_SERIAL_SPLIT", "0") not in ("0", "false", "no")


def fused_greedy_enabled() -> bool:
    """DEEPINFER_FUSED_GREEDY=0 makes the sampler take its general path (log_softmax, argmax, gather, rank)
    for all-greedy steps too, instead of op greedy_sample (sampling/sampler.py; for A/B runs); default on."""
    return os.environ.get("DEEPINFER_FUSED_GREEDY", "1") not in ("0", "false", "no")


def fused_route_enabled() -> bool:
    """DEEPINFER_FUSED_ROUTE=0 makes op "moe_route" on CUDA run the MoE gate's unfused ops (GEMV, gate; the
    routed experts then make their slot blocks and act_quant(x) themselves) where it would take its one fused
    launch (kernels/triton/moe_route.py; for A/B runs; read at each call, so a graph keeps what its capture
    saw); default on."""
    return os.environ.get("DEEPINFER_FUSED_ROUTE", "1") not in ("0", "false", "no")


def gate_packed_key() -> bool:
    """The Triton MoE gate (kernels/triton/moe_gate.gate_row, in the gate kernel and the fused route) takes its
    top-k by one max of a packed (score, lowest expert) key a round; DEEPINFER_GATE_PACKED_KEY=0 takes the three
    reductions a round of before 2026-12-07 (the same bits: interpreter and H100 tests; A/B runs; read at each
    launch, so a graph keeps what its capture saw); default on since its GPU tests passed on an H100."""
    return os.environ.get("DEEPINFER_GATE_PACKED_KEY", "1") not in ("0", "false", "no", "")


def route_first_enabled() -> bool:
    """The fast MoE layers queue their routing (the critical path's start) before the shared expert's GEMMs
    on the side stream (model/moe.py without a communicator, v41_moe.py; same kernels, same bits, another
    launch order); DEEPINFER_ROUTE_FIRST=0 queues the shared expert first (the order before 2026-12-07; A/B
    runs; read at each call, so a graph keeps what its capture saw); default on."""
    return os.environ.get("DEEPINFER_ROUTE_FIRST", "1") not in ("0", "false", "no")


def _int_plan(name: str, keys: tuple[str, ...] | None = None) -> dict:
    """A launch plan from variable `name` = "key:int;key:int" (unset or empty: {}); `keys`: the ones allowed."""
    value = os.environ.get(name, "")
    out = {}
    for item in filter(None, value.split(";")):
        key, _, number = item.partition(":")
        if not key or not number.isdigit():
            raise ValueError(f"{name} must be key:int items separated by ';', got {value!r}")
        if keys is not None and key not in keys:
            raise ValueError(f"{name}: unknown key {key!r} in {value!r}; known: {', '.join(keys)}")
        out[key] = int(number)
    return out


def hc_post_mix_plan() -> dict:
    """DEEPINFER_HC_POST_MIX="num_stages:1;num_warps:2": launch-plan keys of `norm_hc.hc_post_pre_fused`'s
    post-mix kernel at decode on top of its POST_MIX_PLAN (A/B runs of the plan; integers; read at each call,
    so a graph keeps what its capture saw); unset: {}."""
    return _int_plan("DEEPINFER_HC_POST_MIX")


def gather_plan() -> dict:
    """DEEPINFER_GATHER_PLAN="elems:4096;warps:8": the program size and warps of `act_quant.act_quant_gather`
    (the prefill experts' operand gathers) instead of its GATHER_ELEMS / GATHER_WARPS (A/B runs; the same bits
    at any; read at each call); unset: {}."""
    return _int_plan("DEEPINFER_GATHER_PLAN", ("elems", "warps"))


def moe_mma_waves() -> int | None:
    """DEEPINFER_MOE_MMA_WAVES=n: the mma.sync expert form's auto split-K aims for n CTAs per SM instead of
    fp4_moe.MMA_WAVES (a benchmark's A/B of the split counts; read at each call, so a graph keeps what its
    capture saw); unset: None."""
    value = os.environ.get("DEEPINFER_MOE_MMA_WAVES")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"DEEPINFER_MOE_MMA_WAVES must be a positive integer, got {value!r}")
    return int(value)


def fast_launch_enabled() -> bool:
    """The decorated Triton kernels launch through kernels/triton/launch.py's per-specialisation cache
    instead of Triton's per-call JIT dispatch; default on since its GPU tests passed on the H200 (2026-12-05);
    DEEPINFER_FAST_LAUNCH=0 takes Triton's own dispatch (A/B runs; read once, at import; `launch.ENABLED`
    switches it at run time)."""
    return os.environ.get("DEEPINFER_FAST_LAUNCH", "1") not in ("0", "false", "no")


def pdl_enabled() -> bool:
    """Kernels written for it (a `PDL` parameter in the Triton ones, `pdl=True` in the CUDA ones) launch with
    programmatic dependent launch on sm_90+: each grid starts while the previous kernel still runs and waits
    for it on the device (kernels/triton/pdl.py). DEEPINFER_PDL=0 launches them plainly (A/B runs; read once,
    at import; `kernels.cuda.runtime.PDL_ENABLED` switches both kinds at run time)."""
    return os.environ.get("DEEPINFER_PDL", "1") not in ("0", "false", "no")


def wo_a_fp8_enabled() -> bool:
    """DEEPINFER_WO_A_FP8=0 makes fast numerics hold the attention's `wo_a` as convert.py's bf16 value (op
    "grouped_proj_bf16": cuBLAS's einsum) instead of its checkpoint FP8 bytes + block scales (op
    "grouped_proj_fp8", model/out_lora.py: the same values in half the memory, 1.4 GB less on V4-Flash's 43
    layers). Default on since 2026-12-05: the mma.sync form up to 8 tokens and the wgmma form for 9..256
    (kernels/triton/grouped_proj.py) ran the oracle judges on the GPU and timed faster than cuBLAS on the
    bf16 weight (H100: T=1 18.1 against 28.7 us, T=32 24.4 against 29.6, T=128 32.7 against 32.7; H200:
    T=1 14.4 against 21.6) and the decode step with it was faster (BENCHMARKS.md twenty-first session). Read
    when params are made."""
    return os.environ.get("DEEPINFER_WO_A_FP8", "1") not in ("0", "false", "no")


SPLIT_MIXED_CHOICES = ("auto", "on", "off")


def split_mixed_steps() -> str:
    """DEEPINFER_SPLIT_MIXED_STEPS: whether a step that mixes decoding sequences with prefills / extends runs
    its decode rows through the batched decode path (model/mixed_step.py): "auto" (the default: on CUDA,
    where each decode row in the extend path costs launches and the decode path replays a graph; not on
    the CPU, where the extend path's math is cheaper than a second forward), "on", or "off" (the whole step
    through the extend path, as before 2026-12-04; for A/B runs). Anything else is a ValueError."""
    value = os.environ.get("DEEPINFER_SPLIT_MIXED_STEPS", "auto").strip().lower() or "auto"
    value = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(value, value)
    if value not in SPLIT_MIXED_CHOICES:
        raise ValueError(f"DEEPINFER_SPLIT_MIXED_STEPS={value!r}: expected one of {SPLIT_MIXED_CHOICES}")
    return value


ATTN_PREFILL_KERNEL_CHOICES = ("auto", "wgmma", "triton")


def attn_prefill_kernel() -> str:
    """DEEPINFER_ATTN_PREFILL_KERNEL: which kernel runs the flat sparse attention with the sink (op
    sparse_attn_sink_official*: prefill and extend steps) on CUDA: "wgmma" (kernels/cuda/sparse_attn_wgmma.cu on
    sm_90 where it can run: head dim 512, whole blocks of 64 heads; else Triton), "triton"
    (kernels/triton/sparse_attn.py), "auto" (the default: kernels/triton/sparse_attn.py WGMMA_MIN_TOKENS). Else a
    ValueError naming the choices. Read at each call."""
    return _kernel_choice("DEEPINFER_ATTN_PREFILL_KERNEL", ATTN_PREFILL_KERNEL_CHOICES)
