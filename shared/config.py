"""Command-line flags from a Config dataclass: `--field_name` for every field, and the comment after the field is
its `--help`, so default, unit and meaning sit on one line in the recipe. The comments are read from the source file,
as simple-parsing reads them: no second list of help texts to keep in step; without a file (a notebook cell, exec())
the flags work without help. Booleans become `--flag / --no-flag`, `Literal[...]` fields get their choices,
`X | None = None` fields are optional. With --resume, a run continues with its own flags: those its config.json
records, each parsed as if typed, and those given on the command line over them (shared/resume.py's
`recorded_flags`)."""

import argparse
import dataclasses
import difflib
import inspect
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.errors import printable

MAX_JSON_BYTES = 2**24  # a config.json: a few KB, up to about 2 MB with 100,000 class names
MAX_WORDS = 1_000  # a command line's words: a recipe has under 40 flags, of one or two words each


def parse_config(cls: type, argv: list[str] | None = None):
    """Build `cls` from the command line (or `argv`); a bad value is one line and exit status 2."""
    parser = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n\n")[0],
                                     allow_abbrev=False)  # `--lr` must not silently match `--lr_scaling`
    flags = []  # every --flag, for the one a mistyped flag was meant to be (Python 3.14's argparse suggests too)

    def error(message: str):
        typed = re.match(r"unrecognized arguments: ([^\s=]+)", message)  # the first word no flag took
        close = difflib.get_close_matches(typed[1], flags) if typed else []  # best first; `data` too: --data
        # Else a word that is no flag is a value without one: `predict.py --weights RUN photos/`
        suggestion = (f": did you mean {close[0]}?" if close else
                      ": a value follows its flag, as in --name VALUE" if typed and typed[1][0] != "-" else "")
        parser.exit(2, f"{parser.prog}: error: {printable(where + message + suggestion)} (see --help)\n")

    where = ""  # while the flags a run's config.json records are parsed: the file they come from

    parser.error = error
    helps = {}  # field -> the comment after it, base classes first so the recipe's own comments win
    for klass in reversed(cls.__mro__):
        try:  # the class's lines in its file: a recipe run from a notebook cell or exec() has none, and no help
            source = inspect.getsource(klass) if dataclasses.is_dataclass(klass) else ""
        except (OSError, TypeError):
            source = ""
        helps.update(re.findall(r"^\s+(\w+): [^#\n]*#\s*(.*)$", source, re.M))
    # What the recipe's Config declares (its own fields and the shared ones it gives a default) first.
    declared = {name for klass in cls.__mro__ if klass not in (RunConfig, object)
                for name in vars(klass).get("__annotations__", {})}
    hints = typing.get_type_hints(cls)
    for field in sorted(dataclasses.fields(cls), key=lambda f: f.name not in declared):
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None` -> int
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        # The default, where there is one: a None's or an empty string's meaning is the comment's ("default: ~100 a
        # run", not "None"; "(default: )")
        default = "" if field.default in (None, "") else " (default: %(default)s)"
        kwargs = {"default": field.default, "help": helps.get(field.name, "") + default}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kwargs.update(choices=typing.get_args(kind), type=type(typing.get_args(kind)[0]))
        else:
            kwargs.update(type=kind, metavar=kind.__name__.upper())
        parser.add_argument(f"--{field.name}", **kwargs)
        flags.append(f"--{field.name}")

    def parse(words):
        args = vars(parser.parse_args(words))
        for name, value in args.items():  # NaN passes every `< 0` check, and ended as a NaN loss ("lower --lr")
            if isinstance(value, float) and not (math.isfinite(value) or name == "max_grad_norm" and value == math.inf):
                parser.error(f"--{name} must be a finite number, got {value}")
            # `--data "$DATA"` with the variable unset: an empty path is the working folder, read as the dataset
            if value == "" and parser.get_default(name) != "":
                parser.error(f"--{name} is empty (an unset shell variable?): pass a value, or leave the flag out")
            if isinstance(value, str):
                if re.search("[\udc80-\udcff]", value):  # bytes Python could not read as UTF-8
                    parser.error(f"--{name} {value!r} is not UTF-8 (a name in another encoding, which datasets, "
                                 "safetensors and matplotlib refuse): rename it in UTF-8")
                # `--output_dir=~/runs` (one word) reaches here as typed, since no shell expands a ~ after a `=`: a
                # folder named ~ in the working folder, which a later `rm -rf ~` of it would take the home with
                if value.startswith("~/"):
                    args[name] = str(Path(value).expanduser())
        try:
            return cls(**args)
        except ValueError as error:
            parser.error(str(error))

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > MAX_WORDS:  # argparse takes minutes over 100,000 (quadratic), and would list each unknown one
        parser.error(f"{len(argv):,} words on the command line, more than a recipe's flags take ({MAX_WORDS:,})")
    cfg = parse(argv)
    if getattr(cfg, "resume", None):  # a run continues with its own flags (its config.json's), but those given here
        from shared.resume import recorded_flags  # only the runs that resume: an opt-in module

        try:
            recorded, path = recorded_flags(cfg, argv)
        except ValueError as error:
            parser.error(str(error))
        where = f"{path} (the flags --resume continues with): "  # those typed passed above: a bad value is the file's
        cfg = parse([*recorded, *argv])
    return cfg


def read_json(path: Path):
    """A run's JSON file (config.json), or None if missing, not a regular file (a FIFO would block the read), damaged,
    over MAX_JSON_BYTES or nested past Python's recursion limit: a run folder may come from anywhere."""
    try:
        if path.is_file():
            with path.open("rb") as f:
                raw = f.read(MAX_JSON_BYTES + 1)  # no more, whatever the file's size says
            return json.loads(raw) if len(raw) <= MAX_JSON_BYTES else None
    except (OSError, ValueError, RecursionError):
        pass
    return None


@dataclass
class RunConfig:
    """Flags every recipe shares (docs/recipe_contract.md). A recipe redeclares a field to set its own default;
    these are the only fields shared/ reads. `Config.parse()` reads them from the command line."""

    data: str = ""  # hub id, or a folder: save_to_disk, parquet, imagefolder, IDX, CIFAR files
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
    checkpoint_every: int | None = None  # steps between full-state checkpoints; default: ~10 min apart; 0: at the end
    keep_checkpoints: int = 3  # newest full-state checkpoints kept on disk
    checkpoint_dir: str | None = None  # where checkpoints go (a scratch disk); default: <output_dir>/checkpoints
    resume: str | None = None  # `latest` or a checkpoints/step_<N> folder to continue from
    init_from: str | None = None  # a model.safetensors (or a run or checkpoint folder) to start a new run from
    init_partial: bool = False  # --init_from another model: load only the tensors that fit by name and shape
    keep_classifier: bool = False  # --init_from weights trained on other classes: keep their classifier anyway
    tracker: Literal["wandb", "tensorboard", "none"] = "wandb"  # wandb is offline without an API key
    compile: bool = False  # torch.compile the model: 10-40 s to compile, then slower in every run measured (BENCHMARKS)
    channels_last: bool = False  # NHWC memory layout for convolutions (faster on CPUs; on GPUs: BENCHMARKS.md)
    data_on_device: bool | None = None  # uint8 dataset in GPU memory, no copy per batch; default: on a GPU if it fits
    tf32: bool = True  # on a GPU, float32 matmuls and convolutions in TF32 (~3x faster); --no-tf32: full float32
    cudnn_benchmark: bool = False  # on a GPU, time cuDNN's algorithms per shape, keep the fastest: for long runs
    cuda_graph: bool = True  # on a GPU, capture the training step once and replay it (shared/loop.py)
    ema: float | None = None  # also keep an average of the weights over the last ~1/(1 - EMA) steps, e.g. 0.99

    parse = classmethod(parse_config)
    # Fields that must be > 0, or >= 0 (unset, None passes). A recipe adds its own, e.g.
    # NON_NEGATIVE = RunConfig.NON_NEGATIVE + ("momentum",); a momentum or weight_decay must also be below 1 (SGD's, in
    # any recipe); other rules go in its own __post_init__.
    POSITIVE = ("epochs", "batch_size", "grad_accum", "lr", "max_grad_norm", "max_steps", "log_every",
                "keep_checkpoints")
    NON_NEGATIVE = ("seed", "checkpoint_every")

    def __post_init__(self):
        for name in self.POSITIVE + self.NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and not (value > 0 if name in self.POSITIVE else value >= 0):
                raise ValueError(f"--{name} must be {'>' if name in self.POSITIVE else '>='} 0, got {value}")
        if self.seed >= 2**31:  # seeds are 32-bit, and each process and resume adds its rank and step
            raise ValueError(f"--seed must be below 2**31, got {self.seed}")
        # A recipe's SGD, at 1 or more: each step's update grows without end (--momentum), or the decay outweighs the
        # gradient (--weight_decay 5: chance accuracy after 20 steps) or, larger, flips the weights' signs and grows
        # them (5e4, 5e-4 mistyped: a NaN loss at step 10, whose line said "lower --lr")
        for name in ("momentum", "weight_decay"):
            if getattr(self, name, 0) >= 1:
                raise ValueError(f"--{name} must be below 1 (e.g. {getattr(type(self), name)}), got "
                                 f"{getattr(self, name)}")
        if self.ema is not None and not 0 < self.ema < 1:
            raise ValueError(f"--ema is the average's decay per step, between 0 and 1 (e.g. 0.99); got {self.ema}")
