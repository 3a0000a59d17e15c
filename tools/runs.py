"""Compare runs: one row per run folder, from its summary.json and config.json.

    python -m tools.runs runs/                      # print the table
    python -m tools.runs runs/ --markdown RUNS.md   # and write it as markdown, e.g. for a README
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.report import markdown_table

COLUMNS = ["run", "recipe", "state", "data", "launch", "world_size", "precision", "global_batch", "epochs",
           "final_acc", "max_acc", "samples_per_s", "wall_s", "pieces"]


def collect(folder: Path) -> list[dict]:
    rows = []
    for summary_file in sorted(Path(folder).rglob("summary.json")):
        run = summary_file.parent
        summary = json.loads(summary_file.read_text())
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        rows.append({
            "run": str(run.relative_to(folder)) if run != Path(folder) else run.name,
            "recipe": config.get("recipe"), "data": summary.get("data") or config.get("data"),
            # Only the end of a run writes `steps`; a stop (SIGTERM, Ctrl-C) leaves its last logged values.
            "state": "finished" if "steps" in summary else f"stopped at step {summary.get('step', '?')}",
            "launch": f"{config.get('distributed_type', '?')} on {config.get('device', '?')}",
            "world_size": summary.get("world_size"), "precision": summary.get("mixed_precision"),
            "global_batch": config.get("global_batch_size"), "epochs": summary.get("epochs"),
            "final_acc": summary.get("eval_acc"),
            "max_acc": summary.get("max_eval_acc", summary.get("best_eval_acc")),  # best_eval_acc: in older runs
            "samples_per_s": summary.get("samples_per_s"), "wall_s": summary.get("wall_s"),
            "pieces": summary.get("pieces"),  # launches: 1 + resumes; samples_per_s and wall_s cover them all
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Table of the runs under a folder (their summary.json files).")
    parser.add_argument("folder", type=Path, help="a run folder, or a folder of run folders (e.g. runs/)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    rows = collect(args.folder)
    if not rows:
        print(f"error: no finished runs (summary.json) under {args.folder}", file=sys.stderr)
        return 1
    table = markdown_table(rows, COLUMNS)
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(f"Runs under `{args.folder}`:\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
