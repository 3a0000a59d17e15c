"""Beyond one machine: two nodes over loopback, a node that dies, and a SLURM job preempted and requeued.

Two `accelerate launch` processes with --num_machines 2 and --machine_rank 0 / 1 are a real two-node rendezvous
(gloo on the CPU, ACCELERATE_USE_CPU=true), started from accelerate_configs/multinode.yaml with the per-node
values overridden on the command line, as slurm_multinode.sh does. The SLURM test runs that script itself on a
real two-node SLURM cluster on this machine (tests/slurm_cluster.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster
from test_cpu_speed import check_bf16_run
from test_stops import safe_rows

from conftest import ROOT, assert_bitwise_equal, exited_cleanly, free_ports, launch, ok, read_json, read_jsonl, weights
from tiny_data import cifar_binary_dataset

pytestmark = pytest.mark.slow  # two nodes, SLURM

RUN = ("--batch_size", "8", "--log_every", "1", "--seed", "3", "--tracker", "none")
STEPS = 100  # long enough for a kill or a preemption to land mid-run (the SLURM test stops two starts)
LONG = ("--max_steps", str(STEPS))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("nodes") / "data", sizes={"train": 64, "test": 20})


def start_node(env: dict, rank: int, port: int, *args: str, cwd: Path = ROOT) -> subprocess.Popen:
    """One node of two: the multinode template, its per-node values overridden as slurm_multinode.sh does."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "-q", "--config_file",
               str(ROOT / "accelerate_configs/multinode.yaml"), "--num_machines", "2", "--num_processes", "2",
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               str(ROOT / "recipes/cifar_cnn.py"), *args]
    return subprocess.Popen(command, cwd=cwd, env=dict(env, ACCELERATE_USE_CPU="true"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def two_nodes(env: dict, *args: str, timeout: int = 600) -> list[tuple[int, str, str]]:
    port = free_ports()
    nodes = [start_node(env, rank, port, *args) for rank in (0, 1)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


def node_ok(result: tuple[int, str, str]) -> None:
    returncode, stdout, stderr = result
    assert exited_cleanly(returncode, stderr), f"exit {returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"


@pytest.fixture(scope="module")
def one_machine(env, data, tmp_path_factory) -> tuple[Path, str]:
    """The long run, never stopped, on one machine: 2 processes of 2gpu.yaml, in bf16 as multinode.yaml is. Two
    nodes must reproduce it, stopped or not. Its run folder and what it printed."""
    out = tmp_path_factory.mktemp("single") / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(data), *RUN, *LONG, "--output_dir", str(out), config="2gpu",
                       use_cpu=True, launcher_args=("--mixed_precision", "bf16")))
    return out, result.stdout


@pytest.fixture(scope="module")
def long_reference(one_machine) -> Path:
    return one_machine[0]


def test_bf16_autocast_on_two_cpu_processes_keeps_float32_weights(one_machine):
    """cifar_cnn's case of test_cpu_speed.py's bf16 test, on this file's one-machine run."""
    check_bf16_run(*one_machine, world_size=2, steps=STEPS)


def test_two_nodes_over_loopback_equal_two_processes_on_one_machine(env, data, long_reference, tmp_path):
    out = tmp_path / "run"
    for result in two_nodes(env, "--data", str(data), *RUN, *LONG, "--output_dir", str(out)):
        node_ok(result)
    config = read_json(out / "config.json")
    assert config["world_size"] == 2 and config["mixed_precision"] == "bf16"
    # Only the global main process writes: one line per step, not one per node.
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert steps == list(range(1, STEPS + 1))
    assert_bitwise_equal(weights(out), weights(long_reference))


def test_a_node_killed_stops_the_other_within_bounds_then_both_resume_exactly(env, data, long_reference, tmp_path):
    out = tmp_path / "run"
    args = ("--data", str(data), *RUN, *LONG, "--checkpoint_every", "2", "--output_dir", str(out))
    port = free_ports()
    nodes = [start_node(env, rank, port, *args) for rank in (0, 1)]
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_4").is_dir():
        assert time.monotonic() < deadline and nodes[0].poll() is None, nodes[0].communicate()[1][-3000:]
        time.sleep(0.01)
    for process in [*psutil.Process(nodes[1].pid).children(recursive=True), psutil.Process(nodes[1].pid)]:
        process.kill()  # node 1 at once: its training process (torchrun starts it in a session of its own), launcher
    killed = time.monotonic()
    _, stderr = nodes[0].communicate(timeout=300)
    waited = time.monotonic() - killed
    nodes[1].communicate()
    print(f"(node death) the surviving node stopped {waited:.1f} s after the other was killed")
    assert nodes[0].returncode != 0 and waited < 120
    assert not re.search(r'File "[^"]*(recipes|shared)/', stderr), stderr[-3000:]  # no traceback of ours
    assert "error: another process of this run stopped" in stderr, stderr[-3000:]
    assert any((out / "checkpoints").glob("step_*"))
    for result in two_nodes(env, *args, "--resume", "latest"):
        node_ok(result)
    assert_bitwise_equal(weights(out), weights(long_reference))


@pytest.mark.parametrize("flag", ["--output_dir", "--checkpoint_dir"])
def test_nodes_that_do_not_share_the_run_folder_stop_in_one_line(env, data, tmp_path, flag):
    """Each node resolves a relative --output_dir (or --checkpoint_dir) in its own working folder: two folders, as on
    machines without a shared filesystem, where only the main node's checkpoints would be complete."""
    port = free_ports()
    folders = [tmp_path / f"node{rank}" for rank in (0, 1)]
    shared = ("--output_dir", str(tmp_path / "run")) if flag == "--checkpoint_dir" else ()
    nodes = []
    for rank, folder in enumerate(folders):
        folder.mkdir()
        nodes.append(start_node(env, rank, port, "--data", str(data), *RUN, "--max_steps", "2", "--checkpoint_every",
                                "1", flag, "run", *shared, cwd=folder))
    results = [(node.wait(timeout=600), *node.communicate()) for node in nodes]
    assert all(returncode != 0 for returncode, _, _ in results)
    stderr = results[0][2]
    assert f"error: {flag} run is not one folder shared by every node (1 process(es)" in stderr, stderr[-3000:]
    assert not re.search(r'File "[^"]*(recipes|shared)/', stderr), stderr[-3000:]
    assert not any((folder / "run" / "checkpoints").exists() or list(folder.glob("run/*step_*")) for folder in folders)


@pytest.fixture(scope="module")
def cluster():
    if reason := slurm_cluster.missing():
        pytest.skip(reason)
    cluster = slurm_cluster.Cluster(nodes=2)
    yield cluster
    cluster.close()


def newest_checkpoint(run: Path) -> int:
    return max((int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*")), default=0)


def wait_for(condition, what: str, cluster: slurm_cluster.Cluster, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s\n{log.read_text()[-3000:]}\n{cluster.logs()}"
        time.sleep(0.1)


def completed(cluster: slurm_cluster.Cluster, job: str, restarts: str, log: Path) -> bool:
    """Whether the job ended COMPLETED after `restarts` restarts; a job that failed fails the test at once."""
    state = cluster.fields("job", job)
    assert state.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), (
        f"{state}\n{log.read_text()[-3000:]}")
    return state.get("JobState") == "COMPLETED" and state.get("Restarts") == restarts


def test_slurm_job_preempted_both_ways_requeues_and_resumes_exactly(env, data, long_reference, cluster, tmp_path):
    """accelerate_configs/slurm_multinode.sh as users submit it, on two SLURM nodes of one process each, stopped the
    two ways SLURM stops a job early, one after the other: SIGTERM to the batch script (what --signal=B:TERM@120 sends
    before the time limit), then preemption by a job of a higher partition, which signals the training processes
    themselves. Each time it requeues itself and the next start resumes from the checkpoint the stop saved. With wandb,
    the default tracker (offline here): both stops signal every process of the job's step, wandb's service process
    too, which ends at once (wandb/wandb#9963); the main process's next log (every step) ended it in a traceback
    before the stop's checkpoint, and the next start resumed from an older one."""
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    flags = ("--data", str(data), *RUN, *LONG, "--checkpoint_every", "2", "--tracker", "wandb")
    job_env = dict(env, SLURM_CONF=str(cluster.conf), PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
                   ACCELERATE_USE_CPU="true", GPUS_PER_NODE="1", MAIN_PORT=str(free_ports()), OUTPUT_DIR=str(out),
                   RECIPE_FLAGS=" ".join(flags))
    submitted = cluster.run("sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
                            f"--output={log}", "accelerate_configs/slurm_multinode.sh", cwd=ROOT, env=job_env)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    stops = {"SIGTERM to the script": lambda: cluster.run("scancel", "--signal=TERM", "--batch", job),
             "a job of a higher partition": lambda: cluster.run(  # all of both nodes, now
                 "sbatch", "--partition=urgent", "--nodes=2", "--exclusive", "--wrap", "true",
                 f"--output={tmp_path / 'urgent.out'}")}
    for start, (stop, signal_job) in enumerate(stops.items()):
        resumed_at = newest_checkpoint(out)
        wait_for(lambda: newest_checkpoint(out) >= resumed_at + 4, f"checkpoint of start {start}", cluster, log)
        assert signal_job().returncode == 0
        signalled = time.monotonic()
        wait_for(lambda: f"job {job}, start {start + 1}:" in log.read_text(), f"start {start + 1}", cluster, log)
        print(f"(slurm, {stop}) the requeued job started again {time.monotonic() - signalled:.1f} s after the signal")

    wait_for(lambda: completed(cluster, job, "2", log), "requeued run to the end", cluster, log)
    assert cluster.fields("job", job)["ExitCode"] == "0:0"
    text = log.read_text()  # every start of the job, appended (--open-mode=append)
    pieces = [text.split(f"job {job}, start {n}:")[1].split(f"job {job}, start {n + 1}:")[0] for n in range(3)]
    assert "(new run)" in pieces[0]
    # (Tracebacks of the launchers, before accelerate 1.16, report the signal: docs/troubleshooting.md)
    assert "raise ConnectionResetError" not in text and "Exception ignored" not in text, text[-3000:]
    for n, stop in enumerate(stops):
        assert "stopped by SIGTERM at step " in pieces[n], pieces[n][-3000:]
        assert "wandb: its service process has stopped (" in pieces[n], pieces[n][-3000:]
        stopped = int(pieces[n].split("stopped by SIGTERM at step ")[1].split(",")[0])
        assert f"requeueing job {job}" in pieces[n]
        assert ("preempted: " in pieces[n]) == (stop == "a job of a higher partition")  # the processes were signalled
        assert "--resume latest" in pieces[n + 1].splitlines()[0]
        assert f"resuming from {out / 'checkpoints' / f'step_{stopped}'}: step {stopped}," in pieces[n + 1]
    assert_bitwise_equal(weights(out), weights(long_reference))


def test_slurm_job_requeued_without_a_checkpoint_starts_again_and_a_finished_one_stays_finished(
        env, data, long_reference, cluster, tmp_path):
    """A job killed before its first checkpoint (kill -9: an OOM, a lost node, GraceTime 0) leaves config.json and
    no checkpoint: requeued, it starts the run again in its own folder. Its second node's process then aborts as it
    exits, after the run, as gloo's exit race does: the job still ends COMPLETED. Requeued once finished, it exits 0."""
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_env = dict(env, SLURM_CONF=str(cluster.conf), PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
                   ACCELERATE_USE_CPU="true", GPUS_PER_NODE="1", MAIN_PORT=str(free_ports()), OUTPUT_DIR=str(out),
                   RECIPE_FLAGS=" ".join(("--data", str(data), *RUN, *LONG)), PYTHONPATH=str(ROOT / "tests" / "faults"),
                   FAULT_ABORT_AT_EXIT_RANK="1")
    submitted = cluster.run("sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
                            f"--output={log}", "accelerate_configs/slurm_multinode.sh", cwd=ROOT, env=job_env)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    wait_for(lambda: any(row.get("step", 0) >= 3 for row in safe_rows(out)), "training", cluster, log)
    # Every process of the job's training, at once, the recipe's own first: a launcher's death is its processes' SIGTERM
    # (StopOnSignals), and so is the job's end that killing srun brings. Killed after them, they could still save a
    # checkpoint (once, on a loaded machine, killed srun first: a checkpoint at step 13).
    training = [process for process in psutil.process_iter(["cmdline"]) if str(out) in " ".join(
        process.info["cmdline"] or []) and "recipes/cifar_cnn.py" in " ".join(process.info["cmdline"])]
    for process in sorted(training, key=lambda process: "launch" in " ".join(process.info["cmdline"])):
        process.kill()  # the recipe's processes, then `accelerate launch` and srun (their command lines say launch)
    wait_for(lambda: cluster.fields("job", job).get("JobState") in ("FAILED", "COMPLETED"), "the job to end",
             cluster, log)
    assert not list((out / "checkpoints").glob("step_*")) and (out / "config.json").exists()

    assert cluster.run("scontrol", "requeue", job).returncode == 0
    wait_for(lambda: completed(cluster, job, "1", log), "requeued run to the end", cluster, log)
    second = log.read_text().split(f"job {job}, start 1:")[1]
    assert "--overwrite (restarted with no complete checkpoint" in second.splitlines()[0], second[-3000:]
    assert "the run finished" in second and "a process aborted after it (SIGABRT" in second  # the race, as such
    assert_bitwise_equal(weights(out), weights(long_reference))
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row] == list(
        range(1, STEPS + 1))
    assert cluster.run("scontrol", "requeue", job).returncode == 0
    wait_for(lambda: completed(cluster, job, "2", log), "finished job's restart", cluster, log)
    restart = log.read_text().split(f"job {job}, start 2:")[1]
    assert "already finished (model.safetensors, curves.png); nothing to do" in restart



def test_slurm_job_that_fails_after_its_weights_ends_failed(env, data, cluster, tmp_path):
    """The script counts a failure after model.safetensors as success only by gloo's exit race's signature (the main
    process's last line, then SIGABRTs only): a crash while the pictures are written is the job's failure."""
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job_env = dict(env, SLURM_CONF=str(cluster.conf), PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
                   ACCELERATE_USE_CPU="true", GPUS_PER_NODE="1", MAIN_PORT=str(free_ports()), OUTPUT_DIR=str(out),
                   RECIPE_FLAGS=" ".join(("--data", str(data), *RUN, "--max_steps", "8")),
                   PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_FAIL_SAVING_IMAGE="confusion_matrix.png")
    submitted = cluster.run("sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
                            f"--output={log}", "accelerate_configs/slurm_multinode.sh", cwd=ROOT, env=job_env)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    wait_for(lambda: cluster.fields("job", job).get("JobState") in ("FAILED", "COMPLETED"), "the job to end",
             cluster, log)
    text = log.read_text()
    assert cluster.fields("job", job)["JobState"] == "FAILED", text[-3000:]
    assert (out / "model.safetensors").exists() and "confusion_matrix.png" in text and "ends as completed" not in text
