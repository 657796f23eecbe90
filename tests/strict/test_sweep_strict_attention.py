"""tools/bench/sweep_strict_attention.py --compare: two trees' saved outputs and times -> one JSON row per shape, the
outputs compared bit for bit (a -0 against a +0 differs), refusing files from two devices (CPU only: no kernel runs)."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench", "sweep_strict_attention.py")


def _save(path, commit, device, outs, us):
    rows = [dict(queries=1, batch=2, keys=k, us=t, out=o) for k, o, t in zip((40, 72), outs, us)]
    torch.save(dict(commit=commit, device=device, rows=rows), path)


def test_compare_writes_one_row_per_shape_with_its_bits(tmp_path):
    a = torch.tensor([1.0, -0.0, 3.0])
    _save(tmp_path / "old.pt", "aaa", "GPU X", [a, a], [10.0, 20.0])
    _save(tmp_path / "new.pt", "bbb", "GPU X", [a.clone(), torch.tensor([1.0, 0.0, 3.0])], [5.0, 30.0])
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, TOOL, "--compare", str(tmp_path / "old.pt"), str(tmp_path / "new.pt"), "--out",
                    str(out)], check=True, capture_output=True, timeout=120)
    doc = json.loads(out.read_text())
    assert doc["device"] == "1x GPU X" and {"date", "commit", "command"} <= set(doc)
    assert [(r["keys"], r["old_us"], r["new_us"], r["bitwise"]) for r in doc["rows"]] == [(40, 10.0, 5.0, True),
                                                                                       (72, 20.0, 30.0, False)]
    assert doc["rows"][0]["old_commit"] == "aaa" and doc["rows"][0]["new_commit"] == "bbb"
    _save(tmp_path / "other.pt", "ccc", "GPU Y", [a, a], [1.0, 1.0])
    bad = subprocess.run([sys.executable, TOOL, "--compare", str(tmp_path / "old.pt"), str(tmp_path / "other.pt"),
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not one device" in bad.stderr


def test_effective_names_what_runs_under_the_constants_as_set(monkeypatch):
    """A sweep row records the kernel, heads and chunks that ran, not only the values asked (chunk_blocks halves the
    chunks until a launch has ATTENTION_MIN_PROGRAMS programs)."""
    sys.path.insert(0, os.path.dirname(TOOL))
    import sweep_strict_attention as S
    FA = S.FA
    for name, value in (("ATTENTION_KEY_BLOCK", 32), ("ATTENTION_HEADS_PER_PROGRAM", 1), ("ATTENTION_CHUNK_BLOCKS", 8),
                        ("ATTENTION_MIN_PROGRAMS", 2048), ("ATTENTION_ONE_LAUNCH_BLOCKS", 8)):
        monkeypatch.setattr(FA, name, value)
    assert S.effective(64, 1064) == dict(heads_run=1, chunk_blocks_run=8, chunks_run=5, kernel="split, four launches")
    assert S.effective(8, 1064)["chunk_blocks_run"] == 4  # 256 programs a chunk: 9 chunks of 4 blocks reach 2,048
    assert S.effective(64, 72)["kernel"] == "per-head, one launch"
    monkeypatch.setattr(FA, "ATTENTION_HEADS_PER_PROGRAM", 4)
    assert S.effective(1, 1064) == dict(heads_run=4, chunk_blocks_run=1, chunks_run=34, kernel="split, four launches")
