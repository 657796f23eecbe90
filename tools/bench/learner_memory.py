"""Where a learner's memory goes, BF16 vs NVFP4, measured on any device (the CPU included) by accounting tensors.

    python tools/bench/learner_memory.py                        (a small model on the CPU, both precisions)
    python tools/bench/learner_memory.py --backend triton       (NVFP4 through the Triton kernels; on a CPU under
                                                                 TRITON_INTERPRET=1, slow: the fp16 block values the
                                                                 GPU path keeps are only written on this path)

For each precision one Learner takes a warm-up train step (so Adam's moments exist), then a second step under
accounting; one JSON row per precision:
    state        bytes per parameter kept across steps: model parameters, DDP's fp32 gradient buffer, the
                 optimizer's fp32 master weights and Adam moments (numbers for the whole model)
    nvfp4_cache  the quantised-weight caches of the NVFP4 modules (megatron_patches.nvfp4_layers.cached_weight_q)
                 as a forward leaves them: bytes by part (packed codes, block scales, fp16 block values, cached
                 transposes) and per quantised parameter; and what is still cached when the optimizer step starts
                 (the step makes every cache stale, so anything held then is dead weight)
    saved        saved-for-backward bytes per decoder layer (torch.autograd.graph.saved_tensors_hooks; distinct
                 storages, parameters excluded since they are state, not activations), and the maximum
    leak         tensor bytes per parameter still alive after `del learner` (gc.collect), without and with
                 Learner.close() (`--leak`; Megatron's DDP hooks keep a deleted learner alive otherwise)
The shape flags default to a small Qwen3-MoE (hidden 256, 8 experts top-2, 2 layers, 128 tokens) that takes seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import weakref

import torch

SMALL = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_query_groups=2, head_dim=64,
             num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _storages(ts) -> dict:
    return {t.untyped_storage().data_ptr(): _nbytes(t) for t in ts if torch.is_tensor(t) and t.numel()}


@contextlib.contextmanager
def saved_bytes_by_layer(model, into: dict):
    """Within the block, every tensor autograd saves for backward is counted against the decoder layer running when it
    was saved (`into[layer index] = bytes`, distinct storages; parameters and their views are not counted)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, seen, handles = [None], {}, []
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda *_: current.__setitem__(0, None)))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in params and t.numel():
            seen.setdefault(current[0], {})[ptr] = _nbytes(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()
        into.update({i: sum(d.values()) for i, d in sorted(seen.items())})


def nvfp4_cache_bytes(model) -> dict:
    """Bytes of every cached quantised weight (cached_weight_q), by part, over the whole model."""
    parts = {"codes": 0, "scales": 0, "values": 0, "transposed": 0}
    quantised = 0
    for m in model.modules():
        for name, entry in list(vars(m).items()):
            if not name.startswith("_nvfp4_wq_cache_"):
                continue
            q = entry[1]
            quantised += q.scale.numel() * 16 * q.block[0] if q.data is None else q.data.numel() * 2
            parts["codes"] += _nbytes(q.data) if q.data is not None else 0
            parts["scales"] += _nbytes(q.scale)
            parts["values"] += _nbytes(q.values) if q.values is not None else 0
            tr = getattr(q, "_transposed", None)
            if tr is not None:
                parts["transposed"] += sum(_storages([tr.data, tr.scale, tr.values]).values())
    total = sum(parts.values())
    return {"bytes": total, **parts, "quantised_params": quantised,
            "bytes_per_quantised_param": total / quantised if quantised else 0.0}


def state_bytes(learner) -> dict:
    params = list(learner.model.parameters())
    n = sum(p.numel() for p in params)
    grads = sum(_nbytes(b.grad_data) for b in learner.ddp.buffers + learner.ddp.expert_parallel_buffers)
    inner = [o.optimizer for o in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])]
    ids = {id(p) for p in params}
    masters = [p for o in inner for g in o.param_groups for p in g["params"] if id(p) not in ids]
    moments = [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    model_b = sum(p.numel() * p.element_size() for p in params)
    master_b = sum(p.numel() * p.element_size() for p in masters)
    moment_b = sum(t.numel() * t.element_size() for t in moments)
    return {"params": n, "model_bytes_per_param": model_b / n, "grad_buffer_bytes_per_param": grads / n,
            "master_bytes_per_param": master_b / n, "adam_bytes_per_param": moment_b / n}


def _live_tensor_bytes() -> int:
    gc.collect()
    seen = {}
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and not o.is_meta:
                seen[o.untyped_storage().data_ptr()] = _nbytes(o)
        except RuntimeError:  # tensors without storage (wrappers)
            pass
    return sum(seen.values())


def build(precision: str, shape: dict, layers: int, seq: int, backend: str):
    from minite.config import load_config
    from minite.learner.learner import Learner

    sets = [f"model.{k}={v}" for k, v in shape.items()]
    sets += [f"model.num_layers={layers}", f"model.max_position_embeddings={seq + 1}", f"precision.mode={precision}"]
    learner = Learner(load_config(None, sets))
    if learner.nvfp4 is not None:
        learner.nvfp4.backend = backend
    dev = learner.model.embedding.word_embeddings.weight.device
    tokens = torch.randint(1, shape["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    return learner, tokens.to(dev)


def measure(precision: str, shape: dict, layers: int, seq: int, backend: str) -> dict:
    learner, tokens = build(precision, shape, layers, seq, backend)
    loss = lambda lp: (-lp.mean(), {})  # noqa: E731
    learner.train_step(tokens, loss)
    saved, at_step = {}, {}
    step_fn = learner.optimizer.step

    def step(*a, **k):  # what the NVFP4 caches hold when the optimizer step starts
        at_step.update(nvfp4_cache_bytes(learner.model))
        return step_fn(*a, **k)

    learner.optimizer.step = step
    with saved_bytes_by_layer(learner.model, saved):
        learner.train_step(tokens, loss)
    learner.optimizer.step = step_fn
    learner.logprobs(tokens)  # a forward: the caches as the forward and backward hold them
    row = {"precision": precision, "layers": layers, "seq": seq, "backend": backend, "state": state_bytes(learner),
           "saved_bytes_by_layer": list(saved.values()), "saved_bytes_max_layer": max(saved.values()),
           "nvfp4_cache": nvfp4_cache_bytes(learner.model), "nvfp4_cache_bytes_at_optimizer_step": at_step["bytes"]}
    learner.close()
    return row


def leak(precision: str, shape: dict, layers: int, seq: int) -> dict:
    """Tensor bytes per parameter alive after deleting a learner that took one step, without and with close()."""
    out = {}
    for close in (False, True):
        base = _live_tensor_bytes()
        learner, tokens = build(precision, shape, layers, seq, "auto")
        learner.train_step(tokens, lambda lp: (-lp.mean(), {}))
        n = sum(p.numel() for p in learner.model.parameters())
        probe = weakref.ref(next(learner.model.parameters()))
        if close:
            learner.close()
        del learner
        out["with_close" if close else "without_close"] = {
            "bytes_per_param": (_live_tensor_bytes() - base) / n, "params_freed": probe() is None}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precisions", default="bf16,nvfp4")
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "triton"))
    p.add_argument("--leak", action="store_true", help="also measure what a deleted learner leaves alive")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a shape field, e.g. hidden_size=512")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    shape = dict(SMALL, **{k: int(v) for k, v in (s.split("=", 1) for s in a.set)})
    rows = []
    for prec in a.precisions.split(","):
        rows.append(measure(prec, shape, a.layers, a.seq, a.backend))
        if a.leak:
            rows[-1]["leak"] = leak(prec, shape, a.layers, a.seq)
        print(json.dumps(rows[-1]), flush=True)
    result = {"shape": shape, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
