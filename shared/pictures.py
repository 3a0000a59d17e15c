"""[shared/pictures.py]
The run's pictures, drawn with matplotlib: curves.png (RunFiles.finish) and the confusion matrix (`save_pictures`);
and metrics.jsonl's rows read back, bounded (`read_rows`: for curves.png, and for a resume that cuts the file back to
its checkpoint). An opt-in module: imported where a picture is drawn or the rows are read.
"""

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from shared.errors import RecipeError, printable, replacing

COLOURS = {"train": "C0", "eval": "C1", "grad": "C2"}  # matplotlib's first three: blue, orange, green
STYLES = ("-", "--", ":", "-.")
MAX_POINTS = 10_000  # of a curve: more than a picture 1,500 pixels wide shows (a metrics.jsonl may hold millions)
MAX_MATRIX_CLASSES = 1_000  # above, a confusion matrix is no picture to read, and 10^5 classes take 80 GB
MAX_ROW_BYTES = 2**20  # one line of metrics.jsonl: a few hundred bytes as a run writes them
# Keys of metrics.jsonl read back (curves, a resume's summary): a run logs a few dozen, and a file from anywhere
# may name a million, one a row (drawn, as many series: a 39 MB file took 0.25 GB more than a run's)
MAX_KEYS = 100


def is_point(row: dict) -> bool:
    """A training or an evaluation point of a curve; not the summary, logged once at the end with one value a key."""
    return "train_loss" in row or "eval_loss" in row


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def label(name: str) -> str:
    """A run's or a class's name as matplotlib draws it: control characters escaped, and `$` a dollar sign, never the
    start of a formula (an unbalanced one would stop the drawing). A character its font has no glyph for (狗 in
    matplotlib's own DejaVu Sans) is written as its escape, \\u72d7: it was drawn as an empty box, and matplotlib
    warned of it at each run's end."""
    from matplotlib import font_manager, ft2font

    font = ft2font.FT2Font(font_manager.findfont(font_manager.FontProperties()))  # matplotlib's default
    return "".join(c if font.get_char_index(ord(c)) else c.encode("unicode_escape").decode()
                   for c in printable(name).replace("$", r"\$"))


def plot_curves(rows: Iterable[dict], path: Path, title: str) -> None:
    """Loss, the recipe's metrics (train and eval) and the gradient norm against the optimizer step, with the epoch
    above and each resume marked. One pass over the rows, keeping only the numbers drawn. One colour a series in every
    panel (train blue, eval orange), a line style a metric; evaluations as dots over the training curves."""
    series, metrics, seen, stride, resumed = defaultdict(list), set(), Counter(), defaultdict(lambda: 1), []
    for row in rows:
        if row.get("resumed") is True and len(resumed) < MAX_POINTS:  # the row a resume writes (tracking.RunFiles)
            resumed.append(row["step"])
        for key, value in row.items():
            if ((key.startswith(("train_", "eval_", "grad_norm")) or key == "epoch") and type(value) in (int, float)
                    and (key in seen or len(seen) < MAX_KEYS)):
                if seen[key] % stride[key] == 0:  # memory for MAX_POINTS a series, whatever the file's length
                    series[key].append((row["step"], value))
                    if len(series[key]) > 2 * MAX_POINTS:  # every other point: the same curve, half the points
                        del series[key][1::2]
                        stride[key] *= 2
                seen[key] += 1
                # train_<name> and eval_<name> of each of metric_sums, from the training and evaluation points: not
                # the summary's train_s (the run's training time), which is no metric
                if (is_point(row) and key.startswith(("train_", "eval_")) and "loss" not in key
                        and key != "eval_samples"):
                    metrics.add(key)
    names = sorted({key.split("_", 1)[1] for key in metrics})  # acc, top5, ...: a line style each
    steps, epochs = map(np.array, zip(*series["epoch"])) if series["epoch"] else ([], [])
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ordered = sorted(metrics, key=lambda k: (k.split("_", 1)[1], k.startswith("eval")))  # train_acc, eval_acc, ...
    panels = (("train_loss", "eval_loss"), ordered, ("grad_norm",))
    for ax, keys, ylabel in zip(axes, panels, ("loss", "metric (a fraction)", "gradient L2 norm, before clipping")):
        for key in keys:
            if series[key]:
                name, evaluation = key.split("_", 1)[1], key.startswith("eval")
                ax.plot(*zip(*series[key]), color=COLOURS[key.split("_")[0]], label=key, zorder=3 if evaluation else 2,
                        linestyle=STYLES[names.index(name) % len(STYLES)] if name in names else "-",
                        marker="o" if evaluation else None, markersize=5)
        for n, step in enumerate(resumed):
            ax.axvline(step, color="grey", linestyle=":", label=None if n else "resumed")
        ax.set(xlabel="optimizer step", ylabel=ylabel, ylim=(0, 1) if ylabel.startswith("metric") else None)
        if len(steps) > 1 and (np.diff(steps) > 0).all() and (np.diff(epochs) > 0).all():  # an axis needs both rising
            ax.secondary_xaxis("top", functions=(lambda s: np.interp(s, steps, epochs),
                                                 lambda e: np.interp(e, epochs, steps))).set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    fig.suptitle(label(title))
    fig.tight_layout()
    with replacing(path) as partial:
        fig.savefig(partial, dpi=100, format="png")
    plt.close(fig)


def save_pictures(accelerator, run_dir: Path, test_set, predictions: torch.Tensor, step: int) -> None:
    """confusion_matrix.png in the run folder, and as an image in wandb or TensorBoard. `gather_for_metrics` keeps
    the test set's order, so prediction i belongs to test image i."""
    if not accelerator.is_main_process or len(test_set.classes) > MAX_MATRIX_CLASSES:
        return
    plt = pyplot()
    # On the CPU whatever device each came from (--data_on_device keeps the test set on the GPU), for NumPy and PNGs.
    labels, predictions, k = test_set.labels.cpu(), predictions.cpu(), len(test_set.classes)
    counts = torch.bincount(labels * k + predictions, minlength=k * k).reshape(k, k).double()
    fractions = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()  # rows: true class
    figure, ax = plt.subplots(figsize=(4 + 0.5 * min(k, 20),) * 2)
    ax.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    if k <= 20:  # readable names and numbers; 100 classes would only be noise
        names = [label(name) for name in test_set.classes]
        ax.set_xticks(range(k), names, rotation=90)
        ax.set_yticks(range(k), names)
        for (i, j), fraction in np.ndenumerate(fractions):
            if counts[i, j]:
                ax.text(j, i, f"{fraction:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if fraction > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=f"confusion matrix: {int(counts.trace())} of {len(labels)} right")
    figure.tight_layout()  # the class names need it
    figure.canvas.draw()  # drawn once: the PNG and the trackers' image are these pixels (savefig would draw again)
    pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3) uint8
    plt.close(figure)
    with replacing(run_dir / "confusion_matrix.png") as partial:
        Image.fromarray(pixels).save(partial, format="PNG")
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.log_images({"confusion_matrix": [pixels]}, step=step)
        elif tracker.name == "tensorboard":
            tracker.log_images({"confusion_matrix": pixels[None]}, step=step, dataformats="NHWC")


def read_rows(path: Path) -> Iterator[dict]:
    """metrics.jsonl's rows, one at a time (memory: one row, whatever the file's size). A run folder may come from
    anywhere: a line that is not a JSON object with an integer step, or is over MAX_ROW_BYTES, is one error line."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line) if len(line) <= MAX_ROW_BYTES else None
            except (ValueError, RecursionError):
                row = None
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                raise RecipeError(f"{path} line {number} is not a metrics row (a JSON object with an integer step, "
                                  f"under {MAX_ROW_BYTES // 2**20} MiB): remove the line, or start a new --output_dir")
            yield row
