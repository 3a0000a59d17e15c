"""Where a run's start goes, phase by phase: what `start_s` (summary.json: from the command to the first step) is made
of on this machine, for the ResNet recipe in the README's GPU setting. Each part is timed in new processes, as a
user's run pays it:

- `interpreter_s`: a bare `python -c pass`, from the command to its exit;
- `launcher_s`: `accelerate launch --config_file CONFIG` of a script whose first line reads the clock, from the
  command to that line: the launcher's own imports and its second interpreter, before the recipe's first line;
- in one new process that starts as the recipe does, each phase in the order the recipe meets it:
  `import_torch_s`; `import_recipe_s` (the recipe's module and what it imports of shared/, accelerate, torchvision);
  `device_s` (the Accelerator, and one kernel run and waited for: CUDA's set-up on a GPU); `data_s` (the decoded
  data read from its cache, and moved to the device where the recipe would: the decode itself, if the cache was
  empty, is `decoded`); `model_s` (built and moved to the device); `dynamo_import_s` (torch._dynamo, which the first
  optimizer imports); `prepare_s` (the optimizer and accelerator.prepare); `first_step_s` (one batch's forward,
  backward and optimizer step, waited for: the first kernels, cuDNN's and cuBLAS's set-up); `second_step_s` (the same
  again: what a step costs once set up).

benchmarks/gpu_speed.py runs it (its `start` entry); on its own:
    python benchmarks/start_cost.py --config accelerate_configs/bf16.yaml --fashion_mnist DIR     # prints the JSON
    python benchmarks/start_cost.py --config accelerate_configs/cpu.yaml --fashion_mnist DIR --batch_size 8
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before any import: the probe's phases count from here

import argparse  # noqa: E402 (after the clock: the imports are what is measured)
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def probe(fashion_mnist: str, batch_size: int) -> dict:
    """In this new process: the phases of a start, each timed where the recipe meets it."""
    marks, last = {}, STARTED

    def mark(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        marks[name], last = now - last, now

    import torch

    mark("import_torch_s")
    sys.path.insert(0, str(ROOT))
    from accelerate import Accelerator

    recipe = importlib.import_module("recipes.resnet18_fmnist")
    from shared import data, loop

    mark("import_recipe_s")
    cfg = recipe.Config.parse(["--data", fashion_mnist, "--batch_size", str(batch_size), "--tracker", "none"])
    accelerator = Accelerator()
    loop.device_settings(accelerator, cfg)
    torch.ones(1, device=accelerator.device).add_(1).cpu()  # one kernel, waited for
    mark("device_s")
    cached = set(data.CACHE_DIR.glob("*.safetensors"))
    train_set, test_set = recipe.load_data(cfg)
    decoded = bool(set(data.CACHE_DIR.glob("*.safetensors")) - cached)  # the cache was made here: a decode
    if loop.data_on_device(accelerator.device, cfg.data_on_device, train_set, test_set):
        train_set, test_set = train_set.to(accelerator.device), test_set.to(accelerator.device)
    mark("data_s")
    model = recipe.make_model(len(train_set.classes), cfg).to(accelerator.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    mark("model_s")
    import torch._dynamo  # noqa: F401 (what the first optimizer imports: timed alone)

    mark("dynamo_import_s")
    optimizer = recipe.make_optimizer(model, cfg, cfg.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    mark("prepare_s")
    images, labels = (tensor.to(accelerator.device) for tensor in train_set.__getitems__(list(range(batch_size))))
    for name in ("first_step_s", "second_step_s"):
        inputs = recipe.preprocess(images, True)
        if cfg.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        loss = recipe.loss_fn(model(inputs), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss.item()  # waited for
        mark(name)
        if name == "first_step_s":
            marks["to_first_step_s"] = time.perf_counter() - STARTED  # from this script's first line
    return {**marks, "decoded": decoded, "device": str(accelerator.device),
            "mixed_precision": accelerator.mixed_precision, "batch_size": batch_size}


def run(command: list[str], env: dict) -> str:
    """`command`'s standard output; a failure raises with the end of what it printed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def measure(config: str, fashion_mnist: str, batch_size: int) -> dict:
    """The three parts, each in new processes of this Python."""
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_MIXED_PRECISION"}  # the config's
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "first_line.py"  # writes the time.time() of its first line
        script.write_text("import sys, time\nopen(sys.argv[1], 'w').write(repr(time.time()))\n")
        stamp = Path(folder) / "stamp"
        before = time.time()
        run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, str(script), str(stamp)],
            env)
        launcher_s = float(stamp.read_text()) - before
    start = time.perf_counter()
    run([sys.executable, "-c", "pass"], env)
    interpreter_s = time.perf_counter() - start
    # The probe in a process of its own, launched as a run is (the config's precision, threads and device)
    printed = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, __file__, "--probe",
                   "--fashion_mnist", fashion_mnist, "--batch_size", str(batch_size)], env)
    found = json.loads(printed.strip().splitlines()[-1])
    return {"config": Path(config).name, "interpreter_s": interpreter_s, "launcher_s": launcher_s, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "accelerate_configs" / "bf16.yaml"))
    parser.add_argument("--fashion_mnist", required=True, help="the real Fashion-MNIST's IDX files")
    parser.add_argument("--batch_size", type=int, default=512, help="the README's GPU line's")
    parser.add_argument("--probe", action="store_true", help="(internal) the phases, in this process")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.fashion_mnist, args.batch_size)), flush=True)
    else:
        print(json.dumps(measure(args.config, args.fashion_mnist, args.batch_size), indent=1))


if __name__ == "__main__":
    main()
