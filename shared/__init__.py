"""What every recipe repeats, one job per module: config (flags from the Config dataclass), data (datasets ->
uint8 tensors; the resumable epoch order), augment (whole-batch augmentation on the device), schedule (the
learning rate as a function of the step), tracking (run folder, wandb/TensorBoard, readable run files),
checkpoints (save, resume, preemption, weights files), batch_size (--auto_batch_size), errors (one-line errors,
launch checks). What only sweeps, benchmarks and the runs table use is in tools/, outside the recipes' path."""
