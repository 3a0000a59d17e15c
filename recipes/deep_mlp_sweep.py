"""How much memory gradient checkpointing saves on the 72-layer MLP of deep_mlp_ckpt.py, and what it costs.

For every segment count k, at --batch and at the seed's batch of 16: the bytes autograd holds for
backward (counted with saved_tensors_hooks, so on any device), the segment rebuilt during backward,
the median step time, and on CUDA where the peak memory goes. Ratios are to no checkpointing,
measured in the same run. Writes sweep.md, sweep.csv and sweep.png.

Results: see the header of deep_mlp_ckpt.py and README.md ("What gradient checkpointing saves").

Run it (from the repository root; one process, the precision of the config):
  python recipes/deep_mlp_sweep.py
  accelerate launch -q --config_file accelerate_configs/1gpu.yaml recipes/deep_mlp_sweep.py --ckpt blocks
"""

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ and tools/ without installing them
from recipes.deep_mlp_ckpt import WIDTH, DeepMLP, make_model, make_optimizer
from recipes.deep_mlp_ckpt import Config as RecipeConfig
from shared.checkpoints import new_folder
from shared.config import parse_config
from shared.errors import RecipeError, one_line_errors
from tools.measure import median_step_ms, memory_breakdown
from tools.report import markdown_table, write_report


@dataclass
class Config:
    ckpt: Literal["sequential", "blocks"] = "sequential"  # checkpoint_sequential, or checkpoint() per block of layers
    batch: int = 1024  # samples per step: large enough for activations to matter (the seed's 16 is measured too)
    repeats: int = 3  # timed steps per row, after one warm-up step; the median is reported
    segments: str = "1,2,3,4,6,8,9,12,18,24,36,72"  # segment counts to measure, comma-separated (and always none)
    seed: int = 0  # seeds the model and the random inputs
    output_dir: str | None = None  # default runs/deep_mlp_sweep-<YYYYmmdd-HHMMSS>

    def __post_init__(self):
        if self.batch < 1 or self.repeats < 1:
            raise ValueError(f"--batch and --repeats must be > 0, got {self.batch} and {self.repeats}")
        if not all(k.strip().isdigit() and 1 <= int(k) <= 72 for k in self.segments.split(",")):
            raise ValueError(f"--segments takes comma-separated counts from 1 to 72, got {self.segments!r}")
        if not 0 <= self.seed < 2**32:  # what NumPy's seed takes (accelerate's set_seed): a traceback otherwise
            raise ValueError(f"--seed must be from 0 to 2**32 - 1, got {self.seed}")


def saved_bytes(fn, x: torch.Tensor, model: nn.Module) -> int:
    """Bytes that autograd keeps for backward while `fn(x)` runs forward, parameters excluded.

    Counted with saved_tensors_hooks, so it works on any device. Inside a checkpointed segment
    nothing is kept; the segment's input is, and it is counted."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:  # a storage saved by several ops counts once
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn(x)
    output.float().sum().backward()  # runs backward, which frees what was saved
    return sum(saved.values())


def measure(model: DeepMLP, optimizer, x, labels, segments: int | None, mode: str, repeats: int) -> dict:
    """One sweep row: memory held for backward, the segment rebuilt during backward, step time."""
    model.ckpt, model.segments = ("none", 1) if segments is None else (mode, segments)
    held = saved_bytes(model, x, model)
    recomputed = 0  # one segment's activations, rebuilt during backward (sequential never rebuilds its last)
    if segments is not None and (mode == "blocks" or segments > 1):
        size = len(model.layers) // segments if mode == "sequential" else math.ceil(len(model.layers) / segments)
        recomputed = saved_bytes(model.layers[:size], x, model)

    def step():
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: a fixed part of the breakdown
        F.cross_entropy(model(x), labels).backward()
        optimizer.step()

    row = {"segments": "none" if segments is None else segments, "saved_MB": held / 2**20,
           "recomputed_MB": recomputed / 2**20, "step_ms": median_step_ms(step, x.device, repeats)}
    return row | memory_breakdown(step, model, optimizer, x.device)  # on CUDA: where the peak goes


def sweep(cfg: Config) -> None:
    from shared.launch import check_launch  # the launch's settings, checked: an opt-in module

    check_launch()
    accelerator = Accelerator()
    if accelerator.num_processes > 1:
        raise RecipeError("the sweep measures a single process: launch it with cpu.yaml, 1gpu.yaml or bf16.yaml")
    out = Path(cfg.output_dir or new_folder(f"runs/deep_mlp_sweep-{time.strftime('%Y%m%d-%H%M%S')}"))
    try:
        out.mkdir(parents=True, exist_ok=True)
        filled = any(out.iterdir())
    except OSError as error:
        raise RecipeError(f"cannot write to {out} ({error.strerror}): pass --output_dir a writable folder, not a file "
                          "or a path inside one") from None
    if filled:  # an earlier sweep's files, or your own: never replaced
        raise RecipeError(f"{out} already holds files, which a sweep would replace: pass a new or empty --output_dir")
    set_seed(cfg.seed)
    model = make_model(100, RecipeConfig()).to(accelerator.device)
    optimizer = make_optimizer(model, RecipeConfig())
    with accelerator.autocast():  # the precision the config asks for, as in training
        rows = []
        for batch in dict.fromkeys((cfg.batch, 16)):  # --batch 16 is measured once
            try:
                x = torch.randn(batch, WIDTH, device=accelerator.device)
                labels = torch.randint(100, (batch,), device=accelerator.device)
                batch_rows = [{"batch": batch, **measure(model, optimizer, x, labels, k, cfg.ckpt, cfg.repeats)}
                              for k in [None, *(int(k) for k in cfg.segments.split(","))]]  # None: no checkpointing
            except (MemoryError, RuntimeError) as error:  # torch's CPU allocator raises a RuntimeError
                if not isinstance(error, (MemoryError, torch.OutOfMemoryError)) and "allocate memory" not in str(error):
                    raise
                # Named here: the recipes' line says --batch_size, a flag the sweep does not have
                said = " ".join(str(error).rpartition("DefaultCPUAllocator: ")[2].split())  # after torch's C++ place
                raise RecipeError(f"out of memory at --batch {batch} ({said[:150]}): lower --batch") from None
            for row in batch_rows:  # ratios to no checkpointing, measured in this same run
                row["saved_x"] = row["saved_MB"] / batch_rows[0]["saved_MB"]
                row["time_x"] = row["step_ms"] / batch_rows[0]["step_ms"]
                row["note"] = "~ sqrt(72)" if row["segments"] == 8 else ""
            accelerator.print(markdown_table(batch_rows))
            rows += batch_rows
    title = (f"# Gradient checkpointing sweep, {cfg.ckpt} mode: {accelerator.device.type}, "
             f"{accelerator.mixed_precision} precision, torch {torch.__version__}")
    write_report(rows, out / "sweep", title, x="segments", ys=["saved_x", "time_x"], group="batch",
                 mark=math.sqrt(len(model.layers)), log_x=True)
    accelerator.print(f"wrote {out}/sweep.md, sweep.csv and sweep.png")


def main() -> None:
    cfg = parse_config(Config)
    with one_line_errors():
        sweep(cfg)


if __name__ == "__main__":
    main()
