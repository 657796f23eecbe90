"""Multi-node on one CPU machine: two torchrun "nodes" on 127.0.0.1 with expert parallelism across them.

Both launches go through the real launchers with the worker multinode_worker.py in place of `minite train`
(MINITE_LAUNCH_ENTRY), the same config (examples/tiny/bf16.yaml) and the same cases:
- one node:  tools/launch/torchrun.sh, NPROC_PER_NODE=2 (ranks 0, 1 on node 0);
- two nodes: tools/launch/slurm.sbatch run by bash with an emulated allocation (SLURM_JOB_NODELIST=127.0.0.[1-2],
  SLURM_JOB_NUM_NODES=2, SLURM_GPUS_ON_NODE=1, SLURM_JOB_ID) and a stand-in `srun` that starts the script's task
  once per node with SLURM_NODEID=0/1, so slurm_env.py's rendezvous arguments are what connects the nodes
  (--nnodes=2, static rendezvous at the first host, 127.0.0.1; gloo pinned to the loopback interface).
EP=2 puts expert 0-1 on node 0 and 2-3 on node 1: every MoE layer's token all-to-all crosses the "network".
Checks: the two layouts give bitwise-equal losses and grad norms (same ranks, same collectives); EP=2 matches the
unsharded learner within TOLERANCES["learner_parallel_fp32"]; one log per rank (and per node) exists; a random HF
checkpoint converted by `minite convert hf-to-megatron` for EP=1, EP=2 and TP=2 loads into learners of those layouts
(each rank its own files) and gives the same log-probs (learner_parallel_fp32).
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multinode_worker.py")
CONFIG = "examples/tiny/bf16.yaml"
TIMEOUT_S = 240
pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun launches
sys.path.insert(0, str(ROOT / "tools" / "launch"))
from slurm_env import SlurmEnvError, expand_hostlist, torchrun_args  # noqa: E402

FAKE_SRUN = '''#!/usr/bin/env python3
"""Stand-in for srun: runs its command once per node of the emulated allocation (SLURM_NODEID=0..N-1), in parallel."""
import os, subprocess, sys
args, out = sys.argv[1:], None
while args and args[0].startswith("--"):
    a = args.pop(0)
    if a.startswith("--output="):
        out = a.split("=", 1)[1]
procs = []
for i in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0")
    log = open(out.replace("%n", str(i)), "w") if out else None
    procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT if log else None))
sys.exit(max(p.wait() for p in procs))
'''


def _free_port_in(lo: int, hi: int) -> int:
    for _ in range(100):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def _env(**extra) -> dict:
    return dict(os.environ, MINITE_TEST_CKPT=extra.pop("ckpt"), TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                MINITE_LAUNCH_ENTRY=str(WORKER), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **extra)


def _report(proc, out: Path, what: str) -> dict:
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"{what} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rep = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in rep.items() if isinstance(v, dict) and "error" in v}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    return rep


def _converted_checkpoints(root: Path) -> Path:
    """A random FP32 Qwen3-MoE HF checkpoint (Hub spelling) and its conversions for ep1, ep2 and tp2."""
    import torch

    from minite.convert.hf_megatron import hf_shapes, hf_to_megatron, read_shape
    from minite.convert.safetensors_stream import StreamWriter

    cfg = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
               rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=64, norm_topk_prob=True)
    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text(json.dumps(cfg))
    shapes = hf_shapes(read_shape(cfg))
    gen = torch.Generator().manual_seed(3)
    w = StreamWriter(root / "hf" / "model.safetensors", [(n, "F32", s) for n, s in shapes.items()])
    for n, s in shapes.items():
        w.write(n, 1 + 0.2 * torch.randn(s, generator=gen) if len(s) == 1 else 0.1 * torch.randn(s, generator=gen))
    w.close()
    for sub, kw in (("ep1", {}), ("ep2", {"ep": 2}), ("tp2", {"tp": 2})):
        hf_to_megatron(root / "hf", root / sub, progress=False, **kw)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun on PATH (torch's launcher)")
    tmp = tmp_path_factory.mktemp("multinode")
    ckpt = _converted_checkpoints(tmp / "ckpt")
    one = subprocess.run(["bash", "tools/launch/torchrun.sh", CONFIG], cwd=ROOT, capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=_env(ckpt=str(ckpt), NPROC_PER_NODE="2", LOG_DIR=str(tmp / "one"),
                                                     MINITE_TEST_OUT=str(tmp / "one.json")))
    (tmp / "bin").mkdir()
    (tmp / "bin" / "srun").write_text(FAKE_SRUN)
    (tmp / "bin" / "srun").chmod(0o755)
    slurm = dict(SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="1",
                 SLURM_JOB_ID=str(_free_port_in(20000, 30000) - 20000), SLURM_JOB_NAME="minite-test",
                 SLURM_SUBMIT_DIR=str(ROOT), MINITE_LOG_ROOT=str(tmp / "two"), MINITE_TEST_OUT=str(tmp / "two.json"),
                 PATH=f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}")
    two = subprocess.run(["bash", "tools/launch/slurm.sbatch", CONFIG], cwd=ROOT, capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=_env(ckpt=str(ckpt), **slurm))
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp / "two").glob("node*.out")))
    return {"one": _report(one, tmp / "one.json", "torchrun.sh (1 node x 2)"),
            "two": _report(two, tmp / "two.json", f"slurm.sbatch (2 nodes x 1)\n{logs}"), "tmp": tmp}


def test_two_nodes_give_the_same_losses_as_one(runs):
    one, two = runs["one"], runs["two"]
    assert one["node_ranks"] == [0, 0] and two["node_ranks"] == [0, 1], (one["node_ranks"], two["node_ranks"])
    for case in ("bf16_ep2", "bf16_ep1", "nvfp4_ep2"):
        assert two[case]["loss"] == one[case]["loss"], case  # bitwise: same ranks, same collectives
        assert two[case]["grad_norm"] == one[case]["grad_norm"], case
    assert two["bf16_ep2"]["local_experts"] == 2  # 4 experts over EP=2: the experts span the two nodes
    assert two["bf16_ep2"]["loss"][-1] < two["bf16_ep2"]["loss"][0]  # it trains


def test_expert_parallel_matches_unsharded(runs):
    atol, _ = TOLERANCES["learner_parallel_fp32"]
    ep2, ep1 = runs["two"]["bf16_ep2"]["loss"], runs["two"]["bf16_ep1"]["loss"]
    print(f"losses EP=2 {ep2}, EP=1 {ep1}")
    assert max(abs(a - b) for a, b in zip(ep2, ep1)) <= atol, (ep2, ep1)


def test_converted_checkpoint_loads_into_every_layout(runs):
    """Per-rank files of `minite convert` in EP=2 / TP=2 learners = the EP=1 learner, on one node and on two."""
    atol, _ = TOLERANCES["learner_parallel_fp32"]
    for run in ("one", "two"):
        ref = runs[run]["load_ep1"]["logp"]
        for case in ("load_ep2", "load_tp2"):
            got = runs[run][case]["logp"]
            gap = max(abs(a - b) for ra, rb in zip(got, ref) for a, b in zip(ra, rb))
            print(f"{run} node(s), {case} vs load_ep1: max |dlogp| {gap:.3g}")
            assert gap <= atol, (run, case, gap)
    assert runs["one"]["load_ep2"]["logp"] == runs["two"]["load_ep2"]["logp"]


def test_one_log_per_rank(runs):
    tmp = runs["tmp"]
    assert len(list((tmp / "one").glob("*/attempt_0/[01]/stdout.log"))) == 2
    for node in (0, 1):
        assert (tmp / "two" / f"node{node}.out").is_file()
        assert len(list((tmp / "two" / f"node{node}").glob("*/attempt_0/0/stdout.log"))) == 1


def test_slurm_env_to_torchrun_args():
    env = {"SLURM_JOB_NODELIST": "gpu-[003-004,010],gpu-a1", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_ID": "4123456", "SLURM_GPUS_PER_NODE": "h200:8"}
    assert torchrun_args(env) == ["--nnodes=4", "--node-rank=2", "--nproc-per-node=8", "--master-addr=gpu-003",
                                  "--master-port=23456"]
    assert torchrun_args({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NPROC_PER_NODE": "4"})[2:] == [
        "--nproc-per-node=4", "--master-addr=10.0.0.1", "--master-port=29500"]
    assert expand_hostlist("b[1,3],n[08-10]") == ["b1", "b3", "n08", "n09", "n10"]
    with pytest.raises(SlurmEnvError, match="SLURM_NODEID=4 is outside 0..3"):
        torchrun_args({**env, "SLURM_NODEID": "4"})
    with pytest.raises(SlurmEnvError, match="SLURM_JOB_NODELIST has 4 hosts, SLURM_JOB_NUM_NODES says 2"):
        torchrun_args({**env, "SLURM_JOB_NUM_NODES": "2"})
    with pytest.raises(SlurmEnvError, match="SLURM_NODEID is not set"):
        torchrun_args({k: v for k, v in env.items() if k != "SLURM_NODEID"})
