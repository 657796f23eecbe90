"""minite.rollout.decode's stop and compaction over two ranks that step together (gloo on CPU, NCCL with two GPUs).
EP = 2: the ranks agree to stop only once every rank's responses have ended, a rank whose responses have all ended
keeps stepping with one slot, and every response is bit for bit its rank's run that never looks, cut at its stop
token (strict mode). TP = 2 (default mode; the embedded engine refused TP > 1 at EP = 1 before 2026-12-05): both
ranks generate, stop and compact alike."""
import json
from pathlib import Path

import pytest

from tests.distributed_backend import torchrun, worker_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def _cut(free, stop):
    out = []
    for toks, lps in free:
        n = toks.index(stop) + 1 if stop in toks else len(toks)
        out.append([toks[:n], lps[:n], stop in toks])
    return out


def test_ranks_stop_together_and_compact_apart(tmp_path):
    proc = torchrun(Path(__file__).with_name("stop_ranks_worker.py"), tmp_path, cwd=ROOT, env=worker_env(ROOT),
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["cut"] == _cut(r["free"], r["stop"])
    assert len(r0["rows"]) == len(r1["rows"])  # the same forwards on both ranks (none would hang)
    assert r0["rows"][-1] == 1 and r0["cut"][0][2]  # rank 0: its one response ended; it stepped on with one slot
    assert not all(c[2] for c in r1["cut"])  # rank 1: a response ran to max_new_tokens, so both ranks did
    assert len(r1["rows"]) == 12 and r1["rows"][-1] == 1 < len(r1["free"])  # ... and rank 1 compacted


def test_tp_ranks_generate_stop_and_compact_alike(tmp_path):
    proc = torchrun(Path(__file__).with_name("stop_ranks_worker.py"), tmp_path, "tp2", cwd=ROOT, env=worker_env(ROOT),
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1  # one batch over the TP group: the same tokens, log-probs, stop token and forwards on both
    free, cut, stop = r0["free"], r0["cut"], r0["stop"]
    assert stop in free[0][0] and stop not in free[1][0]
    (first, _, first_ended), (second, _, second_ended) = cut
    assert first_ended and first[-1] == stop and stop not in first[:-1]  # ended at its stop token ...
    assert not second_ended and len(second) == len(free[1][0])  # ... the other ran to max_new_tokens
    assert r0["rows"][0] == 2 and r0["rows"][-1] == 1  # and the batch compacted to it
