#!/usr/bin/env bash
# The H200 probe of SGLang 0.5.23 with the minite_nvfp4 plugin, in one command (docs/sglang.md, "SGLang on the H200").
# On a GPU machine that reaches no registry, with .sglwhl/ (tools/sglang_gpu_bundle.sh) carried in the working tree:
#   bash tools/sglang_gpu_probe.sh "$OUT" [BUDGET_SECONDS]
# installs the wheels with pip --no-index --no-deps into /tmp/sgl, lays miniTE out there as installed (links into the
# checkout) with its `sglang.srt.plugins` entry point, so that SGLang's processes load the plugin, then runs
# tools/sglang_gpu_probe.py, which writes probe.json, probe.log and probe_table.txt to OUT and prints the table.
# Where the wheels do not fit (another Python, a CPU dry run), it says so and probes the environment as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-/tmp/sglang_gpu_probe}
BUDGET=${2:-200}
mkdir -p "$OUT_DIR"
SITE=${SGLANG_GPU_SITE:-/tmp/sgl}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3
echo "python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
WHL=${SGLANG_GPU_WHEELS:-.sglwhl}  # another folder: a dry run with a bundle built for this machine's Python
TAG=$($PY -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if ls "$WHL"/sglang-0.5.23-"$TAG"-*.whl >/dev/null 2>&1; then
  t0=$(date +%s)
  if $PY -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl >"$OUT_DIR/pip_install.log" 2>&1; then
    echo "installed $(ls "$WHL"/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - t0 )) s"
  else
    echo "pip install of .sglwhl failed (tail of $OUT_DIR/pip_install.log):"; tail -5 "$OUT_DIR/pip_install.log"
  fi
  # miniTE as installed (setup.py maps kernels/ and megatron_patches/ into minite), as links into this checkout,
  # and its entry point for SGLang's plugin loader; no build step, no setuptools needed
  rm -rf "$SITE/minite" && mkdir -p "$SITE/minite"
  for f in minite/*; do ln -s "$PWD/$f" "$SITE/minite/"; done
  ln -s "$PWD/kernels" "$SITE/minite/kernels" && ln -s "$PWD/megatron_patches" "$SITE/minite/megatron_patches"
  EP="$SITE/minite-0.1.0.dist-info"
  mkdir -p "$EP"
  printf 'Metadata-Version: 2.1\nName: minite\nVersion: 0.1.0\n' >"$EP/METADATA"
  printf '[sglang.srt.plugins]\nminite_nvfp4 = minite.rollout.sglang.plugin:register\n' >"$EP/entry_points.txt"
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no $WHL/sglang-0.5.23-$TAG-*.whl (tools/sglang_gpu_bundle.sh builds it): probing the environment as it is"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY tools/sglang_gpu_probe.py --out "$OUT_DIR" --budget "$BUDGET" "${@:3}"
