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
  # sglang pins a CUDA torch: its pure-Python dependencies first, then sglang itself without dependencies. In this
  # order pip's resolver never sees an installed sglang whose CUDA requirements we leave out on purpose, so it has
  # no conflict to print as ERROR lines (--no-deps skips the check); a failed install still stops this script.
  $PIP -r tools/sglang_requirements.txt
  $PIP --no-deps "sglang==0.5.23"
fi
python3 -c "import torch, minite; print('minite', minite.__version__, 'torch', torch.__version__)"
