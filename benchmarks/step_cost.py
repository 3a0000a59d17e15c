"""What one optimizer step costs the host, for each recipe and option, beside a plain loop over the recipe's own parts:
ATen operations (on a GPU each is at least one kernel launch), scalar reads (`.item()`, `bool(tensor)`, ...) and
device syncs (a read of a device value, or a blocking copy between host and device: the host waits for the GPU).

On a CPU-only machine every tensor is on the CPU, and a sync cannot be seen: `.item()` of a "device" tensor is a
memory read and `.to(device)` does nothing. `StandInDevice` stands in for the accelerator. It follows which tensors
would live on it, through torch's two Python hooks (a TorchFunctionMode for what the code asks for, a
TorchDispatchMode for every ATen operation, autograd's included):
- on the device: what `.to(device)` / `.cuda()` return, what a factory makes with an explicit `device=` (the recipes
  name the accelerator's device there, as a torch.device; "cpu" written as a string names the host, as torch's
  optimizers do for their step counters), and every result of an operation on a device tensor;
- a sync: `_local_scalar_dense` of a device tensor (`.item()`, `bool`, `float`, `int`), `.cpu()`, `.to("cpu")`,
  `.tolist()` or `.numpy()` of one, a blocking `.to(device)` of a host tensor or `torch.tensor(..., device=)` (copies
  that wait for the stream), an operation whose output size depends on device values (`nonzero`, boolean-mask
  indexing, ...), and a host tensor of one or more dimensions in an operation on device tensors (an implicit copy, or
  an error on a GPU).
Steps are cut by torch's global optimizer-step hook: a step's counts are everything from one `optimizer.step()` to
the next, so they include the loop's own work (the next batch, preprocessing, the EMA, the metrics' sums).

    python benchmarks/step_cost.py                                  # every recipe and option: the table
    python benchmarks/step_cost.py --recipes cifar_cnn --json out.json --data DIR
Under `accelerate launch` of several processes (`--worker`), each process counts its own steps: the
2-process rows.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from accelerate import PartialState
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

aten = torch.ops.aten
# Operations whose output size depends on the values: the host must read them first.
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten.unique_consecutive, aten._unique2, aten.unique_dim,
                  aten.repeat_interleave, aten.nonzero_static}
# What launches no kernel on a GPU, besides views: allocations, profiler marks, wrapping a new tensor.
NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh", "detach", "alias",
             "_record_function_enter_new", "_record_function_exit"}
TO_HOST = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}
UPLOADS = {torch.tensor, torch.as_tensor, torch.asarray}  # from host data: blocking copies to the device
# Which tensors are on the device: one record for every counting run of a process, since a tensor cached in one run
# (augment's normalization constants) is used by the next. A host tensor moved to the device counts as on it from
# then on: on a CPU, `.to(device)` returns the same tensor.
ON_DEVICE = WeakTensorKeyDictionary()
RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt")
STEPS = 6  # optimizer steps per run; the steady ones are counted (see steady())
# option -> recipe flags and accelerate config; every run holds the data on the device, as a GPU run should.
OPTIONS = {"default": ([], "cpu"), "bf16": ([], "cpu_bf16"), "ema": (["--ema", "0.99"], "cpu"),
           "grad_accum 2": (["--grad_accum", "2"], "cpu")}


class CountedEnough(Exception):
    """Raised after the `stop_after`-th optimizer step: the steps asked for are counted."""


class StandInDevice:
    """Counts, per optimizer step, ATen operations, scalar reads and syncs with a device that the CPU stands in for
    (see the module's docstring). `with StandInDevice() as counts:` then `counts.steps`, a Counter per step."""

    def __init__(self, stop_after: int | None = None):
        self.stop_after = stop_after
        self.on_device = ON_DEVICE
        self.steps: list[Counter] = []
        self.current, self.paused = Counter(), False
        self.modes = (_Functions(self), _Dispatch(self))

    def __enter__(self):
        self.hook = register_optimizer_step_post_hook(self._step_done)
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        self.hook.remove()

    def _step_done(self, optimizer, args, kwargs):
        self.steps.append(self.current)
        self.current = Counter()
        if len(self.steps) == self.stop_after:
            raise CountedEnough  # out of the training loop: the run's end (evaluation, saving) is not counted

    def is_on_device(self, tensors) -> bool:
        return any(t in self.on_device for t in tensors)

    def mark(self, output) -> None:
        for t in _tensors((output,), {}):
            self.on_device[t] = True

    def sync(self, what: str) -> None:
        self.current["device syncs"] += 1
        self.current[f"sync: {what}"] += 1


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an operation's arguments, and in its lists of them (foreach operations take lists)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class _Counting:
    """A mode of a StandInDevice: what it sees goes into its owner's counts."""

    def __init__(self, owner: StandInDevice):
        super().__init__()
        self.owner = owner


class _Functions(_Counting, TorchFunctionMode):
    """What the code asks for: moves between host and device, and factories given a device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, owner = kwargs or {}, self.owner
        if owner.paused:
            return func(*args, **kwargs)
        on_device = owner.is_on_device(_tensors(args, kwargs))
        target = kwargs.get("device")  # where a move or a factory puts its result
        if func is torch.Tensor.to and target is None and len(args) > 1 and not isinstance(args[1], torch.dtype):
            target = args[1] if not isinstance(args[1], torch.Tensor) else args[1].device
        elif func is torch.Tensor.cuda:
            target = "cuda"
        to_host = func in TO_HOST or (func is torch.Tensor.to and names_host(target))
        if to_host and on_device:
            owner.sync(f"Tensor.{func.__name__}({'cpu' * (func is torch.Tensor.to)})")
            owner.paused = True  # the host copy a GPU would make: a new tensor, off the device
            try:
                result = func(*args, **kwargs)
                return result.clone() if isinstance(result, torch.Tensor) else result
            finally:
                owner.paused = False
        result = func(*args, **kwargs)
        to_device = target is not None and not names_host(target)
        if to_device and not on_device and func in (torch.Tensor.to, torch.Tensor.cuda, *UPLOADS):
            owner.current["copies to the device"] += 1
            non_blocking = func is not torch.tensor and (kwargs.get("non_blocking") or any(
                arg is True for arg in args[2:]))  # .to(device, dtype, non_blocking): torch.tensor always blocks
            if not non_blocking:
                owner.sync(f"a blocking copy to the device ({func.__qualname__})")
        if on_device or to_device:
            # `param.data = moved` (nn.Module.to) keeps the parameter object and gives it the moved tensor's data
            owner.mark(args[0] if func == torch.Tensor.data.__set__ else result)
        return result


def names_host(device) -> bool:
    """Whether a move or a factory names the host: "cpu" written as a string (torch's optimizers keep their step
    counters so). Code that means the accelerator passes a torch.device: accelerator.device, tensor.device."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _Dispatch(_Counting, TorchDispatchMode):
    """Every ATen operation, autograd's and the optimizer's included."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, owner = kwargs or {}, self.owner
        if owner.paused:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        device_inputs = [t in owner.on_device for t in tensors]
        owner.current["aten ops"] += 1
        if not (func.is_view or func.overloadpacket.__name__ in NO_KERNEL):
            owner.current["kernels"] += 1
        owner.current[f"op: {func.overloadpacket.__name__}"] += 1
        if func is aten._local_scalar_dense.default:
            owner.current["scalar reads"] += 1
            if device_inputs[0]:
                owner.sync("a read of a device value")
        elif any(device_inputs):
            indices = args[1] if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) else ()
            masks = [t for t in indices if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)]
            if func.overloadpacket in DATA_DEPENDENT or masks:  # x[mask] finds the mask's places first
                owner.sync(f"{func.overloadpacket.__name__}: an output size set by device values")
            elif any(not on and t.dim() > 0 for t, on in zip(tensors, device_inputs)):
                if not (func.overloadpacket in (aten.copy_, aten._to_copy) and kwargs.get("non_blocking")):
                    owner.sync(f"{func.overloadpacket.__name__}: a host tensor in an operation on device tensors")
        result = func(*args, **kwargs)
        if any(device_inputs):
            owner.mark(result)
        return result


# ----------------------------------------------------------------------------- the recipes and the plain loop
def steady(steps: list[Counter], leave_out: set[int] = frozenset()) -> Counter:
    """Steps 3 on (1-based), but those in `leave_out`: the first two set up state (the optimizer's, the EMA's first
    copy, the loader's first batches). Each count is its most over those steps, so that one that occurs in some steps
    only still shows."""
    counted = [counts for number, counts in enumerate(steps, start=1) if number >= 3 and number not in leave_out]
    if not counted:
        raise RuntimeError(f"no steady step among {len(steps)}: the run ended early (an epoch's end, an error)")
    return Counter({key: max(counts[key] for counts in counted) for counts in counted for key in counts})


def forget_cached_tensors(recipe) -> None:
    """Empty the recipe's and augment's caches of device tensors (the normalization constants, the MLP's projection).
    Filled in this process outside a counting run (a test that called preprocess() before), they hold tensors the
    stand-in never saw moved to its device: host tensors to it, and each step's use of them a sync."""
    from shared import augment

    for module in (recipe, augment):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):  # functools.cache
                value.cache_clear()


def count_recipe(name: str, flags: list[str], mixed_precision: str = "no") -> list[Counter]:
    """The recipe's own train() in this process, under the stand-in device: a Counter per optimizer step."""
    from accelerate.state import AcceleratorState, GradientState

    from shared import tracking

    recipe = importlib.import_module(f"recipes.{name}")
    forget_cached_tensors(recipe)
    one_process = not PartialState._shared_state.get("backend")
    if one_process:  # a new precision needs a new state
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    precision_before = os.environ.get("ACCELERATE_MIXED_PRECISION")
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision  # what `accelerate launch` passes on
    # A long run, stopped after STEPS steps: no log point, evaluation or checkpoint among them.
    output_dir = tempfile.TemporaryDirectory(prefix=f"step-cost-{name}-")  # the run's config.json: removed after
    cfg = recipe.Config.parse([*flags, "--max_steps", "1000", "--log_every", "1000", "--tracker", "none",
                               "--output_dir", output_dir.name, "--data_on_device"])
    from shared.launch import STOPS  # the signals a run's start and its stop take over

    handlers = {signum: signal.getsignal(signum) for signum in STOPS}
    # Without a terminal a run prints a line every 30 s, with the loss: a read at its own cadence, like the processes'
    # stop agreement (see worker()), and not part of a step. These counted steps are slow: it would fall among them.
    heartbeat_s, tracking.HEARTBEAT_S = tracking.HEARTBEAT_S, float("inf")
    try:
        with StandInDevice(stop_after=STEPS) as counts, contextlib.redirect_stdout(sys.stderr):
            with contextlib.suppress(CountedEnough):
                recipe.train(cfg)
    finally:  # as they were: this may run inside another program (the tests)
        tracking.HEARTBEAT_S = heartbeat_s
        if precision_before is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION")
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = precision_before
        if one_process:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        for signum, handler in handlers.items():  # train() took SIGTERM, Ctrl-C and SIGHUP (a stop)
            signal.signal(signum, handler)
        output_dir.cleanup()
    return counts.steps


def count_plain_loop(name: str, flags: list[str], mixed_precision: str = "no", ddp: bool = False) -> list[Counter]:
    """The recipe's parts (load_data, make_model, make_optimizer, preprocess, loss_fn) in a hand-written loop without
    accelerate, its data on the device, with the recipe's gradient accumulation and clipping and a learning rate set
    per step; with `ddp`, the model in torch's DistributedDataParallel (the process group already started)."""
    recipe = importlib.import_module(f"recipes.{name}")
    forget_cached_tensors(recipe)
    cfg = recipe.Config.parse(flags)
    with StandInDevice() as counts, contextlib.redirect_stdout(sys.stderr):
        train_set, _ = recipe.load_data(cfg)
        device = torch.device("cpu")  # the stand-in's: what is moved with .to(device) counts as on it
        images, labels = train_set.images.to(device), train_set.labels.to(device)
        model = recipe.make_model(len(train_set.classes), cfg).to(device)
        channels_last = getattr(cfg, "channels_last", False)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = (recipe.make_optimizer(model, cfg, cfg.lr) if name == "resnet18_fmnist"
                     else recipe.make_optimizer(model, cfg))
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        order = torch.randperm(len(images)).to(device)
        augmentation = (cfg.erase,) if name == "resnet18_fmnist" else ()  # its random erasing, as its train() passes
        for step in range(STEPS):
            for micro in range(cfg.grad_accum):
                start = (step * cfg.grad_accum + micro) * cfg.batch_size
                batch = order[start:start + cfg.batch_size]
                inputs = recipe.preprocess(images.index_select(0, batch), True, *augmentation)
                if channels_last:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                with torch.autocast("cpu", torch.bfloat16, enabled=mixed_precision == "bf16"):
                    loss = recipe.loss_fn(model(inputs), labels.index_select(0, batch))
                sync = not ddp or micro == cfg.grad_accum - 1  # DDP all-reduces on the last batch only
                with contextlib.nullcontext() if sync else model.no_sync():
                    (loss / cfg.grad_accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * (step + 1) / STEPS
            optimizer.step()
            optimizer.zero_grad()
    return counts.steps


def row(name: str, option: str, counts: Counter, plain: Counter) -> dict:
    """One row of the table, and each operation's and sync's count for a closer look (--json)."""
    def named(prefix, counter):
        return {k.removeprefix(prefix): v for k, v in sorted(counter.items()) if k.startswith(prefix)}

    return {"recipe": name, "option": option, "aten_ops": counts["aten ops"], "kernels": counts["kernels"],
            "scalar_reads": counts["scalar reads"], "device_syncs": counts["device syncs"],
            "copies_to_device": counts["copies to the device"], "plain_aten_ops": plain["aten ops"],
            "plain_kernels": plain["kernels"], "plain_scalar_reads": plain["scalar reads"],
            "plain_device_syncs": plain["device syncs"], "syncs": named("sync: ", counts),
            "ops": named("op: ", counts), "plain_ops": named("op: ", plain)}


def measure(names: list[str], data_flags: list[str], options: dict = OPTIONS) -> list[dict]:
    """Each option for each recipe, on one process, beside the plain loop with the same flags (an EMA is no part of
    it: the options that differ by --ema alone share one plain loop)."""
    rows = []
    for name in names:
        plain_loops = {}
        for option, (flags, config) in options.items():
            precision = "bf16" if config == "cpu_bf16" else "no"
            plain_flags = [*data_flags, *flags[:flags.index("--ema")], *flags[flags.index("--ema") + 2:]] \
                if "--ema" in flags else [*data_flags, *flags]
            key = (precision, *plain_flags)
            if key not in plain_loops:
                plain_loops[key] = steady(count_plain_loop(name, plain_flags, precision))
            counts = steady(count_recipe(name, [*data_flags, *flags], precision))
            rows.append(row(name, option, counts, plain_loops[key]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("ops", "plain_ops")}), file=sys.stderr,
                  flush=True)
    return rows


def two_processes(name: str, data_flags: list[str], env: dict | None = None) -> dict:
    """The recipe on 2 CPU processes (gloo), each counting its own steps (`--worker`): the main process's row."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "counts.json"
        command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                   str(ROOT / "accelerate_configs" / "2gpu.yaml"), __file__, "--worker", name, "--json", str(out),
                   "--", *data_flags]
        result = subprocess.run(command, env=dict(env or os.environ, ACCELERATE_USE_CPU="true"), capture_output=True,
                                text=True)
        if not out.exists():
            raise RuntimeError(f"2 processes of {name}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


def worker(name: str, flags: list[str], out: Path) -> None:
    """One process of several: the recipe, then the plain loop in DDP. The processes agree on a stop at their own
    cadence (shared/checkpoints.py: a gather and two reads about once a second); here, after the first two steps
    only, since these slow counted steps would otherwise agree at every one, and the steps after an agreement are
    left out (an agreement falls between two optimizer steps)."""
    from shared import checkpoints

    agreements, agree = [], checkpoints.StopOnSignals._agree

    def counted_agreement(self, step, due):
        agreements.append(step)
        return agree(self, step, due)

    checkpoints.StopOnSignals._agree, checkpoints.STOP_CHECK_S = counted_agreement, 1e9
    main_process = PartialState().is_main_process  # starts the process group: the plain loop's DDP needs it
    plain = steady(count_plain_loop(name, flags, ddp=True))  # first: the recipe's end_training ends the group
    counts = steady(count_recipe(name, flags), leave_out={step + 1 for step in agreements})
    if main_process:
        out.write_text(json.dumps(row(name, "2 processes", counts, plain)))


def table(rows: list[dict]) -> str:
    lines = ["| recipe | option | ATen ops (plain loop) | ratio | kernels (plain loop) | scalar reads (plain loop) | "
             "device syncs (plain loop) | copies to the device |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['option']} | {r['aten_ops']} ({r['plain_aten_ops']}) | "
                     f"{r['aten_ops'] / r['plain_aten_ops']:.2f} | {r['kernels']} ({r['plain_kernels']}) | "
                     f"{r['scalar_reads']} ({r['plain_scalar_reads']}) | {r['device_syncs']} "
                     f"({r['plain_device_syncs']}) | {r['copies_to_device']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--data", default=None, help="a data folder for every recipe (default: --synthetic)")
    parser.add_argument("--batch_size", type=int, default=None, help="default: each recipe's own")
    parser.add_argument("--no_two_processes", dest="two_processes", action="store_false")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--worker", choices=RECIPES, help=argparse.SUPPRESS)
    args, flags = parser.parse_known_args()  # the flags after --worker's recipe are the recipe's own
    if args.worker:
        worker(args.worker, [f for f in flags if f != "--"], Path(args.json))
        return
    if flags:  # parse_known_args ignored them: a mistyped flag measured the defaults instead
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    data_flags = (["--data", args.data] if args.data else ["--synthetic"]) + (
        ["--batch_size", str(args.batch_size)] if args.batch_size else [])
    rows = measure(args.recipes, data_flags)
    if args.two_processes:
        rows += [two_processes(name, data_flags) for name in args.recipes]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
