"""What a run draws and traces: curves.png (from RunFiles at the end), the confusion matrix and the
misclassified test images (save_pictures), and a torch.profiler trace of a few steps (start_profiler, --profile)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from accelerate.utils import ProfileKwargs
from PIL import Image

from shared.errors import RecipeError

PROFILE_STEPS = {"wait": 5, "warmup": 2, "active": 5}  # --profile: skip 5 optimizer steps, warm up 2, record 5


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    """Loss, the recipe's metrics (train and eval) and the gradient norm against the optimizer step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    metrics = sorted({key for row in rows for key in row if key.startswith(("train_", "eval_")) and "loss" not in key
                      and key != "eval_samples"})  # train_<name> and eval_<name> of each of metric_sums
    for ax, keys, ylabel in zip(axes, (("train_loss", "eval_loss"), metrics, ("grad_norm",)),
                                ("loss", "metric (a fraction)", "gradient L2 norm, before clipping")):
        for key in keys:
            points = [(row["step"], row[key]) for row in rows if key in row and row.get("step") is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=key)
        ax.set(xlabel="optimizer step", ylabel=ylabel, ylim=(0, 1) if keys is metrics else None)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def start_profiler(accelerator, run_dir: Path, steps_left: int) -> torch.profiler.profile:
    """torch.profiler over the optimizer steps of PROFILE_STEPS, counted from this launch's first (the recipe calls
    .step() after each; a resumed run is traced from its 8th step after the checkpoint). Each process
    writes profile/trace_rank<N>.json, a Chrome trace (https://ui.perfetto.dev or chrome://tracing); the main
    process prints the operators that took the most time. accelerate's `accelerator.profile()` is a context
    manager, which would indent the whole loop; this is the same torch.profiler, started and stopped."""
    cuda = accelerator.device.type == "cuda"
    first = PROFILE_STEPS["wait"] + PROFILE_STEPS["warmup"] + 1
    last = first + PROFILE_STEPS["active"] - 1
    steps = f"steps {first}-{last}"
    if steps_left < last:  # a shorter run would end inside the window, and the trace would hold its evaluation
        raise RecipeError(f"--profile traces {steps}, after warm-up; this run has {steps_left} left: raise --max_steps")

    def write(profiler):
        trace = Path(run_dir) / "profile" / f"trace_rank{accelerator.process_index}.json"
        trace.parent.mkdir(exist_ok=True)
        profiler.export_chrome_trace(str(trace))
        if accelerator.is_main_process:
            print(profiler.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                                row_limit=15))
            print(f"profile of {steps} on the main process: {trace}; open it in https://ui.perfetto.dev", flush=True)

    profiler = ProfileKwargs(activities=["cpu", "cuda"] if cuda else ["cpu"], schedule_option={**PROFILE_STEPS,
                             "repeat": 1}, on_trace_ready=write, record_shapes=True).build()  # a torch.profiler
    profiler.start()
    return profiler


def save_pictures(accelerator, run_dir: Path, test_set, predictions: torch.Tensor, step: int) -> None:
    """confusion_matrix.png and misclassified.png in the run folder, and as images in wandb or TensorBoard.
    `gather_for_metrics` keeps the test set's order, so prediction i belongs to test image i."""
    if not accelerator.is_main_process:
        return
    plt = pyplot()
    # On the CPU whatever device each came from (--data_on_device keeps the test set on the GPU), for NumPy and PNGs.
    labels, predictions, classes, k = test_set.labels.cpu(), predictions.cpu(), test_set.classes, len(test_set.classes)
    counts = torch.bincount(labels * k + predictions, minlength=k * k).reshape(k, k).double()
    fractions = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()  # rows: true class
    confusion, ax = plt.subplots(figsize=(4 + 0.5 * min(k, 20),) * 2)
    ax.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    if k <= 20:  # readable names and numbers; 100 classes would only be noise
        ax.set_xticks(range(k), classes, rotation=90)
        ax.set_yticks(range(k), classes)
        for (i, j), fraction in np.ndenumerate(fractions):
            if counts[i, j]:
                ax.text(j, i, f"{fraction:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if fraction > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=f"confusion matrix: {int(counts.trace())} of {len(labels)} right")
    wrong = (predictions != labels).nonzero().flatten()[:24].tolist()  # the first 24 the model got wrong
    rows, (c, h, w) = max(1, -(-len(wrong) // 8)), test_set.images.shape[1:]
    # One image of 8 x rows cells, each with room above for its caption: one Axes, not 24 (both pictures 1.8 -> 0.7 s).
    sheet = torch.full((rows, 8, c, 2 * h, w + w // 8), 255, dtype=torch.uint8)
    misclassified, ax = plt.subplots(figsize=(16, 2.2 * rows))
    for cell, index in enumerate(wrong):
        sheet[cell // 8, cell % 8, :, h:, :w] = test_set.images[index].cpu()
        ax.text((cell % 8 + 0.45) * sheet.shape[-1], (cell // 8 + 0.45) * 2 * h, ha="center", fontsize=8,
                s=f"{classes[labels[index]]}\n-> {classes[predictions[index]]}")
    sheet = sheet.permute(0, 3, 1, 4, 2).reshape(rows * 2 * h, 8 * sheet.shape[-1], c).numpy()
    ax.imshow(sheet[..., 0] if c == 1 else sheet, cmap="gray" if c == 1 else None, vmin=0, vmax=255)
    ax.axis("off")
    ax.set_title(f"misclassified test images: {len(wrong)} shown of {int((predictions != labels).sum())}")
    for name, figure in (("confusion_matrix", confusion), ("misclassified", misclassified)):
        figure.tight_layout()  # the confusion matrix's class names need it
        figure.canvas.draw()  # drawn once: the PNG and the trackers' images are these pixels (savefig draws again)
        pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3) uint8
        Image.fromarray(pixels).save(Path(run_dir) / f"{name}.png")
        for tracker in accelerator.trackers:
            if tracker.name == "wandb":
                tracker.log_images({name: [pixels]}, step=step)
            elif tracker.name == "tensorboard":
                tracker.log_images({name: pixels[None]}, step=step, dataformats="NHWC")
        plt.close(figure)
