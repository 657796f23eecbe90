"""A failure inside SGLang's scheduler no longer ends the calling process: SGLang's own SIGQUIT handler kills the
whole process tree (the learner with it); the engine's handler (engine._contain_child_failures) marks the engine
failed, ends SGLang's processes and makes the waiting call and every later one raise SGLangEngineFailed in one line.
The same while the engine starts (engine._launch_sigquit_handler: the start raises) and between the start and the
first request. Run in subprocesses (were the containment to fail, SGLang would kill the process that runs it)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.rollout.sglang.conftest import STUBS, sglang_skip_reason

_REASON = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from tests.rollout.sglang.conftest import tiny_hf_checkpoint
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf
    from minite.nvfp4 import NVFP4Recipe
    from minite.rollout.base import SamplingParams
    from minite.rollout.sglang.engine import SGLangEngineFailed, iter_buckets, start_from_learner_tensors

    def main(tmp):
        hf = tiny_hf_checkpoint(Path(tmp) / "w1", seed=1)
        cfg = json.loads((hf / "config.json").read_text())
        cfg.pop("eos_token_id", None)
        w1 = [(n, t.clone()) for n, t in megatron_view_of_hf(_HFReader(hf), cfg)]
        eng = start_from_learner_tensors(w1, cfg, NVFP4Recipe())
        params = SamplingParams(temperature=1e-6, max_new_tokens=2, n=1, seed=0)
        eng.generate([[1, 2, 3]], params)  # SGLang's handler is installed with the first request
        # a tensor SGLang's load_weights raises on (its scheduler then signals this process)
        bad = [("model.layers.0.mlp.gate.weight", torch.zeros(3, 5, dtype=torch.bfloat16))]
        ok, msg = eng._load(iter_buckets(bad))
        print("load", ok, flush=True)
        for call in (lambda: eng.generate([[1, 2, 3]], params), lambda: eng.update_weights(w1)):
            try:
                call()
                print("no error", flush=True)
            except SGLangEngineFailed as e:
                print("failed:", e, flush=True)
        eng.shutdown()
        print("alive", flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
""")


def test_a_failed_scheduler_raises_instead_of_killing_the_caller(tmp_path):
    script = tmp_path / "child_failure.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (STUBS, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stdout.splitlines()
    assert lines[0] == "load False", proc.stdout
    assert [ln.startswith("failed: sglang rollout engine: an SGLang child process failed") for ln in lines[1:3]] == \
        [True, True], proc.stdout
    assert lines[-1] == "alive"
    assert not list(tmp_path.glob("minite-sglang-*"))


LAUNCH_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    import torch
    from tests.rollout.sglang.conftest import tiny_hf_checkpoint
    from minite.convert.export_nvfp4 import _HFReader, megatron_view_of_hf
    from minite.nvfp4 import NVFP4Recipe
    from minite.rollout.base import SamplingParams
    import minite.rollout.sglang.engine as E

    def main(tmp):
        hf = tiny_hf_checkpoint(Path(tmp) / "w1", seed=1)
        cfg = json.loads((hf / "config.json").read_text())
        cfg.pop("eos_token_id", None)
        w1 = [(n, t.clone()) for n, t in megatron_view_of_hf(_HFReader(hf), cfg)]
        pack = E.pack_for_sglang

        def bad_pack(*a, **k):  # a checkpoint SGLang's scheduler cannot load: it fails while the engine starts
            return [(n, torch.zeros(3, 5, dtype=torch.bfloat16) if n.endswith("mlp.gate.weight") else t)
                    for n, t in pack(*a, **k)]
        E.pack_for_sglang = bad_pack
        try:
            E.start_from_learner_tensors(w1, cfg, NVFP4Recipe())
            print("started", flush=True)
        except E.SGLangEngineFailed as e:
            print("failed:", e, flush=True)
        E.pack_for_sglang = pack
        eng = E.start_from_learner_tensors(w1, cfg, NVFP4Recipe())  # a good start after a failed one
        os.kill(os.getpid(), signal.SIGQUIT)  # a child failing before the first request
        try:
            eng.generate([[1, 2, 3]], SamplingParams(temperature=1e-6, max_new_tokens=2, n=1, seed=0))
            print("no error", flush=True)
        except E.SGLangEngineFailed as e:
            print("failed:", e, flush=True)
        eng.shutdown()
        print("alive", flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
""")


def test_a_scheduler_failing_at_start_raises_instead_of_killing_the_caller(tmp_path):
    script = tmp_path / "launch_failure.py"
    script.write_text(LAUNCH_SCRIPT)
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (STUBS, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # SGLang's own handler: -9
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("failed: sglang rollout engine: an SGLang child process failed while the engine "
                               "started"), proc.stdout
    assert lines[1].startswith("failed: sglang rollout engine: an SGLang child process failed"), proc.stdout
    assert lines[-1] == "alive"
    assert "custom SIGQUIT handler" not in proc.stderr  # SGLang's notice of the handler is filtered
    assert not list(tmp_path.glob("minite-sglang-*"))  # the failed start's temporary checkpoint is gone too
