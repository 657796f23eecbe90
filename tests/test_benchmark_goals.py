"""tools/bench/goals.py: issue 16/17 goals against the newest measurement of each device, and docs/benchmarks.md's
goals table equal to what it renders from docs/benchmarks/ (a JSON row added without re-rendering fails here)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import goals  # noqa: E402  (a script's module, found through its folder)


def _git(*args: str) -> list:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def _old_and_new_commit() -> tuple:
    """The repository's first commit and HEAD (7 hex digits), or a skip where there is no history to order by."""
    first, head = _git("rev-list", "--max-parents=0", "HEAD")[-1:], _git("rev-parse", "--short=7", "HEAD")
    if not first or not head or goals._commit_time(first[0][:7]) >= goals._commit_time(head[0]):
        pytest.skip("needs the repository's git history (rows are ordered by their commits)")
    return first[0][:7], head[0]


def _row(precision, strict, batch, step_ms, commit, date, prompt_len=32, variant="graphs", floor_ms=0.5):
    return dict(precision=precision, strict=strict, batch=batch, prompt_len=prompt_len, new_tokens=40,
                step_ms=step_ms, floor_ms=floor_ms, decode_tokens_per_s=batch / step_ms * 1e3, commit=commit,
                date=date, variant=variant)


def _write(folder: Path, name: str, doc) -> None:
    (folder / name).write_text(json.dumps(doc))


def test_docs_goals_table_is_the_rendered_one():
    _old_and_new_commit()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = goals.render(ROOT / "docs" / "benchmarks", ["h200", "h100"])
    assert table in text, "docs/benchmarks.md's goals table is stale: paste `python tools/bench/goals.py` into it"


def test_rollout_goals_take_the_newest_code_not_the_newest_measurement(tmp_path):
    old, new = _old_and_new_commit()
    rows = [_row("bf16", False, 64, 2.5, new, "2026-12-07 10:00 UTC"),
            _row("nvfp4", False, 64, 1.0, new, "2026-12-07 10:01 UTC", variant="packed"),
            # an A/B call measured the older code after the newer one: not the newest code's row
            _row("nvfp4", False, 64, 2.0, old, "2026-12-07 10:02 UTC", variant="packed"),
            _row("nvfp4", True, 64, 1.3, new, "2026-12-07 10:03 UTC", variant="packed"),
            _row("nvfp4", False, 64, 0.1, new, "2026-12-07 10:04 UTC", variant="sglang"),  # not the embedded engine
            _row("nvfp4", False, 64, 0.2, new, "2026-12-07 10:05 UTC", prompt_len=1024)]  # not the prompts
    _write(tmp_path, "rollout-h200.json", {"device": "x", "date": "d", "commit": new, "rows": rows,
                                           "reference_rows": [dict(batch=64, step_ms=2.4, graph=True, commit="c0",
                                                                   date="2026-12-06")]})
    cells = goals.device_cells(tmp_path, "h200")
    assert cells[("rollout", "nvfp4_tokens_vs_bf16")] == f"2.500x (1.00 / 2.50 ms a step): **met** ({new}, 2026-12-07)"
    assert cells[("rollout", "strict_vs_default")].startswith("1.300 (1.30 / 1.00 ms): **missed**")
    assert cells[("rollout", "nvfp4_step_vs_floor")].startswith("2.00x (1.00 / 0.50 ms): **met**")
    # a ratio of rows of two commits says so
    assert cells[("rollout", "bf16_vs_reference")] == \
        f"1.042 (2.50 / 2.40 ms): **met** ({new} / c0, 2026-12-07 (rows of different commits))"


def test_missing_files_and_rows_are_named_not_borrowed(tmp_path):
    _write(tmp_path, "rollout-h100.json", {"device": "x", "date": "d", "commit": "c", "rows": [
        _row("bf16", False, 8, 2.0, "c", "2026-12-07")]})
    h100, h200 = goals.device_cells(tmp_path, "h100"), goals.device_cells(tmp_path, "h200")
    assert h100[("rollout", "nvfp4_tokens_vs_bf16")] == "no batch-64 rows"
    assert h200[("rollout", "nvfp4_tokens_vs_bf16")] == "no rollout JSON"
    assert h200[("kernels", "quant")] == "no kernels JSON"
    assert h200[("learner", "step")] == "no learner-slice JSON"
    assert h200[("alignment", None)] == "no alignment JSONL"


def test_kernel_learner_and_gap_verdicts(tmp_path):
    _write(tmp_path, "kernels-h200.json", {
        "device": "x", "date": "2026-12-01 10:00 UTC", "commit": "k1",
        "decode_speedup_vs_bf16": {"1": 3.6, "32": 3.4}, "expert_block_fwd_ratio_vs_bf16": 1.10,
        "expert_block_fwdbwd_ratio_vs_bf16": 1.16,
        "quant_variants": {"row_rne": {"fraction_of_copy": 0.9}, "colwise_rht_sr": {"fraction_of_copy": 0.79}}})
    pair = dict(tokens=4096, micro_batches=1)
    rows = [dict(pair, precision="bf16", tokens_per_s=100.0, fwd_bwd_s=1.0, fwd_bwd_model_tflops=210.0,
                 peak_mem_gib=60.0),
            dict(pair, precision="nvfp4", tokens_per_s=95.0, fwd_bwd_s=1.2, fwd_bwd_model_tflops=180.0,
                 peak_mem_gib=60.5)]
    _write(tmp_path, "learner-slice-h200.json", {"device": "x", "date": "2026-12-02 10:00 UTC", "commit": "l1",
                                                 "rows": rows})
    lines = [{"kind": "device", "commit": "a1", "date": "2026-11-29 09:00 UTC"},
             {"kind": "gap", "strict": True, "model": "m", "precision": "nvfp4", "max_abs_logp_gap": 0.0,
              "tokens_compared": 16},
             {"kind": "gap", "strict": False, "model": "m", "precision": "nvfp4", "max_abs_logp_gap": 0.3,
              "tokens_compared": 16}]
    (tmp_path / "alignment-h200.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    c = goals.device_cells(tmp_path, "h200")
    assert c[("kernels", "decode_gemm")].startswith("3.40-3.60x (M = 1, 32; lowest at M = 32): **missed** (k1,")
    assert c[("kernels", "block_fwd")] == "1.100x: **met** (k1, 2026-12-01)"
    assert c[("kernels", "block_fwdbwd")] == "1.160x: **missed** (k1, 2026-12-01)"
    assert c[("kernels", "quant")].startswith("0.790 (colwise_rht_sr; 2 variants, 1 at 0.8 or more): **missed**")
    assert c[("learner", "step")] == "0.950 at 1 x 4096: **met** (l1, 2026-12-02)"
    assert c[("learner", "fwd_bwd")].startswith("0.833 at 1 x 4096: **missed**")
    assert c[("learner", "bf16_tflops")].startswith("210 at 1 x 4096: **met**")
    assert c[("learner", "memory")].startswith("+0.50 GiB at 1 x 4096: **missed**")
    assert c[("alignment", None)] == "0 (nvfp4, 16 tokens): **met** (a1, 2026-11-29)"  # the default-mode gap ignored
