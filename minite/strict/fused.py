"""Strict-mode ops fused into single Triton kernels: the same IEEE operations as `minite.strict.ops`, in the same order.

Why: a strict decode step launches ~42 torch ops per exp call (the range reduction, a 14-term Horner polynomial, the 2^n
from exponent bits, the special cases), ~11 per RMSNorm and log2(n) + 2 per tree sum, about 40%, 10% and 10% of a strict
NVFP4 step's launches (tools/bench/op_census.py, docs/benchmarks.md). One kernel does the same arithmetic per element
(exp, log) or per row (rms_norm, tree_sum: sums by adjacent pairs after zero padding to a power of two, as
`ops.tree_sum`) or per position (rope); attention per query and head lives in `fused_attention`. `PROVEN` names the
kernels routed (their GPU test passed on the H200: all of them since 2026-12-01).

Why the bits are the same: every step is an IEEE-754 basic operation (correctly rounded, so the same result in
torch's kernels, in numpy under Triton's interpreter and in PTX), with three cares:
  * no FMA contraction: Triton contracts a * b + c by default on the GPU, which rounds once where torch rounds twice;
    the launches pass enable_fp_fusion=False;
  * correctly rounded division and square root: `tl.div_rn` and `tl.sqrt_rn` (Triton's `/` and `tl.sqrt` on fp32
    are the GPU's approximate instructions);
  * round-half-to-even of x * log2(e) and of x * 2/pi (torch.round) as (t + 1.5 * 2^52) - 1.5 * 2^52, exact for
    |t| < 2^51 (here |t| <= 217 and < 667,546), so no library rint is needed; a zero keeps t's sign (sincos), as
    torch.round's does.
Two more: rms_norm's mean is `tl.div_rn(sum, n)`, which is what `ops.rms_norm` computes since it divides by a
tensor (torch's CUDA `t / python_number` is t * (1 / n), another rounding); a NaN stays NaN through the bf16 cast.
The CPU tests compare them with ops.exp, ops.rms_norm and ops.tree_sum bit for bit under the interpreter; the GPU
test compares them with the torch ops compiled on the H200 (passed there before `ENABLED` was turned on). They have
no backward, so calls that record a gradient stay on the torch ops.
"""
from __future__ import annotations

import logging
import math
import os

import torch

from minite.kernels._interpreter import ensure_interpreter_compat, interpreting
from minite.kernels._launch import cdiv, launcher, next_power_of_2

try:
    import triton
    import triton.language as tl

    from minite.kernels.nvfp4_gemm import _cast_out, _load_f32  # noqa: F401 (_load_f32: the strict kernels')
except ImportError:  # pragma: no cover - triton is a dependency, but keep CPU imports cheap and safe
    triton = None

ENABLED = True
"""Whether `minite.strict.ops` routes CUDA tensors here at all (`routes`; each kernel also has to be in `PROVEN`).
On since their bitwise GPU test (tests/alignment/test_strict_alignment_gpu.py) passed on the H200: 2026-12-01, device
call 1 at 8cadb07; the strict NVFP4 decode step of the rollout slice at batch 64 took 6.45 ms with them, 10.43 ms
without (docs/benchmarks.md)."""

BLOCK = 1024
MAX_WIDTH = 2048
"""The widest row (tree_sum's reduced dim, rms_norm's last dim) routed to the kernels; see `routes`. Compiling for
sm_90 with Triton 3.6 (`triton.compile` for GPUTarget("cuda", 90, 32) on the 2-core CPU machine, 2026-12-01):
rms_norm at width 2048 15 s (fp32) to 37 s (bf16), at 4096 68 s (fp32); tree_sum 4 s at 2048, 43 s at 4096."""
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_RNE = 6755399441055744.0  # 1.5 * 2^52
_EXP_COEFFS = [1.0 / math.factorial(i) for i in range(14)]
EXP_ARGS = dict({f"C{i}": c for i, c in enumerate(_EXP_COEFFS)}, LOG2E=_LOG2E, LN2_HI=_LN2_HI, LN2_LO=_LN2_LO,
                RNE=_RNE)
"""The constexpr arguments of the strict exp (`_exp64`) for every kernel that computes it."""
_SQRT2 = 1.4142135623730951
_ATANH_COEFFS = [1.0 / (2 * k + 1) for k in range(12)]
_TWO_OVER_PI = 0.6366197723675814  # ops.sincos' constants (tests/strict/test_fused.py checks that they are equal)
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624879595063154e-21
_SIN_COEFFS = [(-1) ** k / math.factorial(2 * k + 1) for k in range(11)]
_COS_COEFFS = [(-1) ** k / math.factorial(2 * k) for k in range(12)]
_MIN_NORMAL64 = 2.0 ** -1022
LOG_ARGS = dict({f"A{i}": c for i, c in enumerate(_ATANH_COEFFS)}, SQRT2=_SQRT2, LN2_HI=_LN2_HI, LN2_LO=_LN2_LO,
                MIN_NORMAL=_MIN_NORMAL64)
"""The constexpr arguments of the strict log (`_log64`) for every kernel that computes it."""

PROVEN = {"exp", "tree_sum", "rms_norm", "log", "attention", "rope", "sincos", "linear", "combine", "swiglu",
          "log_softmax", "expert_swiglu", "compact_with_graphs", "combine_rows_dtype", "expert_swiglu_amax",
          "routing_dense", "sampler_lse", "routing_topk", "logits_in_place", "router_logits", "dense_packed"}
"""The kernels whose bitwise GPU test has passed on an sm_90 GPU (the H200, or an H100 where named below); `routes`
sends only these. A new kernel joins after its
test in tests/alignment/test_strict_alignment_gpu.py has passed there (`log` and `attention`: 2026-12-01, at
5ea343c, 24 passed with tests/rollout/test_decode.py; `rope` and `sincos`: 2026-12-01, at 4f981a5, 16 passed with
tests/rollout/test_decode.py; `linear`, the kernel of `minite.strict.fused_linear`: 2026-12-01, at 395e6cc, with
the strict gap runs; `combine` and `swiglu`, `minite.strict.fused_combine` and `fused_swiglu`: 2026-12-04, session
17's last device call; `log_softmax`, `minite.strict.fused_log_softmax` (`ops.token_log_softmax`): 2026-12-04,
session 18's device call 2, tests/strict/test_fused_log_softmax.py at the 151,936-token vocabulary and the strict gap
tests; `expert_swiglu`, default mode's expert SwiGLU with its backward (kernels/expert_swiglu.py, routed by
`minite.ops.experts.swiglu_kernels_apply`, under autograd too), and `compact_with_graphs`, not a kernel but the
rollout's compacted batches under CUDA graphs (minite.rollout.decode): 2026-12-05, session 26's device call on an
H100 (sm_90, the H200's architecture, Triton 3.6, torch 2.11), their tests below passed at 76deda3; see
docs/benchmarks.md); `combine_rows_dtype`, the default (not strict) combine's kernel
(`fused_combine.combine_in_rows_dtype`; its bitwise test passed in that call too), and `expert_swiglu_amax`, the
expert SwiGLU backward's max |dh| for FC1's dgrad operand (`amax=True` of kernels/expert_swiglu.py, taken by
`minite.ops.experts.swiglu` with amax_hint): 2026-12-05, session 27's device call 1 on an H100 at c2b5719, where the
gate stage passed both, and the default-mode learner/rollout gap (`minite diagnose`, the medium model, NVFP4) was
0.0 with the combine's kernel against 0.226 without it (the learner's log-probs, computed without autograd, take the
same kernel; its training forward keeps torch's scatter_add); `routing_dense`, the top-k router's dense probs and
map in one launch (`megatron_patches.moe_dispatch.routing_in_one_launch`, kernels/moe_rows.py): 2026-12-06, session
36's device call 13 on an H100 at d735ae5 (its test and the wrapper's, 6 passed with the quantiser's batch-invariance
test); routed through MINITE_TRY_KERNELS in call 14, the batch-64 NVFP4 decode step took 1.811 ms against 1.894;
`sampler_lse` (default-mode log-probs as logit - the Gumbel sampler pass's log-sum-exp, `minite.ops.logprobs`; the
learner's no-grad log-probs take the same sums), `routing_topk` (the router's top-k and softmax in the dense outputs'
launch, `megatron_patches.moe_dispatch.TOPK_KERNEL`) and `logits_in_place` (a captured decode step's lm_head writes
bf16 logits into the graph's buffer, `minite.rollout.decode.LOGITS_IN_PLACE`): 2026-12-06, session 38's device call
on an H100 at c2f173f, their gate tests with the learner's lse test and the lse-alone launch's bits (41 passed); the
default-mode learner/rollout gap on the medium model with all three was 0.0, and the strict one 0.0;
`router_logits` (the router's fp32 logits from its bf16 operands in one launch,
`megatron_patches.moe_dispatch.router_gating_in_one_launch`): 2026-12-07, session 40's device call 1 on an H100 at
75daa4c, tests/megatron_patches/test_moe_dispatch.py `test_router_logits_in_one_launch` (3 shapes, with a token's
logits the same at 1, 17 and 64 tokens) and the wrapper's test, 42 passed with the decode-order and combine tests;
`dense_packed` (a rollout engine's NVFP4 dense linears on packed weights in the decode order,
`megatron_patches.nvfp4_layers.DENSE_PACKED_KERNEL`; not a new kernel: the experts' decode-order GEMM with one group):
2026-12-07, session 41's device call 1 on an H100 at 29c3e4e, at the tiles it ships with (586af79, 224abc9):
tests/ops/test_ops_kernels.py `test_dense_linear_on_packed_weights_is_the_values_path` and tests/rollout/test_decode.py
`test_packed_weights_give_the_same_bits` (8 passed); routed, the NVFP4 decode step took 1.34 ms at batch 64 and
0.69 ms at batch 1, against 1.35 and 1.34 ms, 0.70 and 0.69 ms in a run before and one after without it (the same
speed; its weights take ~1.0 B a weight instead of ~2.5); the learner/rollout gaps at batch 64 (call 2's headline
rows, routed) were 0.0 in default and strict mode.

MINITE_TRY_KERNELS (a comma-separated list of names, read at import) adds kernels that wait here, for a benchmark on
the GPU that measures one before its test has passed (both ways in one device call); a warning names them. Not for
training runs: an unproven kernel may compute other bits than the ops it replaces."""

WAITS_FOR: dict[str, str] = {
    "qk_norm_rope": "tests/kernels/test_qk_norm_rope.py::test_kernel_is_torch_and_megatron_on_the_gpu "
                    "tests/rollout/test_roped_kv_cache.py::test_qk_norm_rope_gives_the_bits_of_the_nine_launches",
}
"""Each waiting name's GPU test (pytest node ids, space-separated), which tools/gpu_acceptance.sh's `gate` stage runs
on the H200. `qk_norm_rope` (megatron_patches.rope.QK_NORM_ROPE_KERNEL, minite.kernels.qk_norm_rope: a decode step's
q/k RMSNorm, RoPE and KV cache write in one launch) waits since 2026-12-08: whether libdevice's rsqrt and the kernel's
tree are torch's CUDA RMSNorm bit for bit is a GPU fact. The last to pass its test (2026-12-07, see PROVEN):
`dense_packed`."""
WAITING = frozenset(WAITS_FOR)
"""The names above that wait for their GPU test: what MINITE_TRY_KERNELS may name."""


def tried(value: str, waiting: frozenset = WAITING, proven: frozenset = frozenset(PROVEN)) -> frozenset:
    """The waiting names of a MINITE_TRY_KERNELS value (comma-separated; proven names dropped); a ValueError names
    any other."""
    names = frozenset(n.strip() for n in value.split(",") if n.strip()) - proven
    if names - waiting:
        raise ValueError(f"MINITE_TRY_KERNELS names {', '.join(sorted(names - waiting))}: not a kernel waiting for its "
                         f"GPU test (those are: {', '.join(sorted(waiting)) or 'none'})")
    return names


TRIED = tried(os.environ.get("MINITE_TRY_KERNELS", ""))
if TRIED:
    PROVEN = PROVEN | TRIED
    logging.getLogger(__name__).warning("MINITE_TRY_KERNELS routes kernels whose GPU test has not passed: %s",
                                        ", ".join(sorted(TRIED)))

if triton is not None:
    @triton.jit
    def _exp64(x64, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
               C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
               C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr, LOG2E: tl.constexpr,
               LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr):
        """`exp`'s arithmetic on a float64 tensor -> float32 (_exp_kernel's, and every strict kernel's exponent)."""
        nan = x64 != x64
        xc = tl.where(nan, 0.0, x64)
        xc = tl.minimum(tl.maximum(xc, -150.0), 89.0)
        t = xc * LOG2E
        k = (t + RNE) - RNE
        r = (xc - k * LN2_HI) - k * LN2_LO
        acc = tl.full(r.shape, C13, tl.float64)
        acc = acc * r + C12
        acc = acc * r + C11
        acc = acc * r + C10
        acc = acc * r + C9
        acc = acc * r + C8
        acc = acc * r + C7
        acc = acc * r + C6
        acc = acc * r + C5
        acc = acc * r + C4
        acc = acc * r + C3
        acc = acc * r + C2
        acc = acc * r + C1
        acc = acc * r + C0
        p2 = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        y = (acc * p2).to(tl.float32)
        y = tl.where(x64 < -150.0, 0.0, y)
        y = tl.where(x64 > 89.0, float("inf"), y)
        return tl.where(nan, float("nan"), y)

    @triton.jit(do_not_specialize=["n"])
    def _exp_kernel(x_ptr, y_ptr, n, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
                    C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr,
                    C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr,
                    LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, RNE: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        x64 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        y = _exp64(x64, C0, C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13, LOG2E, LN2_HI, LN2_LO, RNE)
        tl.store(y_ptr + offs, y, mask=mask)

    @triton.jit
    def _pair_tree(acc, LEVELS: tl.constexpr, SPLIT: tl.constexpr):
        """ops.tree_sum over the last dim of a 2-D block whose width is 2**LEVELS: adjacent pairs, level by level.
        Each level adds the two elements of every pair once (a + b == b + a in IEEE arithmetic, so either order gives
        the bits). On the GPU a level is a sum over the pair axis: Triton's reduction of two elements is one
        addition with no identity element, and it keeps the block's layout (tl.split made the compiler replicate
        the whole block in every thread: 2,052 additions per thread for a 2,048-wide row, sm_90 SASS). SPLIT:
        tl.split and one add, under the interpreter (`pair_split`: numpy's sum of a pair starts from +0.0 and would
        turn -0.0 + -0.0 into +0.0) and in tree_sum's kernel, whose blocks it compiles shorter."""
        for _ in tl.static_range(LEVELS):
            pairs = tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2])
            if SPLIT:
                a, b = tl.split(pairs)
                acc = a + b
            else:
                acc = tl.sum(pairs, axis=2)
        return tl.reshape(acc, [acc.shape[0]])

    @triton.jit
    def _log64(x64, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, A4: tl.constexpr,
               A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr, A8: tl.constexpr, A9: tl.constexpr,
               A10: tl.constexpr, A11: tl.constexpr, SQRT2: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
               MIN_NORMAL: tl.constexpr):
        """ops._log_fwd's float64 arithmetic on a float64 tensor (fp32 values) -> float64, before its fp32 rounding."""
        nan = x64 != x64
        bits = tl.where(nan | (x64 < MIN_NORMAL), MIN_NORMAL, x64).to(tl.int64, bitcast=True)  # torch's clamp(min=)
        e = ((bits >> 52) & 0x7FF) - 1023
        m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)  # mantissa in [1, 2)
        big = m > SQRT2
        m = tl.where(big, m * 0.5, m)
        ef = (e + big.to(tl.int64)).to(tl.float64)
        t = (m - 1.0) / (m + 1.0)  # fp64 `/` is div.rn.f64 in the PTX for sm_90 (Triton 3.6); tl.div_rn is fp32 only
        z = t * t
        acc = tl.full(z.shape, A11, tl.float64)
        acc = acc * z + A10
        acc = acc * z + A9
        acc = acc * z + A8
        acc = acc * z + A7
        acc = acc * z + A6
        acc = acc * z + A5
        acc = acc * z + A4
        acc = acc * z + A3
        acc = acc * z + A2
        acc = acc * z + A1
        acc = acc * z + A0
        y = ef * LN2_HI + (ef * LN2_LO + (2.0 * t) * acc)
        y = tl.where(x64 == 0.0, float("-inf"), y)
        y = tl.where(x64 == float("inf"), float("inf"), y)
        return tl.where(nan | (x64 < 0.0), float("nan"), y)

    @triton.jit(do_not_specialize=["n"])
    def _log_kernel(x_ptr, y_ptr, n, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr,
                    A4: tl.constexpr, A5: tl.constexpr, A6: tl.constexpr, A7: tl.constexpr, A8: tl.constexpr,
                    A9: tl.constexpr, A10: tl.constexpr, A11: tl.constexpr, SQRT2: tl.constexpr,
                    LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, MIN_NORMAL: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        if x_ptr.dtype.element_ty == tl.bfloat16:  # bf16 -> fp32 by its bits (Triton's interpreter flushes bf16
            # subnormals to zero in the cast; the GPU's conversion is this shift)
            hi = tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0x3F80)
            x64 = (hi.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(tl.float64)
        else:
            x64 = tl.load(x_ptr + offs, mask=mask, other=1.0).to(tl.float32).to(tl.float64)
        y = _log64(x64, A0, A1, A2, A3, A4, A5, A6, A7, A8, A9, A10, A11, SQRT2, LN2_HI, LN2_LO, MIN_NORMAL)
        tl.store(y_ptr + offs, y.to(tl.float32), mask=mask)

    @triton.jit(do_not_specialize=["n"])  # n == 1 would become a constant, and n.to(tl.float32) fail to compile
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, WIDTH: tl.constexpr, LEVELS: tl.constexpr,
                         SPLIT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, WIDTH)[None, :]  # a [1, WIDTH] block: one row
        mask = cols < n
        xf = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        acc = _pair_tree(xf * xf, LEVELS, SPLIT)  # zero past n: the padding of ops.tree_sum; [1]
        ms = tl.div_rn(acc, n.to(tl.float32))
        inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (xf * inv[:, None]) * w
        tl.store(y_ptr + row * n + cols, _cast_out(y, y_ptr.dtype.element_ty), mask=mask)  # RNE, also interpreted

    @triton.jit(do_not_specialize=["n"])
    def _sincos_kernel(x_ptr, s_ptr, c_ptr, n, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                       S3: tl.constexpr, S4: tl.constexpr, S5: tl.constexpr, S6: tl.constexpr, S7: tl.constexpr,
                       S8: tl.constexpr, S9: tl.constexpr, S10: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
                       C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr, C6: tl.constexpr,
                       C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr, C10: tl.constexpr, C11: tl.constexpr,
                       TWO_OVER_PI: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                       RNE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """ops.sincos on fp32 x: round(x * 2/pi) (the 1.5 * 2^52 add: half to even, as torch.round), the 3-part
        Cody-Waite reduction, the two Horner polynomials in r^2 from the top, the quadrant n mod 4 (n & 3: the
        non-negative remainder of torch.remainder) picking +-sin / +-cos, fp64 throughout, rounded to fp32 at the end."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n
        x64 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        t = x64 * TWO_OVER_PI
        k = (t + RNE) - RNE
        k = tl.where(k == 0.0, t * 0.0, k)  # torch.round keeps a zero's sign (round(-0.3) is -0.0): r's sign at x = -0
        r = ((x64 - k * P1) - k * P2) - k * P3
        z = r * r
        sp = tl.full(z.shape, S10, tl.float64)
        sp = sp * z + S9
        sp = sp * z + S8
        sp = sp * z + S7
        sp = sp * z + S6
        sp = sp * z + S5
        sp = sp * z + S4
        sp = sp * z + S3
        sp = sp * z + S2
        sp = sp * z + S1
        sp = sp * z + S0
        sv = r * sp
        cv = tl.full(z.shape, C11, tl.float64)
        cv = cv * z + C10
        cv = cv * z + C9
        cv = cv * z + C8
        cv = cv * z + C7
        cv = cv * z + C6
        cv = cv * z + C5
        cv = cv * z + C4
        cv = cv * z + C3
        cv = cv * z + C2
        cv = cv * z + C1
        cv = cv * z + C0
        q = k.to(tl.int64) & 3
        sin = tl.where(q == 0, sv, tl.where(q == 1, cv, tl.where(q == 2, -sv, -cv)))
        cos = tl.where(q == 0, cv, tl.where(q == 1, -sv, tl.where(q == 2, -cv, sv)))
        tl.store(s_ptr + offs, sin.to(tl.float32), mask=mask)
        tl.store(c_ptr + offs, cos.to(tl.float32), mask=mask)

    @triton.jit
    def _rounded(v, ty: tl.constexpr):
        """fp32 v rounded to nearest even in ty and back to fp32: the rounding torch applies to each op's result
        in the tensor's dtype (bf16 by its bits, as _cast_out, NaN passed through; fp16 by the cast)."""
        if ty == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            return tl.where(v != v, v, r)
        elif ty == tl.float16:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit(do_not_specialize=["R", "d", "rot", "half", "fs"])
    def _rope_kernel(t_ptr, cos_ptr, sin_ptr, y_ptr, R, d, rot, half, fs, mscale,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """ops.rope on rows [s, r, :]: cos_/sin_ = (cos * mscale, sin * mscale) in t's dtype, the rotated half
        (-x2, x1), t * cos_ and rotated * sin_ each rounded to t's dtype, their sum rounded, the channels past rot
        copied; the same operations as the torch ops, one program per (position s, ROWS rows)."""
        s = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        m = (rows < R)[:, None] & (cols < d)[None, :]
        base = (s * R + rows.to(tl.int64)) * d
        ty = t_ptr.dtype.element_ty
        x = _load_f32(t_ptr, base[:, None] + cols[None, :], m)
        in_rot = cols < rot
        first = cols < half
        pc = tl.where(first, cols + half, cols - half)
        xp = _load_f32(t_ptr, base[:, None] + pc[None, :], m & in_rot[None, :])
        rotated = tl.where(first[None, :], -xp, xp)
        c = tl.load(cos_ptr + s * fs + cols, mask=in_rot, other=0.0)
        sn = tl.load(sin_ptr + s * fs + cols, mask=in_rot, other=0.0)
        c_ = _rounded(c * mscale, ty)
        s_ = _rounded(sn * mscale, ty)
        a = _rounded(x * c_[None, :], ty)
        b = _rounded(rotated * s_[None, :], ty)
        out = _rounded(a + b, ty)  # the sum rounded to t's dtype
        offs = base[:, None] + cols[None, :]
        if ty == tl.float32:
            tl.store(y_ptr + offs, tl.where(in_rot[None, :], out, x), mask=m)
        else:  # 2-byte dtypes by their bits: the channels past rot copied as they are (a NaN's payload too), and
            # bf16 written without a cast (Triton's interpreter flushes bf16 subnormals in its cast)
            raw = tl.load(t_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=m, other=0)
            if ty == tl.bfloat16:
                bits = (out.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
            else:
                bits = out.to(tl.float16).to(tl.uint16, bitcast=True)
            tl.store(y_ptr.to(tl.pointer_type(tl.uint16)) + offs, tl.where(in_rot[None, :], bits, raw), mask=m)

    @triton.jit(do_not_specialize=["rows", "n"])
    def _tree_sum_kernel(x_ptr, y_ptr, rows, n, BLOCK_R: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr,
                         SPLIT: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, WIDTH)
        acc = tl.load(x_ptr + r[:, None] * n + cols[None, :], mask=(r < rows)[:, None] & (cols < n)[None, :],
                      other=0.0)  # zero past n: the padding of ops.tree_sum
        tl.store(y_ptr + r, _pair_tree(acc, LEVELS, SPLIT), mask=r < rows)  # adjacent pairs, as ops.tree_sum


def pair_split() -> bool:
    """The SPLIT argument of the kernels' pair trees (`_pair_tree`): tl.split under the interpreter, where numpy's
    sum of a pair would turn -0.0 + -0.0 into +0.0; a sum over the pair axis on the GPU."""
    return interpreting()


def available(x: torch.Tensor) -> bool:
    """Whether the kernel applies: Triton present and a floating tensor on a GPU or under the interpreter."""
    return triton is not None and x.is_floating_point() and (_gpu(x) or interpreting())


def _gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def routes(x: torch.Tensor, *others: torch.Tensor, width: int = 0, kernel: str = "") -> bool:
    """Whether `minite.strict.ops` sends this call here: `ENABLED`, a CUDA tensor, a reduced width of at most
    `MAX_WIDTH` (the whole padded row lives in one program: wider rows compile for minutes, so they stay on the torch
    ops, e.g. a whole log-softmax over a 151,936-token vocabulary; `fused_log_softmax` splits such rows into blocks
    for the log-softmax at one index per row) and no gradient to record (the kernels have no
    backward: under autograd `ops._StrictForward` computes an op's value with nothing recorded, which comes here,
    and takes the gradient from the op's torch twin); `kernel` names one that must be in PROVEN."""
    if kernel and kernel not in PROVEN:
        return False
    if not (ENABLED and _gpu(x) and available(x) and width <= MAX_WIDTH):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)))


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """ops.tree_sum's bits for float32 in one launch: rows of the reduced dim, several per program when short."""
    if not available(x) or x.dtype != torch.float32:
        raise ValueError("strict fused tree_sum needs a float32 CUDA tensor (or TRITON_INTERPRET=1)")
    xm = x.movedim(dim, -1)
    n = xm.shape[-1]
    out = torch.empty(xm.shape[:-1], dtype=x.dtype, device=x.device)
    rows = out.numel()
    if rows == 0:
        return out
    if n == 0:
        return out.zero_()
    ensure_interpreter_compat()
    width = 1 << (n - 1).bit_length()  # n == 1: width 1, no addition (adding the +0 padding would turn -0.0 into +0.0)
    block_r = max(1, min(64, 4096 // width))
    # SPLIT=True on the GPU too: for these [rows, width] blocks tl.split compiles shorter (`sass_census.py --strict`,
    # Triton 3.6: 504 against 1,000 instructions at width 128), the form that passed the H200 tests before 2765bc1
    launcher(_tree_sum_kernel)[(cdiv(rows, block_r),)](
        xm.contiguous(), out, rows, n, BLOCK_R=block_r, WIDTH=width, LEVELS=width.bit_length() - 1, SPLIT=True,
        num_warps=4, enable_fp_fusion=False)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.rms_norm's bits in one launch: one program per row of the last dim (module docstring)."""
    if not available(x):
        raise ValueError("strict fused rms_norm needs a floating CUDA tensor (or TRITON_INTERPRET=1)")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"strict fused rms_norm: weight {tuple(weight.shape)} for rows of {n}")
    ensure_interpreter_compat()
    xc, wc = x.contiguous(), weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = xc.numel() // max(n, 1)
    if rows == 0 or n == 0:
        return y
    width = 1 << (n - 1).bit_length()
    launcher(_rms_norm_kernel)[(rows,)](
        xc, wc, y, n, float(eps), WIDTH=max(width, 2), LEVELS=max(width, 2).bit_length() - 1, SPLIT=pair_split(),
        num_warps=4 if width <= 4096 else 8, enable_fp_fusion=False)
    return y


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32 with ops.exp's bits (module docstring), one launch."""
    if not available(x):
        raise ValueError("strict fused exp needs a floating CUDA tensor (or TRITON_INTERPRET=1)")
    ensure_interpreter_compat()
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = xc.numel()
    if n == 0:
        return y
    launcher(_exp_kernel)[(cdiv(n, BLOCK),)](xc, y, n, **EXP_ARGS, BLOCK_SIZE=BLOCK, enable_fp_fusion=False)
    return y


def log(x: torch.Tensor) -> torch.Tensor:
    """log(x) in float32 with ops._log_fwd's bits (the same float64 operations from the exponent and mantissa bits,
    the 12-term atanh series, fp64 `/` (div.rn.f64), FMA contraction off), one launch; fp32/bf16/fp16 inputs."""
    if not available(x) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("strict fused log needs an fp32/bf16/fp16 CUDA tensor (or TRITON_INTERPRET=1)")
    ensure_interpreter_compat()
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = xc.numel()
    if n == 0:
        return y
    launcher(_log_kernel)[(cdiv(n, BLOCK),)](xc, y, n, **LOG_ARGS, BLOCK_SIZE=BLOCK, enable_fp_fusion=False)
    return y


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) with ops.sincos' bits for fp32 x, one launch (ops.sincos checks the range first)."""
    if not available(x) or x.dtype != torch.float32:
        raise ValueError("strict fused sincos needs a float32 CUDA tensor (or TRITON_INTERPRET=1)")
    ensure_interpreter_compat()
    xc = x.contiguous()
    sin = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    cos = torch.empty_like(sin)
    n = xc.numel()
    if n == 0:
        return sin, cos
    c = {**{f"S{i}": v for i, v in enumerate(_SIN_COEFFS)}, **{f"C{i}": v for i, v in enumerate(_COS_COEFFS)}}
    launcher(_sincos_kernel)[(cdiv(n, BLOCK),)](
        xc, sin, cos, n, **c, TWO_OVER_PI=_TWO_OVER_PI, P1=_PIO2_1, P2=_PIO2_2, P3=_PIO2_3, RNE=_RNE, BLOCK_SIZE=BLOCK,
        enable_fp_fusion=False)
    return sin, cos


def rope_applies(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `rope` takes this call: t fp32/bf16/fp16 [S, ..., d] and freqs [S or 1, 1, ..., 1, rot] of t's rank (Megatron's
    [s, 1, 1, rot] for [s, b, h, d]; SGLang's [tokens, 1, rot] for [tokens, heads, d]), rot even and <= d."""
    rot = freqs.shape[-1]
    return (t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.dim() >= 2 and freqs.dim() == t.dim()
            and rot % 2 == 0 and 0 < rot <= t.shape[-1]
            and freqs.shape[0] in (1, t.shape[0]) and all(n == 1 for n in freqs.shape[1:-1]))


def rope(t: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """ops.rope's bits given its strict sin and cos (fp32, freqs' shape; `rope_applies`), one launch."""
    if not available(t) or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("strict fused rope needs an fp32/bf16/fp16 CUDA tensor (or TRITON_INTERPRET=1)")
    if sin.shape != cos.shape or not rope_applies(t, cos):
        raise ValueError(f"strict fused rope: t {tuple(t.shape)} with sin {tuple(sin.shape)} / cos "
                         f"{tuple(cos.shape)}; needs [S or 1, 1, ..., 1, rot] of t's rank, rot even and <= d")
    ensure_interpreter_compat()
    tc = t.contiguous()
    y = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    S, d, rot = t.shape[0], t.shape[-1], cos.shape[-1]
    if y.numel() == 0:
        return y
    R = y.numel() // (S * d)
    cc = cos.to(torch.float32).contiguous()
    sc = sin.to(torch.float32).contiguous()
    fs = rot if cos.shape[0] == S and S > 1 else 0  # one row of angles per position, or one for all
    block_d = next_power_of_2(d)
    # rows per program: at most 8 (and 4096 elements), fewer where there are few rows in all, so that a decode step
    # fills the GPU (64 tokens x 32 query heads with 32 rows a program were 64 programs: 5.0 us on the H200, 2.1 us
    # with 4; 64 x 4 key heads 5.0 -> 1.4 us with 1; CUDA-graph replays, session 18 call 2; the bits do not depend
    # on it: each element is computed alone)
    rows = 1
    while rows < 8 and rows * 2 * block_d <= 4096 and rows * 2 * 512 <= S * R:
        rows *= 2
    launcher(_rope_kernel)[(S, cdiv(R, rows))](
        tc, cc, sc, y, R, d, rot, rot // 2, fs, float(mscale), ROWS=rows, BLOCK_D=block_d, num_warps=4,
        enable_fp_fusion=False)
    return y
