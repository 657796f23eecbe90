#!/usr/bin/env bash
# One node, N processes (one per GPU): `minite train CONFIG` under torchrun.
#   tools/launch/torchrun.sh CONFIG [--set key=value ...]
#   NPROC_PER_NODE=8 LOG_DIR=logs/run1 tools/launch/torchrun.sh examples/qwen3_30b_a3b/1x8.yaml --set rl.steps=10
# Run it from anywhere: CONFIG, --set paths and the config's relative paths resolve from the caller's directory,
# exactly as for `minite train` (the script does not change directory).
# NPROC_PER_NODE defaults to the number of visible GPUs (nvidia-smi -L), else 1. LOG_DIR (default logs/<date-time>
# under the caller's directory; logs/ is git-ignored) receives one stdout/stderr pair per rank (torchrun --log-dir,
# <LOG_DIR>/<run id>/attempt_0/<rank>/), also teed to this terminal with a rank prefix. Environment set here (the
# library reads none of it): OMP_NUM_THREADS (CPU threads per rank: the cores this process may use, nproc, divided
# by NPROC_PER_NODE, at least 1; more threads than cores makes every rank wait on the others), TORCHDYNAMO_DISABLE=1
# without a GPU, NCCL_NVLS_ENABLE=0 (NVLink multicast off).
# MINITE_LAUNCH_ENTRY=path/to/script.py runs that script (same arguments) instead of `minite train` (tests, tools).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [--set key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
if [ ! -f "$CONFIG" ]; then
  echo "$0: config $CONFIG not found (relative paths resolve from $(pwd)): pass the path of a YAML config" >&2
  exit 2
fi
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${NPROC_PER_NODE:-0}" -ge 1 ] || NPROC_PER_NODE=1
fi
LOG_DIR=${LOG_DIR:-logs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOG_DIR"
CORES=$(nproc 2>/dev/null || echo 1)
THREADS=$(( CORES / NPROC_PER_NODE ))
[ "$THREADS" -ge 1 ] || THREADS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null 2>&1 || export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
echo "torchrun: 1 node x ${NPROC_PER_NODE} processes x ${OMP_NUM_THREADS} threads, config ${CONFIG}, logs in ${LOG_DIR}" >&2
exec torchrun --standalone --nnodes=1 --nproc-per-node="${NPROC_PER_NODE}" \
  --log-dir="${LOG_DIR}" --redirects=3 --tee=3 \
  ${MINITE_LAUNCH_ENTRY:--m minite.cli train} "${CONFIG}" "$@"
