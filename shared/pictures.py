"""Pictures of a classifier's test results: a confusion matrix and the images it got wrong.

`save_pictures` writes confusion_matrix.png and misclassified.png into the run folder and logs
both to the run's tracker (wandb or TensorBoard). Predictions come from `gather_for_metrics`,
which keeps the test set's order, so prediction i belongs to test image i.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def save_pictures(accelerator, run_dir: Path, test_set, predictions: torch.Tensor, step: int) -> None:
    if not accelerator.is_main_process:
        return
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    pictures = {"confusion_matrix": confusion_figure(test_set.labels, predictions, test_set.classes),
                "misclassified": misclassified_figure(test_set, predictions)}
    for name, figure in pictures.items():
        figure.savefig(Path(run_dir) / f"{name}.png", dpi=100)
        figure.canvas.draw()
        pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3) uint8
        for tracker in accelerator.trackers:
            if tracker.name == "wandb":
                tracker.log_images({name: [pixels]}, step=step)
            elif tracker.name == "tensorboard":
                tracker.log_images({name: pixels[None]}, step=step, dataformats="NHWC")
        matplotlib.pyplot.close(figure)


def confusion_figure(labels: torch.Tensor, predictions: torch.Tensor, classes: list[str]):
    """Rows: true class; columns: predicted class; each row as fractions of that class."""
    import matplotlib.pyplot as plt

    k = len(classes)
    counts = torch.bincount(labels * k + predictions, minlength=k * k).reshape(k, k).double()
    fractions = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()
    size = 4 + 0.5 * min(k, 20)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    if k <= 20:  # readable names and numbers; 100 classes would only be noise
        ax.set_xticks(range(k), classes, rotation=90)
        ax.set_yticks(range(k), classes)
        for i in range(k):
            for j in range(k):
                if counts[i, j]:
                    ax.text(j, i, f"{fractions[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if fractions[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true",
           title=f"confusion matrix: {int(counts.trace())} of {int(counts.sum())} right")
    fig.tight_layout()
    return fig


def misclassified_figure(test_set, predictions: torch.Tensor, count: int = 24):
    """The first `count` test images the model got wrong, titled true -> predicted."""
    import matplotlib.pyplot as plt

    wrong = (predictions != test_set.labels).nonzero().flatten()[:count].tolist()
    columns = 8
    rows = max(1, -(-len(wrong) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2 * columns, 2.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, index in zip(axes.flat, wrong):
        image = test_set.images[index].permute(1, 2, 0).numpy()
        ax.imshow(image[..., 0] if image.shape[2] == 1 else image, cmap="gray" if image.shape[2] == 1 else None)
        true, predicted = test_set.classes[test_set.labels[index]], test_set.classes[predictions[index]]
        ax.set_title(f"{true}\n-> {predicted}", fontsize=8)
    fig.suptitle(f"misclassified test images: {len(wrong)} shown of {int((predictions != test_set.labels).sum())}")
    fig.tight_layout()
    return fig
