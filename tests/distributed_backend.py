"""The distributed tests' shared pieces. Workers: init() picks the process-group backend, NCCL when two or more GPUs
are visible (one per rank, by LOCAL_RANK), gloo on CPU otherwise, so the same tests run over NCCL on a GPU machine and
over gloo in the CPU suite. Tests: worker_env() and torchrun() start the workers the same way everywhere."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def name() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"


def init() -> str:
    backend = name()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(root: Path) -> dict:
    """The environment of a worker process: the checkout first on PYTHONPATH, one CPU thread, no torch.compile, and no
    rank variables inherited from an enclosing launcher."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(worker: Path, *args, cwd: Path, env: dict, timeout: float, nproc: int = 2) -> subprocess.CompletedProcess:
    """`worker args...` on nproc local ranks. torchrun's module runs under this interpreter: a copied virtual
    environment's torchrun script may name another one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(worker), *map(str, args)]
    return run_ranks(cmd, cwd=cwd, env=env, timeout=timeout)


def run_ranks(cmd: list, *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) for a launcher of ranks (torchrun, tools/launch/...): on a
    timeout its whole process tree is killed, the ranks too, before TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the ranks too, not only the launcher (as subprocess.run would leave them)
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's ranks run in sessions of their own, so a process group
    does not reach them), the descendants found from /proc before any is killed."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        tree += frontier
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
