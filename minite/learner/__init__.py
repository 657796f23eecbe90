"""The learner: Megatron-Core model building, NVFP4 op functions used by its layers, the training step.

Public interface (consumed by minite.rl and minite.rollout):
    Learner(cfg)                      .logprobs(tokens) / .train_step(tokens, loss_fn) / .state_dict() /
                                      .load_state_dict(sd) / .named_weights() (local shards) /
                                      .full_weights() (gathered to TP=1/EP=1 layout) / .model (the GPTModel) /
                                      .local_rows(B) (the rows this data-parallel rank forwards; loss_fn
                                      still sees the whole batch's log-probs, gathered)
    build_model(cfg)                  the same GPTModel (BF16 or NVFP4) for another engine
    init_parallel(cfg)                torch.distributed (gloo) + Megatron TP/EP groups, once per process
    token_logprobs(logits, tokens)    fp32 log-probs of the next tokens (vocab-parallel aware)
Ops (minite.learner.ops): nvfp4_linear, nvfp4_grouped_linear (autograd); nvfp4_linear_forward,
nvfp4_grouped_linear_forward (forward only, for rollout engines); quantize_weight, derive_seed.
Imported lazily: importing minite.learner does not import Megatron-Core.
"""
from __future__ import annotations

__all__ = ["Learner", "build_model", "init_parallel", "token_logprobs"]


def __getattr__(name):
    if name in ("Learner", "token_logprobs"):
        from minite.learner import learner
        return getattr(learner, name)
    if name in ("build_model", "init_parallel"):
        from minite.learner import model
        return getattr(model, name)
    raise AttributeError(name)
