#!/usr/bin/env bash
# The H200 probe of SGLang 0.5.23 with the minite_nvfp4 plugin, in one command (docs/sglang.md, "SGLang on the H200").
# On a GPU machine that reaches no registry, with .sglwhl/ (tools/sglang_gpu_bundle.sh) carried in the working tree:
#   bash tools/sglang_gpu_probe.sh "$OUT" [BUDGET_SECONDS]
# installs the wheels with pip --no-index --no-deps into /tmp/sgl, makes miniTE's `sglang.srt.plugins` entry point
# visible to SGLang's processes (a dist-info beside the wheels; the repository itself is on PYTHONPATH), then runs
# tools/sglang_gpu_probe.py, which writes probe.json, probe.log and probe_table.txt to OUT and prints the table.
# Where the wheels do not fit (another Python, a CPU dry run), it says so and probes the environment as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-/tmp/sglang_gpu_probe}
BUDGET=${2:-200}
mkdir -p "$OUT_DIR"
SITE=/tmp/sgl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3
echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
if ls .sglwhl/*.whl >/dev/null 2>&1 && $PY -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  t0=$(date +%s)
  if $PY -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" .sglwhl/*.whl >"$OUT_DIR/pip_install.log" 2>&1; then
    echo "installed $(ls .sglwhl/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"
  else
    echo "pip install of .sglwhl failed (tail of $OUT_DIR/pip_install.log):"; tail -5 "$OUT_DIR/pip_install.log"
  fi
  EP="$SITE/minite_sglang_probe-0.0.0.dist-info"
  mkdir -p "$EP"
  printf 'Metadata-Version: 2.1\nName: minite-sglang-probe\nVersion: 0.0.0\n' >"$EP/METADATA"
  printf '[sglang.srt.plugins]\nminite_nvfp4 = minite.rollout.sglang.plugin:register\n' >"$EP/entry_points.txt"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .sglwhl wheels for this Python (need 3.12 and tools/sglang_gpu_bundle.sh): probing the environment as it is"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY tools/sglang_gpu_probe.py --out "$OUT_DIR" --budget "$BUDGET" "${@:3}"
