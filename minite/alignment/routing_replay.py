"""Routing replay: the learner routes each token to the experts the rollout engine chose for it.

Why. In default (non-strict) mode the learner and the rollout compute router logits with slightly different
arithmetic (GEMMs at different M, see docs/alignment.md). When two experts' logits are nearly tied, the top-k can
flip: the token then goes through different experts in the two engines, and its log-prob gap jumps from ~1e-6 to
the size of an expert's contribution. Replaying the rollout's routes in the learner removes those flips; the gap
that remains is the smooth arithmetic one. The probabilities are still the learner's own (softmax over the replayed
experts' learner logits), so gradients flow through the router as usual.

How (Megatron-Core 0.16.1 hook). `TopKRouter.router_replay` (a `RouterReplay`, normally created when
config.moe_enable_routing_replay is set, and registered in a process-global list) is consulted by
`topk_routing_with_score_function`: with action RECORD it computes top-k and calls `record_indices`; with
REPLAY_FORWARD it returns `target_topk_idx` and gathers the scores at those indices. We attach our own instances
per model (not through the global list: the learner and an embedded engine live in one process, and the global
setters would drive both), so recording one model never touches another.

Layout. A router sees hidden states [s, b, h] flattened s-major, so a call's indices are [s * b, k]. The engine's
prefill and decode calls, concatenated, give routes [S, b, k] per layer for positions 0..S-1 of each sequence of
its static batch; the learner's full forward over tokens [b, T] wants [T * b, k]. Positions the engine never ran
(a sequence's last token, padding) get experts 0..k-1: causal attention keeps them from influencing any scored
position. Under TP with sequence parallelism a learner rank's routers see only its slice of the positions
(`Learner.sequence_shard`: T padded to a multiple of TP), so `learner_replay` gives each rank that slice's rows.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _routers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise ValueError("routing replay: the model has no TopKRouter (not an MoE model?)")
    return routers


def has_routers(model: torch.nn.Module) -> bool:
    from megatron.core.transformer.moe.router import TopKRouter

    return any(isinstance(m, TopKRouter) for m in model.modules())


def _layer_replay(action, target: torch.Tensor | None = None):
    """A RouterReplay for one router, kept out of RouterReplay's process-global list."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class _LayerReplay(RouterReplay):
        def __init__(self):  # upstream's __init__ would register the instance globally
            self.target_topk_idx = target
            self.recorded_topk_idx = None
            self.router_replay_action = action
            self.replay_backward_list = []
            self.calls: list[torch.Tensor] = []

        def record_indices(self, topk_indices: torch.Tensor):
            self.calls.append(topk_indices.detach().to("cpu", copy=True))

    return _LayerReplay()


@contextlib.contextmanager
def _attached(model: torch.nn.Module, make) -> Iterator[list]:
    routers = _routers(model)
    saved = [r.router_replay for r in routers]
    replays = [make(i) for i in range(len(routers))]
    for r, rep in zip(routers, replays):
        r.router_replay = rep
    try:
        yield replays
    finally:
        for r, old in zip(routers, saved):
            r.router_replay = old


class RouteRecording:
    """Filled by `record_routes`: per layer, the top-k expert indices of every router call, in call order."""

    def __init__(self):
        self.calls: list[list[torch.Tensor]] = []

    def routes(self, batch: int) -> list[torch.Tensor]:
        """Per layer, routes [S, batch, k] (positions the engine computed, s-major as the router saw them)."""
        out = []
        for calls in self.calls:
            if not calls:
                raise ValueError("routing replay: a router recorded no calls (did the model run?)")
            rows = torch.cat(calls, dim=0)
            if rows.shape[0] % batch:
                raise ValueError(f"routing replay: {rows.shape[0]} routed rows are not a multiple of batch {batch}")
            out.append(rows.reshape(-1, batch, rows.shape[-1]))
        return out


@contextlib.contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RouteRecording]:
    """Record every router call of `model` (e.g. around engine.generate)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rec = RouteRecording()
    with _attached(model, lambda i: _layer_replay(RouterReplayAction.RECORD)) as replays:
        yield rec
        rec.calls = [rep.calls for rep in replays]


def replay_targets(routes: list[torch.Tensor], seq_len: int, rows: list[int] | None = None) -> list[torch.Tensor]:
    """Per layer, [seq_len * b, k] targets for a full forward over seq_len positions of batch rows `rows`
    (default: all). Positions past the recorded ones get experts 0..k-1 (never seen by a scored position)."""
    out = []
    for r in routes:
        r = r if rows is None else r[:, rows]
        s, b, k = r.shape
        full = torch.arange(k, dtype=r.dtype).expand(seq_len, b, k).clone()
        n = min(s, seq_len)
        full[:n] = r[:n]
        out.append(full.reshape(seq_len * b, k))
    return out


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, targets: list[torch.Tensor]) -> Iterator[None]:
    """Run `model`'s forwards inside with each router's top-k replaced by `targets[layer]` ([s * b, k])."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    n = len(_routers(model))
    if len(targets) != n:
        raise ValueError(f"routing replay: {len(targets)} layers of routes for a model with {n} routers")
    with _attached(model, lambda i: _layer_replay(RouterReplayAction.REPLAY_FORWARD, targets[i])):
        yield


def route_flips(a: list[torch.Tensor], b: list[torch.Tensor], valid: torch.Tensor) -> int:
    """How many (layer, position, sequence) routed to a different expert set in a and b ([S, B, k] each);
    valid [S, B] masks the positions to count."""
    flips = 0
    for ra, rb in zip(a, b):
        s = min(ra.shape[0], rb.shape[0], valid.shape[0])
        differ = (ra[:s].sort(-1).values != rb[:s].sort(-1).values).any(-1)
        flips += int((differ & valid[:s].bool()).sum())
    return flips


@contextlib.contextmanager
def engine_recording(engine, enabled: bool) -> Iterator[RouteRecording | None]:
    """For the RL loop: record the engine's routes when `enabled` (None otherwise)."""
    if not enabled:
        yield None
        return
    model = getattr(engine, "model", None)
    if model is None or not has_routers(model):
        raise ValueError("alignment.routing_replay needs a rollout engine that exposes its Megatron model "
                         "(rollout.backend: embedded)")
    with contextlib.ExitStack() as stack:
        if hasattr(engine, "observed"):  # the recording hooks must see every step: no graph replays
            stack.enter_context(engine.observed())
        yield stack.enter_context(record_routes(model))


def learner_replay(learner, routes: list[torch.Tensor] | None, seq_len: int, rows: list[int] | None = None):
    """For the RL loop: a context in which the learner's forwards over rows `rows` replay `routes` (no-op if None).
    Under sequence parallelism each TP rank's routers see their slice of the (padded) positions
    (`Learner.sequence_shard`), so each replays that slice."""
    if routes is None:
        return contextlib.nullcontext()
    padded, start, end = learner.sequence_shard(seq_len)
    return replay_routes(learner.model, shard_targets(replay_targets(routes, padded, rows), padded, start, end))


def shard_targets(targets: list[torch.Tensor], padded: int, start: int, end: int) -> list[torch.Tensor]:
    """Per layer, the rows of positions [start, end) of [padded * b, k] s-major targets."""
    return [t.reshape(padded, -1, t.shape[-1])[start:end].reshape(-1, t.shape[-1]) for t in targets]
