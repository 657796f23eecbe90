"""tools/launch/slurm.sbatch against a real Slurm: a one-node cluster (munged, slurmctld, slurmd from Debian's
slurm-wlm and munge packages, started here on free ports under a temporary directory, stopped at the end) runs the
tiny job (`minite train`, one RL step) with one and with two ranks; the job completes and its logs land where the
script says: <job name>-<job id>.out in the submit directory, logs/<job name>-<job id>/node0.out and one
stdout/stderr pair per rank under logs/<job name>-<job id>/node0/<run id>/attempt_0/<rank>/. Skipped, with the
reason, where the packages are absent or the test cannot run the daemons as root (.ci/run installs them)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "tools" / "launch" / "slurm.sbatch"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")
START_S, JOB_S = 60, 600
pytestmark = pytest.mark.distributed
TINY = ["--set", "rl.steps=1", "--set", "rl.warmup_steps=0", "--set", "rl.prompts_per_step=2",
        "--set", "rollout.group_size=2", "--set", "rl.minibatches=1", "--set", "checkpoint.dir=null",
        "--set", "logging.progress_bar=false", "--set", "logging.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path) -> str:
    host = socket.gethostname()
    return "\n".join([
        "ClusterName=minitetest", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d}/munge.sock",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid", f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
        "SwitchType=switch/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/builtin",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs Slurm and MUNGE ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm runs its daemons as root (SlurmdUser=root); run as root")
    d = tmp_path_factory.mktemp("slurm")
    (d / "state").mkdir()
    (d / "spool").mkdir()
    (d / "munge").mkdir(mode=0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    (d / "slurm.conf").write_text(_conf(d))
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))
    subprocess.run(["munged", f"--key-file={key}", f"--socket={d}/munge.sock", f"--pid-file={d}/munge/pid",
                    f"--log-file={d}/munge/log", f"--seed-file={d}/munge/seed", "--force"], check=True, timeout=30)
    daemons = [subprocess.Popen([tool, "-D", "-f", str(d / "slurm.conf")], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for tool in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + START_S
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            if state.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline:
                logs = "".join((d / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (d / f).exists())
                pytest.fail(f"one-node Slurm not idle after {START_S} s ({state.stdout}{state.stderr}):\n{logs}")
            time.sleep(1)
        yield d, env
    finally:
        for proc in reversed(daemons):
            _stop(proc)
        pid = d / "munge" / "pid"
        if pid.exists():
            os.kill(int(pid.read_text()), signal.SIGTERM)


@pytest.mark.parametrize("ranks", [1, 2])
def test_sbatch_runs_the_tiny_job_and_its_logs_land_where_the_script_says(cluster, tmp_path, ranks):
    d, env = cluster
    shim = tmp_path / "bin"  # torchrun under this interpreter (a copied virtual environment's script may name another)
    shim.mkdir()
    (shim / "torchrun").write_text(f"#!/bin/sh\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
    (shim / "torchrun").chmod(0o755)
    env = dict(env, PATH=f"{shim}:{Path(sys.executable).parent}:{env['PATH']}", MINITE_REPO=str(ROOT),
               NPROC_PER_NODE=str(ranks), TORCHDYNAMO_DISABLE="1")
    env.pop("OMP_NUM_THREADS", None)
    cmd = ["sbatch", "--parsable", "--wait", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}",
           f"--time={JOB_S // 60}", str(SBATCH), str(ROOT / "examples" / "tiny" / "nvfp4.yaml"), *TINY,
           "--set", f"logging.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_S + 60)
    job = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "?"
    out = tmp_path / f"minite-{job}.out"
    node = tmp_path / "logs" / f"minite-{job}" / "node0.out"
    assert proc.returncode == 0, (proc.stderr, out.read_text()[-3000:] if out.exists() else "no job output",
                                  node.read_text()[-3000:] if node.exists() else "no node log")
    assert out.is_file() and node.is_file()
    assert f"--nproc-per-node={ranks}" in node.read_text()
    per_rank = sorted((tmp_path / "logs" / f"minite-{job}" / "node0").glob("*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in per_rank] == [str(r) for r in range(ranks)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # the job trained, and rank 0 alone wrote the metrics
