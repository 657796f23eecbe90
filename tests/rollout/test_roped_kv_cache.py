"""megatron_patches.rope.ROPED_KV_CACHE: the static KV cache holds roped keys; the engine's tokens and log-probs are
the bits of Megatron's order (the whole cached prefix rotated every step)."""
import pytest

from minite.rollout import SamplingParams
from tests.rollout.test_decode import (PARAMS, PROMPTS, _early_stop_token, _engine, _first_difference, _forward_rows,
                                       _run)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("strict", [False, True])
def test_roped_kv_cache_gives_the_bits_of_rotating_the_whole_prefix(precision, strict, monkeypatch):
    """megatron_patches.rope.ROPED_KV_CACHE: the cache holds roped keys, so a decode step rotates its one new key
    instead of every cached one (Megatron's order); RoPE being elementwise per position, the same tokens and log-probs
    bit for bit (with CUDA graphs where the device has them: each setting captures its own), also where a stop token
    compacts the batch (the attention then reads keys from a strided view of the cache)."""
    import megatron.core.transformer.attention as attention_mod

    from minite.megatron_patches import rope
    engine = _engine(precision, strict)
    dispatch = attention_mod.apply_rotary_pos_emb
    rows = []  # positions each RoPE call rotates

    def counting(t, freqs, config, *args, **kwargs):
        rows.append(t.shape[0])
        return dispatch(t, freqs, config, *args, **kwargs)

    monkeypatch.setattr(attention_mod, "apply_rotary_pos_emb", counting)
    runs, compacted, every = {}, {}, engine.decoder.stop_check_every
    stop = _early_stop_token(_run(engine, SamplingParams(max_new_tokens=12, n=2, seed=3), PROMPTS[:2]))
    for roped in (False, True):
        monkeypatch.setattr(rope, "ROPED_KV_CACHE", roped)
        engine.decoder.reset()  # no graph captured under the other setting
        rows.clear()
        runs[roped] = ([_run(engine, params) for params in PARAMS], list(rows))
        engine.decoder.stop_check_every = 1
        steps = _forward_rows(engine)
        compacted[roped] = _run(engine, SamplingParams(max_new_tokens=12, n=2, seed=3, stop_token_id=stop),
                                PROMPTS[:2])
        engine.decoder.stop_check_every = every
        assert min(steps) < steps[0]  # the batch shrank
    assert runs[True][0] == runs[False][0], _first_difference(runs[True][0], runs[False][0])
    assert compacted[True] == compacted[False], _first_difference(compacted[True], compacted[False])
    layers = engine.model.module.config.num_layers
    shortest, longest = min(map(len, PROMPTS)), max(map(len, PROMPTS))
    # roped cache: each forward rotates its own positions, queries and keys alike (a prefill its prompt positions)
    assert all(a == b for a, b in zip(runs[True][1][::2], runs[True][1][1::2])), runs[True][1]
    assert max(runs[True][1]) == shortest and runs[True][1].count(shortest) == 2 * layers * len(PARAMS)
    # Megatron's order: the keys of the whole prefix, every step
    assert max(runs[False][1]) == longest + max(p.max_new_tokens for p in PARAMS) - 1


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_qk_norm_rope_gives_the_bits_of_the_nine_launches(precision, monkeypatch):
    """megatron_patches.rope.QK_NORM_ROPE_KERNEL routed: a decode step's q/k RMSNorm, RoPE and cache write in one
    launch give the tokens and log-probs of Megatron's nine, bit for bit, in every decode step after the first
    generate's prefill (whose cache does not exist yet), with CUDA graphs where the device has them. On the CPU the
    RMSNorms of both runs take torch's CUDA order (`torch_order_rms_norm`: torch's CPU kernel sums otherwise)."""
    import torch

    from minite.kernels import qk_norm_rope
    from minite.megatron_patches import rope
    from minite.strict import fused
    engine = _engine(precision, False)
    if not engine.model.module.config.params_dtype == torch.bfloat16:
        pytest.skip("the kernel takes bf16 heads")
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.nn.RMSNorm, "forward",
                            lambda self, x: qk_norm_rope.torch_order_rms_norm(x, self.weight, self.eps))
    calls = []
    launch = qk_norm_rope.qk_norm_rope_cache
    monkeypatch.setattr(qk_norm_rope, "qk_norm_rope_cache", lambda *a: calls.append(a[0].shape) or launch(*a))
    runs = {}
    for routed in (False, True):
        monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {rope.QK_NORM_ROPE_KERNEL} if routed else fused.PROVEN)
        engine.decoder.reset()
        runs[routed] = [_run(engine, params) for params in PARAMS]
    assert runs[True] == runs[False], _first_difference(runs[True], runs[False])
    layers = engine.model.module.config.num_layers
    assert calls and len(calls) % layers == 0 and min(c[0] for c in calls) == 1  # decode steps took it


def test_qk_norm_rope_steps_aside_for_hooks_and_leaves_no_state(monkeypatch):
    """Routed, the one launch is skipped where a forward hook watches the q/k norms (minite diagnose's op capture
    records every module), and a forward leaves nothing behind: also when it raises between the projection and the
    cache write (a stale 'written' flag would strip RoPE from the layer's next forward)."""
    from minite.kernels import qk_norm_rope
    from minite.megatron_patches import rope
    from minite.strict import fused
    monkeypatch.setattr(fused, "PROVEN", fused.PROVEN | {rope.QK_NORM_ROPE_KERNEL})
    engine = _engine("bf16", False, "rollout.cuda_graphs=false")
    calls = []
    launch = qk_norm_rope.qk_norm_rope_cache
    monkeypatch.setattr(qk_norm_rope, "qk_norm_rope_cache", lambda *a: calls.append(1) or launch(*a))
    attentions = [m for m in engine.model.modules() if type(m).__name__ == "SelfAttention"]
    _run(engine, PARAMS[0])
    assert calls and not any({"_minite_qkv_written"} & set(vars(m)) or m._minite_qkv_step for m in attentions)
    calls.clear()
    seen = []
    hooks = [m.q_layernorm.register_forward_hook(lambda *a: seen.append(1)) for m in attentions]
    _run(engine, PARAMS[0])
    assert not calls and seen
    for h in hooks:
        h.remove()
    upstream = type(attentions[0])._adjust_key_value_for_inference

    def failing(self, *args, **kwargs):
        raise RuntimeError("between the two methods")

    monkeypatch.setattr(type(attentions[0]), "_adjust_key_value_for_inference", failing)
    with pytest.raises(RuntimeError, match="between the two methods"):
        _run(engine, PARAMS[0])
    monkeypatch.setattr(type(attentions[0]), "_adjust_key_value_for_inference", upstream)
    assert calls and not any({"_minite_qkv_written"} & set(vars(m)) or m._minite_qkv_step for m in attentions)
