# The device checks the code of 2026-12-07 still owes, in the order the next device run should take them; each
# stage bounded so one `run` call (10 minutes) brings its logs back. The twenty-seventh session ran s27a (the
# twenty-sixth session's review), s27b-e (PDL: tests, anatomy, the slice against transformers, prefill), all on
# an H100 (passed; numbers in BENCHMARKS.md). The twenty-eighth session ran s27f's and s28a's tests and timings
# on an H100 (BENCHMARKS.md). The twenty-ninth session ran s28b, s28c and its own s29a-c on an H100 (passed; the
# stages as they were are in git history, the numbers in BENCHMARKS.md). The thirtieth session ran s29d and its
# own s30_tests, s30_bench, s30b and s30c on an H100 (passed; BENCHMARKS.md). The thirty-second session ran the
# thirty-first's s31a on an H100 (tests passed; both opt-in changes slower, removed with their stages s31a / s31b)
# and the new stage timeline at b1 / b128 (results/decode_timeline_*_h100_2026-12-07_s32.log); the stage's
# critical path (stream_timeline.critical_path) was added after that run: stage s32 owes it on any Hopper GPU,
# first, with the indexer query kernel's warps A/B. The thirty-third session's H100 ran those (s32's warps A/B,
# the b1 critical path) and its own stage s33 (at c8aa150; results/*_s33*, BENCHMARKS.md). The thirty-fourth
# session's H100 ran s34's tests with its own in stage s35 (at 0974dc8; results/*_s34*, BENCHMARKS.md). The
# thirty-fifth session's H100 ran the owed s36 (the thirty-fourth's A/B), its own experiments' stages s37 / s37b
# (at 8de6614; the code was slower and was removed with its stages), `headline` and slice_defaults
# (results/*_s35*, BENCHMARKS.md); it owes v41_hc (V4.1's decode with its hc plan change, any Hopper GPU). The
# thirty-sixth session's H100 ran s38 (the sparse attention's CUDA form: tests, timings; results/*_s36*) and s38_slice
# in its two-process form with an earlier kernel; it owes s38_slice as it is now (the one-process A/B of the 8k
# prefill's blocks and the engine's prefill GPU tests with the landed kernel), first. The thirty-seventh session's
# H200 ran s38 (both builds' tests; the PIPELINED_QK build 14% faster, now the default), s39 (the experts without a
# producer warp: tests passed, not faster) and s38_slice with the PIPELINED_QK build as a third env set
# (results/*_s37*, BENCHMARKS.md); its H100 ran s40 (multicast experts, slower, removed), headline, v41_hc and
# ncu_experts; it owes s41 (the CUDA attention from 8 tokens: the engine's GPU tests first) and s42 (the experts'
# unserialized two-fragment-buffer plans, a kernel change never run on a GPU: tests first). The thirty-eighth
# session's H100 ran s41 (passed: the CUDA attention now runs from 8 tokens), s42 (tests passed, the two-buffer
# plans slower) and its own s43 (persistent experts CTAs: tests passed, slower, removed with the stage;
# results/*_s38*), then s44 (the gathers: now 8192 values a program), ncu_experts' stall reasons (default plan)
# and the headline (results/*_s38*); it owes s45 (the indexer's head sum, written and reverted: no device time
# left), first. The thirty-ninth session's H100 (3 calls after an hour of refused starts) ran s46 (serial split-K:
# passed, made opt-in; the combine's heads and stable_topk's kernel: kept) with part of s46b and s46_engine
# (results/*_s39*). The fortieth session's H100 (three calls, late) ran s47t (every test of its three fusions and
# s45: passed), s47p (their A/Bs: made the defaults) and s47i (s45's timing: landed; s46c: the stable_topk kernel
# not faster at prefill sizes, the sort stays); a second H100 ran `headline` with the new defaults and V4.1's
# decode GPU tests (passed) (results/*_s40*). The forty-first session's H100 (two calls, then an hour of refused
# starts) ran s48a (the serial split's tests after e5dff6a: 80 passed; the headline) and the split consumers' first
# form's A/B (results/*_s41*). Owed, in order: s48c (or the whole s48b: the split consumers' GPU tests and A/B, the
# code never run on a GPU in its final form), the slice against transformers with the current defaults
# (`slice_defaults`), then the H200 runs below. Still owed
# on an H200 (no run of these sessions got one): anatomy
# (with --env-sets "" DEEPINFER_PDL=0), prefill and slice with the current defaults; the H200's b1 roofline figure
# (28%) predates PDL. Also on an H200: the experts' form crossover that set fp4_moe.WGMMA_SLOTS_PER_EXPERT on the
# H100 (stage crossover; the H200's higher copy rate favours the TMA form, so its crossover may sit higher).
# The machine is handed back after ~30 s idle: have the next stage's command ready before a call returns.
#   source scripts/device_prelude.sh; bash scripts/pending_device_runs.sh anatomy     # with carry: [".whl"]
#   ... prefill_ab | s23b (both of them and the trimmed experts at T=1024) | tests | anatomy | linears | prefill | slice
# Logs go to $OUT (one file per step); each step's summary line is printed.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD/tests:$PWD/benchmarks
OUT=${OUT:-/tmp/out}
stage=${1:?stage: s48c, s48b, s48a, s47t, s47p, s47i, s47a, s47b, s47c, s46, s46b, s46c, s46_engine, s45, s44, s42, s41, ncu_experts, s39, s38, s38_slice, v41_hc, headline, timeline, slice_defaults, s30d, s30c, s30b, s30_tests, s30_bench, s29d, crossover, s28b, s28c, s28a, s27f, s27e, s27d, s27c, s27b, s27a, s26d, s26c, s26b, s26a, s25b, s25, s24b, s24a, fp8_prefill, s23b, s23c, prefill_ab, tests, anatomy, linears, prefill or slice}

step() {  # step NAME SECONDS COMMAND...: run it into $OUT/NAME.log, print its tail
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$?"
    tail -n 4 "$OUT/$name.log"
}

case $stage in
s48c)  # s48b cut to what ~130 s of a call holds (the budget left after refused starts): the split consumers' and
    # PIN_F's bit-identity GPU tests (kernels, the engine's decode), then the b1 / b32 steps with them, alternated
    step gpu_tests_s48c 90 python -m pytest -q -m gpu tests/test_kernels_split_k.py tests/test_engine_fast_decode.py \
        -k "split"
    step decode_anatomy_s48c 80 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 --top 14 \
        --env-sets "" DEEPINFER_SPLIT_SUM=consumer,DEEPINFER_HC_POST_MIX=PIN_F:1 DEEPINFER_HC_POST_MIX=PIN_F:1 ""
    ;;
s48b)  # the forty-first session's split-K consumers (op fp8_linear_unsummed: DEEPINFER_SPLIT_SUM=qkv | post |
    # swiglu | consumer) and the post-mix kernel's pinned f (DEEPINFER_HC_POST_MIX=PIN_F:1): their GPU tests (bit
    # identity against the split-sum kernel / the unpinned build), then the b1 / b8 / b32 steps with each, alternated
    step gpu_tests_s48 240 python -m pytest -q -m gpu tests/test_kernels_split_k.py tests/test_kernels_hc_post_pre.py \
        tests/test_kernels_attn_norm_rope.py tests/test_kernels_swiglu.py tests/test_engine_fast_decode.py \
        -k "split or hc_post or norm_rope or swiglu"
    step decode_anatomy_s48b 240 python benchmarks/decode_anatomy.py --layers 4 --batches 1 8 32 --top 14 \
        --env-sets "" DEEPINFER_SPLIT_SUM=qkv DEEPINFER_SPLIT_SUM=post DEEPINFER_SPLIT_SUM=swiglu \
        DEEPINFER_HC_POST_MIX=PIN_F:1 DEEPINFER_QKV_PROGRAMS=2 DEEPINFER_SPLIT_SUM=consumer,DEEPINFER_HC_POST_MIX=PIN_F:1 ""
    ;;
s48a)  # owed since e5dff6a's refactor: the serial split's GPU tests (the three files, as s46 ran them), then the
    # headline on this card (the forty-first session's first H200 call)
    step gpu_tests_s48_serial 240 python -m pytest -q -m gpu tests/test_kernels_fp8_linear_mma.py \
        tests/test_kernels_grouped_proj.py tests/test_kernels_fp8_linear_wgmma.py
    step run_slice_headline 330 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 32 128 --prefills 8192 \
        --no-breakdown
    ;;
s47t)  # every test the fortieth session's changes owe (with s45 re-applied in the working tree): the new kernels'
    # GPU tests, then the engine's decode and prefill paths with the defaults (their ops' default forms changed
    # wrappers: sparse_attn_sink_qnorm, compress_decode_store, stable_topk_rows) and with all three fusions on
    step gpu_tests_s47_kernels 200 python -m pytest -q -m gpu tests/test_kernels_indexer_scores.py \
        tests/test_kernels_indexer_paged.py tests/test_kernels_attn_paged.py tests/test_kernels_attn_wgmma.py \
        tests/test_kernels_compress_decode.py tests/test_kernels_topk_positions.py
    step gpu_tests_s47_engine 190 python -m pytest -q -m gpu tests/test_engine_fast_decode.py \
        tests/test_engine_fast_prefill.py
    DEEPINFER_ATTN_QNORM=kernel DEEPINFER_COMPRESS_STORE=fused DEEPINFER_TOPK_ROWS=fused step \
        gpu_tests_s47_engine_fused 190 python -m pytest -q -m gpu tests/test_engine_fast_decode.py \
        tests/test_engine_fast_prefill.py
    ;;
s47p)  # the A/Bs: decode b1 / b32 with each fusion and all three, then the 8k prefill with the query norm in the
    # attention kernel and without
    step decode_anatomy_s47 200 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 --top 12 \
        --env-sets "" DEEPINFER_ATTN_QNORM=kernel DEEPINFER_COMPRESS_STORE=fused DEEPINFER_TOPK_ROWS=fused \
        DEEPINFER_ATTN_QNORM=kernel,DEEPINFER_COMPRESS_STORE=fused,DEEPINFER_TOPK_ROWS=fused "" \
        DEEPINFER_ATTN_QNORM=kernel,DEEPINFER_COMPRESS_STORE=fused,DEEPINFER_TOPK_ROWS=fused
    step run_slice_prefill_qnorm 280 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 \
        --top 12 --prefill-env-sets "" DEEPINFER_ATTN_QNORM=kernel "" DEEPINFER_ATTN_QNORM=kernel
    ;;
s47i)  # s45's timing: the indexer ops with the head sum change and before it (old_tree/), then s46c
    step bench_indexer_s45 100 python benchmarks/bench_attn_kernels.py --indexer --indexer-paged
    if [ -d old_tree ]; then
        (cd old_tree && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks step bench_indexer_s45_before 100 \
            python benchmarks/bench_attn_kernels.py --indexer --indexer-paged)
    fi
    step run_slice_prefill_topk 300 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 \
        --top 12 --prefill-env-sets "" DEEPINFER_STABLE_TOPK=kernel
    ;;
s47a)  # (superseded by s47t / s47p / s47i, which ran on the fortieth session's H100) the fortieth session's: s45 (the indexer's head sum; re-apply 0e5727f in the working tree
    # first, old_tree/ = HEAD before it, as s45 says) and two opt-in fusions: the query's per-head norm and RoPE
    # in the attention kernels (DEEPINFER_ATTN_QNORM=kernel; default "launch": head_rms_norm_rope's own launch):
    # decode on the paged Triton kernel's q load (sparse_attn_paged.py QNORM), prefill in the wgmma kernel's
    # shared memory (sparse_attn_wgmma.cu QNORM); the KV compressors' RoPE and packed store in the compressor
    # kernel's epilogue (DEEPINFER_COMPRESS_STORE=fused, compress_decode.py STORE); an indexer layer's top-k and
    # its index rows in one kernel (DEEPINFER_TOPK_ROWS=fused, topk_positions.py). Tests first, then the A/Bs
    # (s47b has the engine's); make the faster ones the defaults
    step gpu_tests_s47a 300 python -m pytest -q -m gpu tests/test_kernels_indexer_scores.py \
        tests/test_kernels_indexer_paged.py tests/test_kernels_attn_paged.py tests/test_kernels_attn_wgmma.py \
        tests/test_kernels_compress_decode.py tests/test_kernels_topk_positions.py
    step bench_indexer_s45 100 python benchmarks/bench_attn_kernels.py --indexer --indexer-paged
    if [ -d old_tree ]; then
        (cd old_tree && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks step bench_indexer_s45_before 100 \
            python benchmarks/bench_attn_kernels.py --indexer --indexer-paged)
    fi
    step decode_anatomy_s47 200 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 --top 12 \
        --env-sets "" DEEPINFER_ATTN_QNORM=kernel DEEPINFER_COMPRESS_STORE=fused DEEPINFER_TOPK_ROWS=fused \
        DEEPINFER_ATTN_QNORM=kernel,DEEPINFER_COMPRESS_STORE=fused,DEEPINFER_TOPK_ROWS=fused "" \
        DEEPINFER_ATTN_QNORM=kernel,DEEPINFER_COMPRESS_STORE=fused,DEEPINFER_TOPK_ROWS=fused
    ;;
s47b)  # the engine's paths over s47a's changes with the norm in the kernels and without (decode, prefill,
    # V4.1's decode), the serial split's tests after e5dff6a's refactor, then the 8k prefill with
    # DEEPINFER_ATTN_QNORM=kernel against the default (if faster and the tests pass: make "kernel" the default)
    DEEPINFER_ATTN_QNORM=kernel DEEPINFER_COMPRESS_STORE=fused DEEPINFER_TOPK_ROWS=fused step gpu_tests_s47b_fused \
        200 python -m pytest -q -m gpu tests/test_engine_fast_decode.py tests/test_engine_fast_prefill.py
    step gpu_tests_s47b 300 python -m pytest -q -m gpu tests/test_engine_fast_decode.py \
        tests/test_engine_fast_prefill.py tests/test_engine_fast_v41_decode.py tests/test_kernels_fp8_linear_mma.py \
        tests/test_kernels_fp8_linear_wgmma.py tests/test_kernels_grouped_proj.py
    ;;
s47c)  # the 8k prefill with the queries normed in the attention kernel and without, alternated (one process)
    step run_slice_prefill_qnorm 300 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 \
        --top 12 --prefill-env-sets "" DEEPINFER_ATTN_QNORM=kernel "" DEEPINFER_ATTN_QNORM=kernel
    ;;
s46)  # serial split-K in the decode linear (kernels/cuda/fp8_linear_mma.cu SERIAL_SPLIT: the tile's last split CTA
    # adds the fp32 partials in order, no _split_sum_kernel launch; 5 a layer on the b1 critical path): its GPU
    # tests (bit-identical to the separate sum, counters put back, replays), the seven decode shapes' three sums,
    # the combine's heads, the wgmma form's sums. (Ran on the thirty-ninth session's H100, with s46b's b1 / b32
    # steps and s46_engine's first two files: passed; serial slower from 8 rows, a tie at 1: made opt-in)
    step gpu_tests_s46 300 python -m pytest -q -m gpu tests/test_kernels_fp8_linear_mma.py tests/test_kernels_grouped_proj.py \
        tests/test_kernels_fp8_linear_wgmma.py tests/test_kernels_topk_positions.py tests/test_kernels_compress_decode.py \
        tests/test_kernels_attn_paged.py tests/test_kernels_attn_paged_mixed.py \
        -k "serial or cluster or graph or sync_form or wgmma_form or twin_v4 or gpu or cuda"
    step bench_linear_sync_s46 150 python benchmarks/bench_linear_sync.py --ms 1,8 --variants "sync split sum,sync cluster sum,sync serial sum"
    step bench_decode_attn_combine_s46 90 python benchmarks/bench_decode_attn.py --combine
    step bench_linear_wgmma_s46 150 python benchmarks/bench_linear_sync.py --ms 32,128 --variants "wgmma split sum,wgmma serial sum"
    ;;
s46b)  # the steps with the serial split and without, with stable_topk's kernel and without (the indexer layers'
    # torch sort), alternated (the combine's heads: every set has them)
    step decode_anatomy_s46 300 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 --top 12 \
        --env-sets "" DEEPINFER_LINEAR_SERIAL_SPLIT=1 DEEPINFER_STABLE_TOPK=torch "" DEEPINFER_LINEAR_SERIAL_SPLIT=1
    ;;
s46c)  # (ran in the fortieth session as s47i's last step: not faster, the sort stays) the 8k prefill with stable_topk's kernel (DEEPINFER_STABLE_TOPK=kernel; by default only decode-sized calls
    # of <= 256 rows take it) and with the torch sort (the default there: 8192 rows of the scores a call). If the
    # kernel is faster, raise topk_positions.STABLE_TOPK_MAX_ROWS
    step run_slice_prefill_topk 300 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 \
        --top 12 --prefill-env-sets "" DEEPINFER_STABLE_TOPK=kernel
    ;;
s46_engine)  # the engine's decode paths over the serial split
    step gpu_tests_s46_engine 400 python -m pytest -q -m gpu tests/test_engine_fast_decode.py tests/test_engine_fast.py \
        tests/test_engine_fast_v41_decode.py
    ;;
s45)  # (ran in the fortieth session within s47t / s47i: passed, faster, landed) the indexer's head sum within a thread's quad (`indexer.head_sum` as keys x q^T: the heads on the MMA's N; the
    # sm_90 build's hot loop 1071 -> 671 instructions, 104 -> 8 shuffles). Written in the thirty-eighth session as
    # 0e5727f and reverted (8c3c599) because no device time was left to run it. Before the call, here:
    #   mkdir old_tree && git archive HEAD deepinfer benchmarks/bench_attn_kernels.py benchmarks/timing.py \
    #       benchmarks/ceilings.py | tar -x -C old_tree && git cherry-pick -n 0e5727f
    # Then: its GPU tests (the paged decode kernel's rows bit-identical to the pair kernel's, the twin's bound), the
    # ops against the tree before (old_tree/), the engine's paths over it. If they pass and it is faster, commit it
    step gpu_tests_s45 200 python -m pytest -q -m gpu tests/test_kernels_indexer_scores.py tests/test_kernels_indexer_paged.py
    step bench_indexer_s45 120 python benchmarks/bench_attn_kernels.py --indexer --indexer-paged
    if [ -d old_tree ]; then
        (cd old_tree && PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks step bench_indexer_s45_before 120 \
            python benchmarks/bench_attn_kernels.py --indexer --indexer-paged)
    fi
    step gpu_tests_s45_engine 240 python -m pytest -q -m gpu tests/test_engine_fast_decode.py tests/test_engine_fast_prefill.py
    ;;
s44)  # (ran on the thirty-eighth session's H100: 8192 x 8 made the default) the prefill gathers and hc collapse: act_quant_gather's program sizes at the 8k
    # prefill's two shapes against the copy rate (its 8 calls took 2.5 ms of the H200's 8k prefill, ~3x their
    # bytes at the copy rate), hc_pre / hc_head at 2k / 8k under the collapse's warps, then the slice's 8k
    # prefill blocks with the gathers' larger programs in alternated rounds (DEEPINFER_GATHER_PLAN). A faster
    # plan becomes act_quant.GATHER_ELEMS / GATHER_WARPS
    step bench_act_quant_gather 120 python benchmarks/bench_act_quant_gather.py
    step bench_hc_pre_prefill 150 python benchmarks/bench_hc_post_pre.py --pre --ts 2048 8192
    step run_slice_prefill_gather 240 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 \
        --top 12 --prefill-env-sets "" "DEEPINFER_GATHER_PLAN=elems:4096;warps:8" "DEEPINFER_GATHER_PLAN=elems:8192;warps:8"
    ;;
s42)  # the experts' two-fragment-buffer plans without ptxas's serialization (thirty-seventh session: no accumulator
    # pins while a wgmma group is in flight; the default plans' cubins are byte-identical): the FRAG_BUFS 2 GPU tests,
    # then the rows at 2k / 8k against the plans. A faster row becomes its regime's plan. (Ran on the thirty-eighth
    # session's H100: passed, slower; its bench rows are gone from WGMMA_VARIANTS)
    step gpu_tests_s42 240 python -m pytest -q -m gpu -x tests/test_kernels_fp4_moe_wgmma.py -k "f2 or op_"
    step bench_fp4_moe_wgmma_s42 300 python benchmarks/bench_fp4_moe.py --wgmma --ts 2048,8192
    ;;
s41)  # WGMMA_MIN_TOKENS 64 -> 8 (kernels/triton/sparse_attn.py: the unserialized CUDA attention beat Triton from T = 8
    # on the thirty-seventh session's H100 and from 16 on its H200): the engine's prefill / extend GPU tests with the
    # CUDA form forced at every T (DEEPINFER_ATTN_PREFILL_KERNEL=wgmma), then the kernel tests; if they pass, set 8
    # (ran on the thirty-eighth session's H100: passed, set)
    DEEPINFER_ATTN_PREFILL_KERNEL=wgmma step gpu_tests_s41_engine 240 python -m pytest -q -m gpu \
        tests/test_engine_fast_prefill.py tests/test_engine_fast.py
    step gpu_tests_s41_attn 120 python -m pytest -q -m gpu tests/test_kernels_attn_wgmma.py tests/test_kernels_attn.py \
        -k "wgmma or sparse or dispatch"
    ;;
ncu_experts)  # what bounds the prefill experts' GEMM (neither the unserialized pipeline, s39, nor multicast
    # activations, 5ce02ec, made it faster): Nsight Compute on the gated and the plain launch at T = 8192, the
    # default plan and PRODUCER_WARP 0 (128 registers, no C7511). (Ran on the thirty-seventh session's H100:
    # results/ncu_experts_*_h100_2026-12-07_s37.txt, without the stall reasons: the --metrics line was added after)
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    for form in ${NCU_FORMS:-default pw0}; do
        cfg='{}'; [ $form = pw0 ] && cfg='{"PRODUCER_WARP": 0}'
        step ncu_experts_$form 200 "$NCU" --kernel-name fp4_expert_gemm_wgmma --launch-skip 2 --launch-count 2 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
            --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
            python benchmarks/profile_fp4_moe_ncu.py --t 8192 --config "$cfg"
    done
    ;;
s39)  # the thirty-seventh session's experts kernel without a producer warp (fp4_moe_wgmma PRODUCER_WARP 0: thread 0
    # issues the TMA, 16 warps a CTA get 128 registers and ptxas no longer serializes the 4-warpgroup tiles' wgmmas,
    # C7511): its GPU tests (every pipeline form with PRODUCER_WARP 0), then the tiles at the 1k / 2k / 8k prefills'
    # slot counts against the current plans. If a PRODUCER_WARP 0 row is faster, it becomes its regime's plan
    step gpu_tests_s39 240 python -m pytest -q -m gpu -x tests/test_kernels_fp4_moe_wgmma.py -k "pw0 or op_"
    step bench_fp4_moe_wgmma_s39 300 python benchmarks/bench_fp4_moe.py --wgmma --ts 1024,2048,8192
    ;;
s38)  # the thirty-sixth session's sparse attention on wgmma (kernels/cuda/sparse_attn_wgmma.cu): its GPU tests with
    # the Triton form's (both builds: the default and PIPELINED_QK, whose wgmmas ptxas no longer serializes; untested
    # on a GPU until this runs), then the forms at the 8k prefill's index rows and the T crossover. If the
    # PIPELINED_QK build passes and is faster, make it the default (the zeroing pin; drop
    # DEEPINFER_ATTN_WGMMA_PIPELINED). The default build's source was refactored after its last GPU run (90a1787: same
    # math, SASS the same up to scheduling): these tests are its first run too. (Ran on an H200 in the thirty-seventh
    # session: PIPELINED_QK is now the default build, pipelined=False the serialized one the bench compares)
    step gpu_tests_s38 240 python -m pytest -q -m gpu -x tests/test_kernels_attn_wgmma.py tests/test_kernels_attn.py \
        -k "wgmma or sparse or dispatch" -s
    step bench_sparse_attn_prefill 200 python benchmarks/bench_sparse_attn_prefill.py
    ;;
s38_slice)  # the 8k prefill of the slice, the blocks with each attention form in alternated rounds on one engine
    # (and the default's breakdown), then the engine's prefill paths' GPU tests (real-dim ones take the CUDA form)
    step run_slice_prefill_ab 200 python benchmarks/run_slice.py --layers 4 --no-hf --batches --prefills 8192 --top 12 \
        --prefill-env-sets DEEPINFER_ATTN_PREFILL_KERNEL=triton ""
    step gpu_tests_s38_engine 200 python -m pytest -q -m gpu tests/test_engine_fast_prefill.py tests/test_engine_fast.py
    ;;
v41_hc)  # V4.1's decode after the thirty-fifth session's hc plans (num_stages 1 for the mix kernel's decode plan: V4.1
    # runs it in every sublayer's hc_pre_deferred_fused; not timed on V4.1): its slice's b1 / b8 / b32 steps
    step bench_v41_decode_hc 200 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 6
    ;;
headline)  # the numbers with the current defaults against the ceilings of the same run: the b1 roofline
    # (back to back, head excluded), b32 / b128, the 8k prefill against the FP8 peak (thirty-fifth session: H100)
    step run_slice_headline 300 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 32 128 --prefills 8192 \
        --no-breakdown
    ;;
timeline)  # the critical path at b1 / b128 with this session's defaults (PDL off: true kernel times)
    DEEPINFER_PDL=0 step decode_timeline 240 python benchmarks/decode_anatomy.py --layers 4 --batches 1 128 \
        --top 8 --timeline 140
    ;;
timeline)  # the b1 / b32 / b128 replays' critical path and main stream in order, PDL off (true kernel times): which
    # kernels and side-stream joins bound a decode layer (its b1 part ran on an H100 in the thirty-third session)
    DEEPINFER_PDL=0 step decode_timeline 240 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 \
        --top 8 --timeline 140
    ;;
s30d)  # routing at prefill sizes for both families' expert counts: where the per-expert kernel stops beating the
    # torch sort (PARALLEL_ROUTING_SLOTS was set from E = 256 on the H200; V4.1's 4k prefill, 24,576 slots over
    # 384 experts, took 236 us a call on it on the H100)
    step bench_routing_s30d 200 python benchmarks/bench_routing.py --experts 256 384 --ts 512 1024 2048 3072 4096 \
        8192 --parallel-max 49152
    ;;
s30c)  # the indexer's chunk rule (fewer blocks a program for small grids; T = 1, E = 65536 had taken 22.2 us with
    # 8-block chunks on the H100) and the lone token's skipped work: its tests, the op, V4.1's prefill kernels
    step gpu_tests_s30c 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_indexer_scores.py \
        tests/test_kernels_indexer_paged.py tests/test_kernels_attn.py -k indexer
    step bench_indexer_s30c 100 python benchmarks/bench_attn_kernels.py --indexer
    ;;
s30b)  # the thirtieth session's second round: grouped_proj_fp8's dequant form through grouped_proj_bf16_cublas (no
    # permuted view for wo_b's flatten to copy), the embed's cat; then the 8k prefill and its ops by shape
    step gpu_tests_s30b 300 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_grouped_proj.py \
        tests/test_kernels_bf16_gemm.py tests/test_engine_fast_prefill.py
    step prefill8k_s30b 200 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 --prefills 8192 --top 16
    step profile_ops_8k_s30b 150 python benchmarks/profile_ops.py --layers 4 --prefill 8192 --decode 0 --top 30
    ;;
s30_tests)  # one call's worth: s29d's GPU tests and the indexer's pair kernel's (s30a in the step names), then the
    # indexer op before / after (s30_bench follows)
    step gpu_tests_s29d 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp4_moe_wgmma.py
    step gpu_tests_s29d_tma 100 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp4_moe_tma.py \
        -k default
    step gpu_tests_s30a 330 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_indexer_scores.py \
        tests/test_kernels_indexer_paged.py tests/test_engine_fast_prefill.py tests/test_engine_fast_v41_extend.py
    step bench_indexer_s30a 100 python benchmarks/bench_attn_kernels.py --indexer
    if git worktree add -q /tmp/before 0190088^ 2>/dev/null; then  # the kernel before, through this bench script
        cp benchmarks/bench_attn_kernels.py /tmp/before/benchmarks/
        (cd /tmp/before && PYTHONPATH=/tmp/site:/tmp/before:/tmp/before/benchmarks step bench_indexer_before 100 \
            python benchmarks/bench_attn_kernels.py --indexer)
    else
        echo "no git here: the kernel before is not timed"
    fi
    ;;
s30_bench)  # the other call: V4.1's prefill with s29d's expert changes, the 8k prefill's kernels and its ops
    step bench_v41_prefill_wgmma_experts 150 python benchmarks/bench_v41_decode.py --batches --prefills 1024 4096 \
        --graphs --top 8
    step prefill8k_s30a 240 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 --prefills 8192 --top 16
    step profile_ops_8k_s30a 150 python benchmarks/profile_ops.py --layers 4 --prefill 8192 --decode 0 --top 30
    ;;
s29d)  # owed by the twenty-ninth session: the experts' wgmma form from 11 slots an expert (fp4_moe.WGMMA_SLOTS_PER_EXPERT,
    # 16 before; the H100's crossover, fp4_moe_crossover_h100_2026-12-06_s29.log): the dispatch test and the wgmma
    # form's tests, among them `act_quant_gather` compiled (now 4 slots a program at V4.1's I = 2304: the K = 2304
    # case), then V4.1's 1k / 4k prefill with both (s29: 33.1 / 61.0 ms; the experts on the TMA form at 1k, the 4k's
    # 8 operand gathers 4.0 ms)
    step gpu_tests_s29d 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp4_moe_wgmma.py
    step gpu_tests_s29d_tma 100 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp4_moe_tma.py \
        -k default
    step bench_v41_prefill_wgmma_experts 150 python benchmarks/bench_v41_decode.py --batches --prefills 1024 4096 \
        --graphs --top 8
    ;;
s27f)  # the twenty-seventh session's last changes, not yet on a GPU: the cache codecs through the registry
    # (V4.1's varlen path now on the Triton codecs; V4's extend path through the same PackedStore methods), V4.1's
    # per-forward window rows and RoPE tables, PDL's one switch and device check (runtime.griddepcontrol_device,
    # the driver check before cuLaunchKernelEx; FastLaunch asking torch for the device once); then V4.1's prefill
    # timed (new --prefills; for the before, the same command on the tree at 508cf3d)
    step gpu_tests_s27f 420 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_v41.py \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast.py tests/test_extend_graphs.py tests/test_kernels_pdl.py \
        tests/test_kernels_launch.py tests/test_engine_fast_decode.py -k "not side_streams"
    step bench_v41_prefill 150 python benchmarks/bench_v41_decode.py --batches --prefills 1024 4096 --no-varlen
    ;;
crossover)  # the TMA decode form against the wgmma prefill form around WGMMA_SLOTS_PER_EXPERT (10), both families'
    # expert shapes (H100: fp4_moe_crossover_h100_2026-12-06_s29.log); run where the H100's numbers do not apply
    step fp4_moe_crossover_v4 150 python benchmarks/bench_fp4_moe.py --wgmma --ts 256,341,427,512,683
    step fp4_moe_crossover_v41 200 python benchmarks/bench_fp4_moe.py --wgmma --ts 512,640,704,768,896,1024 \
        --dims 384,6,5120,2304
    ;;
s28b)  # owed by the twenty-eighth session: V4's per-sequence reference path on the batched path's fused ops (its
    # GPU test failed since the nineteenth session's fusions: bisected on the H100 to 428cfe5 pass / c787048 fail)
    # and the review's mends after the last device run (PackedStore.ring_extend_rows in both families' extend
    # cores, ExtendGraphs._pieces_and_cores / _load_step for both families' graphs, V41Attention.index_keys_of /
    # store_entries on every V4.1 path, decode graphs included): behaviour unchanged on the CPU
    step gpu_tests_s28b 420 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_prefill.py \
        tests/test_engine_fast_v41_extend.py tests/test_extend_graphs.py tests/test_v41_extend_graphs.py \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py
    ;;
s28c)  # V4.1's prefill linears on the bf16 form (fp8_gemm.FP8_MMA_BLOCKS: the fp8 form from 1024 rows for 128-blocks
    # only): the kernel's tests, then the V4.1 slice's prefill and its kernels (s28: 43.1 ms at 1k, 94.5 at 4k, the
    # fp8-form linears 13.8 ms of the 1k's 44 ms of kernels) and the 32x32 rows of the kernel benchmark
    step gpu_tests_s28c 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp8_linear.py
    step bench_v41_prefill_bf16_linears 200 python benchmarks/bench_v41_decode.py --batches --prefills 1024 4096 \
        --graphs --top 16
    ;;
s28a)  # the twenty-eighth session (ran on an H100, see BENCHMARKS.md; the V4 prefill test's failure led to s28b): V4.1's batched extend path (model/v41_extend.py), the shared slot resets
    # (cache.SlotResets: V4's and V4.1's), V4.1's engine GPU tests with them
    step gpu_tests_s28a 420 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_v41_extend.py \
        tests/test_engine_fast_v41.py tests/test_engine_fast_v41_decode.py tests/test_engine_fast_prefill.py \
        tests/test_cache_reset.py
    # what the batched path gives: one prompt, and 16 prompts in one step, against the per-sequence path
    step bench_v41_prefill_batched 240 python benchmarks/bench_v41_decode.py --batches --prefills 1024 4096 \
        --per-sequence
    step bench_v41_prefill_16 200 python benchmarks/bench_v41_decode.py --batches --prefills 2048 --prefill-seqs 16 \
        --per-sequence
    ;;
s27e)  # PDL on and off: the 1k / 8k prefill and the b1 step against the ceilings of the same run
    step run_slice_pdl 240 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 --prefills 1024 8192 \
        --no-breakdown
    DEEPINFER_PDL=0 step run_slice_nopdl 240 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 \
        --prefills 1024 8192 --no-breakdown
    ;;
s27d)  # the ratios against transformers with the current defaults (PDL on; last measured in the
    # twenty-second session)
    step engine_slice_s27 560 python benchmarks/bench_engine_slice.py --layers 4 --batches 1 32 128 --async-modes on \
        --output-kind final_only --transformers --env-sets ""
    ;;
s27b)  # programmatic dependent launch on every Triton and CUDA kernel: the CUDA kernels' GPU tests (their sources
    # changed), the rule's tests, decode with PDL against without (bit-identical, side streams, graphs), the engine
    step gpu_tests_pdl_cuda 330 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_pdl.py \
        tests/test_kernels_fp8_linear_mma.py tests/test_kernels_fp4_moe_mma.py tests/test_kernels_fp4_moe_tma.py \
        tests/test_kernels_fp8_linear_wgmma.py tests/test_kernels_fp4_moe_wgmma.py tests/test_kernels_fp8_linear_prefill.py
    step gpu_tests_pdl_engine 250 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_decode.py \
        tests/test_engine_fast.py
    ;;
s27c)  # what PDL gives the decode steps: the V4-Flash slice's anatomy with it and without, V4.1's slice both ways
    step decode_anatomy_pdl 330 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 --top 30 \
        --env-sets "" DEEPINFER_PDL=0
    step bench_v41_decode_pdl 110 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 6
    DEEPINFER_PDL=0 step bench_v41_decode_nopdl 110 python benchmarks/bench_v41_decode.py --batches 1 8 32 \
        --context 2048 --top 6
    ;;
s27a)  # owed from the twenty-sixth session's review (the embed mends: V4.1's varlen and batched decode, V4's
    # decode_step; topk_positions' empty-input guard), then what PDL with an early trigger saves
    step gpu_tests_s26_review 330 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_topk_positions.py tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py \
        tests/test_engine_fast_decode.py -k "topk or graph or v41"
    step bench_pdl 200 python benchmarks/bench_pdl.py
    ;;
s26d)  # V4.1's wk kept bf16 (the GEMV / cuBLAS bf16 instead of cuBLAS fp32): V4.1's decode and engine GPU tests, the slice
    step gpu_tests_v41_wk 300 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py
    step bench_v41_decode_wk 130 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 10
    ;;
s26c)  # linear_f32 at V4.1-Flash's decode shapes (K 5120: the MoE gate N 384 took cuBLAS's 3-CTA fp32 kernel at
    # b8, 2 x 51 us a step), then the owed 1k / 8k prefill A/B
    step bench_gemv_v41 120 python benchmarks/bench_gemv.py --k 5120 --ns 64,384,512,1024,2048 --no-sweep --budget 90
    bash "$0" prefill_ab
    ;;
s26b)  # V4.1's top-k in position order (topk_positions): its GPU test, V4.1's decode and engine GPU tests with it,
    # the slice's decode steps
    step gpu_tests_topk_positions 200 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_topk_positions.py tests/test_kernels_attn.py -k "topk"
    step gpu_tests_v41_topk 300 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py
    step bench_v41_decode_topk 130 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 10
    ;;
s26a)  # the TMA expert form on any K (the bank's 16-byte scale rows): its GPU tests (V4.1-Flash's w2 K = 2304 new),
    # then the V4.1 slice's decode with it (the default) and with the mma.sync form it replaces there
    step gpu_tests_tma_any_k 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp4_moe_tma.py
    step bench_v41_decode_tma 130 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 8
    DEEPINFER_MOE_DECODE_KERNEL=mma step bench_v41_decode_mma 130 python benchmarks/bench_v41_decode.py \
        --batches 8 32 --context 2048 --top 4
    ;;
s25b)  # what the twenty-fifth session's review changed after its last device run: V4.1's decode on V4's
    # decode_select_rows, hc_pre through the shared _hc_pre, the shared replay-vs-eager helper (both families),
    # bench_v41_decode as a SliceRunner subclass
    step gpu_tests_s25b_kernels 120 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_hc_pre_deferred.py tests/test_kernels_hc_post_pre.py
    step gpu_tests_s25b_decode 330 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py tests/test_engine_fast_decode.py -k \
        "graph or v41"
    step bench_v41_decode_s25b 130 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 12
    ;;
s25)  # V4.1's batched decode path (graphs) and its kernels (deferred hc_pre, the E4M3-scaled FP4 latent decode,
    # the gate with V4.1's renormalisation, the two-layout paged attention): their GPU tests and the V4.1 engine's, then the slice's decode steps
    step gpu_tests_v41_kernels 120 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_hc_pre_deferred.py tests/test_kernels_decode.py tests/test_kernels_attn_paged_mixed.py
    step gpu_tests_v41_decode 300 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_engine_fast_v41_decode.py tests/test_engine_fast_v41.py
    step bench_v41_decode 240 python benchmarks/bench_v41_decode.py --batches 1 8 32 --context 2048 --top 30
    ;;
fp8_prefill)  # the twenty-third session's kernels: the prefill FP8 linear CUDA kernel and the experts' trimmed
    # routing blocks: their tests, then each against what it replaces
    step gpu_tests_s23_kernels 230 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_fp8_linear_prefill.py tests/test_kernels_fp4_moe_wgmma.py
    step bench_fp8_prefill 130 python benchmarks/bench_fp8_prefill.py --ms 1024 8192 --sweep
    step bench_fp4_moe_trim 170 python benchmarks/bench_fp4_moe.py --wgmma --ts 2048,8192
    ;;
s24b)  # the extend graphs after the bind fix: their GPU tests (the bound-model one new) and the engine's
    step gpu_tests_extend_graphs_bind 200 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_extend_graphs.py tests/test_engine_fast.py -k "extend_graphs or llm_fast_cuda"
    ;;
s24a)  # the extend graphs: GPU tests (and the engine's with them on and off), the prefill eager vs graphs
    step gpu_tests_extend_graphs 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_extend_graphs.py \
        tests/test_engine_fast.py -k "extend_graphs or llm_fast_cuda"
    step bench_extend_graphs 200 python benchmarks/bench_extend_graphs.py --layers 4 --tokens 256 512 1024 2048
    ;;
s23c)  # the least of s23b: the persistent form's tests and the sweep
    step gpu_tests_fp8_prefill 100 python -m pytest -m gpu -q -rf -p no:cacheprovider -x \
        tests/test_kernels_fp8_linear_prefill.py
    step bench_fp8_prefill 100 python benchmarks/bench_fp8_prefill.py --ms 1024 8192 --sweep
    ;;
s23b)  # the prefill FP8 kernel's persistent form (tests and the sweep), the trimmed experts at T=1024, the prefill A/B
    step gpu_tests_fp8_prefill 100 python -m pytest -m gpu -q -rf -p no:cacheprovider -x \
        tests/test_kernels_fp8_linear_prefill.py
    step bench_fp8_prefill 100 python benchmarks/bench_fp8_prefill.py --ms 1024 8192 --sweep
    step bench_fp4_moe_trim_1024 45 python benchmarks/bench_fp4_moe.py --wgmma --ts 1024
    bash "$0" prefill_ab
    ;;
prefill_ab)  # the 1k / 8k prefill with the prefill FP8 linears on the CUDA kernel and on the Triton form
    for form in wgmma triton; do
        DEEPINFER_LINEAR_PREFILL_KERNEL=$form step prefill_slice_$form 110 python benchmarks/run_slice.py --layers 4 \
            --no-hf --batches --prefills 1024 8192 --no-breakdown
    done
    ;;
tests)  # the twenty-first session's defaults on the H200 (they ran on an H100): cluster split-K up to 4 splits,
    # lanes, wo_a FP8 with its wgmma form; V4.1's fast path with wo_a FP8 (block 32) has run on no GPU yet
    step gpu_tests 330 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels_fp8_linear_mma.py \
        tests/test_kernels_fp8_linear_wgmma.py tests/test_kernels_grouped_proj.py tests/test_side_stream.py
    step gpu_tests_engine 250 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_decode.py \
        tests/test_engine_fast.py tests/test_engine_fast_v41.py
    ;;
anatomy)  # where the b1 / b32 / b128 steps go: the defaults against the switches' old values; then wo_a bf16 (read
    # when the params are made: its own process)
    step decode_anatomy 300 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 --top 45 \
        --env-sets "" DEEPINFER_INDEXER_LANES=0,DEEPINFER_LINEAR_CLUSTER_SPLIT=0
    DEEPINFER_WO_A_FP8=0 step decode_anatomy_wo_a_bf16 250 python benchmarks/decode_anatomy.py --layers 4 \
        --batches 1 32 128 --top 45
    ;;
linears)  # wo_a's forms and the cluster split-K, op by op
    step grouped_proj 150 python benchmarks/bench_grouped_proj.py --ts 1 8 32 128 --no-sweep
    step linear_sync 200 python benchmarks/bench_linear_sync.py --ms 1,8 --variants "split sum,cluster sum"
    ;;
prefill)  # the 1k / 8k prefill with every change since the eleventh session (its last kernel breakdown)
    step prefill_slice 400 python benchmarks/run_slice.py --layers 4 --no-hf --batches 1 --prefills 1024 8192 --top 40
    ;;
slice_defaults)  # the ratios against transformers with the defaults only (one engine: fits a call with room)
    step engine_slice_defaults 560 python benchmarks/bench_engine_slice.py --layers 4 --batches 1 32 128 \
        --async-modes on --output-kind final_only --transformers --env-sets ""
    ;;
slice)  # the issue's ratios against transformers, the defaults and the switches' old values
    step engine_slice 580 python benchmarks/bench_engine_slice.py --layers 4 --batches 1 32 128 --async-modes on \
        --output-kind final_only --transformers --env-sets "" \
        DEEPINFER_INDEXER_LANES=0,DEEPINFER_LINEAR_CLUSTER_SPLIT=0,DEEPINFER_WO_A_FP8=0
    ;;
*)
    echo "unknown stage $stage: s24b, s24a, fp8_prefill, s23b, s23c, prefill_ab, tests, anatomy, linears, prefill or slice"
    exit 2
    ;;
esac
