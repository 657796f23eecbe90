"""Strict attention in one Triton kernel: `ops.attention`'s operations, in the same order, per (query, batch x head).

`_attention_kernel` walks the context in blocks of ATTENTION_KEY_BLOCK keys through scratch buffers and reads grouped KV
heads in place (query head i reads KV head i // (h / g)); tests/strict/test_fused.py compares its bits with the torch
ops under the interpreter, tests/alignment/test_strict_alignment_gpu.py on the H200. A one-pass variant holding a
context of up to 128 keys in registers (no scratch, no barrier; the same bits) was measured slower on the H200
(2026-12-01, decode shapes, 72 keys x 32 heads: 202-276 us against 177 us at batch 64, 708-1069 us against 668 us at
256, with 4 or 8 warps; faster only at batch 1 and 8), so it is not kept. The IEEE rules (no FMA contraction, correctly
rounded division, the strict exp) are `minite.strict.fused`'s, whose helpers they use; "attention" in `fused.PROVEN`
routes them.
"""
from __future__ import annotations

import torch

from minite.kernels._interpreter import ensure_interpreter_compat
from minite.kernels._launch import launcher

from . import fused
from .fused import EXP_ARGS, available

if fused.triton is not None:
    import triton
    import triton.language as tl

    from .fused import _exp64, _load_f32, _pair_tree

    @triton.jit
    def _pair_tree_halves(acc, LEVELS: tl.constexpr, SPLIT: tl.constexpr):
        """`_pair_tree` over the 2**LEVELS keys of each column of acc [KH, NH, C], key h * KH + a at [a, h] (NH = 2, or
        1 for one key): the same additions, adjacent keys first (along dim 0, which a load contiguous along C keeps in
        a thread's registers), the two halves (dim 1, the lanes Triton spreads next) last: one level crosses lanes."""
        if SPLIT:
            return _pair_tree(tl.reshape(tl.permute(acc, [2, 1, 0]), [acc.shape[2], acc.shape[1] * acc.shape[0]]),
                              LEVELS, SPLIT)
        for _ in tl.static_range(LEVELS - 1):
            acc = tl.sum(tl.reshape(acc, [acc.shape[0] // 2, 2, acc.shape[1], acc.shape[2]]), axis=1)
        return tl.reshape(tl.sum(acc, axis=1), [acc.shape[2]])

    @triton.jit(do_not_specialize=["sq", "sk", "d", "bh", "i0", "h", "rep"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, s_ptr, e_ptr, bs_ptr, cs_ptr, sq, sk, d, bh, i0, h, rep, scale,
                          sq_i, sq_bh, sk_j, sk_bh, so_i, so_bh,
                          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                          C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                          C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
                          LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr,
                          DP: tl.constexpr, DL: tl.constexpr, KB: tl.constexpr, KL: tl.constexpr,
                          NB: tl.constexpr, NL: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
                          KH: tl.constexpr, NH: tl.constexpr):
        """ops.attention for one (query, batch x head) pair: scores, softmax and context as its torch ops compute
        them (module docstring of ops; the function `attention` below says how the sums are split into blocks)."""
        pid = tl.program_id(0).to(tl.int64)  # scratch rows are per launch; the query is i0 + pid // bh
        i, g = i0 + pid // bh, pid % bh
        kv = (g // h) * (h // rep) + (g % h) // rep  # the KV head of query head g % h in batch row g // h
        pos = sk - sq + i
        dd = tl.arange(0, DP)
        din = (dd < d) | EVEN_D  # EVEN_D (d == DP): no channel mask, so the loads of a key's channels are vectors
        jj = tl.arange(0, KB)
        q = _load_f32(q_ptr, i * sq_i + g * sq_bh + dd, din)
        srow, erow = s_ptr + pid * NB * KB, e_ptr + pid * NB * KB
        # a block's base in 64 bits (keys * sk_j reach past 2^31 for long contexts), the offsets in it in 32
        # (`attention` checks KB * sk_j < 2^31). Blocks past the last key (the padding to a power of two) are not
        # computed: each of their block sums is +0 (e = +0 and p * v = +0 * +0 there), which the loads of the
        # block sums below read back as `other`.
        nbk = (sk + KB - 1) // KB
        m = tl.full([1], float("-inf"), tl.float32)
        for blk in range(nbk):  # scores: tree sums over d, then * scale; the max over allowed keys
            j0 = blk * KB
            # a key past the context reads the last key's row instead of a masked zero: its score is finite or
            # not, and it is excluded from the max here and from e in the next pass either way
            r = tl.minimum(jj, sk - 1 - j0)
            kk = _load_f32(k_ptr + (j0.to(tl.int64) * sk_j + kv * sk_bh), r[:, None] * sk_j + dd[None, :],
                           din[None, :])
            sc = _pair_tree(q[None, :] * kk, DL, SPLIT) * scale
            tl.store(srow + j0 + jj, sc)
            m = tl.maximum(m, tl.max(tl.where(j0 + jj <= pos, sc, float("-inf")), axis=0))
        tl.debug_barrier()
        for blk in range(nbk):  # e = exp(scores - m) where allowed, else 0; block sums of e
            j = blk * KB + jj
            sc = tl.load(srow + j)
            ex = _exp64((sc - m).to(tl.float64), C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13,
                        LOG2E, LN2_HI, LN2_LO, RNE)
            e = tl.where(j <= pos, ex, 0.0)
            tl.store(erow + j, e)
            tl.store(bs_ptr + pid * NB + blk + tl.arange(0, 1), _pair_tree(tl.reshape(e, [1, KB]), KL, SPLIT))
        tl.debug_barrier()
        bi = tl.arange(0, NB)
        denom = _pair_tree(tl.load(bs_ptr + pid * NB + bi, mask=bi < nbk, other=0.0)[None, :], NL, SPLIT)  # the top
        r3 = tl.arange(0, NH)[None, :] * KH + tl.arange(0, KH)[:, None]  # key h * KH + a at [a, h] (KB = NH * KH)
        for blk in range(nbk):  # context: p = e / denom; tree sums over the block's keys per channel
            j0 = blk * KB
            p3 = tl.div_rn(tl.load(erow + j0 + r3), tl.broadcast_to(tl.reshape(denom, [1, 1]), [KH, NH]))
            # past the context v is a masked +0 (p * v must be +0 there: a -0 would change a sum of zeros)
            vv = _load_f32(v_ptr + (j0.to(tl.int64) * sk_j + kv * sk_bh), r3[:, :, None] * sk_j + dd[None, None, :],
                           (r3[:, :, None] < sk - j0) & din[None, None, :])  # [KH, NH, DP]
            tl.store(cs_ptr + (pid * DP + dd) * NB + blk, _pair_tree_halves(p3[:, :, None] * vv, KL, SPLIT))
        tl.debug_barrier()
        ctx = _pair_tree(tl.load(cs_ptr + (pid * DP + dd)[:, None] * NB + bi[None, :], mask=bi[None, :] < nbk,
                                 other=0.0), NL, SPLIT)
        tl.store(o_ptr + i * so_i + g * so_bh + dd, ctx, mask=dd < d)


ATTENTION_KEY_BLOCK = 32
"""Keys per block of the fused attention: the tree over the zero-padded key width (a power of two) is the tree over
aligned blocks of this many keys, then the tree over the block sums, so the split changes no bit. 32 is the fastest of
8-64, or within 2 us of it, at decode shapes on an H100 (2026-12-06, docs/benchmarks/strict-attention-sweep-h100.json)
for the kernel before 99d4eb5, which computed every block of padding, and for 99d4eb5's (batch 256 x 72 keys: 189.0 /
109.5 / 79.2 / 106.5 us for 8 / 16 / 32 / 64; 16 computes 80 keys there against 32's 96, but pays more per block)."""
ATTENTION_MAX_KEYS = 8192
"""The longest context routed to the fused attention (its last pass holds [d, keys / ATTENTION_KEY_BLOCK] values)."""
ATTENTION_WARPS = 1
"""Warps per program (any count computes the same bits: every sum is an explicit pair tree). One warp: measured on the
H200 (2026-12-01, session 8 call 6, `.calls/attn.py`-style timing of CUDA-graph replays, 32 heads over 4 KV heads, 128
channels; every variant bitwise equal to the 4-warp launch): batch 64 x 72 keys 40.2 us against 173.1 us with 4 warps
(116.3 with 2, 243.6 with 8), 40 keys 22.4 against 88.7, batch 256 x 72 keys 154.9 against 665.2, batch 8 13.7 against
26.2. A program's sums are short (128 channels, a few 32-key blocks), so cross-warp reductions cost more than they
spread. Only for contexts up to ATTENTION_ONE_WARP_KEYS (padded) keys, the range measured: longer ones (prefill,
training forwards; up to 8192 keys, whose last pass holds 128 x 256 values a program) keep 4 warps. 99d4eb5's kernel
(vector loads, no blocks of padding alone, the context's key tree in registers) on one H100 (2026-12-06): batch 256 x
72 keys 79.0 us (153.5 before), 64 x 72 keys 21.1 (39.7), 8 x 56 keys 5.7 (8.1); the same bits."""
ATTENTION_ONE_WARP_KEYS = 256
ATTENTION_SCRATCH_BYTES = 256 << 20
"""Scratch of one launch; more queries run as further launches (programs are independent: no bit changes)."""


def routable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` takes these shapes (q [sq, b, h, d], k [sk, b, g, d]): a key for every query, at most
    ATTENTION_MAX_KEYS keys, and a cache whose block offsets fit 32 bits; strict ops.attention computes the others
    with its torch ops."""
    sq, sk = q.shape[0], k.shape[0]
    return 0 < sk <= ATTENTION_MAX_KEYS and sq <= sk and ATTENTION_KEY_BLOCK * k[0].numel() < 2**31


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """ops.attention's bits (q [sq, b, h, d], k/v [sk, b, g, d] with g dividing h -> [sq, b, h, d] fp32) with one
    program per (query, batch x head), which reads its KV head in place (query head i: KV head i // (h / g), no expanded
    copy of the cache): the scores' tree sums over d, the causal mask by absolute position, the max, the strict exp, the
    denominator's tree sum over keys, p = e / denominator, the context's tree sums over keys: the same operations in the
    same order. The key sums run over aligned blocks of ATTENTION_KEY_BLOCK keys and then over the block sums
    (ATTENTION_KEY_BLOCK's docstring); the scores, e and the block sums pass through scratch buffers."""
    if not available(q):
        raise ValueError("strict fused attention needs floating CUDA tensors (or TRITON_INTERPRET=1)")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"strict fused attention: q {tuple(q.shape)}, k {tuple(k.shape)}: [s, b, heads, d] each")
    sq, b, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[2]
    if k.shape != (sk, b, hkv, d) or v.shape != k.shape or hkv == 0 or h % hkv:
        raise ValueError(f"strict fused attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if sk == 0 or sq > sk:
        raise ValueError(f"strict fused attention: {sq} queries over {sk} keys (each query needs its own key)")
    if sk > ATTENTION_MAX_KEYS:
        raise ValueError(f"strict fused attention: {sk} keys, at most {ATTENTION_MAX_KEYS}")
    if not routable(q, k):
        raise ValueError(f"strict fused attention: a cache of {b} x {hkv} x {d} values per key is too wide (a block's "
                         f"offsets are 32-bit; strict ops.attention computes it with its torch ops)")
    ensure_interpreter_compat()
    out = torch.empty(sq, b, h, d, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    qc, kc, vc = (t.contiguous().view(t.shape[0], b * t.shape[2], d) for t in (q, k, v))
    dp = 1 << (d - 1).bit_length()
    skp = 1 << (sk - 1).bit_length()
    o = out.view(sq, b * h, d)
    strides = (qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1), o.stride(0), o.stride(1))
    kb = min(ATTENTION_KEY_BLOCK, skp)
    nb = skp // kb
    per_query = b * h * (2 * skp + nb + dp * nb) * 4  # scratch bytes of one query's programs
    step = max(1, min(sq, ATTENTION_SCRATCH_BYTES // per_query))  # queries per launch (independent programs)
    scratch = torch.empty(step * b * h, skp, dtype=torch.float32, device=q.device)
    e = torch.empty_like(scratch)
    bs = torch.empty(step * b * h, nb, dtype=torch.float32, device=q.device)
    cs = torch.empty(step * b * h, dp, nb, dtype=torch.float32, device=q.device)
    for i0 in range(0, sq, step):
        n = min(step, sq - i0)
        launcher(_attention_kernel)[(n * b * h,)](
            qc, kc, vc, o, scratch, e, bs, cs, sq, sk, d, b * h, i0, h, h // hkv, float(scale), *strides, **EXP_ARGS,
            DP=dp, DL=dp.bit_length() - 1, KB=kb, KL=kb.bit_length() - 1, NB=nb, NL=nb.bit_length() - 1,
            SPLIT=fused.pair_split(), EVEN_D=dp == d, KH=max(1, kb // 2), NH=min(2, kb),
            num_warps=ATTENTION_WARPS if skp <= ATTENTION_ONE_WARP_KEYS else 4,
            enable_fp_fusion=False)
    return out
