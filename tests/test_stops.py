"""A stop that ends clean: SIGTERM, Ctrl-C and kill -9, to the training process and to each launcher, of 1 and 2
processes; each run stopped resumes to the weights of the run never stopped (tests/test_checkpoints.py's exactness).

Every test here needs processes of its own (a signal, a kill, gloo between two processes): two launches of about 5-10 s
each, so the file takes minutes. While editing shared/checkpoints.py, run tests/test_checkpoints.py (seconds), then
this before a commit. The 2-process runs also keep an EMA of the weights (--ema), which must come back bitwise too.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import termios
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.utils import compare_versions
from accelerate.utils import load as accelerate_load
from safetensors.torch import load_file
from test_checkpoints import RUN, reference_run, tiny_cifar

from tools.runs import collect

from conftest import ROOT, assert_bitwise_equal, ema_state, launch, ok, read_json, read_jsonl, run_here, weights
from tiny_data import cifar_binary_dataset

pytestmark = pytest.mark.slow  # signals, kills, two processes

EMA = ("--ema", "0.9")  # on the 2-process runs; BatchNorm's statistics differ between their processes


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_cifar(tmp_path_factory.mktemp("stops"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    return reference_run(data, tmp_path_factory.mktemp("reference") / "one")


@pytest.fixture(scope="module")
def reference_of_two(env, data, tmp_path_factory) -> Path:
    """The uninterrupted run of 2 processes (gloo), with --ema."""
    out = tmp_path_factory.mktemp("reference") / "two"
    ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *RUN, *EMA, config="2gpu",
              use_cpu=True))
    return out


# A run long enough for the processes' agreements on a stop (about every STOP_CHECK_S, 1 s, of training) to fall
# between its log points: 400 steps of milliseconds, about 4 s of training on a 2-core CPU. In the 20 steps of RUN
# (0.2-0.4 s), a signal that reached the processes after their second agreement (forwarded late by torchrun on a
# loaded machine; seen once in CI) was agreed on only at the last step, or came after it.
LONG = ("--batch_size", "8", "--max_steps", "400", "--seed", "5", "--tracker", "none", *EMA)
# From accelerate 1.16 `accelerate launch` handles a SIGTERM or Ctrl-C itself: it signals its processes, waits for
# them (one process: 5 s, then kills it) and exits 128 + the signal's number, without a traceback. Before, one process's
# launcher died at once, forwarding nothing (accelerate #929), and torchrun's ended in its SignalException traceback.
LAUNCHER_WAITS = compare_versions("accelerate", ">=", "1.16")


@pytest.fixture(scope="module")
def reference_of_two_long(env, data, tmp_path_factory) -> Path:
    """The uninterrupted LONG run of 2 processes (gloo), its only checkpoint at the end."""
    out = tmp_path_factory.mktemp("reference") / "two_long"
    ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *LONG, "--checkpoint_every", "0",
              config="2gpu", use_cpu=True))
    return out


def ema_weights(run: Path) -> dict:
    return ema_state(run / "checkpoints" / "step_20")


def test_a_resume_of_2_processes_from_a_checkpoint_is_bitwise_exact(env, data, reference_of_two, tmp_path):
    """From step 10, in the middle of epoch 3 (2 processes x 8: 4 steps an epoch): the weights and the EMA."""
    step, out = 10, tmp_path / "resumed"
    result = ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *RUN, *EMA, "--resume",
                       str(reference_of_two / "checkpoints" / f"step_{step}"), config="2gpu", use_cpu=True))
    assert "same configuration: the run continues exactly, to the same weights as a run never stopped" in result.stdout
    assert_bitwise_equal(weights(out), weights(reference_of_two))
    assert_bitwise_equal(ema_weights(out), ema_weights(reference_of_two))
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert steps == list(range(step + 1, 21))  # continued where the checkpoint stopped, each step once


def pasted(command: str, env: dict) -> subprocess.CompletedProcess:
    """`command` pasted into a shell of a new terminal, in another folder than the run was started in (its relative
    paths, the script's and the config's, lead nowhere there): the variables of a login, none of the test's (its
    HF_HOME, ACCELERATE_USE_CPU, ...) but its temporary folder (env's TMPDIR: torchrun leaves a folder there)."""
    login = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    login["TMPDIR"] = env["TMPDIR"]
    return subprocess.run(["bash", "-c", command], cwd=env["TMPDIR"], env=login, capture_output=True, text=True,
                          timeout=600)


def start(env, *args) -> subprocess.Popen:
    """`accelerate launch` in its own process group, so a signal can reach the whole tree."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               "accelerate_configs/cpu.yaml", "recipes/cifar_cnn.py", *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for(predicate, process, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"run ended first:\n{process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def training_processes(launcher: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(launcher).children(recursive=True)
                if "recipes/cifar_cnn.py" in " ".join(child.cmdline())]
    except psutil.Error:  # a process ended while being read
        return []


@pytest.fixture
def marking(env, tmp_path) -> dict:
    """`env`, in which each process marks the moment the run's own stop takes its signals over (StopOnSignals, before
    the first step): it creates <tmp_path>/ready/<pid> (tests/faults/sitecustomize.py). Before that moment a SIGTERM
    ends the process in one line, so a test of the stop waits for the mark."""
    (tmp_path / "ready").mkdir()
    return dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), SIGNALS_READY=str(tmp_path / "ready"))


def stops_on_signals(marking: dict, pid: int) -> bool:
    """Whether the process, started in `marking`, has handed its signals to the run's own stop."""
    return (Path(marking["SIGNALS_READY"]) / str(pid)).exists()


def test_kill_9_mid_epoch_between_checkpoints_then_resume(env, data, reference, tmp_path):
    out = tmp_path / "run"
    kill_after = 11  # after step 10's checkpoint, in the middle of the second epoch
    process = start(env, "--data", str(data), "--output_dir", str(out), *RUN)
    wait_for(lambda: any(r.get("step", 0) >= kill_after for r in safe_rows(out)), process)
    trainers = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    psutil.wait_procs(trainers, timeout=60)  # gone, and with them the run folder's lock
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *RUN, "--resume", "latest"))
    assert_bitwise_equal(weights(out), weights(reference), f"killed after step {kill_after}")
    assert not list((out / "checkpoints").glob("partial_*"))


def safe_rows(run: Path) -> list[dict]:
    try:
        return read_jsonl(run / "metrics.jsonl")
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def test_kill_9_during_a_checkpoint_save_keeps_the_previous_one(env, tmp_path):
    # The save of step 2 stops after its first file (a fault), and is killed there. The 72-layer MLP, with
    # checkpointed segments and dropout: the resumed run must also replay dropout's masks exactly when it recomputes
    # a segment.
    data = cifar_binary_dataset(tmp_path / "data", sizes={"train": 32, "test": 8})
    args = ("--data", str(data), "--batch_size", "8", "--max_steps", "2", "--checkpoint_every", "1",
            "--keep_checkpoints", "1", "--log_every", "1", "--tracker", "none", "--ckpt", "sequential",
            "--segments", "8", "--dropout", "0.1")
    reference = tmp_path / "reference"
    ok(run_here("deep_mlp_ckpt", *args, "--output_dir", reference))
    out = tmp_path / "run"
    command = [sys.executable, "recipes/deep_mlp_ckpt.py", *args, "--output_dir", str(out)]
    held = dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_HOLD_SAVE_AT_STEP="2")
    process = subprocess.Popen(command, cwd=ROOT, env=held, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any((out / "checkpoints" / "partial_step_2").glob("*")), process)
    process.kill()
    process.wait()
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_1"]
    ok(run_here("deep_mlp_ckpt", *args, "--output_dir", out, "--resume", "latest"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # no half-written folder left
    assert_bitwise_equal(weights(out), weights(reference))


def test_sigterm_saves_the_current_step_exits_0_and_prints_a_working_resume_command(env, marking, data, reference,
                                                                                     tmp_path):
    """Started as `nohup` starts it (SIGHUP ignored), a hang-up first: the run goes on (docs/resume.md: a closed
    terminal ends a run started without nohup, tmux or screen), and the SIGTERM after it stops it."""
    out = tmp_path / "run"
    command = [sys.executable, "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(out), *RUN]
    process = subprocess.Popen(command, cwd=ROOT, env=marking, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for(lambda: stops_on_signals(marking, process.pid), process)  # before the first step: it stops after 1 or 2
    process.send_signal(signal.SIGHUP)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    stopped = int(stdout.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert 1 <= stopped < 20 and (out / "checkpoints" / f"step_{stopped}").is_dir()
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    first = torch.load(out / "checkpoints" / f"step_{stopped}" / "custom_checkpoint_0.pkl", weights_only=True)
    assert first["pieces"] == 1 and first["wall_s"] > 0 and first["train_samples"] == 8 * stopped
    assert collect(out)[0]["state"] == f"stopped at step {stopped}"
    resume = stdout.split("continue with:\n")[1].strip().splitlines()[0]
    # The run folder alone: its flags are in its config.json (the data is given: not the recipe's own)
    assert resume.endswith(f"recipes/cifar_cnn.py --data {data} --output_dir {out} --resume latest"), resume
    ok(pasted(resume, env))
    assert_bitwise_equal(weights(out), weights(reference))
    # The summary is the whole run's, both pieces: every sample trained on once, the first piece's time included.
    summary, row = read_json(out / "summary.json"), collect(out)[0]
    assert summary["pieces"] == 2 and summary["wall_s"] > first["wall_s"] and summary["train_s"] > first["train_s"]
    assert round(summary["samples_per_s"] * summary["train_s"]) == 8 * 20 and summary["steps"] == 20
    assert row["state"] == "finished" and row["pieces"] == 2 and row["wall_s"] == summary["wall_s"]


@pytest.mark.parametrize("stderr_too", [False, True])
def test_a_ctrl_c_that_also_ends_the_reader_of_the_runs_lines_saves_and_ends_clean(marking, data, tmp_path,
                                                                                   stderr_too):
    """`python recipes/cifar_cnn.py ... | tee train.log`, then Ctrl-C: the terminal's SIGINT ends tee too, and the
    run's next line (the Ctrl-C's own) met a closed pipe: a BrokenPipeError traceback from the thread that prints it,
    another from the line saying where the run saved, exit 1, no summary.json or curves.png. Now the run goes on and
    its lines go to stderr; with stderr in the same pipe (`2>&1 | tee`), nowhere. Here the test holds the pipe's
    reading end and closes it just before the Ctrl-C, as tee's death does."""
    out, errors = tmp_path / "run", tmp_path / "stderr.txt"
    read_end, write_end = os.pipe()
    command = [sys.executable, "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(out), *RUN]
    with errors.open("w") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=marking, stdout=write_end,
                                   stderr=subprocess.STDOUT if stderr_too else stderr)
    os.close(write_end)
    wait_for(lambda: stops_on_signals(marking, process.pid), process)  # before the first step: it stops after 1 or 2
    os.close(read_end)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 0, errors.read_text()[-3000:]
    stopped = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").iterdir())
    assert collect(out)[0]["state"] == f"stopped at step {stopped}" and (out / "curves.png").exists()
    lines = errors.read_text()
    assert "Traceback" not in lines, lines[-3000:]
    if not stderr_too:  # in this order; the run's first line may come between them (the Ctrl-C came before it)
        ctrl_c = "Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once, without saving)\n"
        saved = f"stopped by SIGINT at step {stopped}, checkpoint saved; continue with:\n"
        assert ctrl_c in lines and saved in lines[lines.index(ctrl_c):], lines[-3000:]


def test_a_terminal_that_closes_stops_the_run_with_a_checkpoint(marking, data, tmp_path):
    """An ssh session that drops: the run's terminal hangs up, and its SIGHUP ended the run at once, with no
    checkpoint (docs/resume.md). Now it stops as on SIGTERM, saving the step, though each line printed after goes to a
    closed terminal (EIO). The run is its terminal's controlling process here, as a login shell is."""
    out = tmp_path / "run"
    terminal, its_end = os.openpty()
    command = [sys.executable, "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(out), *RUN]
    process = subprocess.Popen(command, cwd=ROOT, env=marking, stdin=its_end, stdout=its_end, stderr=its_end,
                               start_new_session=True, preexec_fn=login_job)
    os.close(its_end)
    os.set_blocking(terminal, False)
    shown, deadline = b"", time.monotonic() + 180
    while not stops_on_signals(marking, process.pid):  # before the first step: it stops after step 1 or 2
        assert process.poll() is None and time.monotonic() < deadline, shown[-3000:]
        with suppress(BlockingIOError):  # read as it comes, so that the run never waits on a full terminal
            shown += os.read(terminal, 65536)
        time.sleep(0.005)
    os.close(terminal)  # the hang-up
    assert process.wait(timeout=120) == 0, shown[-3000:]
    stopped = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").iterdir())
    assert stopped < 20 and collect(out)[0]["state"] == f"stopped at step {stopped}"
    assert (out / "curves.png").exists() and not (out / "model.safetensors").exists()


def login_job() -> None:
    """In a started process, before its program: its standard input's terminal made its controlling terminal, and
    SIGHUP's default action back, as a job of a login shell has them (tests run under nohup would pass on their
    ignored SIGHUP, and the run would then go on after the hang-up, as it should under nohup)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.parametrize("closed_pipe", [False, True])
def test_a_second_ctrl_c_stops_a_hung_evaluation_at_once(env, data, tmp_path, closed_pipe):
    """The first Ctrl-C asks for a stop after the step, which a hung evaluation never reaches; the second, a second
    later, stops at once (exit 130) and leaves the checkpoints as they were. Under Python 3.14's default start method
    (forkserver), tqdm's multiprocessing lock had a resource tracker print a "leaked semaphore" warning after it.
    With both outputs in a pipe whose reader the first Ctrl-C ended (`2>&1 | tee`), the second's line failed in its
    thread, and the run stayed hung."""
    out, hung = tmp_path / "run", tmp_path / "hung"
    faulty = dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_HANG_IN_EVALUATION=str(hung),
                  START_METHOD="forkserver")
    command = [sys.executable, "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(out), *RUN]
    read_end, write_end = os.pipe()
    os.close(read_end)  # a pipe whose reader is gone, for closed_pipe
    output = subprocess.PIPE
    process = subprocess.Popen(command, cwd=ROOT, env=faulty, text=True, stdout=write_end if closed_pipe else output,
                               stderr=subprocess.STDOUT if closed_pipe else output)
    os.close(write_end)
    wait_for(hung.exists, process)  # the first epoch's evaluation, after step 8's checkpoint
    process.send_signal(signal.SIGINT)
    time.sleep(2)
    assert process.poll() is None  # the first Ctrl-C waits for the step's end: never, here
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # still hung: not left behind
        process.kill()
        raise
    assert process.returncode == 130 and sorted(p.name for p in (out / "checkpoints").iterdir()) == saved
    assert saved[-1] == "step_8"
    if not closed_pipe:
        assert "Ctrl-C again to stop at once" in stdout, stderr[-3000:]
        assert stderr.strip().splitlines()[-1] == (
            f"error: stopped at once by a second Ctrl-C, without saving: continue from the newest checkpoint in "
            f"{out / 'checkpoints'} with --resume latest")


def waiting_for_data(loading: Path) -> list[str]:
    """A Python command that runs the script after it as `python <script> <flags>` would, but whose data load touches
    `loading` and then waits: a signal sent once `loading` exists comes while the data loads. It waits in sleeps of
    0.1 s, as a real load runs Python between its reads: CPython runs a signal's handler after a sleep it interrupts,
    and one sleep of 300 s that began just after the signal came (or that a signal to another thread did not
    interrupt) would hold it that long. A CI run of this file's Ctrl-C case waited out its 60 s with nothing printed."""
    code = ("import pathlib, runpy, sys, time\nfrom shared import data\n"
            f"data.load_image_data = lambda *args: (pathlib.Path({str(loading)!r}).touch(), "
            "[time.sleep(0.1) for _ in range(3000)])\n"
            "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["Ctrl-C", "SIGTERM", "SIGHUP"])
def test_a_stop_before_the_first_step_is_one_line_and_leaves_no_run_folder(env, data, tmp_path, signum):
    """Ctrl-C, SIGTERM or a closed terminal's SIGHUP while the data loads, before the run's own stop takes signals over
    (StopOnSignals, just before the first step), where a first decode of a large dataset takes minutes. Ctrl-C ended
    in a KeyboardInterrupt traceback from deep inside datasets; SIGTERM and SIGHUP ended the process at once, with no
    line, and left the run folder this start had made, empty. One line now, and the exit status a shell gives a
    process the signal ends (130, 143, 129). Here the load waits (shared.data's load_image_data replaced, the recipe
    run as a script), so that the signal comes during it."""
    loading = tmp_path / "loading"

    def as_in_a_terminal():  # a shell's background job (`pytest ... &`, nohup) starts with these ignored
        for each in (signal.SIGINT, signal.SIGHUP):
            signal.signal(each, signal.SIG_DFL)

    process = subprocess.Popen([*waiting_for_data(loading), "recipes/cifar_cnn.py", "--data", str(data),
                                "--output_dir", str(tmp_path / "run"), *RUN], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_in_a_terminal)
    wait_for(loading.exists, process)
    os.killpg(process.pid, signum)  # Ctrl-C in a terminal signals its whole group
    stdout, stderr = process.communicate(timeout=60)
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert process.returncode == 128 + signum and stderr.strip().splitlines() == [
        f"stopped by {name} before there was anything to save (a training run saves a checkpoint from its first step "
        "on, predict.py its CSV once every image is read): run the same command again"], stderr[-3000:]
    assert not (tmp_path / "run").exists()  # made by this start, and empty: removed


def test_a_launcher_killed_while_the_data_loads_takes_its_process_with_it(env, data, tmp_path):
    """The kernel's SIGTERM on the launcher's death was asked for only just before the first step: a launcher killed
    while the data loaded (here, `accelerate launch` of 1 process sent SIGTERM during a first decode of 20,300 photos)
    left its process training the whole run, unseen. Here the launcher is a process that waits on the recipe, which
    TORCHELASTIC_RUN_ID marks as launched, and the load waits (as in the test above); kill -9 to the launcher."""
    loading = tmp_path / "loading"
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
                                 *waiting_for_data(loading), "recipes/cifar_cnn.py", "--data", str(data),
                                 "--output_dir", str(tmp_path / "run"), *RUN], cwd=ROOT,
                                env={**env, "TORCHELASTIC_RUN_ID": "a stand-in for torchrun's"})
    wait_for(loading.exists, launcher)
    (trainer,) = psutil.Process(launcher.pid).children()
    launcher.kill()
    try:
        trainer.wait(timeout=30)
    except psutil.TimeoutExpired:  # before: it went on loading, then training
        trainer.kill()
        raise
    assert not (tmp_path / "run").exists()  # made by this start, and empty: removed (SIGTERM's default left it)


@pytest.mark.parametrize("ctrl_c", [False, True])
def test_a_stop_under_the_launcher_of_1_process(env, marking, data, reference, tmp_path, ctrl_c):
    """`accelerate launch` of one process starts the script and waits. Before accelerate 1.16 it forwards no signal
    (accelerate #929): a SIGTERM kills the launcher only (exit 143 in a shell). The training process asks the kernel
    for a SIGTERM when its parent dies (PR_SET_PDEATHSIG), so it still saves its step, and the run resumes to the
    uninterrupted run's weights (those of `python recipes/cifar_cnn.py`: one process trains the same under cpu.yaml).
    Ctrl-C reaches both: the launcher ends in a KeyboardInterrupt traceback (exit 130 in a shell), the trainer saves.
    From 1.16 the launcher sends its process a SIGTERM, waits 5 s for it, and exits 143 or 130 with no traceback: a
    second Ctrl-C then still reaches the process, as the line says."""
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "-q", "--config_file",
                "accelerate_configs/cpu.yaml"]
    # SIGINT as a terminal's commands have it: a shell's background job (`pytest ... &`) starts with SIGINT ignored,
    # which the launcher would inherit, and then it outlives a Ctrl-C (exit 0), as it does under `nohup` too.
    process = subprocess.Popen([*launcher, "recipes/cifar_cnn.py", "--data", str(data), "--output_dir", str(out), *RUN],
                               cwd=ROOT, env=marking, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # The trainer's stop takes its signals over before its first step, and it asked for its parent's death signal
    # before that
    wait_for(lambda: [stops_on_signals(marking, pid) for pid in training_processes(process.pid)] == [True], process)
    if ctrl_c:
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    else:
        process.send_signal(signal.SIGTERM)  # to the launcher's pid, as Kubernetes or `kill <pid>` would
    stdout, stderr = process.communicate(timeout=120)  # the pipes close when the trainer exits (orphaned before 1.16)
    name = "SIGINT" if ctrl_c else "SIGTERM"
    # Before 1.16 the launcher died and the trainer saved after it; from 1.16 the launcher waited for the save
    status = 128 + getattr(signal, name) if LAUNCHER_WAITS else -getattr(signal, name)
    assert process.returncode == status, stdout[-3000:] + stderr[-3000:]
    interrupted_launcher = ctrl_c and not LAUNCHER_WAITS  # its KeyboardInterrupt traceback
    assert ("KeyboardInterrupt" in stderr) == interrupted_launcher, stderr[-3000:]
    assert f"stopped by {name} at step " in stdout, stderr[-3000:]
    if ctrl_c and LAUNCHER_WAITS:
        assert ("(Ctrl-C again to stop at once, without saving; accelerate launch allows the save 5 s, then kills this "
                "process)\n") in stdout, stdout[-3000:]
    elif ctrl_c:  # a second Ctrl-C reaches no process once the launcher is gone: the line said so
        pid = re.search(r"this process, (\d+), saves after it: wait for its 'stopped by' line, or stop it at once "
                        r"with kill -INT (\d+)\)\n", stdout)
        assert pid and pid[1] == pid[2] and "Ctrl-C again" not in stdout, stdout[-3000:]
    stopped = int(stdout.split(f"stopped by {name} at step ")[1].split(",")[0])
    assert 1 <= stopped < 20 and (out / "checkpoints" / f"step_{stopped}").is_dir()
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    # The command printed is the launcher's own, its flags (-q, the config file) included
    resume = stdout.split("continue with:\n")[1].strip().splitlines()[0]
    words = [word for word in shlex.split(resume) if not re.match(r"[A-Z_]+=", word)]  # after NAME=value settings
    assert words[:8] == ["cd", str(ROOT), "&&", "accelerate", "launch", "-q", "--config_file",
                         "accelerate_configs/cpu.yaml"], resume
    ok(pasted(resume, env))
    assert_bitwise_equal(weights(out), weights(reference))


def test_a_stop_that_also_stops_wandbs_service_saves_and_ends_clean(marking, data, tmp_path):
    """SIGTERM to every process of the run at once, wandb's service (wandb-core) included, as `accelerate launch` of
    one process sends it from 1.16 (on a Ctrl-C too), and SLURM's scancel: wandb-core ends at once (wandb/wandb
    #9963), and the run's next log (every step here) ended in a ConnectionResetError traceback, before the step's
    checkpoint was saved, and its finish in another, with one more from wandb's exit handler. Now the stop goes on
    without wandb, saying so once: the checkpoint, every row of metrics.jsonl, summary.json."""
    out = tmp_path / "run"
    process = start(dict(marking, WANDB_MODE="offline"), "--data", str(data), "--output_dir", str(out), "--batch_size",
                    "8", "--max_steps", "400", "--log_every", "1", "--checkpoint_every", "0", "--tracker", "wandb")

    def run_with_wandb() -> list[psutil.Process]:
        try:
            trainers = [psutil.Process(pid) for pid in training_processes(process.pid)]
            services = [child for trainer in trainers for child in trainer.children() if child.name() == "wandb-core"]
        except psutil.Error:  # a process ended while being read
            return []
        ready = trainers and stops_on_signals(marking, trainers[0].pid) and services and safe_rows(out)
        return [psutil.Process(process.pid), *trainers, *services] if ready else []

    wait_for(run_with_wandb, process)
    for member in run_with_wandb():
        member.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == (128 + signal.SIGTERM if LAUNCHER_WAITS else -signal.SIGTERM), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stdout.count("wandb: its service process has stopped (") == 1, stdout[-3000:]
    stopped = int(stdout.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert (out / "checkpoints" / f"step_{stopped}").is_dir() and stopped < 400
    assert [row["step"] for row in safe_rows(out) if "train_loss" in row] == list(range(1, stopped + 1))
    assert collect(out)[0]["state"] == f"stopped at step {stopped}" and (out / "summary.json").exists()


@pytest.mark.skipif(not LAUNCHER_WAITS, reason="before accelerate 1.16 the launcher of 1 process waits for no save")
def test_a_save_past_the_launchers_5_s_is_cut_short_and_the_run_resumes_from_the_one_before(env, data, reference,
                                                                                             tmp_path):
    """From accelerate 1.16 the launcher of one process waits 5 s for it after a SIGTERM, then kills it
    (docs/resume.md): a save caught there is cut short, and the run continues from its newest complete checkpoint."""
    out = tmp_path / "run"
    held = dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_HOLD_SAVE_AT_STEP="4")
    process = start(held, "--data", str(data), "--output_dir", str(out), *RUN)
    wait_for(lambda: any((out / "checkpoints" / "partial_step_4").glob("*")), process)  # step 4's save, held
    trainers = training_processes(process.pid)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)  # to the launcher, as `kill <pid>` would
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143 and 5 <= time.monotonic() - signalled < 60, stderr[-3000:]
    assert len(trainers) == 1 and not psutil.pid_exists(trainers[0])  # killed, not left behind
    assert "checkpoint saved" not in stdout, stdout[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["partial_step_4", "step_2"]
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *RUN, "--resume", "latest"))
    assert_bitwise_equal(weights(out), weights(reference))
    assert not list((out / "checkpoints").glob("partial_*"))


@pytest.mark.parametrize("ctrl_c", [False, True])
def test_a_stop_of_2_processes_between_log_points(env, marking, data, reference_of_two_long, tmp_path, ctrl_c):
    """`accelerate launch` of several processes runs torchrun, which forwards a SIGTERM to every worker and kills
    them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default; 5 here). This run's only log point is its
    last step, and it saves no checkpoint before it: the processes must agree on a stop between log points, save a
    complete checkpoint before the kill, and resume from it to the weights of the uninterrupted 2-process run, which
    logged about every 4 steps and saved only at its end (neither changes what is trained). Ctrl-C reaches every
    process of the terminal's group, and torchrun forwards it again at once: that copy is not a second Ctrl-C.
    torchrun itself then ends in its SignalException traceback, exit 1 (docs/resume.md); from accelerate 1.16 the
    launcher exits 143 or 130 instead, without one."""
    args = ("--data", str(data), *LONG, "--log_every", "400")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               "accelerate_configs/2gpu.yaml", "recipes/cifar_cnn.py", *args, "--output_dir", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(marking, ACCELERATE_USE_CPU="true",
                                                           TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # Signalled as soon as both training processes' stops take their signals over (before the first of 400 steps,
    # each an all-reduce between them): on any machine, the run is far from its only log point.
    wait_for(lambda: [stops_on_signals(marking, pid) for pid in training_processes(process.pid)] == [True, True],
             process)
    if ctrl_c:
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    else:
        process.send_signal(signal.SIGTERM)  # to torchrun, as Kubernetes or `kill <pid>` would
    stdout, stderr = process.communicate(timeout=120)
    name = "SIGINT" if ctrl_c else "SIGTERM"
    assert f"stopped by {name} at step " in stdout, stderr[-3000:]
    if LAUNCHER_WAITS:
        assert process.returncode == 128 + getattr(signal, name) and "Traceback" not in stderr, stderr[-3000:]
    else:
        assert process.returncode == 1 and "SignalException" in stderr  # torchrun's own ending
    stopped = int(stdout.split(f"stopped by {name} at step ")[1].split(",")[0])
    checkpoint = out / "checkpoints" / f"step_{stopped}"
    assert stopped < 400 and sorted(p.name for p in checkpoint.glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]
    # Each process draws its own crops and flips (set_seed(..., device_specific=True)).
    states = [accelerate_load(checkpoint / f"random_states_{rank}.pkl") for rank in (0, 1)]
    assert not torch.equal(states[0]["torch_manual_seed"], states[1]["torch_manual_seed"])
    # Pasted into a shell without ACCELERATE_USE_CPU=true: the command printed sets it (it failed: no GPUs).
    resume = stdout.split("continue with:\n")[1].strip().splitlines()[0]
    assert "ACCELERATE_USE_CPU=true " in resume and " accelerate launch --config_file " in resume, resume
    ok(pasted(resume, env))
    # model.safetensors holds the EMA (--ema), the last checkpoint the trained weights: both as if never stopped.
    assert_bitwise_equal(weights(out), weights(reference_of_two_long))
    assert_bitwise_equal(load_file(out / "checkpoints" / "step_400" / "model.safetensors"),
                         load_file(reference_of_two_long / "checkpoints" / "step_400" / "model.safetensors"))


def test_kill_9_of_the_launcher_of_2_processes_stops_both_with_a_checkpoint(env, marking, data, reference_of_two,
                                                                            tmp_path):
    """kill -9 of `accelerate launch` (or an OOM kill of it) forwards nothing: its two training processes trained on,
    orphaned, to the run's end. Each asks the kernel for a SIGTERM when its launcher dies (PR_SET_PDEATHSIG), so both
    stop within seconds, agree on a step and save it, and the command they print continues the run to the weights of
    the run never stopped."""
    args = ("--data", str(data), "--batch_size", "8", "--max_steps", "20", "--log_every", "20", "--seed", "5",
            "--tracker", "none", *EMA)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
               "accelerate_configs/2gpu.yaml", "recipes/cifar_cnn.py", *args, "--output_dir", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(marking, ACCELERATE_USE_CPU="true"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: [stops_on_signals(marking, pid) for pid in training_processes(process.pid)] == [True, True],
             process)
    workers = [psutil.Process(pid) for pid in training_processes(process.pid)]
    process.kill()
    killed = time.monotonic()
    stdout, stderr = process.communicate(timeout=120)  # the pipes close when the orphaned processes exit
    psutil.wait_procs(workers, timeout=10)
    assert time.monotonic() - killed < 60 and not any(worker.is_running() for worker in workers), stderr[-3000:]
    # Stopped by the signal, with a checkpoint: at step 20 too where the agreement fell on the last step (the steps
    # of this tiny run take milliseconds, and the processes agree about once a second), which the resume finishes
    stopped = int(stdout.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert stopped <= 20 and (out / "checkpoints" / f"step_{stopped}").is_dir()
    ok(pasted(stdout.split("continue with:\n")[1].strip().splitlines()[0], env))
    assert_bitwise_equal(weights(out), weights(reference_of_two))
