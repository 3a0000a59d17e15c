"""A project of your own from a recipe, in one command: the recipe as train.py, predict.py, shared/, the accelerate
configs, requirements.txt and the runs table (tools/runs.py), with the recipe's name replaced by the project's and a
README of the commands.

    python -m tools.new_project my_project --from cifar_cnn      # from this repository's root
    python ~/recipes/tools/new_project.py ~/work/shoes --from resnet18_fmnist --data ~/data/shoes   # from anywhere

train.py keeps the recipe's code and comments; its header is replaced, since the recipe's results are not yours.
Nothing of this repository is needed afterwards: the folder runs on its own (tested with its README's commands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt", "finetune")
# What a project copies, each source (in this repository) to its place in the project; tools/: the runs table, and
# the markdown it is written in. main() checks the sources, make_project copies them.
COPIED = {"recipes/predict.py": "predict.py", "shared": "shared", "accelerate_configs": "accelerate_configs",
          "requirements.txt": "requirements.txt",
          **{f"tools/{tool}": f"tools/{tool}" for tool in ("__init__.py", "runs.py", "report.py")}}
FIND_SHARED = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find shared/ without installing it"
COMMANDS = """\
accelerate launch -q --config_file accelerate_configs/cpu.yaml train.py --synthetic --max_steps 200{smoke}
accelerate launch -q --config_file accelerate_configs/cpu.yaml train.py --data {data}
accelerate launch -q --config_file accelerate_configs/cpu.yaml train.py --output_dir runs/RUN --resume latest
python predict.py --weights runs/RUN/model.safetensors --images my_photos/
python predict.py --weights runs/RUN/model.safetensors --evaluate
python -m tools.runs runs/"""


def header(name: str, recipe: str) -> str:
    return f'''"""{name}: started from the accelerate recipes' {recipe}.py (whose header and benchmarks/BENCHMARKS.md
say what it reached, on which data and hardware).

Result: not measured yet. Write here what this script reaches on your data, the hardware and the command.

Run it from this folder (outputs in runs/{name}-<time>/: config.json, metrics.jsonl, summary.json,
curves.png, model.safetensors, checkpoints/); README.md lists the commands.
"""'''


def make_project(folder: Path, recipe: str, data: str | None) -> Path:
    name = re.sub(r"[^a-z0-9_]", "_", folder.name.lower()).strip("_") or "project"
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    if FIND_SHARED not in source or f'RECIPE = "{recipe}"' not in source:
        raise SystemExit(f"error: recipes/{recipe}.py no longer has the lines this tool rewrites: update the tool")
    script = source[source.index('"""', 3) + 3:]  # the recipe without its header
    script = header(name, recipe) + script.replace(f'RECIPE = "{recipe}"', f'RECIPE = "{name}"').replace(
        FIND_SHARED, "sys.path.insert(0, str(Path(__file__).resolve().parent))  # find shared/ beside this file")
    default_data = re.search(r'\n    data: str = "([^"]*)"', script)
    if default_data is None:
        raise SystemExit(f"error: recipes/{recipe}.py has no `data: str = ...` default: update the tool")
    if data:
        script = script.replace(default_data.group(0), f"\n    data: str = {json.dumps(data)}")
    folder.mkdir(parents=True, exist_ok=True)  # main() refused a folder with anything in it
    (folder / "train.py").write_text(script)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source, place in COPIED.items():
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, folder / place, ignore=skip)
        else:
            (folder / place).parent.mkdir(exist_ok=True)  # tools/
            shutil.copy(ROOT / source, folder / place)
    # finetune: offline, the smoke run needs no pretrained weights, and small images are enough
    smoke = " --weights none --image_size 64" if recipe == "finetune" else ""
    # Quoted for a shell, as the commands are pasted: a folder or --data with a space or a quote in its name
    commands = COMMANDS.format(data=shlex.quote(data or default_data.group(1)), smoke=smoke)
    (folder / "README.md").write_text(
        f"# {name}\n\nStarted from the `{recipe}` recipe. Install, then train, continue a stopped run (RUN: the "
        f"folder a run printed; it continues with the flags its config.json records, and a flag you add changes only "
        f"itself), use the model, and compare the runs:\n\n"
        f"```bash\npip install -r requirements.txt\n{commands}\n```\n\n"
        "Edit train.py: `make_model`, `IMAGE_SHAPE`, `MEAN` and `STD`, `loss_fn`, `metric_sums` (a new entry is logged "
        "as train_<name> and eval_<name>), `preprocess`, and the `Config` fields (each is a flag; its comment, the "
        "--help). `accelerate_configs/` holds the configs for one or two GPUs, bf16, fp16 and several nodes.\n")
    return folder


def remove_quietly(path: Path) -> None:
    """A file or a folder, removed as far as it can be: after a failed write, that failure is the one to report."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the new project's folder (must not exist, or be empty)")
    parser.add_argument("--from", dest="recipe", choices=RECIPES, required=True, help="the recipe to start from")
    parser.add_argument("--data", help="the project's default --data: a hub id or a folder")
    args = parser.parse_args(argv)
    if args.folder.exists() and (not args.folder.is_dir() or any(args.folder.iterdir())):
        parser.exit(2, f"error: {args.folder} already exists and is not empty: pick a new folder\n")
    target = args.folder.resolve()
    if target.is_relative_to(ROOT / "shared") or target.is_relative_to(ROOT / "accelerate_configs"):
        parser.exit(2, f"error: {args.folder} is inside the folders a project copies (it would copy itself into "
                       "itself): pick a folder outside them\n")
    if any(parent.exists() and not parent.is_dir() for parent in target.parents):
        parser.exit(2, f"error: {args.folder} lies below a file, not a folder: pick another place\n")
    # A partial copy of this repository (recipes/ and shared/ without requirements.txt, say): said before anything is
    # written, or the failed read was reported as a place that cannot be written.
    missing = [name for name in (f"recipes/{args.recipe}.py", *COPIED) if not (ROOT / name).exists()]
    if missing:
        parser.exit(2, f"error: {ROOT} lacks {', '.join(missing)}, which a project copies: run this tool from a whole "
                       "copy of the recipes repository\n")
    made = not args.folder.exists()
    try:
        folder = make_project(args.folder, args.recipe, args.data)
    except OSError as error:  # a read-only place, a full disk
        # The folder held nothing before (checked above): what was written goes, or the next try would find it taken.
        for path in [args.folder] if made else list(args.folder.iterdir()):
            remove_quietly(path)
        parser.exit(1, f"error: cannot write the project into {args.folder} ({error.strerror}): pick a writable "
                       "place with room\n")
    readme = (folder / "README.md").read_text().splitlines()
    first = next(line for line in readme if line.startswith("accelerate launch"))  # the smoke run
    print(f"{folder}: train.py (from {args.recipe}), predict.py, shared/, accelerate_configs/, requirements.txt, "
          f"tools/runs.py, README.md\n  cd {shlex.quote(str(folder))} && {first}")


if __name__ == "__main__":
    sys.exit(main())
