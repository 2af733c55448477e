# The device checks the code of 2026-12-06 still owes, in the order the next device run should take them; each
# stage bounded so one `run` call (10 minutes) brings its logs back. The twenty-seventh session ran s27a (the
# twenty-sixth session's review), s27b-e (PDL: tests, anatomy, the slice against transformers, prefill), all on
# an H100 (passed; numbers in BENCHMARKS.md). The twenty-eighth session ran s27f's and s28a's tests and timings
# on an H100 (BENCHMARKS.md). The twenty-ninth session ran s28b, s28c and its own s29a-c on an H100 (passed; the
# stages as they were are in git history, the numbers in BENCHMARKS.md). The thirtieth session ran s29d and its
# own s30_tests, s30_bench, s30b and s30c on an H100 (passed; BENCHMARKS.md). The thirty-second session ran the
# thirty-first's s31a on an H100 (tests passed; both opt-in changes slower, removed with their stages s31a / s31b)
# and the new stage timeline at b1 / b128 (results/decode_timeline_*_h100_2026-12-07_s32.log). Still owed
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
stage=${1:?stage: timeline, slice_defaults, s30d, s30c, s30b, s30_tests, s30_bench, s29d, crossover, s28b, s28c, s28a, s27f, s27e, s27d, s27c, s27b, s27a, s26d, s26c, s26b, s26a, s25b, s25, s24b, s24a, fp8_prefill, s23b, s23c, prefill_ab, tests, anatomy, linears, prefill or slice}

step() {  # step NAME SECONDS COMMAND...: run it into $OUT/NAME.log, print its tail
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$?"
    tail -n 4 "$OUT/$name.log"
}

case $stage in
timeline)  # the b1 / b32 / b128 replays' main stream in order, PDL off (true kernel times): which kernels and
    # which side-stream joins make up a decode layer's critical path (stream_timeline.py)
    DEEPINFER_PDL=0 step decode_timeline 240 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 \
        --top 8 --timeline 140
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
