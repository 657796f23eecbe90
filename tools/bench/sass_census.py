"""Instruction census of the W4A4 decode GEMM's main loop, compiled for the H200 (sm_90) on a machine without a GPU.

    python tools/bench/sass_census.py [--config 16,64,128,4,4,swap] [--variants triton,ptx,ptx_decode_order] [--json F]

Triton compiles `kernels/nvfp4_gemm.py`'s `_grouped_gemm_kernel` to a cubin for sm_90 (its bundled ptxas), its bundled
nvdisasm prints the SASS, and the body of the kernel's longest loop (the K loop: one BLOCK_N x BLOCK_K weight tile per
iteration) is counted by opcode. Variants: packed weights decoded by the Triton decode (`triton`), by the inline PTX
(`ptx`), and from the decode order's words (`ptx_decode_order`: shifts and masks, then one `mov` per MMA register;
minite.nvfp4.grouped.DECODE_BLOCK) with the scales as fp16 (`NVFP4Stack.decode_scale`) or as their E4M3 bytes
(`ptx_decode_order_u8_scales`); the activations as fp16 block values, as in a rollout. Integer arguments divisible
by 16 and 16-byte-aligned pointers are declared, as Triton specialises them at a real launch. The counts say where
a decode step's instructions go (docs/benchmarks.md, rollout section); they are a static census of one loop
iteration per thread, not a timing: the GPU measures the time (`bench_nvfp4.py --sections rollout_gemm`).

    python tools/bench/sass_census.py --strict

compiles the strict kernels of `minite.strict` (rms_norm at width 2048 in bf16, attention at a decode shape, tree_sum
and the router's linear) twice, with their adjacent-pair trees as sums over the pair axis (what runs on the GPU) and
as `tl.split` (what the interpreter runs, and what the GPU ran before 2765bc1), and counts whole-kernel instructions,
FADD and local-memory spills (LDL/STL) per thread.

    python tools/bench/sass_census.py --quant

compiles the NVFP4 quantisation kernels of `kernels/nvfp4_quant.py` at the tiles their launchers pick for the
learner's calls (131072 x 2048 bf16, TUNING as shipped): per-row activations (codes, codes + fp16 values), tensor
scope nearest and stochastic, a transposed view with RHT + stochastic rounding (dy^T), the expert-weight stack (16x16)
and the wgrad column segments (x^T with RHT, dy^T with RHT + stochastic), and the learner's SwiGLU with its fused
quantisation (kernels/nvfp4_swiglu.py, F = 768), and the experts' SwiGLU of training, forward and backward
(kernels/expert_swiglu.py); whole-kernel instructions per element and per thread, the stores by
width and the IEEE divisions (FCHK: one per 16-element block a thread holds, plus the global scales', when one
thread computes a block's scale). Compile with the GPU's Triton for the GPU's counts (a wheel of that version
installed into a folder, `--triton-site DIR`): the compiler's layouts differ between versions (Triton 3.9 gave
the row tiles' blocks to 8 threads each where 3.6 gave them to one, docs/benchmarks.md, issue 17 in the
twenty-third session). A static count: it includes paths that rarely run (IEEE division's slow path),
and on the H200 the quantisers are bound by the integer ALU pipe more than by instruction issue (ncu,
docs/benchmarks.md, issue 17 in the twenty-first session: the same instruction count ran slower when shifts became
high multiplies), so read the opcodes, not only the total.

    python tools/bench/sass_census.py --wgrad

compiles the MoE wgrad's K-grouped GEMM (`_kgrouped_gemm_kernel`) at the learner's tile (128 x 256 x 64, 8 warps, 3
stages; fp16 block values), with and without the fp32 accumulate into main_grad, and counts its K loop: the operand
loads by width and the local-memory traffic. Its loads are 16-byte asynchronous copies (LDGSTS) only while the
compiler knows each expert's first token is a multiple of 16: a start summed in the kernel from the counts lost that
(2199bda; 96 two-byte loads and 100 local loads per iteration instead of 12 copies), and the learner step took 0.83
against 0.60 s on the H200 (docs/benchmarks.md, issue 17 in the fifteenth session).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if __name__ == "__main__" and "--triton-site" in sys.argv[:-1]:  # before triton is imported: run again with it first
    _i = sys.argv.index("--triton-site")
    _path = os.pathsep.join(p for p in (sys.argv[_i + 1], os.environ.get("PYTHONPATH", "")) if p)
    os.execve(sys.executable, [sys.executable] + sys.argv[:_i] + sys.argv[_i + 2:], dict(os.environ, PYTHONPATH=_path))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from minite.kernels import nvfp4_gemm as ng, nvfp4_wgrad as nw  # noqa: E402

SIGNATURE = {"a_data": "*u8", "a_scale": "*u8", "a_vals": "*fp16", "a_amax": "*fp32", "a_amax_stride": "i32",
             "b_data": "*u8", "b_scale": "*u8", "b_vals": "*u8", "b_amax": "*fp32", "b_amax_stride_e": "i32",
             "b_amax_stride_n": "i32", "c_ptr": "*bf16", "count_ptr": "*i32", "single_rows": "i32", "E": "i32",
             "N": "i32", "K": "i32", "factor_inv": "fp32"}
VARIANTS = {"triton": dict(PTX=False, DECODE_ORDER=False), "ptx": dict(PTX=True, DECODE_ORDER=False),
            "ptx_decode_order_u8_scales": dict(PTX=True, DECODE_ORDER=True),
            "ptx_decode_order": dict(PTX=True, DECODE_ORDER=True, B_F16_SCALES=True)}
_INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def compile_sass(variant: str, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                 swap_ab: bool) -> str:
    """SASS text of the decode kernel for sm_90."""
    div = [k for k in SIGNATURE if SIGNATURE[k].startswith("*")] + ["N", "K"]
    constexprs = dict(A_SBR=1, B_SBR=16, A_PACKED=False, B_PACKED=True, BLOCK_E=128, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, SWAP_AB=swap_ab, B_TRANS=False, EVEN_K=True, SINGLE=False,
                      **{"B_F16_SCALES": False, **VARIANTS[variant]})
    signature = dict(SIGNATURE, b_scale="*fp16") if constexprs.get("B_F16_SCALES") else SIGNATURE
    return kernel_sass(ng._grouped_gemm_kernel, signature, constexprs, div,
                       dict(num_warps=num_warps, num_stages=num_stages))


def kernel_sass(fn, signature: dict, constexprs: dict, divisible: list, options: dict) -> str:
    """SASS text of a Triton kernel compiled for sm_90 (arguments in `divisible` declared multiples of 16)."""
    names = list(signature)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_census(sass: str) -> collections.Counter:
    """Opcode counts (with modifiers) of the longest loop body: from a label to the last branch back to it."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _INSTR.match(line)
        if m:
            instrs.append((m.group(2), line))
    best = (0, 0)
    for i, (_, line) in enumerate(instrs):
        b = _BRANCH.search(line)
        if b and b.group(1) in labels and labels[b.group(1)] <= i and i - labels[b.group(1)] > best[1] - best[0]:
            best = (labels[b.group(1)], i)
    if best == (0, 0):
        raise RuntimeError("no loop found in the SASS")
    return collections.Counter(op for op, _ in instrs[best[0]:best[1]])


def census(variant: str, config: tuple) -> dict:
    bm, bn, bk, warps, stages, swap = config
    ops = loop_census(compile_sass(variant, bm, bn, bk, warps, stages, swap))
    codes_per_thread = bn * bk // (32 * warps)
    total = sum(ops.values())
    return {"variant": variant, "config": list(config), "loop_instructions": total,
            "codes_per_thread": codes_per_thread, "instructions_per_code": total / codes_per_thread,
            "opcodes": dict(ops.most_common())}


def strict_rows() -> list:
    """The strict kernels' whole-kernel census, pair levels as sums (SPLIT False) and as tl.split (SPLIT True)."""
    from minite.strict import fused as F, fused_attention as FA, fused_linear as FL
    strides = ("sq_i", "sq_bh", "sk_j", "sk_bh", "so_i", "so_bh")
    head_sig = {**{k: "*bf16" for k in ("q_ptr", "k_ptr", "v_ptr")},
                **{k: "*fp32" for k in ("o_ptr", "s_ptr", "e_ptr", "bs_ptr", "cs_ptr")},
                **{k: "i32" for k in ("sq", "sk", "d", "bh", "i0", "h", "rep")}, "scale": "fp32",
                **{k: "i32" for k in strides}}
    att_sig = {**{k: "*bf16" for k in ("q_ptr", "k_ptr", "v_ptr")},
               **{k: "*fp32" for k in ("o_ptr", "s_ptr", "e_ptr", "bs_ptr", "mx_ptr", "cs_ptr")},
               **{k: "i32" for k in ("sq", "sk", "d", "bg", "i0", "nch", "cb")}, "scale": "fp32",
               **{k: "i32" for k in strides}}
    kernels = [  # (label, kernel, signature, constexprs, divisible arguments)
        ("rms_norm bf16 width 2048", F._rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", n="i32",
                                                              eps="fp32"),
         dict(WIDTH=2048, LEVELS=11), ["x_ptr", "w_ptr", "y_ptr"]),
        ("attention bf16 128 keys x 128 channels", FA._head_kernel, head_sig,  # a short context's decode step
         dict(F.EXP_ARGS, DP=128, DL=7, KB=32, KL=5, NB=4, NL=2, EVEN_D=True, KH=16, NH=2),
         [k for k, t in head_sig.items() if t.startswith("*")] + list(strides)),
        ("attention bf16 2048 keys, p * v, one head", FA._attention_kernel, att_sig,  # a long context's pass 3
         dict(F.EXP_ARGS, PASS=3, SKP=2048, NB=64, NL=6, NCP=8, REP=8, HG=1, RP=1, DP=128, DL=7, KB=32, KL=5, KH=16,
              NH=2, EVEN_D=True),
         [k for k, t in att_sig.items() if t.startswith("*")] + list(strides)),
        ("tree_sum fp32 width 128", F._tree_sum_kernel, dict(x_ptr="*fp32", y_ptr="*fp32", rows="i32", n="i32"),
         dict(BLOCK_R=32, WIDTH=128, LEVELS=7), ["x_ptr", "y_ptr"]),
    ] + [(f"linear bf16 K 2048, {rows} row{'s' * (rows > 1)} a program", FL._linear_kernel,
          dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32", m="i32", n="i32", k="i32", sxm="i32", swn="i32"),
          dict(BLOCK_N=FL._block_n(128, 2048), WIDTH=2048, LEVELS=11, ROWS=rows),
          ["x_ptr", "w_ptr", "y_ptr", "sxm", "swn"]) for rows in (1, 8)]  # decode batches 1-32 and 256
    rows = []
    for label, fn, sig, ce, div in kernels:
        for split in (False, True):
            warps = FA.ATTENTION_WARPS if fn in (FA._head_kernel, FA._attention_kernel) else 4  # decode launches
            sass = kernel_sass(fn, sig, dict(ce, SPLIT=split), div, dict(num_warps=warps, enable_fp_fusion=False))
            ops = collections.Counter(m.group(2).split(".")[0] for m in map(_INSTR.match, sass.splitlines()) if m)
            rows.append({"kernel": label, "pair_levels": "tl.split" if split else "sum over the pair axis",
                         "instructions": sum(ops.values()), "FADD": ops.get("FADD", 0),
                         "spills": ops.get("LDL", 0) + ops.get("STL", 0)})
    return rows


_QUANT_SIG = dict(x_ptr="*bf16", stride_r="i32", stride_c="i32", R="i32", C="i32", data_ptr="*u8", scale_ptr="*u8",
                  gs_ptr="*fp32", vals_ptr="*fp16", seed_mix="i32", sixth="fp32", amax_ptr="*fp32",
                  amax_out_ptr="*fp32", flag_ptr="*fp32")
_SEGMENT_SIG = dict(x_ptr="*bf16", stride_r="i32", stride_c="i32", table_ptr="*i64", OC="i32", data_ptr="*u8",
                    scale_ptr="*u8", amax_ptr="*fp32", gs_ptr="*fp32", amax_out_ptr="*fp32", seed_ptr="*i32",
                    vals_ptr="*fp16", sixth="fp32", R_ALL="i32", E="i32")


def quant_rows(rows: int = 131072, cols: int = 2048) -> list:
    """The quantisation kernels' whole-kernel census at the tiles their launchers choose (module docstring)."""
    from minite.kernels import nvfp4_quant as nq, nvfp4_segments as ns
    calls = [  # label, kernel, tuning kind, block rows, row scope, stochastic, RHT, values, transposed view
        ("row, codes", nq._quant_kernel, "plain", 1, True, False, False, False, False),
        ("row, codes + values", nq._quant_kernel, "values", 1, True, False, False, True, False),
        ("tensor, codes + values", nq._quant_kernel, "values", 1, False, False, False, True, False),
        ("tensor, stochastic, codes + values", nq._quant_kernel, "values", 1, False, True, False, True, False),
        ("dy^T, RHT + stochastic, values", nq._quant_kernel, "colmajor", 1, False, True, True, True, True),
        ("expert stack 16x16, values", ns._segments_quant_kernel, "stack", 16, False, False, False, True, False),
        ("wgrad segments x^T, RHT, values", ns._segments_quant_kernel, "colmajor_segments", 1, False, False, True,
         True, True),
        ("wgrad segments dy^T, RHT + SR, values", ns._segments_quant_kernel, "colmajor_segments", 1, False, True,
         True, True, True),
        ("wgrad count segments dy^T, RHT + SR, values", ns._segments_quant_kernel, "colmajor_segments", 1, False,
         True, True, True, True),
    ]
    out = []
    for label, fn, kind, br, row, sr, rht, vals, transposed in calls:
        tune = nq.TUNING[kind]
        r, c = (cols, rows) if transposed else (rows, cols)
        block_r, block_c, single = nq._tile_shape(r, c, br, row, tune["elems"], transposed, tune.get("rows", 128))
        warps = nq._warps(tune, block_r, block_c)
        sig = dict(_QUANT_SIG if fn is nq._quant_kernel else _SEGMENT_SIG)
        counts = label.startswith("wgrad count")  # segments found from device counts (int32) instead of a table
        if counts:
            sig["table_ptr"] = "*i32"
        unit = "stride_r" if transposed else "stride_c"
        del sig[unit]
        ce = dict(BLOCK_R=block_r, BLOCK_C=block_c, BR=br, STOCHASTIC=sr, RHT=rht, WRITE_VALS=vals,
                  SIGN_MASK=nq.RHT_SIGN_MASK, VEC2D=tune["vec2d"], **{unit: 1})
        if fn is nq._quant_kernel:
            ce.update(ROW_SCOPE=row, SINGLE=single, GIVEN_AMAX=False, FLAG=False)
        else:
            ce.update(ROWS16=True, XC16=kind == "stack", COUNTS=counts, BLOCK_E=128)  # the wgrad experts' token
            # counts: any columns; 128 experts (Qwen3-30B-A3B)
        div = [k for k, t in sig.items() if t.startswith("*")] + [k for k in ("stride_r", "stride_c", "C", "OC")
                                                                  if k in sig]
        sass = kernel_sass(fn, sig, ce, div, dict(num_warps=warps))
        ops = collections.Counter(m.group(2) for m in map(_INSTR.match, sass.splitlines()) if m)
        out.append(_quant_row(label, [block_r, block_c], warps, ops))
    # the learner's SwiGLU with the FC2 operand's quantisation (kernels/nvfp4_swiglu.py, F = 768: Qwen3-30B-A3B)
    from minite.kernels import nvfp4_swiglu as sw
    block_r, block_c = sw._tile(768)
    sig = dict(h_ptr="*bf16", a_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", gs_ptr="*fp32", amax_ptr="*fp32",
               vals_ptr="*fp16", R="i32", F="i32", sixth="fp32")
    sass = kernel_sass(sw._swiglu_quant_kernel, sig, dict(BLOCK_R=block_r, BLOCK_C=block_c, QUANT=True,
                                                          WRITE_VALS=True),
                       [k for k, t in sig.items() if t.startswith("*")] + ["F"], dict(num_warps=sw.SWIGLU_WARPS))
    ops = collections.Counter(m.group(2) for m in map(_INSTR.match, sass.splitlines()) if m)
    out.append(_quant_row("swiglu + row quantisation, values", [block_r, block_c], sw.SWIGLU_WARPS, ops))
    # the experts' SwiGLU of training, forward and backward (kernels/expert_swiglu.py, F = 768), as launched
    from minite.kernels import expert_swiglu as es
    backward = dict(h_ptr="*bf16", p_ptr="*fp32", da_ptr="*bf16", dh_ptr="*bf16", dp_ptr="*fp32", amax_ptr="*i32",
                    R="i32", F="i32")
    for label, fn, elems, sig, more in (
            ("expert swiglu forward (training)", es._forward_kernel, es.FORWARD_ELEMS,
             dict(h_ptr="*bf16", p_ptr="*fp32", a_ptr="*bf16", R="i32", F="i32"), {}),
            ("expert swiglu backward (training, BF16)", es._backward_kernel, es.BACKWARD_ELEMS, backward,
             dict(AMAX=False)),
            ("expert swiglu backward + amax (training, NVFP4)", es._backward_kernel, es.BACKWARD_ELEMS, backward,
             dict(AMAX=True))):
        block_r, block_c = es.tile(768, elems)
        sass = kernel_sass(fn, sig, dict(BLOCK_R=block_r, BLOCK_C=block_c, EXP_NEG=es._exp_neg_libdevice, **more),
                           [k for k, t in sig.items() if t.startswith("*")] + ["F"], dict(num_warps=4))
        ops = collections.Counter(m.group(2) for m in map(_INSTR.match, sass.splitlines()) if m)
        out.append(_quant_row(label, [block_r, block_c], 4, ops))
    return out


def _quant_row(label: str, tile: list, warps: int, ops: collections.Counter) -> dict:
    per_thread = tile[0] * tile[1] // (32 * warps)
    n = sum(ops.values())
    return {"call": label, "tile": tile, "warps": warps, "elements_per_thread": per_thread, "instructions": n,
            "per_element": n / per_thread, "stores": {op: k for op, k in sorted(ops.items()) if op.startswith("STG")},
            "float_to_int": sum(k for op, k in ops.items() if op.startswith("F2I")),
            "divisions": sum(k for op, k in ops.items() if op.startswith("FCHK"))}


WGRAD_SIGNATURE = {"a_data": "*u8", "a_scale": "*u8", "a_vals": "*fp16", "a_amax": "*fp32", "a_amax_stride": "i32",
                   "a_amax_stride_e": "i32", "b_data": "*u8", "b_scale": "*u8", "b_vals": "*fp16", "b_amax": "*fp32",
                   "b_amax_stride": "i32", "b_amax_stride_e": "i32", "c_ptr": "*fp32", "k_start_ptr": "*i32",
                   "k_count_ptr": "*i32", "M": "i32", "N": "i32", "KT": "i32", "factor_inv": "fp32",
                   "a_amax_stride_s": "i32", "b_amax_stride_s": "i32"}


def wgrad_rows() -> list:
    """The K-grouped wgrad GEMM's K loop at the learner's tile, with and without the fp32 accumulate (and the
    accumulate into a buffer known to hold zeros, C_ZERO: written, not read), and the multi-pass form at its tile
    (its longest loop is the one over passes, the K loop inside)."""
    div = [k for k, v in WGRAD_SIGNATURE.items() if v.startswith("*")] + ["M", "N", "KT"]
    rows = []
    tile = nw.PASSES_TILE
    for accumulate, zero, passes, block_m, block_n, stages in (
            (False, False, 1, 128, 256, 3), (True, False, 1, 128, 256, 3), (True, True, 1, 128, 256, 3),
            (True, False, 8, tile.block_m, tile.block_n, tile.num_stages)):
        constexprs = dict(A_PACKED=False, B_PACKED=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, PTX=True,
                          ACCUMULATE=accumulate, PASSES=passes, C_ZERO=zero)
        sass = kernel_sass(nw._kgrouped_gemm_kernel, WGRAD_SIGNATURE, constexprs, div,
                           dict(num_warps=8, num_stages=stages))
        loop = loop_census(sass)
        rows.append({"kernel": f"kgrouped wgrad {block_m}x{block_n}x64" + (", accumulate" if accumulate else "")
                     + (" into zeros" if zero else "")
                     + (f", {passes} passes" if passes > 1 else ""),
                     "loop_instructions": sum(loop.values()),
                     "loop_loads": {k: v for k, v in loop.items() if k.startswith(("LDG", "LDS", "LDL"))},
                     "loop_local": sum(v for k, v in loop.items() if k.startswith(("LDL", "STL"))),
                     "kernel_local": sum(1 for m in map(_INSTR.match, sass.splitlines())
                                         if m and m.group(2).startswith(("LDL", "STL")))})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="16,64,128,4,4,swap", help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages[,swap]")
    p.add_argument("--variants", default="triton,ptx,ptx_decode_order_u8_scales,ptx_decode_order")
    p.add_argument("--json", default="", help="also write the rows here")
    p.add_argument("--strict", action="store_true", help="the strict kernels instead (module docstring)")
    p.add_argument("--quant", action="store_true", help="the quantisation kernels instead (module docstring)")
    p.add_argument("--wgrad", action="store_true", help="the MoE wgrad's K-grouped GEMM instead (module docstring)")
    p.add_argument("--triton-site", metavar="DIR", help="compile with the Triton installed in DIR (e.g. `pip install "
                   "--no-deps -t DIR triton==3.6.0`, the H200's): the layouts, and so the counts, differ between "
                   "versions (docs/upstream.md)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass_census: TRITON_INTERPRET=1 makes Triton interpret, not compile; unset it")
    if a.wgrad:
        rows = wgrad_rows()
        print(f"triton {triton.__version__}, sm_90, the K loop's body, one iteration per thread")
        for r in rows:
            print(f"{r['kernel']:>36}: {r['loop_instructions']:4d} instructions | loads {r['loop_loads']} | local "
                  f"memory {r['loop_local']} (whole kernel {r['kernel_local']})")
    elif a.quant:
        rows = quant_rows()
        print(f"triton {triton.__version__}, sm_90, the learner's quantisation calls at 131072 x 2048: whole kernel")
        for r in rows:
            print(f"{r['call']:>38} | tile {r['tile']} x {r['warps']} warps: {r['instructions']:5d} instructions, "
                  f"{r['per_element']:5.1f} per element | stores {r['stores']}")
    elif a.strict:
        rows = strict_rows()
        print(f"triton {triton.__version__}, sm_90, the decode launches' warps: whole kernel, per thread")
        for r in rows:
            print(f"{r['kernel']:>40} | {r['pair_levels']:>22}: {r['instructions']:5d} instructions, FADD "
                  f"{r['FADD']:4d}, spill loads/stores {r['spills']}")
    else:
        parts = a.config.split(",")
        config = (*map(int, parts[:5]), len(parts) > 5 and parts[5] == "swap")
        rows = [census(v, config) for v in a.variants.split(",")]
        print(f"triton {triton.__version__}, sm_90, config {a.config}: the K loop's body, one iteration per thread")
        for r in rows:
            top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:8])
            print(f"{r['variant']:>18}: {r['loop_instructions']:4d} instructions, {r['instructions_per_code']:.2f} "
                  f"per code ({r['codes_per_thread']} codes) | {top}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
