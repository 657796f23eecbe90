"""A Qwen3-MoE decode step written in plain PyTorch (BF16, random weights): the yardstick for the embedded engine's
decode step in tools/bench/bench_rollout.py (issue 16: "a user's baseline must be fast too").

One step for a batch of B tokens, each attending over a KV cache of `context` positions:
    x = embedding[tokens]
    per layer:  h = RMSNorm(x); q, k, v = h @ W_qkv^T (GQA: kv groups of head_dim), per-head q/k RMSNorm;
                k, v written into the cache at `pos`; SDPA of q over the whole cache; x += o @ W_o^T
                h = RMSNorm(x); router logits h @ W_r^T (fp32), softmax, top-k, renormalised;
                rows sorted by expert; gate/up and down on torch._grouped_mm (a loop of per-expert matmuls where
                it is absent or off CUDA); silu(gate) * up * prob; x += the k rows of each token (index_add_)
    logits = RMSNorm(x) @ W_lm^T; next token = argmax
No RoPE (an elementwise rotation, negligible bytes) and no sampling: the point is the weights, the KV cache and the
launches a step needs. Every shape is static and nothing reads the device from the host (expert counts come from a
scatter_add_, not bincount), so on a GPU the whole step is captured in one CUDA graph and replayed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class ReferenceDecoder:
    """Random BF16 weights of `shape`, a KV cache of `context` positions for `batch` sequences, and `step()`."""

    def __init__(self, shape: Shape, batch: int, context: int, device: str, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        s, dt = shape, torch.bfloat16
        h, hd, nh, kv = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_query_groups
        rnd = lambda *dims: (torch.randn(*dims, generator=g, device=device) * 0.02).to(dt)  # noqa: E731
        self.shape, self.batch, self.context = s, batch, context
        self.embedding, self.lm_head = rnd(s.vocab_size, h), rnd(s.vocab_size, h)
        self.final_norm = torch.ones(h, dtype=dt, device=device)
        self.layers = [dict(norm1=torch.ones(h, dtype=dt, device=device), norm2=torch.ones(h, dtype=dt, device=device),
                            q_norm=torch.ones(hd, dtype=dt, device=device), k_norm=torch.ones(hd, dtype=dt, device=device),
                            qkv=rnd((nh + 2 * kv) * hd, h), proj=rnd(h, nh * hd), router=rnd(s.num_experts, h),
                            fc1=rnd(s.num_experts, 2 * s.moe_ffn_hidden_size, h),
                            fc2=rnd(s.num_experts, h, s.moe_ffn_hidden_size),
                            k_cache=rnd(batch, kv, context, hd), v_cache=rnd(batch, kv, context, hd))
                       for _ in range(s.num_layers)]
        self.tokens = torch.randint(0, s.vocab_size, (batch,), generator=g, device=device)
        self.pos = torch.tensor([context - 1], device=device)
        self.grouped = hasattr(torch, "_grouped_mm") and device == "cuda"

    def _experts(self, layer: dict, h: torch.Tensor) -> torch.Tensor:
        s = self.shape
        probs = torch.softmax((h.float() @ layer["router"].float().t()), dim=-1)
        top_p, top_i = torch.topk(probs, s.moe_router_topk, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows_token = order // s.moe_router_topk
        counts = torch.zeros(s.num_experts, dtype=torch.int32, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        x = h.index_select(0, rows_token)
        if self.grouped:
            offs = counts.cumsum(0, dtype=torch.int32)
            gu = torch._grouped_mm(x, layer["fc1"].transpose(1, 2), offs=offs)
        else:
            gu = self._loop(x, layer["fc1"], counts)
        gate, up = gu.chunk(2, dim=-1)
        act = (F.silu(gate.float()) * up.float() * top_p.reshape(-1)[order, None]).to(h.dtype)
        out = (torch._grouped_mm(act, layer["fc2"].transpose(1, 2), offs=offs) if self.grouped
               else self._loop(act, layer["fc2"], counts))
        return torch.zeros_like(h).index_add_(0, rows_token, out)

    @staticmethod
    def _loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):  # off CUDA only: a host read per layer
            outs.append(x[start:start + c] @ w[e].t())
            start += c
        return torch.cat(outs)

    def step(self) -> torch.Tensor:
        """One decode step; returns the next tokens [B] (also kept as the next step's input)."""
        s = self.shape
        b, nh, kv, hd = self.batch, s.num_attention_heads, s.num_query_groups, s.head_dim
        x = self.embedding.index_select(0, self.tokens)
        for layer in self.layers:
            qkv = _rms(x, layer["norm1"]) @ layer["qkv"].t()
            q, k, v = qkv.split([nh * hd, kv * hd, kv * hd], dim=-1)
            q = _rms(q.view(b, nh, 1, hd), layer["q_norm"])
            k = _rms(k.view(b, kv, 1, hd), layer["k_norm"])
            layer["k_cache"].index_copy_(2, self.pos, k)
            layer["v_cache"].index_copy_(2, self.pos, v.view(b, kv, 1, hd))
            o = F.scaled_dot_product_attention(q, layer["k_cache"], layer["v_cache"], enable_gqa=True)
            x = x + o.reshape(b, nh * hd) @ layer["proj"].t()
            x = x + self._experts(layer, _rms(x, layer["norm2"]))
        logits = _rms(x, self.final_norm) @ self.lm_head.t()
        self.tokens.copy_(logits.argmax(-1))
        return self.tokens


def time_step(dec: ReferenceDecoder, iters: int, warmup: int, graph: bool) -> float:
    """Mean seconds per step over `iters` steps (after `warmup`), eager or as CUDA-graph replays."""
    cuda = dec.tokens.is_cuda
    run = dec.step
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch.cuda.graphs asks
            for _ in range(max(1, warmup)):
                dec.step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dec.step()
        run = g.replay
    for _ in range(warmup):
        run()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters
