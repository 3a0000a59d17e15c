"""Compare runs: one row per run folder, from its summary.json and config.json.

    python -m tools.runs runs/                      # print the table: at most 12 columns, the flags that differ first
    python -m tools.runs runs/ --all                # every column: the launch, every metric
    python -m tools.runs runs/ --markdown RUNS.md   # and write every column as markdown, e.g. to copy into a README
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tools/runs.py` finds tools/ too
from tools.report import escaped, markdown_table  # noqa: E402 (after the path it needs)

SHOWN = ["run", "recipe", "state", "data", "epochs", "final_acc", "max_acc", "wall_s"]  # in a terminal, with the
MOST_SHOWN = 12  # flags that differ, up to this many columns in all (--all: every column)
HASH = re.compile(r"[0-9a-f]{64}")  # a sha256 (--init_from's), shown by its first 12 digits
MAX_JSON_BYTES = 2**24  # a summary.json or config.json: a few KB, up to about 2 MB with 100,000 class names
COLUMNS = ["run", "recipe", "state", "data", "launch", "world_size", "precision", "global_batch", "epochs",
           "final_acc", "max_acc", "samples_per_s", "wall_s", "pieces"]
# config.json keys that are no flag of the training (where and how the run was started), and summary.json keys that
# the columns above already show or that are bookkeeping, not metrics
NOT_FLAGS = {"output_dir", "run_id", "resume", "resumed_from", "resumed_step", "overwrite", "versions", "script",
             "device", "distributed_type", "world_size", "mixed_precision", "classes", "lr_schedule", "recipe",
             "data", "global_batch_size", "total_steps", "train_size", "test_size", "epochs"}
NOT_METRICS = {"step", "steps", "epochs", "pieces", "wall_s", "train_s", "samples_per_s", "world_size",
               "max_eval_acc", "best_eval_acc", "eval_acc", "eval_samples", "synthetic"}


def read_json(path: Path) -> dict:
    """A run's JSON file, or {} if it is missing, not a regular file (a FIFO would block the read), over
    MAX_JSON_BYTES, nested too deep or not a JSON object (a run folder from anywhere). shared/checkpoints.py's
    read_json, without importing torch into this small tool."""
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)  # no more, whatever the file's size says
        value = json.loads(raw) if len(raw) <= MAX_JSON_BYTES else {}
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def run_folders(folder: Path) -> list[tuple[Path, bool]]:
    """(folder, whether it holds a summary.json) for every folder under `folder` that holds a summary.json, or a run's
    config.json without one (a run still running, or killed): not a checkpoint's copy of it (step_<N>,
    partial_step_<N>). A summary.json that is a link counts as none. Without following links; not recursive
    (rglob is, in Python 3.11): a tree thousands of folders deep is walked all the same. shared/bounds.py's walk,
    without importing torch."""
    found, folders = [], [folder]
    while folders:
        current = folders.pop()
        with os.scandir(current) as entries:
            names = set()
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    names.add(entry.name)
        checkpoint = re.fullmatch(r"(partial_)?step_[0-9]+", current.name)
        if "summary.json" in names or "config.json" in names and not checkpoint:
            found.append((current, "summary.json" in names))
    return found


def held_folders() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every file or folder a process of this machine holds an flock on, from Linux's
    /proc/locks (elsewhere: none known): a run's folder while the run holds it (shared/tracking.py's lock)."""
    held = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():  # 1: FLOCK  ADVISORY  WRITE 4242 fe:00:2261247 0 EOF
            words = line.split()
            with contextlib.suppress(ValueError, IndexError):
                if words[1] == "FLOCK":  # not a process waiting for one ("->")
                    major, minor, inode = words[5].split(":")
                    held.add((int(major, 16), int(minor, 16), int(inode)))
    return held


def newest_checkpoint(run: Path) -> int | None:
    """The step of a run's newest checkpoint in its checkpoints/ (None: none there, or its checkpoints are elsewhere,
    --checkpoint_dir): where a resume continues. The checkpoints are the step_<N> folders (no link: a resume refuses
    one), as shared/checkpoints.py's list_checkpoints finds them, without importing torch."""
    folder, steps = run / "checkpoints", []
    if folder.is_dir() and not folder.is_symlink():
        with contextlib.suppress(OSError), os.scandir(folder) as entries:  # unreadable: none known
            steps = [int(found[1]) for entry in entries if entry.is_dir(follow_symlinks=False)
                     and (found := re.fullmatch(r"step_([0-9]+)", entry.name))]
    return max(steps, default=None)


def state(run: Path, summary: dict | None, held: set) -> str:
    """Running (its folder locked by a process of this machine), finished (only the end of a run writes `steps`, then
    curves.png), or stopped at its newest checkpoint's step (the summary's step is the last one logged, often earlier;
    without a checkpoint here, that step). A finished run that a resume extends keeps its summary until the longer run
    finishes: its newest checkpoint, past its steps, says how far that got. A run without a summary was killed, or
    failed (an error such as a NaN loss ends a run without one), or runs on another machine (`summary` None): a resume
    continues from its newest checkpoint. A summary read as {} (not a JSON object, or too large) is said as
    unreadable: its run may have finished or not."""
    with contextlib.suppress(OSError):
        stat = run.stat()
        if (os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino) in held:
            return "running"
    newest = newest_checkpoint(run)
    if summary is None:
        return f"killed or failed? no summary; resumes from step {newest}" if newest is not None else (
            "killed or failed? no summary, no checkpoint")
    if not summary:  # a run writes its summary whole (shared/errors.py, replacing): this one came from elsewhere
        return "summary.json unreadable"
    # curves.png: the last file a run's end writes (shared/resume.py's test of a finished run). A disk that filled
    # before it left a summary with `steps`; a finished/<N>_steps record is a finished run's, whatever it holds
    if "steps" in summary and not (run / "curves.png").is_file() and run.parent.name != "finished":
        return "end cut short (no curves.png): --resume latest writes its final files"
    if "steps" in summary:
        steps = summary["steps"]
        extended = newest is not None and type(steps) is int and newest > steps
        return f"finished at step {steps}; its extension stopped at step {newest}" if extended else "finished"
    if newest is None:
        return f"stopped (last logged step {summary.get('step', '?')})"
    return f"stopped at step {newest}"


def collect(folder: Path) -> list[dict]:
    """One row per run under `folder`: the columns above, then the flags whose values differ between the runs
    (`--name`), then every metric of their summaries (the last logged value of each)."""
    rows, configs, held = [], [], held_folders()
    found = sorted(run_folders(Path(folder)), key=lambda pair: pair[0] / "summary.json")  # finished/<N>_steps first
    for run, has_summary in found:
        summary, config = read_json(run / "summary.json") if has_summary else {}, read_json(run / "config.json")
        if not has_summary and not (isinstance(config.get("run_id"), str) and "recipe" in config):
            continue  # a config.json of something else, no run of these recipes
        # finished/<N>_steps: a finished run's record, set aside when a resume extended it (its flags but the length
        # are those of the run around it)
        around = read_json(run.parent.parent / "config.json") if run.parent.name == "finished" else {}
        rows.append({
            "run": str(run.relative_to(folder)) if run != Path(folder) else run.name,
            "recipe": config.get("recipe") or around.get("recipe"), "data": summary.get("data") or config.get("data"),
            "state": state(run, summary if has_summary else None, held),
            "launch": f"{config.get('distributed_type', '?')} on {config.get('device', '?')}",
            "world_size": summary.get("world_size"), "precision": summary.get("mixed_precision"),
            "global_batch": config.get("global_batch_size"), "epochs": summary.get("epochs"),
            "final_acc": summary.get("eval_acc"),
            "max_acc": summary.get("max_eval_acc", summary.get("best_eval_acc")),  # best_eval_acc: in older runs
            "samples_per_s": summary.get("samples_per_s"), "wall_s": summary.get("wall_s"),
            "pieces": summary.get("pieces"),  # launches: 1 + resumes; samples_per_s and wall_s cover them all
            **{key: value for key, value in summary.items() if key not in NOT_METRICS
               and isinstance(value, (int, float)) and not isinstance(value, bool)},
        })
        configs.append(config)
    flags = sorted({key for config in configs for key in config if key not in NOT_FLAGS})
    # Among the runs that record their flags: a record without (finished/<N>_steps, an unreadable config.json) would
    # make every flag a column
    known = [config for config in configs if config]
    differing = [key for key in flags if len({json.dumps(config.get(key), sort_keys=True) for config in known}) > 1]
    for row, config in zip(rows, configs):
        row.update({f"--{key}": config.get(key) for key in differing})
    return rows


def columns(rows: list[dict]) -> list[str]:
    """COLUMNS, then the differing flags, then the metrics, in the order the runs first have them."""
    keys = list(dict.fromkeys(key for row in rows for key in row if key not in COLUMNS))
    return COLUMNS + [key for key in keys if key.startswith("--")] + [key for key in keys if not key.startswith("--")]


def table_file(path: Path) -> bool:
    """Whether `path` is a table --markdown wrote, known by its first line: that one is replaced, never a file of yours
    (a README, a notes file) that --markdown names."""
    with path.open("rb") as f:
        return f.readline(4096).startswith(b"Runs under `")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Table of the runs under a folder (summary.json, config.json).")
    parser.add_argument("folder", type=Path, help="a run folder, or a folder of run folders (e.g. runs/)")
    parser.add_argument("--all", action="store_true", help="print every column (the launch, every metric)")
    parser.add_argument("--markdown", type=Path,
                        help="also write the table, every column, to this markdown file (a new one, or one it wrote)")
    args = parser.parse_args(argv)
    # Never renamed over a folder, a device or a FIFO: as root, --markdown /dev/null made /dev/null a file (a link is
    # replaced, never written through)
    if args.markdown and args.markdown.exists() and not args.markdown.is_symlink() and not args.markdown.is_file():
        print(f"error: --markdown {args.markdown} is a folder, device or FIFO: nothing written; pass a file name",
              file=sys.stderr)
        return 1
    if args.markdown and args.markdown.is_file() and not args.markdown.is_symlink() and not table_file(args.markdown):
        print(f"error: --markdown {args.markdown} exists and is no table this tool wrote: nothing written; pass a new "
              "file, then copy the table from it", file=sys.stderr)
        return 1
    if not args.folder.is_dir():
        print(f"error: {args.folder} is no folder: pass a run folder or a folder of runs (e.g. runs/)", file=sys.stderr)
        return 1
    try:
        rows = collect(args.folder)
    except OSError as error:  # a tree deeper than the system's path limit (4,096 bytes), a folder you may not read
        print(f"error: cannot list the folders under {args.folder} ({error.strerror}): move the runs nearer the root, "
              "or make their folders readable", file=sys.stderr)
        return 1
    if not rows:
        print(f"error: no runs (a summary.json, or a run's config.json) under {args.folder}", file=sys.stderr)
        return 1
    rows = [{key: value[:12] if isinstance(value, str) and HASH.fullmatch(value) else value
             for key, value in row.items()} for row in rows]
    every = columns(rows)
    shown = every if args.all else (SHOWN + [key for key in every if key.startswith("--")])[:MOST_SHOWN]
    try:  # flushed here, where a reader that ended first (`| head`) is caught: the rest is not wanted, --markdown is
        print(markdown_table(rows, shown), end="", flush=True)
        if len(shown) < len(every):
            print(f"{len(every) - len(shown)} more columns ({', '.join(key for key in every if key not in shown)}): "
                  "--all", flush=True)
    except BrokenPipeError:  # what is still buffered goes nowhere, not into a traceback at the exit's own flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.markdown:
        table = markdown_table(rows, every)
        partial = args.markdown.with_name(f"{args.markdown.name}.tmp{os.getpid()}")
        # shared/errors.py's `replacing`, written out: importing shared/ would import torch into this small tool
        try:  # under a temporary name, renamed into place: never written through a link planted at the name
            partial.unlink(missing_ok=True)
            partial.write_text(f"Runs under `{escaped(str(args.folder))}`:\n\n{table}")
            os.replace(partial, args.markdown)
        except OSError as error:
            partial.unlink(missing_ok=True)
            print(f"error: cannot write --markdown {args.markdown} ({error.strerror}): pass a file path in a "
                  "writable folder", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
