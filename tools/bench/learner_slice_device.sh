#!/usr/bin/env bash
# The learner slice on one H200 in one device call (about 3-4 minutes): the learner's GPU tests of the optimizer and
# memory changes, then bench_learner_slice.py, BF16 and NVFP4, 4 full-width Qwen3-30B-A3B layers, one 4096-token
# sequence and the RL-sized step (8 x 4096 tokens, gradient accumulation, one optimizer step), with each row's peak
# memory. Writes $OUT/learner-slice-h200.json and the logs. BLOCK_BENCH=1 adds the expert-block section of
# bench_nvfp4.py ($OUT/kernels-block.json: quant_dyT_rht_sr, quant_aT_rht and the block ratios; about 1 more minute).
#   OUT=/tmp/out bash tools/bench/learner_slice_device.sh
# megatron-core comes from .whl/ when the call carries it (the device reaches no registry), as tools/gpu_acceptance.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; exit 1; }
fi
[ -e minite/kernels ] || ln -s ../kernels minite/kernels
[ -e minite/megatron_patches ] || ln -s ../megatron_patches minite/megatron_patches
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/device.txt"
git rev-parse --short HEAD >>"$OUT/device.txt" 2>/dev/null
timeout "${TEST_TIMEOUT:-60}" python3 -m pytest -q -p no:cacheprovider -rs tests/learner/test_learner_gpu.py \
  -k "adam or kernels_vs_reference" >"$OUT/tests.log" 2>&1
echo "tests rc=$?: $(tail -1 "$OUT/tests.log")"
timeout "${BENCH_TIMEOUT:-200}" python3 tools/bench/bench_learner_slice.py --layers 4 --seq 4096 --steps 3 --warmup 1 \
  --micro-batches 1,8 --out "$OUT/learner-slice-h200.json" 2>&1 | tee "$OUT/bench.log" | grep '^{'
echo "bench rc=${PIPESTATUS[0]}"
if [ "${BLOCK_BENCH:-0}" = "1" ]; then
  timeout "${BLOCK_TIMEOUT:-90}" python3 tools/bench/bench_nvfp4.py --sections block --out "$OUT/kernels-block.json" \
    >"$OUT/block.log" 2>&1
  echo "block rc=$?"; grep -E "quant_dyT|quant_aT|ratio" "$OUT/block.log" | tail -6
fi
