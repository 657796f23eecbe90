#!/usr/bin/env bash
# One set-up command for a working CPU install (the README's): torch, miniTE editable with its pinned upstreams,
# and the test tools. Run from the repository root: `bash tools/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore"
# torch first and pinned, so that no later requirement range pulls a multi-GB CUDA build on a CPU machine.
$PIP "torch==2.13.0"
$PIP -e ".[megatron,triton,tensorboard,transformers,dev]"
if [ -f tools/sglang_requirements.txt ]; then
  # sglang pins a CUDA torch: install it without its dependencies, then its pure-Python ones (NOTES.md section 5).
  $PIP --no-deps "sglang==0.5.23"
  $PIP -r tools/sglang_requirements.txt
fi
python3 -c "import torch, minite; print('minite', minite.__version__, 'torch', torch.__version__)"
