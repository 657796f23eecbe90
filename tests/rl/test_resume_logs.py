"""Resume as a user sees it: a corrupt newest checkpoint is named and skipped (or stops the run when asked for by
name), metrics.jsonl and TensorBoard hold each step once after a resume, warm-up steps have their own tags, a
resumed run saves exactly the bytes-for-bytes state of an uninterrupted one (RNG states included), and nothing of an
earlier run is mixed in or deleted unasked (checkpoints of two runs in one directory, logs, a changed seed or KL).

The loop runs over the stand-in policy of test_checkpoint.py (seconds per run); tests/rl/test_rl_step.py and tests/rl/test_checkpoint_resume.py
run the real Learner."""
import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch

from minite.config import ConfigError
from minite.rl import checkpoint as ckpt
from minite.rl import loop
from tests.rl.test_checkpoint import StandInEngine, StandInLearner, _cfg


def _train(cfg):
    run = loop.setup(cfg, learner_factory=StandInLearner, engine_factory=StandInEngine,
                     reference_factory=StandInLearner)
    try:
        while run.step < cfg.rl.steps:
            loop.rl_step(run)
    finally:
        if run.logger is not None:
            run.logger.close()
    return run


def _rows(logdir):
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def _tb(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _flip_byte(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _same(a, b, where="state"):
    """Exact equality of two nested checkpoint states (tensors bitwise)."""
    assert type(a) is type(b), where
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _scramble_global_rng(seed):
    """A later process starts from unrelated global generators."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1, "checkpoint.keep": 0}
    straight = _train(_cfg(tmp_path / "a", 3))
    _train(_cfg(tmp_path / "b", 2, **ck))
    _flip_byte(tmp_path / "ck" / "step_000002" / "state.pt")
    with caplog.at_level(logging.WARNING, logger="minite.rl.loop"):
        resumed = _train(_cfg(tmp_path / "c", 3, **ck))
    assert "step_000002" in caplog.text and "corrupt" in caplog.text
    assert [h["step"] for h in resumed.history] == [2, 3]  # from step_000001, the newest intact one
    assert [h["loss/policy"] for h in straight.history[1:]] == [h["loss/policy"] for h in resumed.history]
    shutil.rmtree(tmp_path / "ck" / "step_000003")  # the resumed run re-saved steps 2 and 3 intact
    _flip_byte(tmp_path / "ck" / "step_000002" / "state.pt")
    _flip_byte(tmp_path / "ck" / "step_000001" / "state.pt")
    with pytest.raises(ckpt.CheckpointError,
                       match=r"no intact checkpoint in .*ck \(2 corrupt or incomplete; the newest: .*step_000002/state.pt "
                             r"is corrupt"):
        _train(_cfg(tmp_path / "c", 3, **ck))
    explicit = {**ck, "checkpoint.dir": str(tmp_path / "ck-d"),
                "checkpoint.resume_from": str(tmp_path / "ck" / "step_000001")}
    with pytest.raises(ckpt.CheckpointError, match="step_000001/state.pt is corrupt"):
        _train(_cfg(tmp_path / "d", 3, **explicit))


def test_half_written_checkpoint_is_never_taken(tmp_path):
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1, "checkpoint.keep": 0}
    _train(_cfg(tmp_path / "b", 1, **ck))
    partial = tmp_path / "ck" / "step_000002"  # as if renamed by hand without its manifest
    partial.mkdir()
    shutil.copy(tmp_path / "ck" / "step_000001" / "state.pt", partial / "state.pt")
    resumed = _train(_cfg(tmp_path / "c", 2, **ck))
    assert [h["step"] for h in resumed.history] == [2]


def test_metrics_and_tensorboard_hold_each_step_once_after_a_resume(tmp_path):
    logs = {"logging.tensorboard": True}
    straight = _train(_cfg(tmp_path / "a", 4, **logs))
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 2, "checkpoint.keep": 0}
    _train(_cfg(tmp_path / "b", 4, **ck, **logs))
    shutil.rmtree(tmp_path / "ck" / "step_000004")  # the run "died" after logging steps 3, 4 but before saving 4
    with open(tmp_path / "b" / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # ... and was killed in the middle of writing a row
    _scramble_global_rng(4321)
    _train(_cfg(tmp_path / "b", 4, **ck, **logs))
    _train(_cfg(tmp_path / "b", 4, **ck, **logs))  # nothing to do: adds neither rows nor an event file
    a, b = _rows(tmp_path / "a" / "logs"), _rows(tmp_path / "b" / "logs")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    keys = ("reward/mean", "loss/policy", "kl/ref", "mismatch/logp_abs_mean")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [h["reward/mean"] for h in straight.history] == [r["reward/mean"] for r in b]
    events = sorted((tmp_path / "b" / "logs").glob("events.out.tfevents.*"))
    assert len(events) == 2  # the first run's and the resumed run's; the no-op run wrote none
    tb = _tb(tmp_path / "b" / "logs", "reward/mean")
    assert [s for s, _ in tb] == [1, 2, 3, 4]  # purge_step dropped the first run's steps 3, 4
    assert [v for _, v in tb] == [v for _, v in _tb(tmp_path / "a" / "logs", "reward/mean")]


def test_warmup_steps_are_logged_under_their_own_tags(tmp_path):
    _train(_cfg(tmp_path / "a", 1, **{"logging.tensorboard": True, "rl.warmup_steps": 3}))
    logdir = tmp_path / "a" / "logs"
    rows = [json.loads(line) for line in (logdir / "warmup.jsonl").read_text().splitlines()]
    assert [r["warmup_step"] for r in rows] == [1, 2, 3] and all("warmup/nll" in r for r in rows)
    assert [s for s, _ in _tb(logdir / "warmup", "warmup/nll")] == [1, 2, 3]
    # TensorBoard stores float32: the same values, rounded once
    assert [v for _, v in _tb(logdir / "warmup", "warmup/nll")] == [float(np.float32(r["warmup/nll"])) for r in rows]
    assert [r["step"] for r in _rows(logdir)] == [1]


def test_resumed_run_saves_exactly_what_the_uninterrupted_run_saves(tmp_path):
    every = {"checkpoint.every": 2, "checkpoint.keep": 0}
    _scramble_global_rng(1)
    _train(_cfg(tmp_path / "a", 4, **{"checkpoint.dir": str(tmp_path / "cka"), **every}))
    _scramble_global_rng(2)
    _train(_cfg(tmp_path / "b", 2, **{"checkpoint.dir": str(tmp_path / "ckb"), **every}))
    _scramble_global_rng(3)
    _train(_cfg(tmp_path / "b", 4, **{"checkpoint.dir": str(tmp_path / "ckb"), **every}))
    a = ckpt.load_checkpoint(tmp_path / "cka" / "step_000004")
    b = ckpt.load_checkpoint(tmp_path / "ckb" / "step_000004")
    _same(a, b)


def test_a_key_added_since_the_checkpoint_counts_as_its_default():
    """A checkpoint saved before a config key existed (rl.micro_batches) resumes without naming it as changed, unless
    the run sets it to something else."""
    from minite.config import load_config
    from minite.rl.resume_policy import config_changes, config_for_checkpoint

    saved = config_for_checkpoint(load_config(None, []))
    del saved["rl"]["micro_batches"]
    assert config_changes(saved, load_config(None, [])) == {}
    assert config_changes(saved, load_config(None, ["rl.micro_batches=2"])) == {"rl.micro_batches": (1, 2)}


def test_a_start_before_checkpoints_already_there_is_refused(tmp_path):
    """Branching from an older checkpoint into the directory of a newer one (or starting from scratch there) would
    leave two runs' checkpoints side by side, and the next resume would take the other run's newest."""
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1, "checkpoint.keep": 0}
    _train(_cfg(tmp_path / "a", 3, **ck))
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    branch = {**ck, "checkpoint.resume_from": str(tmp_path / "ck" / "step_000001")}
    with pytest.raises(ConfigError, match=r"holds 2 checkpoint\(s\) after step 1 \(the newest: step_000003\), and "
                                          r"checkpoint.resume_from=.*step_000001 is at step 1: .* Move them out"):
        _train(_cfg(tmp_path / "b", 3, **branch))
    with pytest.raises(ConfigError, match=r"holds 3 checkpoint\(s\) after step 0 .*checkpoint.resume=false starts at "
                                          r"step 0: .*delete them with --fresh"):
        _train(_cfg(tmp_path / "b", 3, **ck, **{"checkpoint.resume": False}))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    with pytest.raises(ConfigError, match=r"to continue the run they belong to, drop checkpoint.resume_from"):
        _train(_cfg(tmp_path / "b", 3, **branch))
    branched = _train(_cfg(tmp_path / "b", 3, **{**branch, "checkpoint.dir": str(tmp_path / "ck-b")}))
    assert [h["step"] for h in branched.history] == [2, 3]
    run = loop.setup(_cfg(tmp_path / "f", 3, **ck, **{"checkpoint.resume": False}), fresh=True,
                     learner_factory=StandInLearner, engine_factory=StandInEngine, reference_factory=StandInLearner)
    assert run.step == 0  # --fresh: rank 0 empties checkpoint.dir, no rank refuses what it is deleting
    latest = _train(_cfg(tmp_path / "a", 3, **{**branch, "checkpoint.resume_from": str(tmp_path / "ck" /
                                                                                      "step_000003")}))
    assert latest.history == []  # the newest one itself: nothing newer, nothing to do


def test_a_run_from_step_zero_moves_an_earlier_runs_logs_aside(tmp_path, caplog):
    logs = {"logging.tensorboard": True, "rl.warmup_steps": 1}
    _train(_cfg(tmp_path / "a", 2, **logs))
    logdir = tmp_path / "a" / "logs"
    first = (logdir / "metrics.jsonl").read_text()
    with caplog.at_level(logging.WARNING, logger="minite.rl.loop"):
        _train(_cfg(tmp_path / "a", 1, **logs))
    assert "held an earlier run's logs" in caplog.text and "previous_run_1" in caplog.text
    kept = logdir / "previous_run_1"
    assert (kept / "metrics.jsonl").read_text() == first
    assert (kept / "warmup.jsonl").is_file() and list((kept / "warmup").glob("events.out.tfevents.*"))
    assert len(list(kept.glob("events.out.tfevents.*"))) == 1
    assert [r["step"] for r in _rows(logdir)] == [1]
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    _train(_cfg(tmp_path / "a", 1, **logs))
    assert (logdir / "previous_run_2" / "metrics.jsonl").is_file() and (kept / "metrics.jsonl").read_text() == first


@pytest.mark.parametrize("change", ["rl.seed=7", "rl.prompts_per_step=2", "rl.kl_coef=0.1"])
def test_a_resume_that_cannot_follow_the_saved_state_stops_with_one_line(tmp_path, change):
    """The prompt stream's seed and batch size, and a KL penalty raised from 0 (no reference policy was kept), are
    refused by the resume policy in one line naming the key."""
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "rl.kl_coef": 0.0}
    _train(_cfg(tmp_path / "a", 1, **ck))
    key, value = change.split("=")
    with pytest.raises(ConfigError, match=rf"^{key} .* start over with --fresh"):
        _train(_cfg(tmp_path / "a", 2, **{**ck, key: value}))


def test_a_branch_into_the_same_logging_dir_moves_the_later_logs_aside(tmp_path):
    """Branching from step 1 of a run logged to step 3: the main run's rows 2-3 are another run's, not to be cut."""
    ck = {"checkpoint.dir": str(tmp_path / "ck"), "checkpoint.every": 1, "checkpoint.keep": 0}
    _train(_cfg(tmp_path / "a", 3, **ck))
    logdir = tmp_path / "a" / "logs"
    main = (logdir / "metrics.jsonl").read_text()
    branch = {"checkpoint.dir": str(tmp_path / "ck-b"), "checkpoint.resume_from": str(tmp_path / "ck" / "step_000001")}
    _train(_cfg(tmp_path / "a", 3, **branch))
    assert (logdir / "previous_run_1" / "metrics.jsonl").read_text() == main
    assert [r["step"] for r in _rows(logdir)] == [2, 3]
    (logdir / "previous_run_1").rename(logdir / "previous_run_7")
    _train(_cfg(tmp_path / "a", 3, **{**branch, "checkpoint.dir": str(tmp_path / "ck-c")}))  # past step 1 again
    assert (logdir / "previous_run_8" / "metrics.jsonl").is_file()
