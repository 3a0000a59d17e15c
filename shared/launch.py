"""The launch checked as a run starts (`check_launch`, called by tracking.open_run, predict.py and deep_mlp_sweep.py: an
opt-in module): the process tied to its launcher's life (`stop_with_launcher`), and a SIGTERM, Ctrl-C or SIGHUP
before the run's own stop takes them over made one line (`stopped_before_the_first_step`); settings left in the
shell or a config these recipes do not follow, which would run, but not as the user thinks; then the process group
started (its collectives wait 30 minutes for a slow process, on every backend). For a training run on a CPU,
`check_cpu`: a line where a GPU was meant or bf16 would be emulated."""

import ctypes
import importlib.util
import os
import signal
import sys
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import PrecisionType, parse_flag_from_env

from shared.checkpoints import launcher_command
from shared.errors import RecipeError
from shared.reinstall import torchvision_mismatch

PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies (<linux/prctl.h>)
# How long a collective waits for the other processes before it fails, on every backend: gloo's default, and what
# transformers' Trainer (ddp_timeout) and Ray Train set for NCCL too, whose own default is 10 minutes. A machine's
# first decode runs in one process while the others wait in a barrier (docs/troubleshooting.md).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what StopOnSignals takes over before the first step


def check_launch() -> None:
    """Start the process group, and stop launches that would run, but not as the user thinks; before either, ask for
    a SIGTERM when the launcher dies (stop_with_launcher), and make that signal, or any SIGTERM, Ctrl-C or SIGHUP, end
    this process in one line until the run's own stop takes them over (StopOnSignals, before the first step)."""
    stop_with_launcher()  # first: the process group below may wait for other processes
    for signum in STOPS:
        if signal.getsignal(signum) != signal.SIG_IGN:  # ignored from the start (nohup, a shell's `&`): it stays so
            signal.signal(signum, stopped_before_the_first_step)
    if line := torchvision_mismatch():  # said before anything imports torchvision
        raise RecipeError(line)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # what a launcher sets for each process
        if not os.environ.get(name, "0").isdigit():
            raise RecipeError(f"the environment sets {name}={os.environ[name]!r}, not a count of processes: unset it "
                              "(accelerate launch sets it)")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        # A value left in the shell: the process group would wait forever for processes that never start.
        raise RecipeError(f"the environment sets WORLD_SIZE={os.environ['WORLD_SIZE']}, but no launcher started "
                          "this process (torchrun, which accelerate launch runs, would have): unset WORLD_SIZE, or "
                          "start it with accelerate launch")
    # Set by accelerate launch from a config (`accelerate config`'s default config, say) that these recipes do not
    # follow: each model fits on one device (DDP), and --compile compiles it in place, where accelerate's dynamo would
    # wrap it (every weight named `_orig_mod.` in model.safetensors and the checkpoints)
    for name in ("USE_FSDP", "USE_DEEPSPEED", "USE_MEGATRON_LM", "DYNAMO_BACKEND"):
        if os.environ.get(f"ACCELERATE_{name}", "NO").upper() not in ("NO", "FALSE", "0", ""):
            raise RecipeError(f"the accelerate config sets ACCELERATE_{name}={os.environ[f'ACCELERATE_{name}']}: these "
                              "recipes train with DDP and compile with --compile: pass --config_file "
                              "accelerate_configs/2gpu.yaml or another of accelerate_configs/")
    # Set in a shell, not by the launcher (which checks its own): accelerate trained a mistyped precision in float32,
    # recorded as "precision bfloat16", and ended in a ValueError traceback on ACCELERATE_USE_CPU=maybe
    if (precision := os.environ.get("ACCELERATE_MIXED_PRECISION", "no")) not in PrecisionType.list():
        raise RecipeError(f"the environment sets ACCELERATE_MIXED_PRECISION={precision!r}: accelerate takes one of "
                          f"{', '.join(PrecisionType.list())}")
    try:
        use_cpu = parse_flag_from_env("ACCELERATE_USE_CPU")
    except ValueError:
        raise RecipeError(f"the environment sets ACCELERATE_USE_CPU={os.environ['ACCELERATE_USE_CPU']!r}: set it to "
                          "true or false") from None
    per_machine, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if per_machine > 1 and not use_cpu and 0 < gpus < per_machine:
        raise RecipeError(f"the config starts {per_machine} processes on this machine but it has {gpus} GPU(s): "
                          f"use --num_processes {gpus} or a config that matches the machine")
    # The Accelerator reuses this state. Like the Accelerator, honour ACCELERATE_USE_CPU (PartialState would not).
    state = PartialState(cpu=use_cpu, timeout=PROCESS_GROUP_TIMEOUT)
    if launched > 1 and state.num_processes == 1:
        # accelerate 1.x starts a MULTI_GPU config's processes even without GPUs; each then trains alone on the CPU,
        # writing the same files: N duplicate runs, not one DDP run.
        raise RecipeError(f"{launched} processes were launched but no GPUs were found, so each would train alone "
                          "(duplicate runs): set ACCELERATE_USE_CPU=true to run them as one group on the CPU, "
                          "or use accelerate_configs/cpu.yaml")
    if launched == 1 and "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ and launcher_command():
        # accelerate's launcher of one process (--cpu, or a config of distributed_type NO: cpu.yaml, bf16.yaml) starts
        # one whatever --num_processes asks, and sets MASTER_ADDR only when asked for more (torchrun sets its own id)
        print("warning: accelerate launch started one process, whatever --num_processes asks: --cpu, or a config of "
              "one process (cpu.yaml, 1gpu.yaml, bf16.yaml), takes its launcher of one. For several: a config of "
              "several (2gpu.yaml), on the CPU with ACCELERATE_USE_CPU=true, not --cpu")
    source = Path(torch.__file__)
    if state.is_main_process and source.suffix == ".py" and not Path(importlib.util.cache_from_source(source)).exists():
        # Python compiles torch's code again in each process that cannot keep its compiled copy (the launcher's too):
        # on one H200 whose image sets PYTHONDONTWRITEBYTECODE, the README's GPU line took 22-25 s, 13-15 s once kept
        fixes = []
        if sys.dont_write_bytecode:
            fixes.append("unset PYTHONDONTWRITEBYTECODE")
        if not os.access(source.parent, os.W_OK):  # a read-only image (Apptainer's, say): keep the copies elsewhere
            fixes.append("export PYTHONPYCACHEPREFIX=~/.cache/pycache")
        if fixes:
            print("note: each start compiles torch's Python code again, as Python cannot keep the compiled copy here "
                  "(the README's GPU line took 22-25 s without it on one H200, 13-15 s with it): to keep it, "
                  f"{' and '.join(fixes)}")
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16" and state.device.type == "cpu":
        # accelerate accepts fp16 on a CPU but does not autocast there: the run would be float32.
        raise RecipeError("fp16 mixed precision needs a GPU (on a CPU it would silently train in float32): "
                          "use accelerate_configs/bf16.yaml on a CPU")


def stopped_before_the_first_step(signum: int, frame) -> None:
    """A SIGTERM, Ctrl-C or SIGHUP before the run's own stop takes them over (a large dataset's first decode takes
    minutes; predict.py keeps this one): one line, and the exit status a shell gives a process the signal ends.
    Python's default for SIGTERM and SIGHUP ended the process at once, with no line, and left the run folder this start
    made, empty; an exit runs the cleanup a Ctrl-C runs (tracking.open_run's removal of that folder, the `finally` of
    temporary files). Python runs this where the main thread next runs Python code: a wait in a collective ends when
    the other processes, stopped too, are gone."""
    # The first signal decides. A second must not cut the exit's cleanup short: accelerate 1.16's launcher of one
    # process, given a Ctrl-C, sends its process a SIGTERM too, which came in the middle of Python's exit
    for each in STOPS:
        signal.signal(each, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt  # its line: shared/errors.py's one_line_errors
    # torchrun stops every process this way when one fails, and its report then names that failure as the cause; on a
    # stop it says itself that a signal came ("Received 15 death signal")
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        with suppress(OSError):  # its reader gone: the launcher's death, a closed terminal
            # Written once, unbuffered: a print here could land inside a print the signal interrupted
            os.write(2, f"stopped by {signal.Signals(signum).name} before there was anything to save (a training run "
                        "saves a checkpoint from its first step on, predict.py its CSV once every image is read): run "
                        "the same command again\n".encode())
    sys.exit(128 + signum)


def check_cpu() -> None:
    """For a training run on a CPU (tracking.open_run), a line where the launch meant a GPU, and one where bf16 would
    be emulated (on a CPU without its instructions, 4 to 16 times slower: BENCHMARKS.md)."""
    # What `accelerate launch` sets from a config without use_cpu (1gpu.yaml, bf16.yaml, or none): a GPU was meant
    if os.environ.get("ACCELERATE_USE_CPU") == "False":
        why = (f"it sees no GPU (CUDA {torch.version.cuda}: check nvidia-smi and CUDA_VISIBLE_DEVICES)"
               if torch.version.cuda else "it is built for the CPU only: install the build for your GPU "
               "(pytorch.org/get-started)")
        print(f"warning: training on the CPU, as torch {torch.__version__} must: {why}; for the CPU, launch with "
              "accelerate_configs/cpu.yaml")
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16" and not cpu_has_bf16():
        print("warning: this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16 in lscpu), so bf16 is emulated "
              "here, 4 to 16 times slower than float32: accelerate_configs/cpu.yaml is faster")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 in hardware: Linux lists avx512_bf16 or amx_bf16 among its x86 flags. Elsewhere
    (no x86 flags to read: macOS, ARM), it is not said otherwise."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return True
    return "avx512_bf16" in text or "amx_bf16" in text or "\nflags" not in text


def stop_with_launcher() -> None:
    """From now on the kernel sends this process SIGTERM when its launcher dies: before the first step it ends the
    process, after it the stop saves a checkpoint (with several processes, they agree on it as on any stop).
    `accelerate launch` of one process starts this script and waits: before accelerate 1.16 it forwards no signal
    (accelerate #929), so a SIGTERM to it (Kubernetes stops a container's first process; a user kills the pid they
    see) would leave this process training on, never saving. torchrun (several processes), and from 1.16 the launcher
    of one, forward a signal, but killed (kill -9, an OOM kill) they leave their processes training on, orphaned, to
    the run's end. Asked as the run starts, not before its first step: a launcher killed while the data loaded
    (minutes, on a large dataset's first decode) left its process to train the whole run, unseen, since the kernel
    sends nothing for a parent already dead. A script run with `python` has no launcher to lose."""
    if sys.platform == "linux" and (launcher_command() or "TORCHELASTIC_RUN_ID" in os.environ):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
