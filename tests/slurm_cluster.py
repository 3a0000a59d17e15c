"""A real SLURM cluster on this machine, for the tests: munge, slurmctld and one slurmd per node, every node at
127.0.0.1 on a port of its own, all state, spool and logs in one temporary folder, taken down at the end.

What it needs: root (slurmd starts jobs as their user), Debian's `slurmctld slurmd slurm-client munge` (SLURM
22.05 there). `missing()` says what is absent, for the test's skip reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import free_ports

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "srun")


def missing() -> str | None:
    absent = [program for program in PROGRAMS if shutil.which(program) is None]
    if absent:
        return (f"SLURM is not installed ({', '.join(absent)} missing): "
                "apt-get install slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "a SLURM cluster on this machine needs root (slurmd starts the jobs as their user)"
    return None


class Cluster:
    def __init__(self, nodes: int = 2):
        # munged runs as the munge user and insists that only it can write beside its key and socket, and that every
        # user can reach the socket: a folder of its own (pytest's temporary folders are 0700, closed to munge).
        self.folder = Path(tempfile.mkdtemp(prefix="slurm-"))
        self.folder.chmod(0o755)
        munge = self.folder / "munge"
        munge.mkdir(mode=0o755)
        shutil.chown(munge, "munge", "munge")
        self.socket = munge / "munge.socket"
        as_munge = dict(user="munge", group="munge", extra_groups=[])
        subprocess.run(["mungekey", "--create", f"--keyfile={munge}/munge.key"], check=True, **as_munge)
        self.daemons = [subprocess.Popen(["munged", "--foreground", f"--key-file={munge}/munge.key",
                                          f"--socket={self.socket}", f"--pid-file={munge}/munged.pid",
                                          f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_munge)]
        self._wait_for(self.socket.exists, "munged")
        self.conf = self.folder / "slurm.conf"
        self.conf.write_text(self._slurm_conf(nodes))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.daemons.append(self._start("slurmctld", "-D", "-i"))
        self.daemons += [self._start("slurmd", "-D", "-N", name) for name in self.names]
        self._wait_for(lambda: all(self.node_state(name) == "IDLE" for name in self.names), "the nodes to be idle")

    def _slurm_conf(self, nodes: int) -> str:
        host = socket.gethostname()
        first = free_ports(nodes + 1)
        return f"""\
ClusterName=recipes-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={first + nodes}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5 and a 2-second scheduler: a requeued job may start again after ~6 s instead of 120 s (no prolog and no
# user environment to load, which the credential's lifetime must cover: srun starts the steps at once). Measured: the
# restart came 9.1 and 9.7 s after the stop's signal with 5, 14.9 and 14.8 s with 10 (the two SLURM tests 94 s, 113 s).
AuthInfo=socket={self.socket},cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=1
StateSaveLocation={self.folder}/state
SlurmdSpoolDir={self.folder}/spool-%n
SlurmctldPidFile={self.folder}/slurmctld.pid
SlurmdPidFile={self.folder}/slurmd-%n.pid
SlurmctldLogFile={self.folder}/slurmctld.log
SlurmdLogFile={self.folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName=n[1-{nodes}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{first}-{first + nodes - 1}] CPUs=2 State=UNKNOWN
# Jobs of `urgent` preempt jobs of `test`: SIGTERM to their processes, then requeued or killed after GraceTime.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""

    def _start(self, *command: str) -> subprocess.Popen:
        log = open(self.folder / f"{command[0]}-{command[-1]}.out", "w")
        return subprocess.Popen([*command, "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def _wait_for(self, condition, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or any(daemon.poll() is not None for daemon in self.daemons):
                raise RuntimeError(f"waiting for {what}: SLURM did not come up\n{self.logs()}")
            time.sleep(0.2)

    def run(self, *command: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=kwargs.pop("env", self.env), capture_output=True, text=True, **kwargs)

    def fields(self, kind: str, name: str) -> dict[str, str]:
        """`scontrol show job|node NAME` as a dict of its KEY=VALUE words."""
        result = self.run("scontrol", "show", kind, name)
        return dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)

    def node_state(self, name: str) -> str:
        return self.fields("node", name).get("State", "")

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(self.folder.glob("*.log"))
                         if path.is_file())

    def close(self) -> None:
        self.run("scancel", "--full", "--user=root")  # a failed test's job: its processes end before the daemons
        deadline = time.monotonic() + 30
        while self.run("squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for daemon in reversed(self.daemons):
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(self.folder, ignore_errors=True)
