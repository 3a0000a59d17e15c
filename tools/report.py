"""Tables for people: rows of dicts as markdown (for READMEs and terminals), CSV (for tools) and
a plot (for eyes)."""

from __future__ import annotations

import csv
import re
from pathlib import Path


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub markdown table; floats get 3 significant digits, missing values a dash."""
    columns = columns or list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(map(escaped, columns)) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(column)) for column in columns) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path, columns: list[str] | None = None) -> None:
    columns = columns or list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return escaped(str(value))


def escaped(text: str) -> str:
    """Text from a run folder (from anywhere) fit for a terminal and a table: control characters (a terminal's escape
    sequences, a newline) and the bytes of a name that is not UTF-8 (`\\udcff`, which no UTF-8 file can hold) written as
    escapes, and `|` as `\\|`: a value can neither drive a terminal nor make a row."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f\udc80-\udcff]", lambda m: repr(m.group())[1:-1], text).replace("|", "\\|")


def write_report(rows: list[dict], stem: Path, title: str, x: str, ys: list[str], group: str | None = None,
                 mark: float | None = None, log_x: bool = False) -> None:
    """stem.md (title + table), stem.csv and stem.png (each of `ys` against `x`, one line per `group`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.with_suffix(".md").write_text(f"{title}\n\n{markdown_table(rows)}")
    write_csv(rows, stem.with_suffix(".csv"))
    fig, axes = plt.subplots(1, len(ys), figsize=(5 * len(ys), 4), squeeze=False)
    groups = list(dict.fromkeys(row.get(group) for row in rows))
    for ax, y in zip(axes[0], ys):
        for value in groups:
            points = [(row[x], row[y]) for row in rows if row.get(group) == value and isinstance(row[x], (int, float))]
            ax.plot(*zip(*points), marker="o", label=f"{group} {value}" if group else y)
        if mark is not None:
            ax.axvline(mark, color="gray", linestyle="--", label=f"{x} = {mark:.3g}")
        ax.set(xlabel=x, ylabel=y, xscale="log" if log_x else "linear")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title.splitlines()[0].lstrip("# "))
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    plt.close(fig)
