"""What every recipe repeats, one job per module (what only sweeps, benchmarks, the runs table and new projects use is
in tools/, outside the recipes' path):

- config: flags from the Config dataclass, a field's comment its --help
- data: datasets and published files -> uint8 tensors, decoded once and cached; a split served a batch at a time,
  in the resumable epoch order
- dataset_files: IDX files and CIFAR's binary and Python versions, read as published (opt-in: imported for a folder)
- images: one image file decoded, images converted to the recipe's channels and size
- limits: what a file from anywhere may claim (free memory, file, decoded and decompressed sizes), a folder's walk
- pickles: a CIFAR pickle or a file for torch.load from anywhere, checked before it is unpickled (opt-in)
- augment: whole-batch augmentation on the device
- schedule: the learning rate and the EMA's decay as functions of the step
- graphs: the training step captured once as a CUDA graph and replayed (on one GPU)
- tracking: the run folder, wandb and TensorBoard, readable run files and pictures, the training window
- checkpoints: full-state checkpoints, the run's progress, model.safetensors, --init_from
- stopping: a stop on SIGTERM or Ctrl-C with a checkpoint, and the command that continues the run
- resume: which checkpoint --resume names, and what a resume changes
- speed: the device's settings (the CPU allocator; TF32, cuDNN, the data on the GPU)
- errors: one-line errors and the launch checks
"""
