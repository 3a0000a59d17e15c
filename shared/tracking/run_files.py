"""The run's files readable without any service, written as an accelerate tracker (`RunFiles`)."""

import json
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker

from shared.diagnostics import plot_curves


class RunFiles(GeneralTracker):
    """An accelerate tracker that writes the run's readable files (main process only)."""

    name, requires_logging_directory = "run_files", False

    def __init__(self, run_dir: Path, run_id: str, labels: dict):
        self.tracker = self  # what accelerator.get_tracker("run_files", unwrap=True) returns
        super().__init__()
        self.run_dir, self.run_id, self.labels, self.summary = Path(run_dir), run_id, labels, {}
        self.metrics = self.run_dir / "metrics.jsonl"

    def store_init_configuration(self, values: dict):
        write_json(self.run_dir / "config.json", {**values, "run_id": self.run_id})
        step = values.get("resumed_step")
        if step is not None and self.metrics.exists():
            # The points after the checkpoint will be logged again, and so will those of its own step logged after
            # it was written (an epoch's or the run's evaluation, the summary): keep the file up to its training point.
            rows = [row for row in read_jsonl(self.metrics) if row["step"] < step or row["step"] == step
                    and "train_loss" in row]
            write_atomic(self.metrics, "".join(json.dumps(row) + "\n" for row in rows))  # a kill keeps one whole

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.metrics.open("a") as f:
            f.write(json.dumps({"step": step, **values, **self.labels}) + "\n")
        self.summary.update(values, step=step)  # the last logged step: a run stopped early says where it stopped

    def finish(self):
        write_json(self.run_dir / "summary.json", {**self.summary, **self.labels})
        plot_curves(read_jsonl(self.metrics), self.run_dir / "curves.png",
                    self.run_dir.name + (" (SYNTHETIC DATA)" if self.labels else ""))
        offline_runs = sorted((self.run_dir / "wandb").glob("offline-run-*"))
        if offline_runs:
            print(f"wandb ran offline; upload the run with: wandb sync {offline_runs[-1]}")


def write_json(path: Path, values: dict) -> None:
    write_atomic(path, json.dumps(values, indent=2, default=str) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Readers, and a run killed while writing, see the old file or the new one, never half of one."""
    partial = path.with_suffix(".tmp")
    partial.unlink(missing_ok=True)  # a link left there (a run folder from anywhere) goes, and is never written through
    partial.write_text(text)
    os.replace(partial, path)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
