"""`minite convert` as a user meets it, run as a real subprocess: every user error (a bad input, a bad argument, an
--out that holds something) is one line naming the file and what is wrong, exit status 2, and leaves no --out.

One tiny single-file Hugging Face checkpoint (transformers' save_pretrained) and its Megatron conversion serve every
test; each failure is one `minite` process (about two seconds, most of it importing torch)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.test_cli import assert_one_line_failure, minite


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A directory holding hf/ (config.json, model.safetensors, generation_config.json) and mg/, its conversion."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=32, norm_topk_prob=True, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).to(torch.bfloat16).save_pretrained(root / "hf")
    out = minite("convert", "hf-to-megatron", "--hf", "hf", "--out", "mg", "--no-progress", cwd=root)
    assert out.returncode == 0 and out.stdout == "wrote mg\n", out.stderr[-3000:]
    return root


def _copy(ckpt: Path, name: str, dst: Path) -> Path:
    return Path(shutil.copytree(ckpt / name, dst / name))


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_user_errors_exit_2_in_one_line(ckpt, tmp_path):
    assert_one_line_failure(minite("convert", "hf-to-megatron", "--hf", "nope", "--out", "o", cwd=tmp_path),
                            r"^minite convert: nope.*: not found")
    assert not (tmp_path / "o").exists()


def test_export_names_a_tensor_holding_nan(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _copy(ckpt, "hf", tmp_path)
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.experts.2.up_proj.weight"][0, 3] = float("nan")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    out = minite("convert", "export-nvfp4", "--hf", "hf", "--out", "o", cwd=tmp_path)
    assert_one_line_failure(out, r"^minite convert: tensor 'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight' in hf "
                                 r"holds NaN or Inf")
