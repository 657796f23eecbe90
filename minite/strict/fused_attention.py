"""Strict attention in Triton: `ops.attention`'s operations, in the same order, per (query, batch x head).

Both kernels walk the context in blocks of ATTENTION_KEY_BLOCK keys through scratch buffers and read grouped KV heads in
place (query head i reads KV head i // (h / g)). A short context (up to ATTENTION_ONE_LAUNCH_BLOCKS blocks, the decode
steps of short prompts) runs on `_head_kernel`: one program per (query, batch x head) over the whole context, one
launch. A longer one runs on `_attention_kernel`, split into chunks of key blocks: a program takes one (query, batch x
KV head) pair, `heads_per_program` of the query heads of that KV head (one, as shipped; more would read each key and
value block once for them all) and one chunk, and the passes run as four launches (`attention`). Until 2026-12-07 every
context ran on the per-head kernel in one launch: at a 1,024-token prompt the strict NVFP4 decode step took 6.85 ms
against the default step's 1.47 ms (H100, batch 64, docs/benchmarks.md, forty-third session), each program walking
~1,060 keys alone on 4 warps; with the split kernel it took 3.33 ms (forty-fourth session, 8 heads a program) and
3.04 ms with one head a program (forty-fifth session).
tests/strict/test_fused.py compares the bits with the torch ops under the interpreter (both kernels; chunks of 1-8 key
blocks with 1-6 heads a program and one query a launch), tests/alignment/test_strict_alignment_gpu.py on a GPU. The IEEE
rules (no FMA contraction, correctly rounded division, the strict exp) are `minite.strict.fused`'s, whose helpers they
use; "attention" in `fused.PROVEN` routes them.
"""
from __future__ import annotations

from typing import NamedTuple

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

    @triton.jit
    def _context_out(cs_ptr, o_ptr, row, i, g, d, nbk, so_i, so_bh, NB: tl.constexpr, NL: tl.constexpr,
                     DP: tl.constexpr, SPLIT: tl.constexpr):
        """The last pass of both kernels for one (query, batch x head) scratch row: per channel the pair tree over the
        block sums of p * v."""
        dd = tl.arange(0, DP)
        bi = tl.arange(0, NB)
        ctx = _pair_tree(tl.load(cs_ptr + (row * DP + dd)[:, None] * NB + bi[None, :], mask=bi[None, :] < nbk,
                                 other=0.0), NL, SPLIT)
        tl.store(o_ptr + i * so_i + g * so_bh + dd, ctx, mask=dd < d)

    @triton.jit(do_not_specialize=["sq", "sk", "d", "bh", "i0", "h", "rep"])
    def _head_kernel(q_ptr, k_ptr, v_ptr, o_ptr, s_ptr, e_ptr, bs_ptr, cs_ptr, sq, sk, d, bh, i0, h, rep, scale,
                     sq_i, sq_bh, sk_j, sk_bh, so_i, so_bh,
                     C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                     C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                     C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
                     LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr,
                     DP: tl.constexpr, DL: tl.constexpr, KB: tl.constexpr, KL: tl.constexpr,
                     NB: tl.constexpr, NL: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
                     KH: tl.constexpr, NH: tl.constexpr):
        """ops.attention for one (query, batch x head) pair over the whole context, for short contexts (at most
        ATTENTION_ONE_LAUNCH_BLOCKS key blocks): scores, softmax and context as its torch ops compute them, in three
        passes through scratch (`attention` says how the sums are split into blocks)."""
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
        _context_out(cs_ptr, o_ptr, pid, i, g, d, nbk, so_i, so_bh, NB, NL, DP, SPLIT)

    @triton.jit
    def _scores(q_ptr, k_ptr, s_ptr, row0, head0, i, kv, pos, sk, d, scale, blk0, blk1, sq_i, sq_bh, sk_j, sk_bh,
                SKP: tl.constexpr, HG: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, DL: tl.constexpr,
                KB: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr):
        """Pass 1 over key blocks blk0..blk1 - 1 of KV head kv: the scores (tree sums over d, then * scale) of its HG
        query heads head0 + h into scratch rows row0 + h, each key block read once for all of them; returns the
        largest allowed score of each head ([RP]; -inf for the RP - HG padding heads)."""
        dd = tl.arange(0, DP)
        din = (dd < d) | EVEN_D  # EVEN_D (d == DP): no channel mask, so the loads of a key's channels are vectors
        jj = tl.arange(0, KB)
        rr = tl.arange(0, RP)
        m = tl.full([RP], float("-inf"), tl.float32)
        for blk in range(blk0, blk1):
            j0 = blk * KB
            # a block's base in 64 bits (keys * sk_j reach past 2^31 for long contexts), the offsets in it in 32
            # (`attention` checks KB * sk_j < 2^31). A key past the context reads the last key's row instead of a
            # masked zero: its score is finite or not, and it is excluded from the max here and from e in pass 2.
            r = tl.minimum(jj, sk - 1 - j0)
            kk = _load_f32(k_ptr + (j0.to(tl.int64) * sk_j + kv * sk_bh), r[:, None] * sk_j + dd[None, :],
                           din[None, :])
            allowed = j0 + jj <= pos
            for h in tl.static_range(HG):
                q = _load_f32(q_ptr, i * sq_i + (head0 + h) * sq_bh + dd, din)
                sc = _pair_tree(q[None, :] * kk, DL, SPLIT) * scale
                tl.store(s_ptr + (row0 + h) * SKP + j0 + jj, sc)
                m = tl.where(rr == h, tl.maximum(m, tl.max(tl.where(allowed, sc, float("-inf")), axis=0)), m)
        return m

    @triton.jit
    def _exps(s_ptr, e_ptr, bs_ptr, row0, m, pos, blk0, blk1,
              C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
              C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
              C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
              LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr,
              SKP: tl.constexpr, NB: tl.constexpr, HG: tl.constexpr, RP: tl.constexpr, KB: tl.constexpr,
              KL: tl.constexpr, SPLIT: tl.constexpr):
        """Pass 2 over key blocks blk0..blk1 - 1: e = exp(score - m) where allowed, else 0, per head (scratch rows
        row0 + h, m [RP] each head's max over the whole context); each block's sum of e per head (its pair tree over
        the block's keys)."""
        rr = tl.arange(0, RP)
        rows = row0 + rr
        rin = rr < HG
        jj = tl.arange(0, KB)
        for blk in range(blk0, blk1):
            j = blk * KB + jj
            sc = tl.load(s_ptr + rows[:, None] * SKP + j[None, :], mask=rin[:, None], other=0.0)
            ex = _exp64((sc - m[:, None]).to(tl.float64), C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13,
                        LOG2E, LN2_HI, LN2_LO, RNE)
            e = tl.where(j[None, :] <= pos, ex, 0.0)
            tl.store(e_ptr + rows[:, None] * SKP + j[None, :], e, mask=rin[:, None])
            tl.store(bs_ptr + rows * NB + blk, _pair_tree(e, KL, SPLIT), mask=rin)

    @triton.jit
    def _contexts(v_ptr, e_ptr, bs_ptr, cs_ptr, row0, kv, sk, d, nbk, blk0, blk1, sk_j, sk_bh,
                  SKP: tl.constexpr, NB: tl.constexpr, NL: tl.constexpr, HG: tl.constexpr, RP: tl.constexpr,
                  DP: tl.constexpr, KB: tl.constexpr, KL: tl.constexpr, KH: tl.constexpr, NH: tl.constexpr,
                  SPLIT: tl.constexpr, EVEN_D: tl.constexpr):
        """Pass 3 over key blocks blk0..blk1 - 1: each head's denominator (the pair tree over every block sum of the
        context; blocks past the last key, the padding to a power of two, sum to +0 and are read back as `other`),
        p = e / denominator, and per channel the pair tree of p * v over the block's keys, each value block read once
        for all HG heads (scratch rows row0 + h)."""
        rr = tl.arange(0, RP)
        rows = row0 + rr
        bi = tl.arange(0, NB)
        dd = tl.arange(0, DP)
        din = (dd < d) | EVEN_D
        denom = _pair_tree(tl.load(bs_ptr + rows[:, None] * NB + bi[None, :],
                                   mask=(rr < HG)[:, None] & (bi[None, :] < nbk), other=0.0), NL, SPLIT)
        r3 = tl.arange(0, NH)[None, :] * KH + tl.arange(0, KH)[:, None]  # key h * KH + a at [a, h] (KB = NH * KH)
        for blk in range(blk0, blk1):
            j0 = blk * KB
            # past the context v is a masked +0 (p * v must be +0 there: a -0 would change a sum of zeros)
            vv = _load_f32(v_ptr + (j0.to(tl.int64) * sk_j + kv * sk_bh), r3[:, :, None] * sk_j + dd[None, None, :],
                           (r3[:, :, None] < sk - j0) & din[None, None, :])  # [KH, NH, DP]
            for h in tl.static_range(HG):
                # head h's denominator alone: it plus +0s (a denominator, a sum of e >= +0, is never -0)
                den = tl.zeros([KH, NH], tl.float32) + tl.sum(tl.where(rr == h, denom, 0.0), axis=0)
                p3 = tl.div_rn(tl.load(e_ptr + (row0 + h) * SKP + j0 + r3), den)
                tl.store(cs_ptr + ((row0 + h) * DP + dd) * NB + blk, _pair_tree_halves(p3[:, :, None] * vv, KL,
                                                                                       SPLIT))

    @triton.jit(do_not_specialize=["sq", "sk", "d", "bg", "i0", "nch", "cb"])
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, s_ptr, e_ptr, bs_ptr, mx_ptr, cs_ptr, sq, sk, d, bg, i0, nch, cb,
                          scale, sq_i, sq_bh, sk_j, sk_bh, so_i, so_bh,
                          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                          C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                          C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
                          LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr,
                          PASS: tl.constexpr, SKP: tl.constexpr, NB: tl.constexpr, NL: tl.constexpr,
                          NCP: tl.constexpr, REP: tl.constexpr, HG: tl.constexpr, RP: tl.constexpr,
                          DP: tl.constexpr, DL: tl.constexpr,
                          KB: tl.constexpr, KL: tl.constexpr, KH: tl.constexpr, NH: tl.constexpr,
                          SPLIT: tl.constexpr, EVEN_D: tl.constexpr):
        """ops.attention for one (query, batch x KV head) pair and HG of its REP query heads together, over chunk
        program_id(1) of cb key blocks: pass PASS (1-3; the function `attention` below says how the passes split the
        sums)."""
        pid = tl.program_id(0).to(tl.int64)  # (query, batch x KV head, group of HG heads), the query's index i - i0
        c = tl.program_id(1)
        i, kv = i0 + pid // (bg * (REP // HG)), (pid // (REP // HG)) % bg  # kv: the row of k/v [sk, batch x KV, d]
        head0 = kv * REP + (pid % (REP // HG)) * HG  # its heads head0 + h (of batch x heads)
        row0 = pid * HG  # their scratch rows, per launch: row0 + h = (query - i0) * batch x heads + head0 + h
        pos = sk - sq + i
        nbk = (sk + KB - 1) // KB
        blk0 = c * cb
        blk1 = tl.minimum(blk0 + cb, nbk)
        rr = tl.arange(0, RP)
        rows = row0 + rr
        rin = rr < HG
        if PASS == 1:
            m = _scores(q_ptr, k_ptr, s_ptr, row0, head0, i, kv, pos, sk, d, scale, blk0, blk1, sq_i, sq_bh, sk_j,
                        sk_bh, SKP, HG, RP, DP, DL, KB, SPLIT, EVEN_D)
            tl.store(mx_ptr + rows * NCP + c, m, mask=rin)
        if PASS == 2:  # the max over the chunks' maxima (a max is exact in any order)
            cc = tl.arange(0, NCP)
            m = tl.max(tl.load(mx_ptr + rows[:, None] * NCP + cc[None, :], mask=rin[:, None] & (cc[None, :] < nch),
                               other=float("-inf")), axis=1)
            _exps(s_ptr, e_ptr, bs_ptr, row0, m, pos, blk0, blk1, C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11,
                  C12, C13, LOG2E, LN2_HI, LN2_LO, RNE, SKP, NB, HG, RP, KB, KL, SPLIT)
        if PASS == 3:
            _contexts(v_ptr, e_ptr, bs_ptr, cs_ptr, row0, kv, sk, d, nbk, blk0, blk1, sk_j, sk_bh, SKP, NB, NL, HG,
                      RP, DP, KB, KL, KH, NH, SPLIT, EVEN_D)

    @triton.jit(do_not_specialize=["d", "bh", "i0", "nbk"])
    def _context_out_kernel(cs_ptr, o_ptr, d, bh, i0, nbk, so_i, so_bh, NB: tl.constexpr, NL: tl.constexpr,
                            DP: tl.constexpr, SPLIT: tl.constexpr):
        """Pass 4 of a context split into chunks: one program per (query, batch x head) scratch row."""
        row = tl.program_id(0).to(tl.int64)
        _context_out(cs_ptr, o_ptr, row, i0 + row // bh, row % bh, d, nbk, so_i, so_bh, NB, NL, DP, SPLIT)


ATTENTION_KEY_BLOCK = 32
"""Keys per block of the fused attention: the tree over the zero-padded key width (a power of two) is the tree over
aligned blocks of this many keys, then the tree over the block sums, so the split changes no bit. 32 is the fastest of
8-64, or within 2 us of it, at decode shapes on an H100 (2026-12-06, docs/benchmarks/strict-attention-sweep-h100.json)
for the kernel before 99d4eb5, which computed every block of padding, and for 99d4eb5's (batch 256 x 72 keys: 189.0 /
109.5 / 79.2 / 106.5 us for 8 / 16 / 32 / 64; 16 computes 80 keys there against 32's 96, but pays more per block)."""
ATTENTION_MAX_KEYS = 8192
"""The longest context routed to the fused attention (its last pass holds [d, keys / ATTENTION_KEY_BLOCK] values)."""
ATTENTION_WARPS = 1
"""Warps per program of both kernels (any count computes the same bits: every sum is an explicit pair tree). One warp:
measured on the H200 for the per-head kernel (2026-12-01: batch 64 x 72 keys 40.2 us on one warp against 173.1 us on
4) and on an H100 for the split one (2026-12-07, session 43 call 3, CUDA-graph replays, 32 heads over 4 KV heads,
128 channels; outputs on 1 and 2 warps bitwise equal): batch 64 x 1,064 keys 476.5 us on 1 warp, 889.6 on 2 and
1,346.3 on 4 (call 2); batch 8 x 1,064 keys 82.3 / 140.6 / 207.1 us."""
ATTENTION_ONE_LAUNCH_BLOCKS = 8
"""Contexts of up to this many key blocks (256 keys) run on `_head_kernel` in one launch, one program per (query,
batch x head) over the whole context; longer ones on `_attention_kernel`, split into chunks of key blocks over four
launches. On an H100 (2026-12-07, session 43 calls 2-3) the split kernel, then with 8 query heads a program, was
slower than the per-head one at short contexts (batch 64 x 72 keys: 58.9 us on one warp against 21.0) and faster
at long ones (batch 64 x 1,064 keys: 476.5 us against 1,363.0 on 4 warps; batch 1: 26.9 against 124.7). With one or
two heads a program (session 44 call 1) the split kernel is still slower at short contexts: batch 64 x 72 keys
24.2-27.8 us against 21.2 in one launch, batch 256 89.9-98.0 against 79.3, batch 8 x 56 keys 9.4-11.3 against 5.9."""
ATTENTION_HEADS_PER_PROGRAM = 1
"""Query heads a program of a split context takes together, at most (`heads_per_program`): each key and value block it
reads serves them all, but fewer heads a program make more programs, each with less to do. One: on an H100 (2026-12-07,
session 44 call 1, 3c96dd1, docs/benchmarks/strict-attention-heads-h100.json; CUDA-graph replays, 32 heads over 4 KV
heads, 128 channels, one warp, outputs bitwise equal) one head a program in chunks of 8 blocks and 2,048 programs at
least took 378.0 us at batch 64 x 1,064 keys, 1,585.7 at batch 256, 14.8 at batch 1, 49.1 at batch 8 and 1,163.9 at
batch 64 x 2,088 keys, against 477.4, 2,970.3, 26.9, 82.8 and 1,435.3 for 3c96dd1's 8 heads in chunks of 8 and 256
programs at least. Two heads took 416.1, 1,988.5, 15.3, 44.3 and 1,330.2 us (faster at batch 8 only). Chunks are
halved to reach the programs: at batch 8 one head ran in chunks of 4, two heads in chunks of 2 and 3c96dd1's in
chunks of 4; at batch 1 all ran in chunks of 1."""
ATTENTION_CHUNK_BLOCKS = 8
"""Key blocks per program of a split context, halved (down to 1) while the launch would have fewer than
ATTENTION_MIN_PROGRAMS programs: a decode step at batch 1 has only the heads' few programs per chunk. 8 was the
fastest of 2 / 4 / 8 with one head a program where nothing was halved (same call: batch 64 x 1,064 keys 431.2 / 404.9
/ 378.0 us; batch 256 2,978.2 / 2,116.2 / 1,585.7; batch 64 x 2,088 keys 1,334.9 / 1,242.0 / 1,163.9). At batch 8 the
chunks of 4 it comes to took 49.1 us against 45.6 in chunks of 2."""
ATTENTION_MIN_PROGRAMS = 2048
"""Programs a split launch should have at least (~16 one-warp programs a streaming multiprocessor of an H100). Against
256 (same call, one head a program): batch 1 x 1,064 keys 14.8 against 19.7 us in chunks of 8 (of 1 and 4 blocks
after halving); elsewhere at most 1.0% apart (batch 8: 0.4-1.0% slower with 2,048)."""
ATTENTION_SCRATCH_BYTES = 256 << 20
"""Scratch of one launch; more queries run as further launches (programs are independent: no bit changes)."""


def heads_per_program(rep: int) -> int:
    """Query heads a program of a split context takes, of the `rep` that read one KV head: the largest divisor of rep
    that is at most ATTENTION_HEADS_PER_PROGRAM (at least 1). Any count gives the same bits: heads are independent."""
    return max(n for n in range(1, max(1, min(rep, ATTENTION_HEADS_PER_PROGRAM)) + 1) if rep % n == 0)


def chunk_blocks(programs: int, blocks: int) -> int:
    """Key blocks per program for `programs` programs a chunk (one per (query, batch x KV head, group of heads)) over a
    context of `blocks` key blocks: all of them (one launch) up to ATTENTION_ONE_LAUNCH_BLOCKS, else
    ATTENTION_CHUNK_BLOCKS halved while there would be fewer than ATTENTION_MIN_PROGRAMS programs. Any count gives the
    same bits (`attention`)."""
    if blocks <= ATTENTION_ONE_LAUNCH_BLOCKS:
        return blocks
    cb = ATTENTION_CHUNK_BLOCKS
    while cb > 1 and programs * -(-blocks // cb) < ATTENTION_MIN_PROGRAMS:
        cb //= 2
    return cb


class Plan(NamedTuple):
    """How `attention` splits a context: keys a block, key blocks in the context, query heads a split program, key
    blocks a chunk, chunks (1: the per-head kernel in one launch)."""
    key_block: int
    blocks: int
    heads: int
    chunk_blocks: int
    chunks: int


def launch_plan(sq: int, b: int, h: int, hkv: int, sk: int) -> Plan:
    """The split `attention` makes of sq queries over sk keys, batch b, h query heads over hkv KV heads, under the
    constants as set now (tools/bench/sweep_strict_attention.py records it beside each time)."""
    kb = min(ATTENTION_KEY_BLOCK, 1 << (sk - 1).bit_length())
    blocks = -(-sk // kb)
    rep = h // hkv
    heads = heads_per_program(rep)
    cb = chunk_blocks(sq * b * hkv * (rep // heads), blocks)
    return Plan(kb, blocks, heads, cb, -(-blocks // cb))


def routable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `attention` takes these shapes (q [sq, b, h, d], k [sk, b, g, d]): a key for every query, at most
    ATTENTION_MAX_KEYS keys, and a cache whose block offsets fit 32 bits; strict ops.attention computes the others
    with its torch ops."""
    sq, sk = q.shape[0], k.shape[0]
    return 0 < sk <= ATTENTION_MAX_KEYS and sq <= sk and ATTENTION_KEY_BLOCK * k[0].numel() < 2**31


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """ops.attention's bits (q [sq, b, h, d], k/v [sk, b, g, d] with g dividing h -> [sq, b, h, d] fp32). A program
    takes one (query, batch x KV head) pair and `heads_per_program` of its h / g query heads (query head i reads KV head
    i // (h / g) in place: no expanded copy of the cache, and each key and value block is read once for them), over a
    chunk of the context's key blocks: the scores' tree sums over d, the causal mask by absolute position, the max, the
    strict exp, the denominator's tree sum over keys, p = e / denominator, the context's tree sums over keys: the same
    operations in the same order. The key sums run over aligned blocks of ATTENTION_KEY_BLOCK keys and then over the
    block sums (ATTENTION_KEY_BLOCK's docstring), so a context can be split into chunks of blocks without changing a
    bit. Passes: (1) scores and each chunk's max, (2) exps and block sums of e, (3) block sums of p * v per channel, (4)
    the tree over those, as four launches (a max and a denominator need the whole context); a context of one chunk
    (`chunk_blocks`) runs on `_head_kernel` instead, its passes in one program per (query, batch x head). Scores, the
    chunks' maxima, e and the block sums pass through scratch buffers."""
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
    kb, nbk, hg, cb, nch = launch_plan(sq, b, h, hkv, sk)
    nb, rep = skp // kb, h // hkv
    ncp = 1 << (nch - 1).bit_length()
    per_query = b * h * (2 * skp + nb + ncp + dp * nb) * 4  # scratch bytes of one query's programs
    step = max(1, min(sq, ATTENTION_SCRATCH_BYTES // per_query))  # queries per launch (independent programs)
    rows = step * b * h
    scratch, e = (torch.empty(rows, skp, dtype=torch.float32, device=q.device) for _ in range(2))
    bs = torch.empty(rows, nb, dtype=torch.float32, device=q.device)
    mx = torch.empty(rows, ncp, dtype=torch.float32, device=q.device)
    cs = torch.empty(rows, dp, nb, dtype=torch.float32, device=q.device)
    sizes = dict(NB=nb, NL=nb.bit_length() - 1, DP=dp, DL=dp.bit_length() - 1, KB=kb, KL=kb.bit_length() - 1,
                 KH=max(1, kb // 2), NH=min(2, kb), SPLIT=fused.pair_split(), EVEN_D=dp == d)
    run = dict(num_warps=ATTENTION_WARPS, enable_fp_fusion=False)
    for i0 in range(0, sq, step):
        n = min(step, sq - i0)
        if nch == 1:  # a short context: one program per (query, batch x head)
            launcher(_head_kernel)[(n * b * h,)](qc, kc, vc, o, scratch, e, bs, cs, sq, sk, d, b * h, i0, h, rep,
                                                 float(scale), *strides, **EXP_ARGS, **sizes, **run)
            continue
        args = (qc, kc, vc, o, scratch, e, bs, mx, cs, sq, sk, d, b * hkv, i0, nch, cb, float(scale), *strides)
        for pass_ in (1, 2, 3):
            launcher(_attention_kernel)[(n * b * hkv * (rep // hg), nch)](
                *args, **EXP_ARGS, **sizes, PASS=pass_, SKP=skp, NCP=ncp, REP=rep, HG=hg,
                RP=1 << (hg - 1).bit_length(), **run)
        launcher(_context_out_kernel)[(n * b * h,)](cs, o, d, b * h, i0, nbk, o.stride(0), o.stride(1), NB=nb,
                                                    NL=nb.bit_length() - 1, DP=dp, SPLIT=fused.pair_split(), **run)
    return out
