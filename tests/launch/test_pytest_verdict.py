"""tools/pytest_verdict.py, which tools/gpu_acceptance.sh's gate stage uses to judge a waiting kernel's GPU test: a
pass is a summary of passed tests (and warnings) only, wherever the summary line sits in the output."""
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "pytest_verdict.py"
NCCL_AT_EXIT = ("[rank0]:[W1205 12:37:37.402979016 ProcessGroupNCCL.cpp:1575] Warning: WARNING: "
                "destroy_process_group() was not called before program exit, which can leak resources.")


@pytest.mark.parametrize("output,verdict", [
    ("....\n4 passed in 1.20s\n", True),
    ("PASSED a\nPASSED b\n2 passed, 7 warnings in 31.03s\n" + NCCL_AT_EXIT + "\n", True),  # the H100's gate, 12-05
    ("===== 1 passed, 1 warning in 0.50s =====\n", True),
    ("1 passed in 3725.01s (1:02:05)\n", True),
    ("1 skipped in 0.10s\n", False),
    ("1 passed, 1 skipped in 0.10s\n", False),
    ("1 failed, 3 passed in 2.00s\n", False),
    ("3 passed, 1 error in 2.00s\n", False),
    ("no tests ran in 0.01s\n", False),
    ("1 deselected in 0.01s\n", False),
    ("", False),
    ("killed by the stage's time limit after 12 passed\n", False),
])
def test_verdict(output, verdict):
    out = subprocess.run([sys.executable, str(TOOL)], input=output, text=True, capture_output=True)
    assert out.returncode == (0 if verdict else 1), (output, out.stderr)
