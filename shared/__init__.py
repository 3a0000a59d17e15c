"""What every recipe repeats, one job per module (what only sweeps, benchmarks, the runs table and new projects use is
in tools/, outside the recipes' path). A recipe imports the first eight; the last fourteen are opt-in, imported inside
the function that needs them:

- config: flags from the Config dataclass, a field's comment its --help
- data: datasets and published files -> uint8 tensors, decoded once and cached; a split served a batch at a time,
  in the resumable epoch order
- images: one image file decoded, images converted to the recipe's channels and size
- augment: whole-batch augmentation on the device (crops, a random resized crop, flips)
- loop: the learning rate as a function of the step; the training step captured once as a CUDA
  graph and replayed (on one GPU); the device's settings (the CPU allocator; TF32, cuDNN, the data on the GPU)
- tracking: the run folder, wandb, readable run files, the training window
- checkpoints: full-state checkpoints, the run's progress, model.safetensors, a stop on SIGTERM, Ctrl-C or
  SIGHUP with a checkpoint and the command that continues the run
- errors: one-line errors, a write that no crash breaks
- launch: the launch's settings checked before the process group starts; on a CPU, a line where a GPU was meant or
  bf16 would be emulated (opt-in: imported where a run opens)
- failures: a failed run's error in one line, where it is not the recipe's own (a full disk, a process limit,
  memory, a package not installed, a torchvision built for another torch, another process): opt-in, imported where
  a run fails
- bounds: the free memory, what a dataset may take decoded or resized, its classes and labels checked, datasets' cache
  and the decode cache that cannot be written, a hub that cannot provide a dataset, and a folder's walk that no depth
  breaks (opt-in: imported where images are decoded or their labels checked, where a load or a write failed, and where
  a folder from anywhere is walked)
- dataset_files: IDX files and CIFAR's binary and Python versions, read as published, and a folder of datasets'
  formats, read once checked (the bounds on a dataset file's size and a parquet file's decompressed size) (opt-in:
  imported for local data)
- image_files: an image file from anywhere (a regular file, a PNG, a JPEG), checked before PIL opens it (opt-in:
  imported where an image file is decoded)
- pickles: a CIFAR pickle or a file for torch.load from anywhere, checked before it is unpickled (opt-in)
- pictures: curves.png and the confusion matrix, with matplotlib, and metrics.jsonl's rows read back, bounded (opt-in:
  imported where one is drawn or a resume cuts the file back)
- resume: everything --resume does: the flags it continues with, the checkpoint it names, checked and loaded, what
  changed since it, the run's files cut back to it or set aside, and a branch from an older one; the command that
  continues a run a signal stopped; and a folder that already holds files, checked as a run to resume or replace
  (opt-in)
- nodes: on several machines, the check that every node sees the run's folders (opt-in)
- synthetic: the generated stand-in of --synthetic (opt-in)
- init_from: --init_from's model.safetensors loaded into a new run; finetune.py's pretrained file, torchvision's,
  read from its cache and loaded; and weights from elsewhere checked against the model (opt-in: also where
  finetune.py and predict.py load weights)
- tensorboard_tracker: accelerate's TensorBoard tracker for --tracker tensorboard (opt-in)
- ema: --ema's average of the weights, updated as a function of the step (opt-in)
- reinstall: a torchvision built for another torch, and the command that installs the one built for this torch
  (opt-in: imported where a run opens, and where an import of torchvision failed)
"""
