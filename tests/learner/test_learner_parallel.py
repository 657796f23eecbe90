"""TP=2 and EP=2 learners equal the unsharded learner on the same inputs (torchrun, 2 ranks, gloo, CPU).

One torchrun launch runs four configurations (BF16 and NVFP4, each with TP=2 and with EP=2; see
learner_parallel_worker.py); this wrapper launches it with a timeout and checks its JSON report:
- weights: the initial model gathered from its shards equals the unsharded one exactly (layout-invariant init);
- log-probs with every router replaying fixed routes (routing replay) agree as the plain ones do (under TP each
  rank's routers replay their slice of the sequence);
- BF16 (fp32 compute): log-probs, per-parameter gradients and log-probs after one Adam step agree to fp32 rounding;
- NVFP4: log-probs agree to fp32 rounding (the TP amax sync makes shards quantise like the unsharded tensor);
  gradients differ by stochastic-rounding noise no larger than two seeds of one layout differ (tolerances.py);
- a TP=2 model with a shared expert: its Learner.full_weights() loaded into the unsharded model reproduce its
  log-probs;
- TP=2 with clipped steps: every rank computes one grad norm, and the TP ranks' whole copies stay equal.
"""
import json
import shutil
from pathlib import Path

import pytest

from tests.distributed_backend import torchrun, worker_env
from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("learner_parallel_worker.py")
TIMEOUT_S = 300
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun launches



@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun on PATH (torch's launcher)")
    out = tmp_path_factory.mktemp("learner_parallel") / "report.json"
    env = worker_env(ROOT)
    proc = torchrun(WORKER, out, cwd=ROOT, env=env, timeout=TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"torchrun failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rep = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in rep.items() if "error" in v}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    return rep


CONFIGS = ["bf16_tp2_ep1", "nvfp4_tp2_ep1", "bf16_tp1_ep2", "nvfp4_tp1_ep2"]


@pytest.mark.parametrize("key", CONFIGS)
def test_sharded_equals_unsharded(report, key):
    r = report[key]
    assert r["weights_equal"], "initial weights differ between the sharded and the unsharded model"
    atol, rtol = TOLERANCES["learner_parallel_fp32"]
    assert r["logp0_max_abs"] <= atol, r
    assert r["logp_replay_max_abs"] <= atol < r["replay_moves_logp"], r  # the sharded routers replayed their rows
    assert abs(r["loss"] - r["loss_ref"]) <= atol, r
    if key.startswith("bf16"):
        assert r["grad_rel_max"] <= rtol, r
        assert r["grad_norm_rel"] <= rtol, r
        assert r["logp1_max_abs"] <= atol, r
    else:
        _, factor = TOLERANCES["learner_parallel_nvfp4_vs_seed_noise"]
        assert r["grad_rel_max"] <= factor * r["grad_rel_max_seed_to_seed"], r
        assert r["logp1_max_abs"] <= TOLERANCES["learner_parallel_nvfp4_logp_after_step"][0], r


def test_tp_shared_expert_full_weights_reproduce_logprobs(report):
    """Learner.full_weights() of a TP=2 model with a SwiGLU shared expert, loaded into the unsharded model, gives
    the same log-probs (the [gate_r; up_r] shards are reordered to [gate; up])."""
    atol, _ = TOLERANCES["learner_parallel_fp32"]
    assert report["bf16_tp2_shared_expert_full_weights"]["logp_max_abs"] <= atol


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_tp_ranks_clip_alike_and_keep_equal_replicas(report, precision):
    """TP=2, every step clipped: one grad norm on every rank, and the parameters both TP ranks hold whole (norms,
    routers, experts) still bitwise equal after three steps (Megatron-Core 0.16.1's expert optimizer counted the
    experts on TP rank 0 only: megatron_patches/grad_stats.py)."""
    r = report[f"{precision}_tp2_clipped_replicas"]
    rank0, rank1 = r["grad_norms_by_rank"]
    assert rank0 == rank1, r
    assert not r["replicas_differ"], r


def test_all_configs_ran(report):
    assert sorted(report) == sorted(CONFIGS + ["bf16_tp2_shared_expert_full_weights", "bf16_tp2_clipped_replicas",
                                               "nvfp4_tp2_clipped_replicas"])
