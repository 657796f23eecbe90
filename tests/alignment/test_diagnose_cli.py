"""`minite diagnose` arguments as a user meets them, through the real command: an out-of-range number, a --json path
that cannot be written, or sequences longer than the model's positions are one line with exit status 2, before any
model is built (so these runs are quick)."""
import json

import pytest

from minite.models.qwen3_moe import Qwen3MoeShape
from tests.cli.test_cli import REPO, assert_one_line_failure, minite

TINY = str(REPO / "examples/tiny/nvfp4.yaml")


@pytest.mark.parametrize("args,pattern", [
    (["--fail-above", "nan"], r"^minite diagnose: --fail-above must be a finite number, got nan$"),
    (["--prompts", "0"], r"^minite diagnose: --prompts must be >= 1, got 0$"),
    (["--max-new-tokens", "0"], r"^minite diagnose: --max-new-tokens must be >= 1, got 0$"),
    (["--max-prompt-len", "1"], r"^minite diagnose: --max-prompt-len must be >= 2, got 1$"),
    (["--json", "/nonexistent/dir/x.json"],
     r"^minite diagnose: --json /nonexistent/dir/x.json: /nonexistent/dir is not a directory this process can write"),
    (["--json", "."], r"^minite diagnose: --json \. is a directory: name a file in it, e.g. diagnose.json$"),
    (["--max-new-tokens", "1000"], r"^minite diagnose: --max-prompt-len 9 \+ --max-new-tokens 1000 exceeds "
                                   r"model.max_position_embeddings=32: lower them$"),
    (["--set", "logging.dir=tiny.json"], r"^minite diagnose: logging.dir: tiny.json is a file, not a directory"),
])
def test_bad_arguments_are_one_line(tmp_path, args, pattern):
    (tmp_path / "tiny.json").write_text("{}")
    assert_one_line_failure(minite("diagnose", TINY, *args, cwd=tmp_path), pattern)


def test_the_shape_of_model_hf_config_is_checked(tmp_path):
    """max_position_embeddings and the router of a Hugging Face config.json, checked as `minite train` checks them."""
    shape = Qwen3MoeShape(vocab_size=16, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          head_dim=16, moe_ffn_hidden_size=32, num_experts=4, moe_router_topk=2,
                          max_position_embeddings=12)
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf()))
    out = minite("diagnose", TINY, "--set", "model.hf_config=config.json", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite diagnose: --max-prompt-len 9 \+ --max-new-tokens 6 exceeds "
                                 r"model.max_position_embeddings=12: lower them$")
    shape.moe_router_topk = 1
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf()))
    out = minite("diagnose", TINY, "--set", "model.hf_config=config.json", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite diagnose: .*nvfp4.yaml: model.moe_router_topk=1 with model.norm_topk_prob"
                                 r".*: set norm_topk_prob to false in config.json ")
    (tmp_path / "config.json").write_text(json.dumps({**shape.to_hf(), "hidden_size": "64"}))
    out = minite("diagnose", TINY, "--set", "model.hf_config=config.json", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite diagnose: .*config.json: hidden_size = '64', expected an integer >= 1$")
    (tmp_path / "config.json").write_text("{not json")
    out = minite("diagnose", TINY, "--set", "model.hf_config=config.json", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite diagnose: .*config.json: not a JSON file \(")
