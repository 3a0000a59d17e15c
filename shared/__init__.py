"""What every recipe repeats: flags, data, run files, checkpoints and launch checks.

Each module has one job:
    config       the Config dataclass -> command-line flags
    data         datasets (hub, local folders, synthetic) -> uint8 tensors; the resumable epoch order
    augment      whole-batch image augmentation on the device
    schedule     the learning rate as a function of the step
    tracking     run folder, config.json, metrics.jsonl, summary.json, curves.png, wandb, TensorBoard
    pictures     confusion matrix and misclassified images at the end of a run
    checkpoints  full-state checkpoints, resume, preemption, portable weights loading
    errors       one-line errors and launch checks

What only sweeps, benchmarks and the runs table use is in tools/, outside the recipes' import path.
"""
