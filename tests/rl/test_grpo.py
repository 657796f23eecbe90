"""GRPO math against hand-computed values: advantages, clipping, K3, TIS/MIS, masking."""
import math

import pytest
import torch

from minite.rl.grpo import GRPOParams, group_advantages, grpo_loss, is_weights, k3
from minite.rl.metrics import mismatch_metrics
from tests.tolerances import TOLERANCES


def test_group_advantages_normalise_within_groups():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0])
    a = group_advantages(r, 2)
    atol, rtol = TOLERANCES["grpo_advantage_eps"]
    assert torch.allclose(a[:2], torch.tensor([1.0, -1.0]), atol=atol, rtol=rtol)
    assert torch.equal(a[2:], torch.zeros(4))  # equal rewards: no signal
    g = group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), 4)
    assert abs(g.mean().item()) < TOLERANCES["grpo_advantage_mean"][0]
    assert abs(g.std(unbiased=False).item() - 1) < atol


def test_group_advantages_rejects_ragged():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 2)


def test_k3_is_nonnegative_and_matches_kl():
    assert k3(torch.tensor(0.0)).item() == 0.0
    x = torch.linspace(-5, 5, 101)
    assert (k3(x) >= 0).all()
    # Monte Carlo check: p = N(0,1) samples, q = N(0.3,1); E_p[k3(log q/p)] = KL(p||q) = 0.045
    z = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    log_ratio = -0.5 * (z - 0.3) ** 2 + 0.5 * z ** 2
    assert abs(k3(log_ratio).mean().item() - 0.045) < TOLERANCES["k3_monte_carlo"][0]


def _loss(logp, old, adv, **kw):
    mask = torch.ones_like(logp)
    params = GRPOParams(**{k: v for k, v in kw.items() if k in GRPOParams.__dataclass_fields__})
    return grpo_loss(logp, old, adv, mask, params, rollout_logp=kw.get("rollout_logp"), ref_logp=kw.get("ref_logp"))


def test_on_policy_gradient_is_advantage_weighted_logp():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, m = _loss(logp, logp.detach(), adv)
    loss.backward()
    # ratio = exp(0) = 1: d loss / d logp = -A / n_tokens; exact (powers of two times small integers)
    assert torch.equal(logp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]]))
    assert m["train/clip_frac"] == 0.0 and m["kl/ref"] == 0.0
    assert m["loss/policy"] == -(2 * 2 - 1 * 2) / 4


def test_clipping_stops_the_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_(True)
    loss, m = _loss(logp, old, torch.tensor([1.0]), clip_eps_low=0.2, clip_eps_high=0.2)
    loss.backward()
    # A > 0: ratio 1.5 is clipped (no grad); ratio 0.5 below 1 - eps is not (min picks the unclipped term)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert math.isclose(m["train/clip_frac"], 1 / 3, rel_tol=TOLERANCES["fp32_count_fraction"][1])


def test_tis_truncates_and_mis_masks():
    old = torch.log(torch.tensor([[1.0, 3.0, 0.2]]))
    rollout = torch.zeros(1, 3)
    tis = is_weights(old, rollout, GRPOParams(is_correction="tis", is_cap=2.0))
    atol, rtol = TOLERANCES["fp32_exp_log_roundtrip"]
    assert torch.allclose(tis, torch.tensor([[1.0, 2.0, 0.2]]), atol=atol, rtol=rtol)
    mis = is_weights(old, rollout, GRPOParams(is_correction="mis", is_cap=2.0))
    assert torch.equal(mis, torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.equal(is_weights(old, rollout, GRPOParams()), torch.ones(1, 3))
    logp = old.clone().requires_grad_(True)
    loss, m = _loss(logp, old, torch.tensor([1.0]), is_correction="mis", is_cap=2.0, rollout_logp=rollout)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 0] != 0
    assert math.isclose(m["train/is_masked_frac"], 2 / 3, rel_tol=TOLERANCES["fp32_count_fraction"][1])


def test_kl_penalty_pulls_towards_the_reference():
    logp = torch.tensor([[-0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0]])
    loss, m = _loss(logp, logp.detach(), torch.tensor([0.0]), kl_coef=0.5, ref_logp=ref)
    loss.backward()
    assert math.isclose(m["kl/ref"], math.exp(-0.5) + 0.5 - 1, rel_tol=TOLERANCES["grpo_k3_fp32"][1])
    assert logp.grad.item() > 0  # lowering logp towards ref lowers the loss


def test_mask_excludes_prompt_and_padding():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 0.0]])
    loss, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), mask, GRPOParams())
    loss.backward()
    assert torch.equal(logp.grad, torch.tensor([[0.0, -1.0, 0.0]]))


def test_mismatch_metrics():
    train = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    roll = torch.tensor([[-1.1, -2.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(train, roll, mask)
    rtol = TOLERANCES["fp64_logp_metrics"][1]
    assert math.isclose(m["mismatch/logp_abs_mean"], 0.05, rel_tol=rtol)
    assert math.isclose(m["mismatch/logp_abs_max"], 0.1, rel_tol=rtol)
    assert math.isclose(m["mismatch/k3_kl"], (math.exp(0.1) - 0.1 - 1) / 2, rel_tol=rtol)


@pytest.mark.parametrize("kw", [{"clip_eps_low": 1.0}, {"kl_coef": -1.0}, {"is_correction": "ppo"}, {"is_cap": 1.0}])
def test_bad_params(kw):
    with pytest.raises(ValueError):
        GRPOParams(**kw)


def test_mismatch_metrics_locate_the_largest_gap():
    """Where the largest gap is: both sides' log-probs of that token, its position in its row's response, and how
    many tokens differ by over 1 nat; prompt and padding columns (mask 0) never count."""
    train, rollout, mask = torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6)
    mask[0, 1:4] = 1
    mask[1, 2:5] = 1
    train[1, 3], rollout[1, 3] = -9.0, -0.5  # the largest gap: row 1's second response token
    train[0, 2] = -2.0
    train[1, 5] = -50.0  # a padding column: ignored
    m = mismatch_metrics(train, rollout, mask)
    assert m["mismatch/logp_abs_max"] == 8.5
    assert (m["mismatch/max_at_train_logp"], m["mismatch/max_at_rollout_logp"]) == (-9.0, -0.5)
    assert m["mismatch/max_at_position"] == 1.0 and m["mismatch/tokens_over_1"] == 2.0


def test_chunk_shares_add_up_to_the_whole_batch():
    """Gradient accumulation (rl.micro_batches): with `tokens` = the whole batch's token count, each chunk's loss,
    gradient and metrics are its share, and the shares add up to the whole batch's (fp32 sums in another order:
    the tolerance names why)."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 5, generator=g) * 3).requires_grad_(True)
    old, ref, roll = (logp.detach() + 0.3 * torch.randn(6, 5, generator=g) for _ in range(3))
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    params = GRPOParams(kl_coef=0.1, is_correction="tis")
    whole, wm = grpo_loss(logp, old, adv, mask, params, rollout_logp=roll, ref_logp=ref)
    (gw,) = torch.autograd.grad(whole, logp)
    total, shares, metrics, grads = float(mask.sum()), 0.0, {}, torch.zeros_like(logp)
    for rows in torch.arange(6).chunk(3):
        part, m = grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], params, rollout_logp=roll[rows],
                            ref_logp=ref[rows], tokens=total)
        (gp,) = torch.autograd.grad(part, logp)
        shares, grads = shares + part.detach(), grads + gp
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    atol, rtol = TOLERANCES["grpo_chunk_shares_fp32"]
    torch.testing.assert_close(shares, whole.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(grads, gw, atol=atol, rtol=rtol)
    for k, v in wm.items():
        assert math.isclose(metrics[k], v, rel_tol=rtol, abs_tol=atol), k


def test_chunk_metrics_scale_in_fp64_as_the_host_floats_did():
    """grpo_loss's metrics are fp32 device scalars (read once a step by the learner); the loop's `_per_chunk` scales
    them by the chunk count in fp64, as `.item() * n` did when they were host floats: 0.1f x 3 rounds differently in
    fp32, so a metric would change with rl.micro_batches = 3."""
    from minite.rl.loop import _per_chunk

    metric = torch.tensor(0.1)
    loss_fn = _per_chunk(torch.arange(3), 3, lambda logp, part: (logp.sum(), {"m": metric, "host": 0.25}))
    _, metrics = loss_fn(torch.zeros(1, 2))
    assert float(metrics["m"]) == float(metric) * 3 and metrics["host"] == 0.75
    assert float(metric * 3) != float(metric) * 3  # what the fp32 product would have reported
    grpo_metrics = grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), GRPOParams())[1]
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in grpo_metrics.values())
