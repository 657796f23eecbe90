"""Megatron-Core layers and model: NVFP4 vs BF16 (same weights, outputs and gradients close), the NVFP4 layers are
the op functions inside Megatron's modules, the Qwen3-MoE spec from a config.json, the CPU patches, and one train
step that lowers the loss. World size 1, gloo, CPU. On a machine with a GPU the models are built there and the inputs
follow them; the tests of CPU-only paths skip, saying which GPU test covers the GPU's path."""
import contextlib
import json

import pytest
import torch

from minite.config import load_config
from tests.tolerances import TOLERANCES

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.vocab_size=64", "model.num_experts=4",
        "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "rl.seed=3"]


def cfg(*overrides):
    return load_config(None, TINY + list(overrides))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))


def _fwd_bwd(model, tokens):
    from minite.learner.learner import token_logprobs
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, pos, None)
    (-token_logprobs(logits, tokens).mean()).backward()
    return logits.detach().float(), {k: p.grad.float() for k, p in model.named_parameters()}


def test_cpu_patches_idempotent_on_real_classes():
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    from minite.megatron_patches import cpu
    if cpu.gpu_present():
        pytest.skip("the CPU patches apply only without a GPU")
    first = cpu.apply()
    assert cpu.apply() == first and any("current_device" in p for p in first)
    assert moe_utils.te_general_gemm is None and torch.cuda.current_device() == "cpu"
    assert mrandom.CudaRNGStatesTracker.add.__module__ == cpu.__name__
    with cpu.cuda_as_cpu():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.type() == "torch.cuda.FloatTensor" and t.cuda() is t


def test_gathered_l2_norm_is_upstreams_bitwise():
    """The grad-norm fallback patched to read its norms back once gives upstream's value bit for bit (the same CPU
    fp32 norm of the same per-tensor norms), on gradients of very different sizes and scales; clip_grads uses it."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from minite.megatron_patches import cpu
    cpu.apply_upstream_fixes()
    assert clip_grads.l2_norm_impl is cpu._gathered_l2_norm
    g = torch.Generator().manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    grads = [(torch.randn(n, generator=g) * s).to(dev) for n, s in ((7, 1e-3), (4096, 1.0), (33, 1e3), (1, 0.5))]
    ours, _ = cpu._gathered_l2_norm(2048 * 32, None, [grads], False)
    with cpu.cuda_as_cpu() if dev == "cpu" else contextlib.nullcontext():  # upstream's result has device="cuda"
        theirs, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert ours.shape == (1,) and ours.dtype == torch.float32 and ours.device == grads[0].device
    assert torch.equal(ours, theirs)


def _special_fp32(n: int, g: torch.Generator) -> torch.Tensor:
    """Random fp32 values with the edge cases a copy or a scale must keep: signed zeros, subnormals, the largest
    finite values (which a bf16 copy rounds to infinity), infinities and NaN."""
    edge = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3.4028234663852886e38, -3.4028234663852886e38, float("inf"),
                         float("-inf"), float("nan"), 1.0, -1.0 - 2**-23])
    return torch.cat([torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g), edge])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, NaN in the same places (a GPU multiply returns the canonical NaN, a copy keeps the
    payload: both NaN)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    ints = torch.int16 if a.dtype in (torch.bfloat16, torch.float16) else torch.int32
    return torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


def test_multi_tensor_scale_without_temporary_is_upstreams_bitwise():
    """The patched `multi_tensor_scale_impl` of Megatron's optimizer and clip_grads gives upstream's fallback's bits:
    the fp32 -> bf16 copy at scale 1.0 (the masters into the weights after each step), an in-place scale of fp32
    gradients onto themselves (clip_grads), and a scale into other tensors; NaN compared as NaN (`_same_bits`)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from minite.megatron_patches import cpu
    cpu.apply_upstream_fixes()
    assert optimizer.multi_tensor_scale_impl is cpu._scale_without_temporary
    assert clip_grads.multi_tensor_scale_impl is cpu._scale_without_temporary
    g = torch.Generator().manual_seed(5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    masters = [_special_fp32(n, g).to(dev) for n in (1, 300, 4096)]
    for scale in (1.0, 0.37, 3.0):
        for dst_dtype in (torch.bfloat16, torch.float32):
            ours = [torch.empty(m.shape, dtype=dst_dtype, device=dev) for m in masters]
            theirs = [torch.empty_like(o) for o in ours]
            cpu._scale_without_temporary(2048 * 32, None, [masters, ours], scale)
            utils.local_multi_tensor_scale(2048 * 32, None, [masters, theirs], scale)
            assert all(_same_bits(o, t) for o, t in zip(ours, theirs)), (scale, dst_dtype)
        grads = [m.clone() for m in masters]  # onto themselves, as clip_grads calls it
        want = [m.clone() for m in masters]
        cpu._scale_without_temporary(2048 * 32, None, [grads, grads], scale)
        utils.local_multi_tensor_scale(2048 * 32, None, [want, want], scale)
        assert all(_same_bits(a, b) for a, b in zip(grads, want)), scale
    cpu._scale_without_temporary(2048 * 32, None, [[], []], 0.5)  # an empty group is a no-op


def test_cpu_grouped_gemm_fallback_runs_upstream_grouped_mlp():
    """The legacy GroupedMLP (upstream class) runs on the patched gmm and equals a per-expert matmul loop."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLP

    from minite.learner.model import init_parallel
    from minite.megatron_patches import cpu
    from minite.megatron_patches.qwen3_moe import Qwen3MoeShape, transformer_config
    if cpu.gpu_present():
        pytest.skip("the grouped-GEMM fallback is patched in only without a GPU (test_learner_gpu.py: experts on GPU)")
    init_parallel(cfg())
    shape = Qwen3MoeShape(vocab_size=16, hidden_size=32, num_layers=1, num_attention_heads=2, num_query_groups=1,
                          head_dim=16, moe_ffn_hidden_size=16, num_experts=2, moe_router_topk=2)
    mlp = GroupedMLP(2, transformer_config(shape, compute_dtype=torch.bfloat16),
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    x, probs, counts = torch.randn(7, 32, dtype=torch.bfloat16), torch.rand(7), torch.tensor([3, 4])
    out, _ = mlp(x, counts, probs)
    w1, w2 = mlp.weight1.view(2, 32, -1), mlp.weight2.view(2, -1, 32)
    want = []
    for e, (a, b) in enumerate(((0, 3), (3, 7))):
        gate, up = (x[a:b] @ w1[e]).chunk(2, dim=-1)
        want.append(((F.silu(gate) * up) * probs[a:b, None]).to(torch.bfloat16) @ w2[e])
    torch.testing.assert_close(out, torch.cat(want), atol=0, rtol=0)


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_nvfp4_model_close_to_bf16_model(tokens, compute):
    from minite.learner.model import build_model
    mb = build_model(cfg("precision.mode=bf16", f"precision.compute_dtype={compute}"), strict=False)
    mn = build_model(cfg("precision.mode=nvfp4", f"precision.compute_dtype={compute}"), strict=False)
    sb, sn = mb.state_dict(), mn.state_dict()
    assert sb.keys() == sn.keys() and all(torch.equal(sb[k], sn[k]) for k in sb if torch.is_tensor(sb[k]))
    dev = next(mb.parameters()).device
    lb, gb = _fwd_bwd(mb, tokens.to(dev))
    ln, gn = _fwd_bwd(mn, tokens.to(dev))
    assert float((ln - lb).norm() / lb.norm()) < TOLERANCES["nvfp4_model_vs_bf16_logits"][1]
    flat_b = torch.cat([gb[k].flatten() for k in gb])
    flat_n = torch.cat([gn[k].flatten() for k in gb])
    assert float((flat_n - flat_b).norm() / flat_b.norm()) < TOLERANCES["nvfp4_model_vs_bf16_grads"][1]
    assert all(gn[k].abs().sum() > 0 for k in gn), "every parameter gets a gradient"


def test_nvfp4_layers_run_the_op_functions():
    """Inside Megatron's modules the GEMM is exactly ops.nvfp4_linear / nvfp4_grouped_linear (atol=0)."""
    import torch.nn.functional as F

    from minite.learner.model import build_model
    from minite.ops import derive_seed, nvfp4_grouped_linear, nvfp4_linear
    model = build_model(cfg("precision.mode=nvfp4", "precision.compute_dtype=float32"), strict=False)
    ctx, layer = model.nvfp4_context, model.decoder.layers[1]
    ctx.step = 5
    x = torch.randn(8, 2, 64).to(next(model.parameters()).device)
    for lin in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj):
        inp = x[..., :lin.weight.shape[1]]
        want = nvfp4_linear(inp, lin.weight, ctx.recipe, seed=ctx.layer_seed(lin.nvfp4_layer_id))
        got, bias = lin(inp)
        assert bias is None and torch.equal(got, want)
    lin = layer.self_attention.linear_qkv  # the cached quantised weight follows in-place updates
    with torch.no_grad():
        lin.weight.copy_(lin.weight * 1.5)  # version counter: seen
    assert torch.equal(lin(x)[0], nvfp4_linear(x, lin.weight, ctx.recipe, seed=ctx.layer_seed(lin.nvfp4_layer_id)))
    with torch.no_grad():
        lin.weight.data.mul_(0.5)  # .data bypasses the version counter: weights_updated() is the contract
    ctx.weights_updated()
    assert torch.equal(lin(x)[0], nvfp4_linear(x, lin.weight, ctx.recipe, seed=ctx.layer_seed(lin.nvfp4_layer_id)))
    experts = layer.mlp.experts
    hidden, probs, counts = torch.randn(10, 64).to(x.device), torch.rand(10).to(x.device), [3, 0, 4, 3]
    base = ctx.layer_seed(experts.nvfp4_layer_id)
    h = nvfp4_grouped_linear(hidden, experts.fc1_weight, counts, ctx.recipe, seed=derive_seed(base, 1))
    gate, up = h.chunk(2, dim=-1)
    want = nvfp4_grouped_linear(F.silu(gate) * up * probs[:, None], experts.fc2_weight, counts, ctx.recipe,
                                seed=derive_seed(base, 2))
    got, bias = experts(hidden, torch.tensor(counts), probs)
    assert bias is None and torch.equal(got, want)


def test_dense_linears_packed_for_a_rollout(monkeypatch):
    """With a rollout engine's weight_values off, the QKV and output projections cache a one-member packed stack on a
    GPU's kernels ("dense_packed", proven there) and keep fp16 block values elsewhere (the CPU, weight_values on, K
    outside the decode order, the name taken out of PROVEN); packed, in the decode order on the kernels, they give
    bitwise the values path's output without autograd, refuse a backward, and take a weight update in place (the
    decode order too)."""
    import types

    import minite.megatron_patches.nvfp4_layers as layers
    from minite.learner.model import build_model
    from minite.nvfp4 import NVFP4Stack, NVFP4Tensor, decode_order
    from minite.ops import nvfp4_linear
    from minite.strict import fused
    model = build_model(cfg("precision.mode=nvfp4", "model.hidden_size=128", "model.head_dim=32"), strict=False)
    if next(model.parameters()).is_cuda:
        pytest.skip("CPU weights here; tests/rollout/test_decode.py test_packed_weights_give_the_same_bits: the GPU")
    ctx, attn = model.nvfp4_context, model.decoder.layers[0].self_attention
    ctx.backend = "triton"  # the kernels (interpreted on the CPU): the packed codes also in the decode order
    lins, x = (attn.linear_qkv, attn.linear_proj), torch.randn(6, 2, 128).to(next(model.parameters()).device)
    cache = lambda lin: lin.__dict__["_nvfp4_wq_cache_weight"][1]  # noqa: E731
    with torch.no_grad():
        want = [lin(x)[0] for lin in lins]
    assert not any(layers._dense_packed_applies(lin, lin.weight) for lin in lins)  # weight_values on
    ctx.weight_values = False
    ctx.weights_updated()
    assert layers.DENSE_PACKED_KERNEL in fused.PROVEN
    assert not layers._dense_packed_applies(lins[0], torch.empty(8, 272))  # K outside the decode order
    gpu = types.SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(384, 128))
    assert all(layers._dense_packed_applies(lin, lin.weight) and not layers._dense_packed(lin, lin.weight)
               for lin in lins)  # the CPU's weights
    with torch.no_grad():
        assert all(torch.equal(lin(x)[0], w) and isinstance(cache(lin), NVFP4Tensor) for lin, w in zip(lins, want))
    monkeypatch.setattr(layers, "resolve", lambda *a, **k: ("triton", "test"))
    assert layers._dense_packed(lins[0], gpu) and not layers._dense_packed(lins[0], lins[0].weight)  # the CPU's
    with monkeypatch.context() as m:
        m.setattr(fused, "PROVEN", fused.PROVEN - {layers.DENSE_PACKED_KERNEL})
        assert not layers._dense_packed(lins[0], gpu)  # unproven: values
    monkeypatch.setattr(layers, "_dense_packed", layers._dense_packed_applies)  # as on a GPU, proven
    ctx.weights_updated()
    with torch.no_grad():
        assert all(torch.equal(lin(x)[0], w) and isinstance(cache(lin), NVFP4Stack) for lin, w in zip(lins, want))
    assert all(cache(lin).decode_data is not None for lin in lins)
    with pytest.raises(RuntimeError, match="packed for a rollout engine"):
        lins[0](x.clone().requires_grad_())
    layers.quantize_weights_now(model)
    stack = cache(lins[0])
    with torch.no_grad():
        lins[0].weight.mul_(0.5)
    layers.quantize_weights_now(model, in_place=True)  # a weight sync: the graphs' addresses keep the new codes
    assert cache(lins[0]) is stack and torch.equal(stack.decode_data, decode_order(stack.data))
    with torch.no_grad():
        got = lins[0](x)[0]
        assert torch.equal(got, nvfp4_linear(x, lins[0].weight, ctx.recipe, backend="triton"))
        assert not torch.equal(got, want[0])


def test_spec_from_hf_config_json(tmp_path):
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from minite.learner.model import build_model
    from minite.megatron_patches.nvfp4_layers import GroupedExperts, NVFP4ColumnParallelLinear
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 16,
          "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "norm_topk_prob": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    c = cfg("precision.mode=nvfp4", f"model.hf_config={path}", "precision.recipe.bf16_first_layers=1")
    model = build_model(c, strict=False)
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert shapes["embedding.word_embeddings.weight"] == (96, 32) and shapes["output_layer.weight"] == (96, 32)
    assert shapes["decoder.layers.2.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 16, 32)
    assert shapes["decoder.layers.0.mlp.experts.fc1_weight"] == (4, 32, 32)
    assert shapes["decoder.layers.0.self_attention.q_layernorm.weight"] == (16,)
    layers = model.decoder.layers
    assert type(layers[0].self_attention.linear_qkv) is ColumnParallelLinear  # bf16_first_layers=1
    assert isinstance(layers[1].self_attention.linear_qkv, NVFP4ColumnParallelLinear)
    assert isinstance(layers[1].mlp.shared_experts, SharedExpertMLP)
    assert isinstance(layers[1].mlp.shared_experts.linear_fc1, NVFP4ColumnParallelLinear)
    assert layers[0].mlp.experts.nvfp4 is None and isinstance(layers[2].mlp.experts, GroupedExperts)
    assert layers[2].mlp.experts.nvfp4 is not None
    ids = [m.nvfp4_layer_id for m in model.modules() if getattr(m, "nvfp4", None) is not None]
    assert len(set(ids)) == len(ids), "each NVFP4 module has its own rounding-seed id"


def test_bad_model_configs_raise():
    from minite.megatron_patches.qwen3_moe import Qwen3MoeShape, build_gpt_model
    with pytest.raises(ValueError, match="precision"):
        build_gpt_model({}, precision="fp8")
    with pytest.raises(ValueError, match="missing fields"):
        Qwen3MoeShape.from_any({"vocab_size": 8})
    with pytest.raises(ValueError, match="no gradient"):
        build_gpt_model(dict(vocab_size=8, hidden_size=16, num_layers=1, num_attention_heads=1, num_query_groups=1,
                             head_dim=16, moe_ffn_hidden_size=16, num_experts=2, moe_router_topk=1))
    with pytest.raises(ValueError, match="mlp_only"):
        Qwen3MoeShape.from_any({"num_hidden_layers": 2, "mlp_only_layers": [0]})


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_train_step_reduces_loss(tokens, precision):
    from minite.learner.learner import Learner
    learner = Learner(cfg(f"precision.mode={precision}", "optim.lr=3e-3"))

    def loss_fn(logp):
        loss = -logp.mean()
        return loss, {"nll": float(loss.detach())}

    losses = [learner.train_step(tokens, loss_fn) for _ in range(3)]
    assert all(m["grad_norm"] > 0 and m["step_ok"] == 1.0 for m in losses)
    assert losses[0]["loss"] > losses[1]["loss"] > losses[2]["loss"]
    after = float(-learner.logprobs(tokens).mean())
    assert after < losses[2]["loss"]


def test_sdpa_attention_equals_upstream_dot_product_attention():
    """The fused path (torch SDPA, taken on GPUs for whole-sequence causal passes) computes upstream's
    DotProductAttention: same causal mask, GQA repeat, scale and output layout; on the CPU the module keeps upstream."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from minite.learner.model import init_parallel
    from minite.megatron_patches import cpu
    if cpu.gpu_present():
        pytest.skip("CPU tensors here; tests/learner/test_learner_gpu.py covers SDPA on the GPU")
    from minite.megatron_patches.qwen3_moe import (FusedDotProductAttention, Qwen3MoeShape, sdpa_attention,
                                                   transformer_config)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    init_parallel(cfg())
    model_parallel_cuda_manual_seed(0, force_reset_rng=True)  # upstream forks its dropout RNG
    shape = Qwen3MoeShape(vocab_size=16, hidden_size=64, num_layers=1, num_attention_heads=4, num_query_groups=2,
                          head_dim=16, moe_ffn_hidden_size=16, num_experts=2, moe_router_topk=2)
    conf = transformer_config(shape, compute_dtype=torch.float32)
    up = DotProductAttention(conf, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    fused = FusedDotProductAttention(conf, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, h, 16, generator=g) for h in (4, 2, 2))
    want = up(q, k, v, None)
    assert torch.equal(fused(q, k, v, None), want)  # CPU: upstream's path
    got = sdpa_attention(q, k, v, up.softmax_scale)
    assert got.shape == want.shape == (9, 2, 64)
    torch.testing.assert_close(got, want, atol=TOLERANCES["sdpa_vs_unfused_fp32"][0], rtol=0)
    assert fused._sdpa_mode(q, k, None, None, None, None) is None  # CPU tensors never take it
    # a decode step: one query over a 9-position KV cache, no mask (Megatron's no_mask past the prompt)
    want1 = up(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    got1 = sdpa_attention(q[-1:], k, v, up.softmax_scale, causal=False)
    torch.testing.assert_close(got1, want1, atol=TOLERANCES["sdpa_vs_unfused_fp32"][0], rtol=0)
    torch.testing.assert_close(got1, got[-1:], atol=TOLERANCES["sdpa_vs_unfused_fp32"][0], rtol=0)


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
def test_experts_without_tokens_give_zero_gradients(precision):
    """A rank whose experts receive no token (EP) still gives every expert parameter a gradient, zero, without
    reading the weights (their storage is freed here, as the learner releases it during the step:
    release_quantised_weights), and the router probs stay in the graph (under EP their dispatch's backward is a
    collective that every rank must enter)."""
    from minite.learner.model import build_model
    model = build_model(cfg(f"precision.mode={precision}"), strict=False)
    experts = model.decoder.layers[0].mlp.experts
    w = experts.fc1_weight
    hidden = torch.randn(0, 64, dtype=w.dtype, device=w.device, requires_grad=True)
    probs = torch.rand(0, device=w.device, requires_grad=True)
    for p in (experts.fc1_weight, experts.fc2_weight):
        p.untyped_storage().resize_(0)
    out, _ = experts(hidden, torch.zeros(4, dtype=torch.long, device=w.device), probs)
    out.sum().backward()
    for p in (experts.fc1_weight, experts.fc2_weight):
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()
    assert probs.grad is not None and hidden.grad is not None
    assert out.shape == (0, 64)


@pytest.mark.gpu
def test_expert_init_on_the_gpu_is_ep_invariant_and_repeatable():
    """With a GPU, GroupedExperts draws its initial weights there (megatron_patches.nvfp4_layers._init_weights): two
    builds give the same weights, and rank r of EP=2 holds experts [2r, 2r+2) of the EP=1 draw, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import dataclasses

    from minite.learner.model import build_model
    from minite.megatron_patches.nvfp4_layers import GroupedExperts

    experts = [m for m in build_model(cfg(), strict=False).modules() if isinstance(m, GroupedExperts)][0]

    def draw(ep: int, rank: int) -> torch.Tensor:
        e = object.__new__(GroupedExperts)  # only what _init_weights reads
        torch.nn.Module.__init__(e)
        e.num_local_experts = experts.num_local_experts // ep
        e.config = dataclasses.replace(experts.config, expert_model_parallel_size=ep)
        e.fc1_weight = torch.nn.Parameter(torch.empty((e.num_local_experts,) + tuple(experts.fc1_weight.shape[1:])))
        e.fc2_weight = torch.nn.Parameter(torch.empty((e.num_local_experts,) + tuple(experts.fc2_weight.shape[1:])))
        torch.manual_seed(11)  # the CPU generator every rank advances alike
        e._init_weights(rank)
        return torch.cat([e.fc1_weight.detach().flatten(1), e.fc2_weight.detach().flatten(1)], dim=1)

    whole = draw(1, 0)
    assert torch.equal(whole, draw(1, 0))
    assert torch.equal(torch.cat([draw(2, 0), draw(2, 1)]), whole)
    assert whole.std() > 0
