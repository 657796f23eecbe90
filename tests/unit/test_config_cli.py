"""Config loading (strict keys and types, overrides, round trip) and the minite command."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minite.config import Config, ConfigError, from_dict, load_config, to_dict

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
    with pytest.raises(ConfigError, match=rf"{p}.*rl.*'stepz'"):
        load_config(p)


def test_wrong_type_names_key_and_file(tmp_path):
    p = _write(tmp_path, {"model": {"hidden_size": "big"}})
    with pytest.raises(ConfigError, match=rf"{p}.*model.hidden_size.*expected int"):
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


def test_bad_files():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/cfg.yaml")


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


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "minite.cli", "--help"], capture_output=True, text=True, check=True)
    for sub in ("train", "diagnose", "convert", "bench"):
        assert sub in out.stdout


def test_cli_train_reports_a_bad_config(tmp_path):
    p = _write(tmp_path, {"rl": {"stepz": 1}})
    out = subprocess.run([sys.executable, "-m", "minite.cli", "train", str(p)], capture_output=True, text=True)
    assert out.returncode == 2 and "stepz" in out.stdout + out.stderr
