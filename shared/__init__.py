"""What every recipe repeats, one job per module: config (flags from the Config dataclass), data and dataset_files
(datasets and published files -> uint8 tensors), batches (a split in memory; the resumable epoch order), augment
(whole-batch augmentation on the device), schedule (the learning rate and the EMA's decay as functions of the step),
tracking (run folder, wandb/TensorBoard, readable run files), diagnostics (pictures), checkpoints and resume (save,
resume, preemption, weights files), memory (the CPU allocator setting), errors (one-line errors, launch checks).
What only sweeps, benchmarks, the runs table and new projects use is in tools/, outside the recipes' path."""
