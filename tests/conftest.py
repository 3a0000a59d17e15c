"""Run the recipes the way users do: `accelerate launch --config_file ... recipes/<recipe>.py`,
or `python recipes/<recipe>.py`, in a subprocess, from the repository root."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# Recipes run in this process (run_here) decode into a cache of this process's own, never the user's:
# huggingface_hub and datasets read HF_HOME once, when first imported, which is after this line.
HF_HOME = Path(tempfile.mkdtemp(prefix="recipes-tests-")) / "hf"
os.environ["HF_HOME"] = str(HF_HOME)
for _name in [name for name in os.environ if name.startswith(("WANDB_", "ACCELERATE_", "HF_DATASETS_"))]:
    del os.environ[_name]  # a setting of the shell this runs in must not reach an in-process run
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))  # the measuring scripts some tests import (benchmarks/ is no package)
# One thread per process: the suite's workers (README: 3 on CI's 2 cores) each run a recipe at a time, and with
# torch's default of a thread per core, 2 x 2 threads on 2 cores spin-wait for each other (OpenMP): test_resume.py
# and test_deep_mlp_ckpt.py took 142 s with the default and 92 s with one thread, interleaved (2 workers). torchrun
# already gives each of several processes one.
THREADS = "1"
torch.set_num_threads(int(THREADS))
# The longest files first: with `--dist loadfile --no-loadscope-reorder`, xdist hands files to its workers in this
# order, so that the suite ends on short files and no worker is left alone with a long one (by default it sorts files
# by their number of tests, and the one-test GPU check came last). The seconds are each file's in the last full run
# that stored them (`--store-durations`); a file not there yet goes first.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test file's seconds in this run to {DURATIONS.name}: the order of the next runs")


FILE_SECONDS: dict[str, float] = {}  # this run's, on the main process (xdist's workers report to it)


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    FILE_SECONDS[file] = FILE_SECONDS.get(file, 0.0) + report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("--store-durations") and not hasattr(session.config, "workerinput") and FILE_SECONDS:
        DURATIONS.write_text(json.dumps({file: round(total, 1) for file, total in sorted(FILE_SECONDS.items())},
                                        indent=1) + "\n")


def pytest_unconfigure(config):
    shutil.rmtree(HF_HOME.parent, ignore_errors=True)


def pytest_collection_modifyitems(items):
    stored = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items.sort(key=lambda item: -stored.get(item.path.name, float("inf")))  # stable: a file's tests stay in order


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    """A clean environment: private caches, home and temporary folder (so no wandb login, and nothing left in /tmp), no
    inherited launcher settings."""
    home = tmp_path_factory.mktemp("home")
    (home / "tmp").mkdir()  # the launched processes' temporary files: torchrun leaves a log folder for each launch
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "HF_"))}
    clean.update(HOME=str(home), HF_HOME=str(home / "hf"), PYTHONUNBUFFERED="1", HF_HUB_DISABLE_TELEMETRY="1",
                 OMP_NUM_THREADS=THREADS, TMPDIR=str(home / "tmp"))
    return clean


def launch(env: dict, recipe: str, *args: str, config: str | None = None, use_cpu: bool = False,
           launcher_args: tuple[str, ...] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py args` (one process), or with `config`:
    `accelerate launch --config_file accelerate_configs/<config>.yaml recipes/<recipe>.py args`
    (`--config_file <config>` when it is a path to a .yaml file), `launcher_args` before the script.

    One process runs the same code either way; the launcher adds about 3 s to every run, so tests name
    a config where the launch itself is what they check, or where it starts several processes."""
    script = f"recipes/{recipe}.py"
    if config is None:
        command = [sys.executable, script, *args]
    else:
        # Exactly what the `accelerate launch` command runs, with this interpreter.
        config_file = config if config.endswith(".yaml") else f"accelerate_configs/{config}.yaml"
        command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                   config_file, *launcher_args, script, *args]
    run_env = dict(env, ACCELERATE_USE_CPU="true") if use_cpu else env
    return subprocess.run(command, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)


def run_here(script: str, *args, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python recipes/<script>.py args` in this process: its main() with these arguments, after accelerate's state
    is reset (a singleton), with `env` and `cwd` for the run only; what it printed and its exit status (a SystemExit's
    code, else 0), as `launch` returns them. An exception main() does not turn into a line propagates: the test fails
    with its traceback. Left out, since they belong to a process: stop_on_signals (the signal handlers of pytest's
    process stay its own; tests of a stop launch the script), a memory limit, a timeout. The run folder's lock is
    released at the end, as a process's exit releases it."""
    from accelerate.state import AcceleratorState, GradientState

    from shared import tracking
    from shared.checkpoints import Checkpoints

    module = importlib.import_module(f"recipes.{script}")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    argv = [str(ROOT / "recipes" / f"{script}.py"), *map(str, args)]
    try:
        with (mock.patch.dict(os.environ, env or {}), mock.patch.object(sys, "argv", argv),
              mock.patch.object(Checkpoints, "stop_on_signals", lambda self: None), working_directory(cwd),
              contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), own_signal_handlers()):
            module.main()
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    finally:
        for descriptor in tracking._LOCKS.values():
            os.close(descriptor)
        tracking._LOCKS.clear()
    return subprocess.CompletedProcess(argv, status, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def own_signal_handlers():
    """pytest's own handlers of the signals a run's start takes over (shared/launch.py's check_launch), back after."""
    from shared.launch import STOPS

    handlers = {signum: signal.getsignal(signum) for signum in STOPS}
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """Also for the tests that call check_launch itself."""
    with own_signal_handlers():
        yield


@contextlib.contextmanager
def working_directory(path: Path | None):
    before = Path.cwd()
    os.chdir(path or ROOT)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def hooked(module, name: str, hook):
    """While inside: `module.name` is `hook(original)`'s result, e.g. a make_model that also records the model."""
    original = getattr(module, name)
    with mock.patch.object(module, name, hook(original)):
        yield


# gloo (processes on the CPU) can abort one process at interpreter exit, after the run has finished and destroyed its
# process group: "terminate called without an active exception", exit -6 (the teardown race of pytorch#179291). It is
# torch's, not the recipe's: a 20-line accelerate script whose main process is busy while the other tears down
# aborts in 6 of 40 launches on a loaded 2-core machine; in 2 of the last 4 full suites, one two-process launch did.
# A test accepts it, with a warning, and goes on to check what the run wrote; any other failure, or a Python
# traceback from recipes/ or shared/, still fails. docs/troubleshooting.md tells users the same.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def exited_cleanly(returncode: int, stderr: str) -> bool:
    if returncode == 0:
        return True
    recipe_traceback = re.search(r'File "[^"]*(recipes|shared)/', stderr)
    if GLOO_EXIT_ABORT in stderr and "Signal 6 (SIGABRT)" in stderr and not recipe_traceback:
        warnings.warn(f"a process aborted at exit in gloo's teardown ({GLOO_EXIT_ABORT}); the outputs are checked")
        return True
    return False


def printed_once_and_last(stderr: str, start: str) -> str:
    """A run of several processes that failed: its line (starting with `start`) printed once by the processes, and
    again as the root cause that ends torchrun's report, the last lines on the screen. Returns the line."""
    lines = stderr.strip().splitlines()
    own = [line for line in lines if line.startswith(start)]
    assert len(own) == 1 and lines[-2].strip() == f"traceback : {own[0]}" and set(lines[-1]) == {"="}, lines[-14:]
    return own[0]


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert exited_cleanly(result.returncode, result.stderr), (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}")
    return result


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive free TCP ports on 127.0.0.1 (a rendezvous; slurm.conf's port range)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count < 65536 and all(_free(port) for port in range(first + 1, first + count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ema_state(checkpoint: Path) -> dict:
    """The --ema average in a checkpoint folder: its state dict (the model's own keys),
    accelerate's second registered object after the recipe's Progress."""
    return torch.load(checkpoint / "custom_checkpoint_1.pkl", weights_only=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def weights(run: Path) -> dict:
    return load_file(run / "model.safetensors")


def assert_bitwise_equal(a: dict, b: dict, context: str = "") -> None:
    """`context`: said in the failure message (e.g. the random step a run was killed at)."""
    assert a.keys() == b.keys(), context
    different = [k for k in a if not torch.equal(a[k], b[k])]
    worst = max((a[k] - b[k]).abs().max().item() for k in different) if different else 0.0
    assert not different, f"{context}: differ: {different[:3]} (max {worst:.3g})"


@pytest.fixture
def deep_tree():
    """deep_tree(root, depth): root/d/d/.../d, `depth` folders deep, made one at a time and removed bottom up at the
    end (Path.mkdir(parents=True) and shutil.rmtree recurse, and pytest's clean-up of old temporary folders would
    fail on it)."""
    made = []

    def make(root: Path, depth: int) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        folder = root
        for _ in range(depth):
            folder = folder / "d"
            folder.mkdir()
        made.append(root)
        return folder

    yield make
    for root in made:
        found, folders = [], [root]
        while folders:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    found.append(entry.path)
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
        for path in sorted(found, key=len, reverse=True):  # a folder after everything in it
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
