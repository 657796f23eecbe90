"""The GPU examples load and validate on CPU (building their 2.6B-parameter model is for the GPU), their shapes suit
NVFP4 (multiples of 16) and the layout (DP rows), and the parameter counts their comments size memory by hold."""
from pathlib import Path

import pytest

from minite.config import load_config
from minite.rl.tasks import make_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "h200"
GPUS = {"moe-nvfp4.yaml": 1, "moe-bf16.yaml": 1, "moe-ep2-nvfp4.yaml": 2}


def _params(m, experts):
    attn = m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim \
        + m.num_attention_heads * m.head_dim * m.hidden_size
    return m.num_layers * attn, m.num_layers * experts * 3 * m.hidden_size * m.moe_ffn_hidden_size


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_example_validates(name):
    cfg = load_config(str(EXAMPLES / name))
    m, gpus = cfg.model, GPUS[name]
    assert m.hidden_size == 2048 and m.num_layers >= 8 and 64 <= m.num_experts <= 128
    assert all(x % 16 == 0 for x in (m.hidden_size, m.moe_ffn_hidden_size, m.vocab_size, m.head_dim))
    assert cfg.parallel.ep == gpus and m.num_experts % gpus == 0
    rows = cfg.rl.prompts_per_step * cfg.rollout.group_size // cfg.rl.minibatches
    assert rows % (gpus // cfg.parallel.tp) == 0
    task = make_task(cfg.rl.task, length=cfg.rl.task_length, num_digits=cfg.rl.task_digits)
    assert task.prompt_len + cfg.rollout.max_new_tokens <= m.max_position_embeddings
    assert cfg.rollout.max_new_tokens >= task.response_len


def test_memory_arithmetic_in_the_comments():
    m = load_config(str(EXAMPLES / "moe-nvfp4.yaml")).model
    attn, experts = _params(m, m.num_experts)
    assert round(attn / m.num_layers / 1e6, 1) == 18.9 and round(experts / m.num_layers / 1e6) == 302
    assert round((attn + experts) / 1e9, 2) == 2.57 and round(18 * (attn + experts) / 1e9) == 46
    attn2, experts2 = _params(m, m.num_experts // 2)
    assert round(experts2 / 1e9, 2) == 1.21 and round(18 * (attn2 + experts2) / 1e9) == 24
