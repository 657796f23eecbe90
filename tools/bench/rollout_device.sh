#!/usr/bin/env bash
# Issue 16 in one device call on one H200 (about 4 minutes): the GPU tests of the rollout's deferred NaN/Inf check,
# then tools/bench/bench_rollout.py (the 4-layer full-width slice: BF16/NVFP4, default/strict, batches, HBM floors,
# the plain-PyTorch CUDA-graph reference) into $OUT/rollout-h200.json, then its table. Each stage has its own time
# limit; the JSON is written after every row, so a cut-short run keeps what it measured.
#   MINITE_COMMIT=$(git rev-parse --short HEAD) bash tools/bench/rollout_device.sh
# Knobs: BATCHES (default 64,1,8,256: batch 64, the issue's goal row, first), T_TESTS, T_BENCH (seconds), SKIP_TESTS=1,
# BENCH_ARGS (more bench_rollout.py arguments, e.g. --precisions nvfp4 or --no-reference).
# As tools/gpu_acceptance.sh: megatron-core comes from .whl/ when the call carries it (the device has no registry);
# kernels/ and megatron_patches/ are linked into minite/ as setup.py installs them.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; cat "$OUT/pip.log"; exit 1; }
fi
[ -e minite/kernels ] || ln -s ../kernels minite/kernels
[ -e minite/megatron_patches ] || ln -s ../megatron_patches minite/megatron_patches
# TORCHDYNAMO_DISABLE: Megatron's jit_fuser is torch.compile; its compile time would eat the device budget (the
# learner-slice and alignment benchmarks ran the same way)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 MINITE_COMMIT=${MINITE_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  t0=$SECONDS
  timeout "${T_TESTS:-90}" python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/rollout/test_embedded_finite.py \
    >"$OUT/tests.log" 2>&1
  echo "== tests rc=$? $((SECONDS - t0))s: $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
fi
t0=$SECONDS
# shellcheck disable=SC2086
timeout "${T_BENCH:-200}" python3 tools/bench/bench_rollout.py --batches "${BATCHES:-64,1,8,256}" \
  --out "$OUT/rollout-h200.json" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
echo "== bench rc=$? $((SECONDS - t0))s"
grep -E "^(bf16|nvfp4|reference) " "$OUT/bench.log"
grep -E "Error|error" "$OUT/bench.log" | grep -v Warning | tail -5
[ -f "$OUT/rollout-h200.json" ] && python3 tools/bench/bench_rollout.py --render "$OUT/rollout-h200.json"
