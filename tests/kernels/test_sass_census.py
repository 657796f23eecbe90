"""tools/bench/sass_census.py: the decode GEMM compiled for sm_90 on this machine (Triton's bundled ptxas and
nvdisasm), its K loop found and counted. Runs the tool in a subprocess: the tests' Triton interpreter
(TRITON_INTERPRET=1, conftest.py) cannot compile."""
import json
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
pytestmark = pytest.mark.skipif(not os.path.exists(NVDISASM), reason="Triton without its NVIDIA tools")


def test_decode_loop_census(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "census.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "sass_census.py"), "--variants",
                    "triton,ptx_decode_order_u8_scales,ptx_decode_order", "--json", str(out)], env=env, check=True,
                   capture_output=True, timeout=300)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert any(op.startswith("HGMMA") for op in r["opcodes"]), "the K loop holds the MMAs"
        assert r["codes_per_thread"] == 64

    def count(r, prefix):
        return sum(n for op, n in r["opcodes"].items() if op.startswith(prefix))
    # the decode order reads every operand of the loop through asynchronous copies (LDGSTS): no synchronous global
    # load waits in the loop. Its scale rows are declared multiples of 8 bytes; without that Triton loaded the scale
    # bytes with LDG.U8 in every iteration and moved them through shared memory (4 loads, a store, a barrier)
    for name in ("ptx_decode_order_u8_scales", "ptx_decode_order"):
        assert count(rows[name], "LDG.") == 0 and count(rows[name], "LDGSTS") > 0, name
    # the codes' bytes leave shared memory as vectors; the fp16 scales (`decode_scales`) too, where the E4M3 bytes
    # need byte loads or byte extractions and ~4 integer operations each
    assert count(rows["ptx_decode_order"], "LDS.U8") == 0 < count(rows["triton"], "LDS.U8")
    # the decode order's words turn into MMA registers in 11 integer operations per 8 codes, with no repacking of
    # 16-bit halves: on Triton 3.9, 227 instructions with fp16 scales, 287 with the scale bytes, 584 for the Triton
    # decode of the byte order
    assert rows["ptx_decode_order"]["loop_instructions"] < rows["ptx_decode_order_u8_scales"]["loop_instructions"]
    assert 5 * rows["ptx_decode_order_u8_scales"]["loop_instructions"] < 3 * rows["triton"]["loop_instructions"]
    assert rows["ptx_decode_order"]["opcodes"].get("PRMT", 0) < 16


def test_strict_kernels_census(tmp_path):
    """The strict kernels' pair levels as sums keep the row distributed: rms_norm at width 2048 neither replicates its
    2,048 additions in every thread nor spills. Triton 3.6 (the H200's) did both with the tl.split form (the reason
    for 2765bc1); Triton 3.9 compiles that form without replicating, so the comparison is asserted on 3.6 only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "strict.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "sass_census.py"), "--strict", "--json",
                    str(out)], env=env, check=True, capture_output=True, timeout=600)
    rows = {(r["kernel"], r["pair_levels"]): r for r in json.loads(out.read_text())["rows"]}
    summed, split = (rows[("rms_norm bf16 width 2048", p)] for p in ("sum over the pair axis", "tl.split"))
    assert summed["spills"] == 0 and summed["FADD"] < 2048
    assert all(r["spills"] == 0 for (_, p), r in rows.items() if p == "sum over the pair axis")
    if triton.__version__.startswith("3.6."):
        assert split["FADD"] >= 2048 and summed["instructions"] * 4 < split["instructions"]
        att = [rows[("attention bf16 128 keys x 128 channels", p)] for p in ("sum over the pair axis", "tl.split")]
        assert att[0]["instructions"] < att[1]["instructions"]


def test_quant_kernels_census(tmp_path):
    """The quantisers' block values leave as vectors (16-byte stores; they had been one 2-byte store per element),
    and on Triton 3.6 (the H200's) the E2M1 rounding has no float -> int conversion per element (the roundings work
    on the fp32 bits; what is left is per 16-element block). Triton 3.9 compiles the per-row codes-only tile (4-D
    addressing) with one conversion per two elements, so that bound is asserted on 3.6 only. The wgrad segments found
    from device counts too (their output columns are products by 16 the compiler can see: a hint on a reduction's
    result was lost, and their values left in 4-byte stores). The learner's SwiGLU with its fused quantisation too, and
    the experts' SwiGLU of training, its backward with and without the amax of dh (its bf16 outputs stored as 16-byte
    vectors, as bits through a uint16 pointer)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "quant.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "sass_census.py"), "--quant", "--json",
                    str(out)], env=env, check=True, capture_output=True, timeout=600)
    rows = {r["call"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 13
    for r in rows.values():
        assert "STG.E.U16" not in r["stores"], r["call"]
        if r["call"].startswith("expert swiglu"):  # the SwiGLU of training (no quantisation): bf16 out in vectors
            assert r["stores"].get("STG.E.128", 0) >= 1, r["call"]
            continue
        # one thread computes a 16-element block's scale (one IEEE division, FCHK), not every thread holding a part
        # of the block: at most one division per block a thread holds, plus a few (2-4 for the global scales). Triton
        # 3.9 gave the [BLOCK_R, G, 8, 2]-addressed row tiles' 8 pairs of a block to 8 threads (34 divisions for 64
        # elements, 18 for 32)
        assert r["divisions"] <= r["elements_per_thread"] // 16 + 8, r["call"]
        if triton.__version__.startswith("3.6."):
            assert r["float_to_int"] * 4 <= r["elements_per_thread"], r["call"]
        if "values" in r["call"]:
            assert r["stores"].get("STG.E.128", 0) >= 1, r["call"]


def test_wgrad_loop_loads_are_async_vector_copies(tmp_path):
    """The K-grouped wgrad GEMM's operands reach shared memory in 16-byte asynchronous copies, with no element-wise
    global load and no local memory in the K loop. 2199bda summed each expert's first token in the kernel and the
    compiler lost its multiple-of-16 hint: 96 two-byte loads and 100 local loads per iteration, the 8-sequence
    learner step 0.83 s against 0.60 s on the H200 (docs/benchmarks.md, issue 17 in the fifteenth session). The
    multi-pass form (several micro-batches in one launch) also keeps its fp32 output tile out of local memory, and so
    does the accumulate into a buffer known to hold zeros (C_ZERO)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "wgrad.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "sass_census.py"), "--wgrad", "--json",
                    str(out)], env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for r in rows:
        loads = r["loop_loads"]
        assert sum(n for op, n in loads.items() if op.startswith("LDGSTS") and op.endswith(".128")) >= 8, r
        assert r["loop_local"] == 0, r
        if "into zeros" in r["kernel"]:  # main_grad not read: no epilogue spills either
            assert r["kernel_local"] == 0, r
        if "passes" in r["kernel"]:  # its longest loop is the one over passes: a few scalar loads of the tables and
            # amaxes per pass, no narrow operand load, and its output tile held in registers without spilling
            assert not any(op.startswith("LDG.") and op.endswith(("U16", "U8")) for op in loads), r
            assert r["kernel_local"] == 0, r
        else:
            assert not any(op.startswith("LDG.") for op in loads), r
