"""The learner: the Megatron-Core model build, the training step, log-probs, weight export.

    learner.py   Learner(cfg): .logprobs(tokens) / .train_step(tokens, loss_fn) / .state_dict() /
                 .load_state_dict(sd) / .named_weights() (local shards) / .full_weights() (gathered to the TP=1/EP=1
                 layout) / .load_weights(named) / .local_rows(B) (the rows this data-parallel rank forwards; loss_fn
                 still sees the whole batch's log-probs, gathered); token_logprobs(logits, tokens);
                 ReferencePolicy (the KL reference's protocol) and reference_policy(cfg) (a frozen Learner)
    model.py     build_model(cfg, strict=): the GPTModel (BF16 or NVFP4) every embedded engine shares;
                 init_parallel(cfg): torch.distributed + Megatron's TP/EP groups, once per process
The NVFP4 op functions its layers call are minite.ops. Importing this package does not import Megatron-Core; its
modules do.
"""
