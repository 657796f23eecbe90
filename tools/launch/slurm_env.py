"""Slurm environment -> torchrun arguments (static rendezvous), for tools/launch/slurm.sbatch and its test.

    python tools/launch/slurm_env.py            # prints: --nnodes=4 --node-rank=2 --nproc-per-node=8 ...

Inputs, all from the environment of one srun task per node (Slurm sets them; tests emulate them):
    SLURM_JOB_NODELIST   hostlist of the allocation, e.g. "gpu-[003-004,010],gpu-a1"; its first host is the master
    SLURM_JOB_NUM_NODES  number of nodes (SLURM_NNODES as a fallback)
    SLURM_NODEID         this node's index in the allocation (0..N-1): torchrun's --node-rank
    SLURM_JOB_ID         seeds the default port (20000 + id % 10000) so concurrent jobs on a node do not collide
    SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE ("8" or "h200:8")   processes per node
Overrides: MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE.
Static rendezvous (--node-rank from SLURM_NODEID, the master's address and port) rather than c10d: node ranks then
follow the allocation order, so logs and ranks map to hosts the same way in every run.
"""
from __future__ import annotations

import os
import re
import sys
from typing import List, Mapping


class SlurmEnvError(ValueError):
    """A Slurm variable is missing or malformed; the message names it."""


def expand_hostlist(hostlist: str) -> List[str]:
    """Slurm's hostlist syntax: "a[01-03,7],b" -> ["a01", "a02", "a03", "a7", "b"] (zero padding kept)."""
    hosts: List[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise SlurmEnvError(f"SLURM_JOB_NODELIST: cannot parse range {part!r} in {hostlist!r}")
            for n in range(int(lo), int(hi or lo) + 1):
                for tail in expand_hostlist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{len(lo)}d}{tail}")
    return hosts


def _need(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise SlurmEnvError(f"{' or '.join(names)} is not set (run inside an sbatch allocation via srun)")


def gpus_per_node(env: Mapping[str, str]) -> int:
    if env.get("NPROC_PER_NODE"):
        return int(env["NPROC_PER_NODE"])
    raw = _need(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
    m = re.fullmatch(r"(?:[\w-]+:)?(\d+)(?:\(.*\))?", raw)
    if not m:
        raise SlurmEnvError(f"SLURM_GPUS_ON_NODE/SLURM_GPUS_PER_NODE: cannot read a GPU count from {raw!r}")
    return int(m.group(1))


def torchrun_args(env: Mapping[str, str]) -> List[str]:
    """The torchrun flags for this node: nnodes, node rank, processes per node, master address and port."""
    hosts = expand_hostlist(_need(env, "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nnodes = int(_need(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    node = int(_need(env, "SLURM_NODEID"))
    if len(hosts) != nnodes:
        raise SlurmEnvError(f"SLURM_JOB_NODELIST has {len(hosts)} hosts, SLURM_JOB_NUM_NODES says {nnodes}")
    if not 0 <= node < nnodes:
        raise SlurmEnvError(f"SLURM_NODEID={node} is outside 0..{nnodes - 1}")
    port = env.get("MASTER_PORT") or str(20000 + int(_need(env, "SLURM_JOB_ID")) % 10000)
    return [f"--nnodes={nnodes}", f"--node-rank={node}", f"--nproc-per-node={gpus_per_node(env)}",
            f"--master-addr={env.get('MASTER_ADDR') or hosts[0]}", f"--master-port={port}"]


if __name__ == "__main__":
    try:
        print(" ".join(torchrun_args(os.environ)))
    except SlurmEnvError as e:
        print(f"slurm_env.py: {e}", file=sys.stderr)
        sys.exit(2)
