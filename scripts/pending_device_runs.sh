# The device checks the nineteenth and twentieth sessions (2026-12-05) wrote without a GPU, in the order the
# next device run should take them; each stage bounded so one `run` call (10 minutes) brings its logs back.
#   source scripts/device_prelude.sh; bash scripts/pending_device_runs.sh tests     # with carry: [".whl"]
#   ... anatomy | linears | slice
# Logs go to $OUT (one file per step); each step's summary line is printed.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD/tests:$PWD/benchmarks
OUT=${OUT:-/tmp/out}
stage=${1:?stage: tests, anatomy, linears or slice}

step() {  # step NAME SECONDS COMMAND...: run it into $OUT/NAME.log, print its tail
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$?"
    tail -n 4 "$OUT/$name.log"
}

case $stage in
tests)  # the fused ops (default on since 2026-12-05), the lanes, the cluster split-K, wo_a's sync form, the gates
    step gpu_tests_kernels 330 python -m pytest -m gpu -q -rf -p no:cacheprovider \
        tests/test_kernels_attn_norm_rope.py tests/test_kernels_indexer_rotate.py tests/test_kernels_hc_post_pre.py \
        tests/test_kernels_attn_paged.py tests/test_kernels_decode.py tests/test_kernels_bf16_gemm.py \
        tests/test_side_stream.py tests/test_kernels_grouped_proj.py tests/test_kernels_fp8_linear_mma.py \
        tests/test_kernels_fp8_linear_wgmma.py -k "cluster or sync_form or not (fp8_linear or grouped_proj)"
    step gpu_tests_engine 240 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_engine_fast_decode.py \
        tests/test_kernels_attn.py
    ;;
anatomy)  # where the b1 / b32 / b128 steps go with each switch
    step decode_anatomy 560 python benchmarks/decode_anatomy.py --layers 4 --batches 1 32 128 --top 45 \
        --env-sets DEEPINFER_ATTN_FUSIONS=0 "" DEEPINFER_INDEXER_LANES=1 DEEPINFER_LINEAR_CLUSTER_SPLIT=1 \
        DEEPINFER_INDEXER_LANES=1,DEEPINFER_LINEAR_CLUSTER_SPLIT=1
    ;;
linears)  # the cluster split-K and wo_a's sync form, op by op
    step linear_sync 200 python benchmarks/bench_linear_sync.py --ms 1,8 --variants "split sum,cluster sum"
    step linear_wgmma 200 python benchmarks/bench_linear_sync.py --ms 32,128 --variants wgmma
    step grouped_proj 150 python benchmarks/bench_grouped_proj.py --ts 1 8 32 128 --no-sweep
    ;;
slice)  # the ratios against transformers, with and without the opt-in switches
    step engine_slice 580 python benchmarks/bench_engine_slice.py --layers 4 --batches 1 32 128 --async-modes on \
        --output-kind final_only --transformers --env-sets "" \
        DEEPINFER_INDEXER_LANES=1,DEEPINFER_LINEAR_CLUSTER_SPLIT=1
    ;;
*)
    echo "unknown stage $stage: tests, anatomy, linears or slice"
    exit 2
    ;;
esac
