"""Command-line flags generated from a recipe's Config dataclass.

Every field becomes `--field_name`, and the comment written after the field is its `--help`
text, so a default, its unit and its meaning sit on one line in the recipe:

    batch_size: int = 256  # images per process per step

Booleans become `--flag / --no-flag`, `Literal[...]` fields get their choices, and
`X | None = None` fields are optional.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Literal

# RunConfig's own rules; a recipe checks the fields it adds in its own __post_init__.
POSITIVE = ("epochs", "batch_size", "grad_accum", "lr", "max_grad_norm", "max_steps", "log_every", "keep_checkpoints")
NON_NEGATIVE = ("seed", "checkpoint_every")


@dataclass
class RunConfig:
    """Flags every recipe shares (../shared/RECIPES.md): what it trains on, how long and in what batches, and
    how a run is fed, stopped, saved, resumed and tracked. A recipe redeclares a field to set its own default;
    these are the only fields shared/ reads."""

    data: str = ""  # hub id, or a local save_to_disk / parquet / imagefolder folder
    epochs: int = 10  # passes over the training set
    batch_size: int = 128  # images per process per step; global batch = batch_size x processes x grad_accum
    grad_accum: int = 1  # batches whose gradients are summed into one optimizer step
    lr: float = 0.1  # peak learning rate of the one-cycle schedule
    max_grad_norm: float = 1.0  # clip the gradient's global L2 norm to this before each step; inf: only measure it
    synthetic: bool = False  # train on generated data with the real shapes and classes (offline)
    max_steps: int | None = None  # optimizer steps to run; wins over --epochs
    seed: int = 0  # seeds Python, NumPy and torch, and fixes the shuffling order
    output_dir: str | None = None  # run folder; default runs/<recipe>-<YYYYmmdd-HHMMSS>
    overwrite: bool = False  # allow a new run in a folder that already holds one
    log_every: int | None = None  # optimizer steps between train_loss / lr / grad_norm points; default: ~100 a run
    checkpoint_every: int = 0  # optimizer steps between full-state checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # newest full-state checkpoints kept on disk
    resume: str | None = None  # `latest` or a checkpoints/step_<N> folder to continue from
    eval_only: bool = False  # evaluate --weights on the test split, no training
    weights: str | None = None  # weights for --eval_only: .safetensors, .pt/.pth or a checkpoint folder
    tracker: Literal["wandb", "tensorboard", "none"] = "wandb"  # wandb is offline without an API key
    compile: bool = False  # torch.compile the model (GPU; the first steps are slow while it compiles)
    channels_last: bool = False  # NHWC memory layout for convolutions (GPU, faster with mixed precision)
    data_on_device: bool = False  # hold the whole uint8 dataset in GPU memory: no host-to-GPU copy per batch
    auto_batch_size: bool = False  # halve --batch_size until a training step fits in memory (all processes agree)

    def __post_init__(self):
        for name in POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"--{name} must be >= 0, got {value}")
        if self.eval_only and not self.weights:
            raise ValueError("--eval_only needs --weights PATH (a model.safetensors, .pt file or checkpoint folder)")
        if self.eval_only and self.resume:
            raise ValueError("--eval_only and --resume do not go together: evaluate --weights, or resume training")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, not a usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_config(cls: type, argv: list[str] | None = None):
    """Build `cls` from the command line (or `argv`): one flag per dataclass field."""
    module_doc = sys.modules[cls.__module__].__doc__ or ""
    parser = OneLineParser(
        description=module_doc.strip().split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # `--lr` must not silently match `--lr_scaling`
    )
    hints = typing.get_type_hints(cls)
    helps = field_comments(cls)
    # The fields the recipe's Config declares (its own, and shared ones it gives a default) first: they are
    # what a user tunes.
    declared = {name for klass in cls.__mro__ if klass is not RunConfig
                for name in vars(klass).get("__annotations__", {})}
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name not in declared)
    for field in fields:
        kind, optional = _unwrap_optional(hints[field.name])
        kwargs = {"default": field.default, "help": helps.get(field.name, "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kwargs.update(choices=typing.get_args(kind), type=type(typing.get_args(kind)[0]))
        else:
            kwargs.update(type=kind, metavar=kind.__name__.upper())
        parser.add_argument(f"--{field.name}", **kwargs)
    args = parser.parse_args(argv)
    try:
        return cls(**vars(args))
    except ValueError as error:
        parser.error(str(error))


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `# comment` after it in the class source (base classes included)."""
    comments = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tokens = list(tokenize.generate_tokens(io.StringIO(inspect.getsource(klass)).readline))
        field_on_line = {
            tok.start[0]: tok.string
            for tok, nxt in zip(tokens, tokens[1:])
            if tok.type == tokenize.NAME and nxt.string == ":" and tok.string in klass.__dataclass_fields__
        }
        for tok in tokens:
            if tok.type == tokenize.COMMENT and tok.start[0] in field_on_line:
                comments[field_on_line[tok.start[0]]] = tok.string.lstrip("#").strip()
    return comments


def _unwrap_optional(hint):
    """`int | None` -> (int, True); `int` -> (int, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False
