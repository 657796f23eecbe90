"""Config loading (strict keys and types, overrides, round trip) and the minite command."""
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from minite.config import (Config, ConfigError, check_paths, check_world_size, from_dict, load_config,
                           to_dict)

EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("examples/**/*.yaml"))


def _write(tmp_path, data) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_and_overrides():
    cfg = load_config(None, ["rl.steps=5", "precision.recipe.activation.scale_scope=tensor", "optim.lr=3e-4"])
    assert cfg.rl.steps == 5 and cfg.optim.lr == 3e-4
    assert cfg.precision.recipe.activation.scale_scope == "tensor"


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, {"rl": {"stepz": 3}})
    with pytest.raises(ConfigError, match=rf"^{p}: rl: unknown key 'stepz' \(known: steps, "):
        load_config(p)
    p = _write(tmp_path, {"rlz": {"steps": 3}})
    with pytest.raises(ConfigError, match=rf"^{p}: unknown key 'rlz' \(known: model, .*alignment\)$") as e:
        load_config(p)
    assert "source" not in str(e.value)  # set by load_config, not a key of the file
    with pytest.raises(ConfigError, match=r"^--set source=x: unknown key 'source' \(known: model, .*alignment\)$"):
        load_config(None, ["source=x"])


def test_wrong_type_names_key_and_file(tmp_path):
    p = _write(tmp_path, {"model": {"hidden_size": "big"}})
    with pytest.raises(ConfigError, match=rf"^{p}: model.hidden_size: expected int"):
        load_config(p)
    p = _write(tmp_path, {"rl": {"steps": True}})
    with pytest.raises(ConfigError, match="rl.steps"):
        load_config(p)


def test_invalid_values_are_rejected(tmp_path):
    for data, match in [({"precision": {"mode": "fp8"}}, "precision.mode"),
                        ({"precision": {"recipe": {"weight": {"block": [1, 16]}}}}, "16, 16"),
                        ({"precision": {"recipe": {"bf16_modules": ["lm_head"]}}}, "unknown roles"),
                        ({"rollout": {"top_p": 0}}, "top_p"),
                        ({"model": {"num_attention_heads": 3, "num_query_groups": 2}}, "multiple")]:
        with pytest.raises(ConfigError, match=match):
            load_config(_write(tmp_path, data))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/cfg.yaml")
    p = tmp_path / "binary.yaml"
    p.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=rf"^{p}: not a text file \(byte 128 is not UTF-8\): give a YAML file"):
        load_config(p)


def test_a_key_given_twice_is_refused(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("rl:\n  steps: 3\n  kl_coef: 0.1\n  steps: 4\n")
    with pytest.raises(ConfigError, match=rf"^{p}: key 'steps' is given twice \(lines 2 and 4\): keep one$"):
        load_config(p)
    p.write_text("rl: {}\nmodel: {}\nrl: {steps: 4}\n")
    with pytest.raises(ConfigError, match=rf"^{p}: key 'rl' is given twice \(lines 1 and 3\)"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^--set rollout.sglang_args=\{a: 1, a: 2\}: key 'a' is given twice: "):
        load_config(None, ["rollout.sglang_args={a: 1, a: 2}"])
    p.write_text("rollout:\n  sglang_args:\n    <<: {a: 1, b: 2}\n    a: 3\n")  # a merged key overridden: fine
    assert load_config(p).rollout.sglang_args == {"a": 3, "b": 2}


def test_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rl: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["model.num_layers=3", "rollout.group_size=4"])
    data = to_dict(cfg)
    data.pop("source")
    assert load_config(_write(tmp_path, data)).model == cfg.model
    assert from_dict(Config, data, "x") == cfg


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_shipped_examples_load(path):
    load_config(path)


def test_override_errors_blame_the_command_line(tmp_path):
    p = _write(tmp_path, {"rl": {"steps": 3}})
    for item, match in [("rl.steps=five", r"^--set rl.steps=five: expected int, got str 'five'$"),
                        ("rl.stepz=1", r"^--set rl.stepz=1: unknown key 'stepz'"),
                        ("rl=3", r"^--set rl=3: rl is a section"),
                        ("rl.steps", r"^--set rl.steps: expected key=value")]:
        with pytest.raises(ConfigError, match=match):
            load_config(p, [item])
    with pytest.raises(ConfigError, match=rf"^{p}: rl: steps must be >= 0, got -1 \(with --set rl.steps=-1\)$"):
        load_config(p, ["rl.steps=-1", "optim.lr=1e-3", "rl.kl_coef=0.5"])  # only the key the message names
    with pytest.raises(ConfigError, match=r"is not a multiple of 16, .* \(with --set model.head_dim=4 --set "
                                          r"model.num_query_groups=1\)$"):
        load_config(p, ["model.head_dim=4", "model.num_layers=3", "model.num_query_groups=1"])


def _float_keys(cls=Config, prefix=""):
    """The dotted keys of every float field (float or float | None) of the config."""
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, f"{prefix}{f.name}.")
        elif tp is float or float in typing.get_args(tp):
            yield f"{prefix}{f.name}"


def test_nan_and_inf_are_refused_in_every_float_field(tmp_path):
    keys = list(_float_keys())
    assert {"rl.is_threshold", "rl.kl_coef", "rollout.temperature", "model.rope_theta", "model.rms_norm_eps",
            "alignment.stop_above"} <= set(keys)
    for key in keys:
        for text, shown in ((".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("1e999", "inf")):
            with pytest.raises(ConfigError, match=rf"^--set {key}={text}: expected a finite number, got {shown}$"):
                load_config(None, [f"{key}={text}"])
        section, name = key.split(".")
        p = _write(tmp_path, {section: {name: float("nan")}})
        with pytest.raises(ConfigError, match=rf"^{p}: {key}: expected a finite number, got nan$"):
            load_config(p)


def test_model_values_that_megatron_would_refuse_later():
    with pytest.raises(ConfigError, match=r"^<defaults>: model.moe_router_topk=1 with model.norm_topk_prob=true .*: "
                                          r"set model.norm_topk_prob=false .*\(with --set model.moe_router_topk=1\)"):
        load_config(None, ["model.moe_router_topk=1"])
    assert load_config(None, ["model.moe_router_topk=1", "model.norm_topk_prob=false"]).model.moe_router_topk == 1
    with pytest.raises(ConfigError, match=r"^<defaults>: model: shared_expert_intermediate_size must be >= 0 "):
        load_config(None, ["model.shared_expert_intermediate_size=-16"])


def test_shape_constraints_are_checked_at_load():
    for sets, match in [(["model.hidden_size=40"], "hidden_size = 40 is not a multiple of 16"),
                        (["model.head_dim=4", "model.num_query_groups=1"], r"num_query_groups\) x head_dim .* = 24 "),
                        (["model.head_dim=10"], r"num_attention_heads x head_dim / parallel.tp = 40 "),
                        (["model.moe_ffn_hidden_size=24"], "moe_ffn_hidden_size = 24"),
                        (["parallel.tp=3"], r"num_attention_heads=4 is not divisible by parallel.tp=3"),
                        (["parallel.ep=3"], r"num_experts=4 is not divisible by parallel.ep=3")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, sets)
    assert load_config(None, ["model.hidden_size=40", "precision.mode=bf16"]).model.hidden_size == 40
    assert load_config(None, ["model.moe_ffn_hidden_size=24", "precision.recipe.bf16_modules=[experts]"])


def test_world_size_must_split_into_tp_and_ep():
    check_world_size(load_config(None, ["parallel.ep=2"]), 4)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide the 1 process\(es\) started"):
        check_world_size(load_config(None, ["parallel.ep=2"]), 1)


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is a directory: give a YAML file"):
        load_config(tmp_path)


def test_paths_resolve_from_where_they_were_written(tmp_path):
    (tmp_path / "cfgs").mkdir()
    p = tmp_path / "cfgs" / "run.yaml"
    p.write_text(yaml.safe_dump({"logging": {"dir": "../out"}, "checkpoint": {"dir": "ck"},
                                 "model": {"init_from": "/abs/init"}}))
    cfg = load_config(p)
    assert cfg.logging.dir == str(tmp_path / "out") and cfg.checkpoint.dir == str(tmp_path / "cfgs" / "ck")
    assert cfg.model.init_from == "/abs/init"
    cfg = load_config(p, ["checkpoint.dir=mine", "model.hf_config=c.json"])  # --set: the current directory
    assert cfg.checkpoint.dir == "mine" and cfg.model.hf_config == "c.json"
    assert load_config(None).logging.dir == "runs/tiny"


def test_missing_input_paths_are_named(tmp_path):
    check_paths(load_config(None))
    for key in ("model.hf_config", "model.init_from", "checkpoint.resume_from"):
        with pytest.raises(ConfigError, match=rf"^{key}: {tmp_path}/nope does not exist"):
            check_paths(load_config(None, [f"{key}={tmp_path}/nope"]))


def test_output_directories_must_not_be_files(tmp_path):
    (tmp_path / "f").write_text("")
    check_paths(load_config(None, [f"logging.dir={tmp_path}/new/run", f"checkpoint.dir={tmp_path}/new/ck"]))
    for key in ("logging.dir", "checkpoint.dir"):
        with pytest.raises(ConfigError, match=rf"^{key}: {tmp_path}/f is a file, not a directory"):
            check_paths(load_config(None, [f"{key}={tmp_path}/f"]))
        with pytest.raises(ConfigError, match=rf"^{key}: {tmp_path}/f/run lies under the file {tmp_path}/f, not a "):
            check_paths(load_config(None, [f"{key}={tmp_path}/f/run"]))


def test_output_directories_must_be_writable(tmp_path, monkeypatch):
    """Checked at the nearest existing directory (root writes anywhere, so the refusal is simulated)."""
    (tmp_path / "ro").mkdir()
    cfg = load_config(None, [f"logging.dir={tmp_path}/ok", f"checkpoint.dir={tmp_path}/ro/a/b"])
    check_paths(cfg)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path / "ro" and real(p, mode))
    with pytest.raises(ConfigError, match=rf"^checkpoint.dir: {tmp_path}/ro/a/b cannot be written by this process "
                                          rf"\({tmp_path}/ro is not writable\)"):
        check_paths(cfg)


def test_source_is_not_a_key_of_the_file(tmp_path):
    (tmp_path / "c.yaml").write_text("source: elsewhere.yaml\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown key 'source' \(known: model, "):
        load_config(tmp_path / "c.yaml", [])


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "minite.cli", "--help"], capture_output=True, text=True, check=True)
    for sub in ("train", "diagnose", "convert", "bench"):
        assert sub in out.stdout


def test_cli_train_reports_a_bad_config(tmp_path):
    p = _write(tmp_path, {"rl": {"stepz": 1}})
    out = subprocess.run([sys.executable, "-m", "minite.cli", "train", str(p)], capture_output=True, text=True)
    assert out.returncode == 2 and "stepz" in out.stdout + out.stderr
