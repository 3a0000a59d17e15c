"""The run's files readable without any service: config.json (at init_trackers), metrics.jsonl (one line per
accelerator.log), summary.json (the last value of every key, like wandb's run summary) and curves.png (at
end_training, drawn by shared/tracking/pictures.py), written as an accelerate tracker (`RunFiles`)."""

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from accelerate.tracking import GeneralTracker

from shared.errors import RecipeError
from shared.limits import replacing

MAX_ROW_BYTES = 2**20  # one line of metrics.jsonl: a few hundred bytes as a run writes them


def is_point(row: dict) -> bool:
    """A training or an evaluation point of a curve; not the summary, logged once at the end with one value a key."""
    return "train_loss" in row or "eval_loss" in row


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name, requires_logging_directory = "run_files", False

    def __init__(self, run_dir: Path, run_id: str, labels: dict):
        self.tracker = self  # what accelerator.get_tracker("run_files", unwrap=True) returns
        super().__init__()
        self.run_dir, self.run_id, self.labels, self.summary = Path(run_dir), run_id, labels, {}
        self.metrics = self.run_dir / "metrics.jsonl"
        self.last_evaluation = None  # time.perf_counter() at the last eval_* point

    def store_init_configuration(self, values: dict):
        step = values.get("resumed_step")
        if step is not None and self.metrics.exists():  # first: a damaged row stops the resume before any change
            # The points after the checkpoint will be logged again, and so will those of its own step logged after
            # it was written (an epoch's or the run's evaluation, the summary): keep the file up to its training point.
            rows = (row for row in read_rows(self.metrics) if row["step"] < step or row["step"] == step
                    and "train_loss" in row)
            write_atomic(self.metrics, (json.dumps(row) + "\n" for row in rows))  # one row in memory at a time
        write_json(self.run_dir / "config.json", {**values, "run_id": self.run_id})

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, **values, **self.labels}) + "\n")
        self.summary.update(values, step=step)  # the last logged step: a run stopped early says where it stopped
        if "eval_loss" in values:
            self.last_evaluation = time.perf_counter()

    def finish(self):
        # finish_s: from the last evaluation to here, the weights and pictures saved (curves.png and the other
        # trackers' ends come after it)
        finish_s = None if self.last_evaluation is None else time.perf_counter() - self.last_evaluation
        write_json(self.run_dir / "summary.json", {**self.summary, "finish_s": finish_s, **self.labels})
        from shared.tracking.pictures import plot_curves  # matplotlib: an opt-in module

        plot_curves(read_rows(self.metrics), self.run_dir / "curves.png",
                    self.run_dir.name + (" (SYNTHETIC DATA)" if self.labels else ""))


def write_json(path: Path, values: dict) -> None:
    write_atomic(path, [json.dumps(values, indent=2, default=str) + "\n"])


def write_atomic(path: Path, pieces: Iterable[str]) -> None:
    with replacing(path) as partial, partial.open("w") as f:
        f.writelines(pieces)


def read_rows(path: Path) -> Iterator[dict]:
    """metrics.jsonl's rows, one at a time (memory: one row, whatever the file's size). A run folder may come from
    anywhere: a line that is not a JSON object with an integer step, or is over MAX_ROW_BYTES, is one error line."""
    if not path.exists():
        return
    with path.open("rb") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line) if len(line) <= MAX_ROW_BYTES else None
            except (ValueError, RecursionError):
                row = None
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                raise RecipeError(f"{path} line {number} is not a metrics row (a JSON object with an integer step, "
                                  f"under {MAX_ROW_BYTES // 2**20} MiB): remove the line, or start a new --output_dir")
            yield row
