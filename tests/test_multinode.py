"""Beyond one machine: two nodes over loopback, and a node that dies.

Two `accelerate launch` processes with --num_machines 2 and --machine_rank 0 / 1 are a real two-node rendezvous
(gloo on the CPU, ACCELERATE_USE_CPU=true), started from accelerate_configs/multinode.yaml with the per-node
values overridden on the command line, as slurm_multinode.sh does."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, assert_bitwise_equal, exited_cleanly, launch, ok, read_json, read_jsonl, weights
from tiny_data import save_to_disk_dataset

RUN = ("--batch_size", "8", "--log_every", "1", "--seed", "3", "--tracker", "none")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return save_to_disk_dataset(tmp_path_factory.mktemp("nodes") / "data", sizes={"train": 64, "test": 20})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(env: dict, rank: int, port: int, *args: str) -> subprocess.Popen:
    """One node of two: the multinode template, its per-node values overridden as slurm_multinode.sh does."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "-q", "--config_file",
               "accelerate_configs/multinode.yaml", "--num_machines", "2", "--num_processes", "2",
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "recipes/cifar_cnn.py", *args]
    return subprocess.Popen(command, cwd=ROOT, env=dict(env, ACCELERATE_USE_CPU="true"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def two_nodes(env: dict, *args: str, timeout: int = 600) -> list[tuple[int, str, str]]:
    port = free_port()
    nodes = [start_node(env, rank, port, *args) for rank in (0, 1)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


def node_ok(result: tuple[int, str, str]) -> None:
    returncode, stdout, stderr = result
    assert exited_cleanly(returncode, stderr), f"exit {returncode}\n{stdout[-2000:]}\n{stderr[-4000:]}"


@pytest.fixture(scope="module")
def reference(env, data, tmp_path_factory):
    """The same run on one machine: 2 processes of 2gpu.yaml, in bf16 as multinode.yaml is."""
    out = tmp_path_factory.mktemp("single") / "run"
    ok(launch(env, "cifar_cnn", "--data", str(data), *RUN, "--max_steps", "12", "--output_dir", str(out),
              config="2gpu", use_cpu=True, launcher_args=("--mixed_precision", "bf16")))
    return out


def test_two_nodes_over_loopback_equal_two_processes_on_one_machine(env, data, reference, tmp_path):
    out = tmp_path / "run"
    for result in two_nodes(env, "--data", str(data), *RUN, "--max_steps", "12", "--output_dir", str(out)):
        node_ok(result)
    config = read_json(out / "config.json")
    assert config["world_size"] == 2 and config["mixed_precision"] == "bf16"
    # Only the global main process writes: one line per step, not one per node.
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert steps == list(range(1, 13))
    assert_bitwise_equal(weights(out), weights(reference))


def test_a_node_killed_stops_the_other_within_bounds_then_both_resume_exactly(env, data, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    length = ("--data", str(data), *RUN, "--max_steps", "200")  # long enough for the kill to land mid-run
    for result in two_nodes(env, *length, "--output_dir", str(reference)):
        node_ok(result)
    args = (*length, "--checkpoint_every", "2", "--output_dir", str(out))
    port = free_port()
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
    assert_bitwise_equal(weights(out), weights(reference))
