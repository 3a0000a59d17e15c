"""What every recipe repeats: flags, data, run files, checkpoints and launch checks.

Each module has one job:
    config       the Config dataclass -> command-line flags
    data         datasets (hub, local folders, synthetic) -> uint8 tensors, batched
    augment      whole-batch image augmentation on the device
    tracking     run folder, config.json, metrics.jsonl, summary.json, curves.png, wandb
    checkpoints  full-state checkpoints, resume, portable weights loading
    errors       one-line errors and launch checks
"""
