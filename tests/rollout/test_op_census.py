"""tools/bench/op_census.py counts a decode step's device ops on the CPU: strict mode's fixed-order ops show up by
site, and only in strict mode."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))


def test_strict_decode_step_ops_by_site():
    import op_census
    from sync_census import engine_for
    sites = {}
    for mode in ("default", "strict"):
        step = op_census.per_step(engine_for("bf16", mode == "strict", 1), batch=2)
        sites[mode] = {site for (_, site) in step}
        sites[mode + "_total"] = sum(step.values())
    assert "rollout/decode._step" in sites["default"]
    assert "strict/ops.tree_sum" in sites["strict"] and "strict/ops.tree_sum" not in sites["default"]
    assert sites["strict_total"] > 2 * sites["default_total"]


def test_fused_strict_kernels_count_as_one_launch_each(monkeypatch):
    """--fused-strict: strict mode's ops routed to minite.strict.fused as on a GPU (the kernels run in Triton's
    interpreter): each kernel one launch, far fewer ops per step than the torch ops."""
    import op_census
    from sync_census import engine_for

    from minite.strict import fused
    plain = sum(op_census.per_step(engine_for("bf16", True, 1), batch=2).values())
    monkeypatch.setattr(fused, "_gpu", lambda x: True)
    step = op_census.per_step(engine_for("bf16", True, 1), batch=2)
    assert ("triton:_exp_kernel", "strict/fused.exp") in step
    assert not [k for k in step if k[1] in ("strict/ops.exp", "strict/ops.rms_norm")]  # no torch op of theirs left
    assert sum(step.values()) < plain, (sum(step.values()), plain)
