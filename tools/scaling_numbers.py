"""The numbers behind docs/scaling.md: Qwen3-30B-A3B learner and rollout from 1 to N nodes of 8 H200s.

    python tools/scaling_numbers.py [--nodes 1 4 16] [--tokens-per-node 1048576] [--config examples/qwen3_30b_a3b/config.json]

Pure arithmetic on the model's shape (its config.json) and the constants below; prints Markdown tables. Every
formula is written out next to its number in docs/scaling.md. Bandwidths are nominal spec values, not measurements.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from minite.models.qwen3_moe import Qwen3MoeShape

REPO = Path(__file__).resolve().parents[1]
GB = 1e9

GPUS_PER_NODE = 8
HBM_BYTES = 141e9             # H200 HBM3e capacity (spec)
HBM_BW = 4.8e12               # H200 HBM bandwidth (spec), B/s
NVLINK_BW = 450e9             # NVLink 4 per GPU per direction (18 links x 25 GB/s, spec), B/s
IB_BW = 50e9                  # one 400 Gb/s NIC per GPU (8 per node), per direction, B/s
LEARNER_BYTES_PER_PARAM = 18  # bf16 param 2 + fp32 main grad 4 + fp32 master 4 + Adam m, v 8 (no distributed optim.)
A2A_PASSES = 6                # per token and MoE layer: dispatch + combine in the train forward, their two
#                               gradients in the backward, dispatch + combine in the log-prob forward
NVFP4_BITS_COMPACT = 4 + 8 / 256   # e2m1 code + one e4m3 scale per 16x16 weight block (the learner's recipe)
NVFP4_BITS_MODELOPT = 4 + 8 / 16   # the same values in ModelOpt's layout: one e4m3 scale per 16 along K


@dataclass(frozen=True)
class Model:
    """Parameter and byte counts of a Qwen3-MoE shape (minite.models.qwen3_moe.Qwen3MoeShape, the one shape type)."""

    shape: Qwen3MoeShape

    @classmethod
    def load(cls, path: Path) -> "Model":
        return cls(Qwen3MoeShape.from_any(Path(path)))

    @property
    def hidden(self) -> int:
        return self.shape.hidden_size

    @property
    def layers(self) -> int:
        return self.shape.num_layers

    @property
    def topk(self) -> int:
        return self.shape.moe_router_topk

    @property
    def attention(self) -> int:  # q, k, v, o projections, all layers
        s = self.shape
        d, h = s.head_dim, s.hidden_size
        return s.num_layers * (2 * s.num_attention_heads * d * h + 2 * s.num_query_groups * d * h)

    @property
    def expert(self) -> int:  # one expert: gate, up [F, H], down [H, F]
        return 3 * self.shape.moe_ffn_hidden_size * self.shape.hidden_size

    @property
    def experts_total(self) -> int:
        return self.shape.num_layers * self.shape.num_experts * self.expert

    @property
    def bf16_always(self) -> int:  # embedding, lm_head, router, norms: BF16 in every recipe here
        s = self.shape
        norms = s.num_layers * (2 * s.hidden_size + 2 * s.head_dim) + s.hidden_size
        return 2 * s.vocab_size * s.hidden_size + s.num_layers * s.num_experts * s.hidden_size + norms

    @property
    def total(self) -> int:
        return self.attention + self.experts_total + self.bf16_always

    @property
    def active(self) -> int:  # parameters a token's forward touches (the lm_head counted, the embedding not)
        s = self.shape
        return self.attention + s.num_layers * s.moe_router_topk * self.expert + s.vocab_size * s.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:  # BF16 K and V
        s = self.shape
        return s.num_layers * 2 * s.num_query_groups * s.head_dim * 2


def sync_bytes(m: Model, bits: float) -> float:
    """Bytes of one full weight copy with NVFP4 linears/experts at `bits` per element and BF16 elsewhere."""
    return (m.attention + m.experts_total) * bits / 8 + m.bf16_always * 2


def layouts(nodes: int):
    """(name, EP, DP) candidates for `nodes` nodes: experts inside a node, or spread over all GPUs."""
    gpus = nodes * GPUS_PER_NODE
    yield "EP8 x DP" + str(nodes), GPUS_PER_NODE, nodes
    if nodes > 1:
        yield f"EP{gpus}", gpus, 1


def learner_row(m: Model, nodes: int, name: str, ep: int, edp: int, tokens_per_gpu: float) -> dict:
    """Per-GPU memory, all-to-all volume (NVLink vs network) and gradient all-reduce volume of one layout."""
    params = m.experts_total / ep + m.attention + m.bf16_always
    a2a_token_layer = A2A_PASSES * m.topk * m.hidden * 2  # bytes a token sends+receives per MoE layer (BF16)
    remote = (ep - 1) / ep                                # share of (token, expert) pairs on another GPU
    off_node = max(0, ep - GPUS_PER_NODE) / ep            # share on another node
    a2a = tokens_per_gpu * m.layers * a2a_token_layer
    expert_grads = m.experts_total / ep * 4               # fp32 main grads, all-reduced over the edp replicas
    dense_grads = (m.attention + m.bf16_always) * 4       # all-reduced over all nodes x 8 replicas
    gpus = nodes * GPUS_PER_NODE
    # ring all-reduce sends 2 (n-1)/n of the buffer per GPU; across nodes only the inter-node share counts
    ar_net = 2 * (edp - 1) / edp * expert_grads + 2 * (nodes - 1) / nodes * dense_grads
    return {
        "layout": name, "params_per_gpu": params, "state_gb": params * LEARNER_BYTES_PER_PARAM / GB,
        # distributed optimizer: fp32 master + Adam m, v (12 B) sharded over the replicas of each parameter
        "state_distopt_gb": (m.experts_total / ep * (6 + 12 / edp)
                             + (m.attention + m.bf16_always) * (6 + 12 / (nodes * GPUS_PER_NODE))) / GB,
        "a2a_nvlink_gb": a2a * (remote - off_node) / GB, "a2a_net_gb": a2a * off_node / GB,
        "a2a_s": a2a * (remote - off_node) / NVLINK_BW + a2a * off_node / IB_BW,
        "allreduce_net_gb": ar_net / GB, "allreduce_s": ar_net / IB_BW if nodes > 1 else 0.0,
        "gpus": gpus,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tokens-per-node", type=float, default=64 * 8 * 2048,
                    help="learner tokens per RL step per node (default: 64 prompts x 8 samples x 2048 tokens)")
    ap.add_argument("--config", default=str(REPO / "examples" / "qwen3_30b_a3b" / "config.json"))
    a = ap.parse_args()
    m = Model.load(a.config)
    print(f"## Model ({Path(a.config).name})\n")
    print(f"total parameters {m.total / 1e9:.2f} B: experts {m.experts_total / 1e9:.2f} B, attention "
          f"{m.attention / 1e9:.3f} B, embedding + lm_head + router + norms {m.bf16_always / 1e9:.3f} B; "
          f"active per token {m.active / 1e9:.2f} B; one expert {m.expert / 1e6:.2f} M; "
          f"KV cache {m.kv_bytes_per_token / 1024:.0f} KiB per token (BF16)\n")
    tok_gpu = a.tokens_per_node / GPUS_PER_NODE
    print(f"## Learner, {a.tokens_per_node:,.0f} tokens per RL step per node ({tok_gpu:,.0f} per GPU), "
          f"one optimizer step per RL step\n")
    print("| nodes | layout | params/GPU | train state/GPU | same, distributed optimizer | all-to-all NVLink | "
          "all-to-all network | a2a time | grad all-reduce network | all-reduce time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in a.nodes:
        for name, ep, edp in layouts(n):
            r = learner_row(m, n, name, ep, edp, tok_gpu)
            print(f"| {n} | {r['layout']} | {r['params_per_gpu'] / 1e9:.2f} B | {r['state_gb']:.1f} GB | "
                  f"{r['state_distopt_gb']:.1f} GB | "
                  f"{r['a2a_nvlink_gb']:.0f} GB | {r['a2a_net_gb']:.0f} GB | {r['a2a_s']:.2f} s | "
                  f"{r['allreduce_net_gb']:.1f} GB | {r['allreduce_s']:.2f} s |")
    flops = 8 * m.active * tok_gpu  # 6 (train fwd+bwd) + 2 (log-prob forward) FLOP per active parameter and token
    print(f"\nper GPU per RL step: {flops / 1e15:.2f} PFLOP (8 x active x tokens): {flops / 75e12:.0f} s at the "
          f"75 TFLOP/s per layer measured for Megatron BF16 on an H200 (docs/upstream.md), "
          f"{flops / 500e12:.1f} s at 500 TFLOP/s\n")
    print("## Weight sync, learner -> rollout, per full copy\n")
    bf16, compact, modelopt = sync_bytes(m, 16), sync_bytes(m, NVFP4_BITS_COMPACT), sync_bytes(m, NVFP4_BITS_MODELOPT)
    print("| format | bytes | BF16 / this | one NIC (50 GB/s) | a node's 8 NICs | NVLink, per GPU | HBM read per decode step |")
    print("|---|---|---|---|---|---|---|")
    for name, b in (("BF16", bf16), ("NVFP4 16x16 scales (4.03 bit)", compact),
                    ("NVFP4 ModelOpt layout (4.5 bit)", modelopt)):
        print(f"| {name} | {b / GB:.1f} GB | {bf16 / b:.2f}x | {b / IB_BW:.2f} s | "
              f"{b / (8 * IB_BW):.3f} s | {b / NVLINK_BW * 1e3:.0f} ms | {b / HBM_BW * 1e3:.1f} ms |")
    print("\n## Rollout memory per GPU (one engine per GPU holding the whole model)\n")
    print("| weights | weights GB | left for KV (minus 10 GB runtime) | KV tokens per GPU |")
    print("|---|---|---|---|")
    for name, b in (("BF16", bf16), ("NVFP4 (ModelOpt layout)", modelopt)):
        left = HBM_BYTES - b - 10e9
        print(f"| {name} | {b / GB:.1f} | {left / GB:.1f} GB | {left / m.kv_bytes_per_token / 1e6:.2f} M |")
    print("\n## Weight-sync volume per RL step by placement (NVFP4 ModelOpt layout; BF16 in brackets)\n")
    print("| nodes | colocated, EP8 learner (NVLink only) | colocated, EP=all learner (network) | "
          "disaggregated, half the nodes roll out (network) |")
    print("|---|---|---|---|")
    for n in a.nodes:
        gpus = n * GPUS_PER_NODE
        both = (NVFP4_BITS_MODELOPT, 16)
        # colocated, EP8 learner: a node's 8 learner ranks hold the whole model between them (dense part replicated);
        # each GPU's rollout engine gathers the 7/8 of the experts it lacks from its 7 peers over NVLink
        colo = [7 / 8 * m.experts_total * bits / 8 / GB for bits in both]
        # colocated, EP over all GPUs: a node holds 1/n of the experts; every node receives the other (n-1)/n over
        # the network once (then NVLink inside the node)
        net = [n * (n - 1) / n * m.experts_total * bits / 8 / GB for bits in both]
        # disaggregated: n/2 rollout nodes each receive one full copy over the network
        dis = [n // 2 * sync_bytes(m, bits) / GB for bits in both]
        print(f"| {n} | {colo[0]:.1f} GB per GPU [{colo[1]:.1f}] x {gpus} GPUs, "
              f"{colo[0] * GB / NVLINK_BW * 1e3:.0f} ms [{colo[1] * GB / NVLINK_BW * 1e3:.0f}] | "
              + (f"{net[0]:.0f} GB [{net[1]:.0f}] in total, {net[0] / n * GB / (8 * IB_BW):.2f} s "
                 f"[{net[1] / n * GB / (8 * IB_BW):.2f}] per node |" if n > 1 else "- |")
              + (f" {dis[0]:.0f} GB [{dis[1]:.0f}] in total, {dis[0] / (n // 2) * GB / (8 * IB_BW):.2f} s "
                 f"[{dis[1] / (n // 2) * GB / (8 * IB_BW):.2f}] per node |" if n > 1 else " - |"))

if __name__ == "__main__":
    main()
