#!/usr/bin/env bash
# One device call: map kernels/ and megatron_patches/ into minite (links inside the device's copy of the tree), run the GPU tests
# and the kernel tests compiled, then the benchmarks; logs and the JSON go to $OUT.
# Usage: bash tools/bench/device_run.sh COMMIT [bench args...]
set -uo pipefail
COMMIT=${1:-unknown}; shift || true
[ -e minite/kernels ] || ln -s ../kernels minite/kernels
[ -e minite/megatron_patches ] || ln -s ../megatron_patches minite/megatron_patches
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MINITE_COMMIT=$COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee $OUT/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee -a $OUT/device.txt
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:--m gpu tests} -rs 2>&1 | tee $OUT/tests.log | grep -E "passed|failed|FAILED|Error" | tail -25
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  timeout ${BENCH_TIMEOUT:-330} python3 tools/bench/bench_nvfp4.py --out $OUT/kernels-h200.json "$@" 2>&1 | tee $OUT/bench.log | grep -v "^  File\|^    " | tail -70
fi
