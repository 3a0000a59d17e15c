"""Run tracking: wandb offline, TensorBoard, progress output and the runs table. The pictures, and one wandb run
from two processes: test_cifar_cnn.py's run files."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import ROOT, launch, ok, read_json, read_jsonl, run_here
from tiny_data import cifar_binary_dataset

SHORT = ("--batch_size", "8", "--max_steps", "6", "--log_every", "2")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("tr") / "data", sizes={"train": 64, "test": 20})


def wandb_records(run_file: Path):
    """The records of an offline run's .wandb file: a LevelDB-style log of wandb protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a wandb transaction log"
    position, pending = 7, b""  # after the file header: ident, magic, version
    while position + 7 <= len(data):
        room = 32768 - position % 32768  # records never straddle a 32 KiB block header
        if room < 7:
            position += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        position += 7
        pending += data[position:position + length]
        position += length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_run_name(run_dir: Path) -> str:
    """The display name of a run folder's (newest) offline wandb run, as last set."""
    offline_run = sorted((run_dir / "wandb").glob("offline-run-*"))[-1]
    names = [r.run.display_name for r in wandb_records(next(offline_run.glob("run-*.wandb")))
             if r.WhichOneof("record_type") == "run"]
    return names[-1]


def wandb_summary_and_history(run_dir: Path) -> tuple[dict, list[dict]]:
    def key(item):  # a plain key, or a nested one ("a/b")
        return item.key or "/".join(item.nested_key)

    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    summary, history = {}, []
    for offline_run in offline_runs:
        for record in wandb_records(next(offline_run.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "summary":
                summary.update({key(item): json.loads(item.value_json) for item in record.summary.update})
            elif kind == "history":
                history.append({key(item): json.loads(item.value_json) for item in record.history.item})
    return summary, history


@pytest.fixture(scope="module")
def wandb_run(env, data, tmp_path_factory):
    # wandb starts a service process of its own, and its state lives in the process: launched, in the slow tier
    """A run with the default tracker and no API key: wandb offline."""
    out = tmp_path_factory.mktemp("wandb") / "run"
    result = ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *SHORT, "--checkpoint_every",
                       "2"))
    return out, result.stdout + result.stderr


@pytest.mark.slow  # wandb
def test_offline_wandb_run_holds_the_summary_and_every_point(wandb_run):
    out, stdout = wandb_run
    offline_runs = list((out / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    # wandb's own start and end (34 of a run's 52 lines) left out: one line says where the run is, how to upload it
    assert [line for line in stdout.splitlines() if line.lower().startswith("wandb")] == [
        f"wandb: offline, in {offline_runs[0]}; upload it later with: wandb sync {offline_runs[0]}"]
    assert wandb_run_name(out).startswith("cifar_cnn-1xno-b8-")  # recipe, processes x precision, global batch
    summary, history = wandb_summary_and_history(out)
    expected = read_json(out / "summary.json")
    for key, value in expected.items():
        if key == "finish_s":  # measured as summary.json is written, after the trackers' last point: its own
            continue
        assert summary[key] == pytest.approx(value) if isinstance(value, float) else summary[key] == value, key
    logged = [row for row in history if "train_loss" in row]
    metrics = [row for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert [row["step"] for row in logged] == [row["step"] for row in metrics] == [2, 4, 6]
    assert [row["train_loss"] for row in logged] == pytest.approx([row["train_loss"] for row in metrics])
    logged_keys = {key.split("/")[0] for row in history for key in row}  # images log as name/_type, name/filenames, ...
    assert "confusion_matrix" in logged_keys
    images = {path.name.split("_")[0] for path in offline_runs[0].glob("files/media/images/*.png")}
    assert images == {"confusion"}


@pytest.mark.slow  # wandb
def test_a_resumed_run_continues_the_same_wandb_run(env, data, wandb_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(wandb_run[0], out)
    checkpoint = out / "checkpoints" / "step_4"
    ok(launch(env, "cifar_cnn", "--data", str(data), "--output_dir", str(out), *SHORT, "--resume", str(checkpoint)))
    offline_runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2
    run_ids = {path.name.rsplit("-", 1)[1] for path in offline_runs}
    assert run_ids == {read_json(out / "config.json")["run_id"]}  # one wandb run, continued
    _, history = wandb_summary_and_history(out)
    steps = [row["step"] for row in history if "train_loss" in row]
    assert steps == [2, 4, 6, 6]  # the resumed part logs step 6 again; nothing is dropped or reordered
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row] == [2, 4, 6]


def test_tensorboard_scalars_match_metrics_jsonl(env, data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = ("--data", str(data), "--output_dir", str(out), *SHORT, "--tracker", "tensorboard",
            "--checkpoint_every", "2")
    result = ok(run_here("cifar_cnn", *args))
    assert "\r" not in result.stderr + result.stdout and "step 6/6" in result.stdout  # no terminal: lines, no bar
    # From an older checkpoint: a new branch, whose points replace the abandoned ones after step 2
    ok(run_here("cifar_cnn", *args, "--resume", out / "checkpoints" / "step_2", "--lr", "0.2"))
    # One run: the flags in its own event files (add_hparams alone writes them as a second run in a folder below)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert not list((out / "tensorboard").glob("*/events.out.tfevents.*"))
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")
    assert not {"wall_s", "pieces", "max_eval_acc"} & set(events.Tags()["scalars"])  # the summary's, one point each
    rows = [row for row in read_jsonl(out / "metrics.jsonl") if "pieces" not in row]  # not the summary's row
    assert [row["step"] for row in rows if "train_loss" in row] == [2, 4, 6]
    for key in ("train_loss", "lr", "samples_per_s", "eval_loss", "eval_acc"):
        expected = [(row["step"], row[key]) for row in rows if key in row]
        logged = [(event.step, event.value) for event in events.Scalars(key)]
        assert [step for step, _ in logged] == [step for step, _ in expected], key
        assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=1e-6), key
    assert "confusion_matrix" in events.Tags()["images"]
    assert not (out / "wandb").exists()
    # datasets' version if this process imported it, else None: a machine without datasets runs (asking for its
    # version was a traceback on a GPU machine without it). One process on CIFAR's binary files imports none
    # (test_dataset_files.py); on several, accelerate's prepare imports it if there.
    assert read_json(out / "config.json")["versions"]["datasets"] == getattr(sys.modules.get("datasets"),
                                                                             "__version__", None)


def test_runs_table_lists_every_run(data, tmp_path):
    folder = tmp_path / "runs"
    for name, lr in (("a", "0.05"), ("b", "0.01")):
        ok(run_here("cifar_cnn", "--data", data, "--output_dir", folder / name, *SHORT, "--tracker", "none",
                    "--lr", lr))
    markdown = tmp_path / "RUNS.md"
    result = subprocess.run([sys.executable, "-m", "tools.runs", str(folder), "--markdown", str(markdown)],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert len(lines) == 2 and all("cifar_cnn" in line for line in lines)
    assert "final_acc" in result.stdout and markdown.read_text().count("| cifar_cnn |") == 2
    # In a terminal, at most 12 columns (it grew to 34): the flags that differ among them, the rest with --all
    header = next(line for line in result.stdout.splitlines() if line.startswith("| run "))
    assert header.count(" | ") + 1 <= 12 and "| --lr |" in header and "| train_loss |" not in header
    assert result.stdout.splitlines()[-1].endswith("): --all") and "train_loss" in result.stdout.splitlines()[-1]
    every = subprocess.run([sys.executable, "-m", "tools.runs", str(folder), "--all"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    header = next(line for line in every.splitlines() if line.startswith("| run "))
    assert "| --lr |" in header and "--output_dir" not in header and "| eval_loss |" in header  # what differs
    assert "| train_loss |" in header and "--seed" not in header  # every metric; a flag both runs share is no column
    assert header in markdown.read_text()  # the file holds every column
    # Written again over its own table; never over a file of yours (it replaced a README whole)
    again = subprocess.run([sys.executable, "-m", "tools.runs", str(folder), "--markdown", str(markdown)], cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 0 and markdown.read_text().count("| cifar_cnn |") == 2, again.stderr
    readme = tmp_path / "README.md"
    readme.write_text("# My project\n")
    mine = subprocess.run([sys.executable, "-m", "tools.runs", str(folder), "--markdown", str(readme)], cwd=ROOT,
                          capture_output=True, text=True)
    assert (mine.returncode, mine.stdout, readme.read_text()) == (1, "", "# My project\n")
    assert mine.stderr == (f"error: --markdown {readme} exists and is no table this tool wrote: nothing written; pass "
                           "a new file, then copy the table from it\n")
    (tmp_path / "nothing").mkdir()
    # Run as a file from elsewhere (`python tools/runs.py`): it found no `tools` package, a ModuleNotFoundError
    empty = subprocess.run([sys.executable, ROOT / "tools" / "runs.py", str(tmp_path / "nothing")], cwd=tmp_path,
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "error: no runs (a summary.json, or a run's config.json) under" in empty.stderr, (
        empty.stderr)


def test_wandb_disabled_by_its_variable_is_said_as_such(data, tmp_path):
    """WANDB_MODE=disabled (wandb's own setting, accepted) printed 'offline, in /tmp/wandb/run-...; upload it later
    with: wandb sync ...', a folder that wandb never writes."""
    out = tmp_path / "run"
    result = ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", out, env={"WANDB_MODE": "disabled"}))
    assert [line for line in result.stdout.splitlines() if line.startswith("wandb")] == [
        "wandb: disabled by WANDB_MODE: nothing is logged there"]
    assert not (out / "wandb").exists() and (out / "summary.json").is_file()


@pytest.mark.slow  # launched: wandb reads its variables once a process, and a run in this one may have
@pytest.mark.parametrize("variables, said", [
    ({"WANDB_PROJECT": "a/b"}, "Invalid project name 'a/b': cannot contain characters"),
    ({"WANDB_MODE": "online", "WANDB_PROJECT": "a/b"}, "Invalid project name 'a/b'"),  # online, then offline
    ({"WANDB_MODE": ""}, "1 validation error for Settings mode Input should be 'online', 'offline'"),
], ids=["a project name wandb refuses", "online, a project name wandb refuses", "an empty WANDB_MODE"])
def test_a_wandb_setting_wandb_refuses_is_one_line(env, data, tmp_path, variables, said):
    """A WANDB_* variable wandb refuses ended the run in wandb's UsageError, or pydantic's ValidationError, traceback
    at its start. One line names it, and the start leaves no run folder. Online, the start falls back to offline
    first (its warning line), as for no network or no key, and the offline start says the same."""
    out = tmp_path / "run"
    result = launch(dict(env, **variables), "cifar_cnn", "--data", str(data), *SHORT, "--output_dir", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(f"error: wandb refused its settings ({said}") and lines[-1].endswith(
        "): fix the WANDB_* variable that set it, or pass --tracker tensorboard or none"), lines
    assert len(lines) == 1 + (variables.get("WANDB_MODE") == "online") and not out.exists()


def test_runs_table_shows_the_flags_that_differ_and_every_metric(tmp_path):
    from tools.runs import collect, columns

    for name, lr, extra in (("a", 0.1, {"eval_top5": 0.9}), ("b", 0.2, {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps": 3, "eval_acc": 0.5, **extra}))
        recipe = {"recipe": "cifar_cnn"} if name == "a" else {}
        (tmp_path / name / "config.json").write_text(json.dumps({"lr": lr, "seed": 0, "run_id": name, **recipe}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "summary.json").write_text("[not a run's summary")  # from anywhere: a row, no traceback
    (tmp_path / "a" / "finished" / "2_steps").mkdir(parents=True)  # a's record before a resume extended it
    (tmp_path / "a" / "finished" / "2_steps" / "summary.json").write_text(json.dumps({"steps": 2, "eval_acc": 0.4}))
    rows = collect(tmp_path)
    assert [row["run"] for row in rows] == ["a/finished/2_steps", "a", "b", "c"]
    assert [row.get("--lr") for row in rows] == [None, 0.1, 0.2, None] and [row.get("eval_top5") for row in rows] == [
        None, 0.9, None, None]
    assert [row["recipe"] for row in rows] == ["cifar_cnn", "cifar_cnn", None, None]  # the record's: its run's
    assert rows[3]["state"] == "summary.json unreadable"  # it read "stopped (last logged step ?)"
    # --seed is the same in every run that records it: the folders without a config make no column of it
    assert columns(rows)[-2:] == ["--lr", "eval_top5"] and "--run_id" not in columns(rows) and "--seed" not in columns(
        rows)


def test_runs_table_says_where_a_stopped_run_continues(tmp_path):
    """A stop saves the step it stopped at, usually after the last logged one: the table said the logged step."""
    from tools.runs import collect

    for name, checkpoints in (("a", ["step_20", "step_29", "partial_step_30"]), ("b", [])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"step": 28, "eval_acc": 0.5}))  # no "steps": stopped
        for checkpoint in checkpoints:
            (tmp_path / name / "checkpoints" / checkpoint).mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "step_99").symlink_to(tmp_path / "b")  # a link named as one is no checkpoint
    # A finished run extended by a resume keeps its summary until the longer run finishes: it read "finished"
    for name, newest in (("c", "step_5"), ("d", "step_4"), ("e", "step_4")):
        (tmp_path / name / "checkpoints" / newest).mkdir(parents=True)
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps": 4, "step": 4, "eval_acc": 0.5}))
        if name != "e":  # e: the disk filled between summary.json and curves.png, the last file; it read "finished"
            (tmp_path / name / "curves.png").write_bytes(b"")
    (tmp_path / "e" / "finished" / "3_steps").mkdir(parents=True)  # a record set aside: finished, whatever it holds
    (tmp_path / "e" / "finished" / "3_steps" / "summary.json").write_text(json.dumps({"steps": 3}))
    assert [row["state"] for row in collect(tmp_path)] == [
        "stopped at step 29", "stopped (last logged step 28)", "finished at step 4; its extension stopped at step 5",
        "finished", "finished", "end cut short (no curves.png): --resume latest writes its final files"]


def test_runs_table_shows_a_running_run_and_a_killed_one(tmp_path):
    """A run killed (kill -9, an OOM kill) writes no summary.json, and was missing from the table, though a resume
    continues it from its newest checkpoint; a resumed run still running read "stopped at step N"."""
    import fcntl

    from tools.runs import collect

    config = json.dumps({"recipe": "cifar_cnn", "run_id": "k", "data": "d"})
    for name in ("killed", "running"):
        (tmp_path / name / "checkpoints" / "step_7").mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(config)
        (tmp_path / name / "checkpoints" / "step_7" / "config.json").write_text(config)  # each checkpoint's copy
    (tmp_path / "killed" / "checkpoints" / "partial_step_9").mkdir()
    (tmp_path / "killed" / "checkpoints" / "partial_step_9" / "config.json").write_text(config)
    (tmp_path / "running" / "summary.json").write_text(json.dumps({"step": 6}))  # stopped at 7, resumed, running
    (tmp_path / "early").mkdir()  # killed before its first checkpoint
    (tmp_path / "early" / "config.json").write_text(config)
    (tmp_path / "notes").mkdir()  # a config.json of something else: no run
    (tmp_path / "notes" / "config.json").write_text(json.dumps({"lr": 1}))
    (tmp_path / "linked").mkdir()  # a summary.json that is a link is none: never read through
    (tmp_path / "linked" / "config.json").write_text(config)
    (tmp_path / "elsewhere.json").write_text(json.dumps({"steps": 3}))
    (tmp_path / "linked" / "summary.json").symlink_to(tmp_path / "elsewhere.json")
    descriptor = os.open(tmp_path / "running", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as shared/tracking.py's lock holds a run's folder
        rows = collect(tmp_path)
    finally:
        os.close(descriptor)
    assert [(row["run"], row["state"]) for row in rows] == [
        ("early", "killed or failed? no summary, no checkpoint"),
        ("killed", "killed or failed? no summary; resumes from step 7"),
        ("linked", "killed or failed? no summary, no checkpoint"), ("running", "running")]
    assert [row["state"] for row in collect(tmp_path) if row["run"] == "running"] == ["stopped at step 7"]  # unlocked


def test_runs_table_shortens_a_hash_to_12_digits(tmp_path, capsys):
    from tools.runs import main

    digest = "0123456789abcdef" * 4
    for name, sha in (("a", digest), ("b", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps": 3, "eval_acc": 0.5}))
        (tmp_path / name / "config.json").write_text(json.dumps({"init_from_sha256": sha, "run_id": name}))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| --init_from_sha256 |" in out and "| 0123456789ab |" in out and digest not in out


def test_runs_table_whose_reader_ends_first_still_writes_its_markdown(tmp_path):
    """`python -m tools.runs runs/ --markdown RUNS.md | head -1`: head ends after its line, and the rest of the table
    met a closed pipe: a BrokenPipeError traceback, exit status 1, and no RUNS.md. Here the pipe's reader is gone from
    the start."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"steps": 3, "eval_acc": 0.5}))
    markdown, (read_end, write_end) = tmp_path / "RUNS.md", os.pipe()
    os.close(read_end)
    result = subprocess.run([sys.executable, "-m", "tools.runs", str(tmp_path), "--markdown", str(markdown)],
                            cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "| a |" in markdown.read_text() and "| b |" in markdown.read_text()


def test_runs_table_of_folders_from_anywhere_is_rows_or_one_line(tmp_path, deep_tree):
    """Summaries nested past the recursion limit, over 16 MiB (a 3 GiB one took 6.2 GB), 1,500 folders deep, and a
    --markdown that is a folder or a FIFO: rows or one line, no traceback. A FIFO or a device was renamed over: as
    root, --markdown /dev/null made /dev/null a file."""
    deep = tmp_path / "runs"
    for name, text in (("nested", "[" * 100_000 + "]" * 100_000), ("big", '{"x": "' + "a" * 2**24 + '"}')):
        (deep / name).mkdir(parents=True)
        (deep / name / "summary.json").write_text(text)
    os.mkfifo(deep / "nested" / "config.json")  # would block the read forever
    folder = deep_tree(deep, 1500) / "run"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"steps": 3, "eval_acc": 0.5}))
    table = subprocess.run([sys.executable, "-m", "tools.runs", str(deep)], cwd=ROOT, capture_output=True, text=True)
    assert table.returncode == 0 and table.stdout.count("\n| ") == 3, table.stderr[-2000:]  # a row per run
    os.mkfifo(tmp_path / "fifo.md")
    for markdown in (tmp_path, tmp_path / "fifo.md"):
        refused = subprocess.run([sys.executable, "-m", "tools.runs", str(deep), "--markdown", str(markdown)],
                                 cwd=ROOT, capture_output=True, text=True)
        assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr[-2000:]
        assert refused.stderr.strip().splitlines() == [f"error: --markdown {markdown} is a folder, device or FIFO: "
                                                       "nothing written; pass a file name"]
    assert (tmp_path / "fifo.md").is_fifo()  # still the FIFO it was
    missing = subprocess.run([sys.executable, "-m", "tools.runs", str(tmp_path / "missing")], cwd=ROOT,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_runs_table_of_hostile_run_folders_writes_and_prints_only_the_table(tmp_path):
    """--markdown was written through a RUNS.md link planted in a run folder, into the file it points to; a summary's
    terminal escapes were printed raw, and a metric's name made a row of its own; a tree past the path limit was a
    traceback."""
    from test_hostile import past_path_max

    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "summary.json").write_text(json.dumps({"steps": 3, "data": "\x1b]0;owned\x07",
                                                         "x |\n| forged | row": 1.0}))
    outside = tmp_path / "outside.md"
    outside.write_text("mine")
    (runs / "a" / "RUNS.md").symlink_to(outside)
    table = subprocess.run([sys.executable, "-m", "tools.runs", str(runs), "--all", "--markdown",
                            str(runs / "a" / "RUNS.md")], cwd=ROOT, capture_output=True, text=True)
    assert table.returncode == 0 and outside.read_text() == "mine", table.stderr[-2000:]
    assert "\x1b" not in table.stdout and table.stdout.count("\n") == 3  # the header, its rule, one row
    assert "| x \\|\\n\\| forged \\| row |" in table.stdout and "| \\x1b]0;owned\\x07 |" in table.stdout
    assert not (runs / "a" / "RUNS.md").is_symlink() and table.stdout in (runs / "a" / "RUNS.md").read_text()
    past_path_max(runs / "deep")
    deep = subprocess.run([sys.executable, "-m", "tools.runs", str(runs)], cwd=ROOT, capture_output=True, text=True)
    assert deep.returncode == 1 and deep.stderr == (f"error: cannot list the folders under {runs} (File name too "
                                                    "long): move the runs nearer the root, or make their folders "
                                                    "readable\n")


def test_runs_table_escapes_a_run_folders_name_that_is_not_utf_8(tmp_path):
    """A run folder named in another encoding (Latin-1's 0xe9): --markdown ended in a UnicodeEncodeError traceback."""
    runs = tmp_path / "runs"
    run = runs / os.fsdecode(b"caf\xe9")
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": 3, "eval_acc": 0.5}))
    table = subprocess.run([sys.executable, "-m", "tools.runs", str(runs), "--markdown", str(tmp_path / "RUNS.md")],
                           cwd=ROOT, capture_output=True, text=True)
    assert table.returncode == 0 and not table.stderr, table.stderr[-2000:]
    assert "| caf\\udce9 |" in table.stdout and "| caf\\udce9 |" in (tmp_path / "RUNS.md").read_text()


def test_runs_table_reads_the_older_name_of_max_eval_acc(tmp_path):
    from tools.runs import collect

    for name, summary in (("old", {"best_eval_acc": 0.8, "steps": 3}), ("new", {"max_eval_acc": 0.7, "steps": 3})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert [(row["run"], row["max_acc"]) for row in collect(tmp_path)] == [("new", 0.7), ("old", 0.8)]


def test_logged_gradient_norm_is_the_mean_of_the_finite_steps():
    # Under fp16 the gradient scaler skips steps whose gradients overflowed; their infinite norm
    # would turn the logged mean into Infinity, so it is left out.
    from accelerate import Accelerator

    from shared.checkpoints import Progress
    from shared.tracking import TrainWindow

    window = TrainWindow(Accelerator(cpu=True), Progress())
    window.add(torch.tensor(0.5), {"acc": torch.tensor(1)}, 2)  # a batch that completed no step: no norm
    for norm in (2.0, float("inf"), 4.0):
        window.add(torch.tensor(0.5), {"acc": torch.tensor(1)}, 2, torch.tensor(norm))
    point = window.flush(step=3)
    assert point["grad_norm"] == 3.0 and point["train_loss"] == 0.5 and point["train_acc"] == 0.5
    window.add(torch.tensor(0.5), {"acc": torch.tensor(2)}, 2, torch.tensor(1.0))
    assert window.flush(step=4)["grad_norm"] == 1.0  # a new window starts from zero


class OnAnotherDevice(torch.Tensor):
    """A CPU tensor that behaves as one on a GPU would: mixing it with CPU tensors or calling .numpy() fails, .cpu()
    returns a plain tensor. (--data_on_device keeps the test set on the GPU; evaluate() returns CPU predictions.)"""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cpu:
            return args[0].as_subclass(torch.Tensor).clone()
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if any(not isinstance(t, cls) for t in tensors):
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("on_the_gpu", ["test set", "predictions"])
def test_pictures_are_drawn_from_tensors_on_any_device(tmp_path, on_the_gpu):
    from accelerate import Accelerator

    from shared.data import ImageTensors
    from shared.pictures import save_pictures

    images = torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8)
    labels, predictions = torch.arange(12) % 3, torch.arange(12) % 2
    if on_the_gpu == "test set":
        images, labels = images.as_subclass(OnAnotherDevice), labels.as_subclass(OnAnotherDevice)
    else:
        predictions = predictions.as_subclass(OnAnotherDevice)
    test_set = ImageTensors(images, labels, ["a", "b", "c"], "test")
    save_pictures(Accelerator(cpu=True), tmp_path, test_set, predictions, step=1)
    with Image.open(tmp_path / "confusion_matrix.png") as image:
        assert image.format == "PNG" and image.size[0] >= 400


def test_a_run_starts_no_progress_bar_monitor_thread(data, tmp_path):
    """tqdm's monitor thread (it only retunes a stalled bar's refresh rate) hung a run under `ulimit -v` (4.5 GB of
    address space): it never began while tqdm held its lock, and Thread.start waited for ever, deaf to SIGTERM."""
    import threading

    before = set(threading.enumerate())
    ok(run_here("cifar_cnn", "--data", data, "--max_steps", "1", "--batch_size", "8", "--tracker", "none",
                "--output_dir", tmp_path / "run"))
    assert not [thread.name for thread in set(threading.enumerate()) - before if "monitor" in thread.name]


def test_without_a_terminal_a_line_comes_at_least_every_30_s(monkeypatch, capsys):
    from accelerate import Accelerator

    from shared import tracking
    from shared.checkpoints import Progress
    from shared.tracking import TrainWindow

    clock = [1000.0]
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: clock[0])
    window = TrainWindow(Accelerator(cpu=True), Progress())
    assert not window.terminal  # pytest's captured stdout and stderr
    window.add(torch.tensor(0.5), {"acc": torch.tensor(1)}, 310)  # 310 samples in the 31 s below
    clock[0] += 29
    window.heartbeat(1, 10)
    assert capsys.readouterr().out == ""  # not yet
    clock[0] += 2
    window.heartbeat(2, 10)
    assert capsys.readouterr().out == "step 2/10  train_loss 0.5000  10 samples/s (since the last log point)\n"
    window.terminal = True  # a terminal has the progress bar instead (TrainWindow: stderr's or stdout's, at its start)
    clock[0] += 60
    window.heartbeat(3, 10)  # and once, ESTIMATE_S after the first step, the time the rest takes, on a terminal too
    assert capsys.readouterr().out == ("about 4 min of training left to step 10, at 31 s a step (steps 2-3; "
                                       "evaluations and checkpoints come on top)\n")
    clock[0] += 60
    window.heartbeat(4, 10)
    assert capsys.readouterr().out == ""
    # stdout a terminal, stderr not: `accelerate launch` of one process from accelerate 1.16 pipes its stderr
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert TrainWindow(Accelerator(cpu=True), Progress()).terminal



def test_the_curves_show_the_metrics_and_nothing_of_the_summary(tmp_path, monkeypatch):
    """The summary's row, logged at the run's end, holds train_s: it was drawn as a metric in curves.png."""
    import matplotlib.axes

    from shared.pictures import plot_curves

    labels, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *args, **kwargs: (
        labels.append(kwargs.get("label")), plot(ax, *args, **kwargs))[1])
    rows = [{"step": 1, "train_loss": 2.0, "train_acc": 0.1, "grad_norm": 1.0, "samples_per_s": 9.0},
            {"step": 1, "eval_loss": 2.1, "eval_acc": 0.2, "eval_samples": 20},
            {"step": 1, "train_s": 3.5, "wall_s": 4.0, "max_eval_acc": 0.2, "samples_per_s": 9.0}]
    plot_curves(rows, tmp_path / "curves.png", "run")
    assert sorted(labels) == ["eval_acc", "eval_loss", "grad_norm", "train_acc", "train_loss"]


def test_the_time_the_rest_of_the_training_takes_is_said_once_early(data, tmp_path):
    """Fine-tuning on a CPU defaulted to 10 epochs with nothing to say what they cost before the first epoch's end:
    now one line, 20 steps (or 10 s) after the first step, which warms caches up."""
    result = ok(run_here("cifar_cnn", "--data", data, "--max_steps", "30", "--batch_size", "4", "--tracker", "none",
                         "--output_dir", tmp_path / "run"))
    said = [line for line in result.stdout.splitlines() if line.startswith("about ")]
    found = re.fullmatch(r"about \d+ (s|min) of training left to step 30, at ([\d.e-]+) s a step \(steps 2-(\d+); "
                         r"evaluations and checkpoints come on top\)", said[0])
    assert len(said) == 1 and found and float(found[2]) > 0 and 2 < int(found[3]) <= 21, said


def test_the_curves_keep_a_colour_a_series_show_evaluations_over_them_the_epochs_and_each_resume(tmp_path, monkeypatch):
    """Before: train blue in one panel and orange in the next (metrics sorted eval first), a run's one evaluation
    hidden under the training curve, no epoch, a resume not shown."""
    import matplotlib.axes

    from shared.pictures import plot_curves

    lines, marks, axes, plot = [], [], [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *args, **kwargs: (
        lines.append(kwargs), plot(ax, *args, **kwargs))[1])
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline", lambda ax, x, **kwargs: marks.append(x))
    secondary = matplotlib.axes.Axes.secondary_xaxis
    monkeypatch.setattr(matplotlib.axes.Axes, "secondary_xaxis", lambda ax, *args, **kwargs: (
        axes.append(kwargs["functions"]), secondary(ax, *args, **kwargs))[1])
    rows = [{"step": n, "epoch": n / 10, "train_loss": 1 / n, "train_acc": 0.5, "train_top5": 0.9, "grad_norm": 1.0}
            for n in range(1, 21)]
    rows[10:10] = [{"step": 10, "eval_loss": 0.5, "eval_acc": 0.6, "eval_top5": 0.95, "eval_samples": 20},
                   {"step": 10, "resumed": True}]
    plot_curves(rows, tmp_path / "curves.png", "run")
    colours = {line["label"]: line["color"] for line in lines}
    assert colours == {"train_loss": "C0", "train_acc": "C0", "train_top5": "C0", "grad_norm": "C2", "eval_loss": "C1",
                       "eval_acc": "C1", "eval_top5": "C1"}
    styles = {line["label"]: line["linestyle"] for line in lines}
    assert styles["train_acc"] == styles["eval_acc"] != styles["train_top5"] == styles["eval_top5"]
    assert all(line["zorder"] > 2 and line["marker"] == "o" for line in lines if line["label"].startswith("eval"))
    assert marks == [10, 10, 10]  # the resume, in each panel
    to_epoch, to_step = axes[0]
    assert len(axes) == 3 and to_epoch(15) == 1.5 and to_step(0.5) == 5


def test_the_curves_of_a_metrics_file_of_any_length_keep_evenly_spaced_points_within_a_bound(tmp_path, monkeypatch):
    """Every point of metrics.jsonl was kept to be drawn: 3 million rows took 400 MB more on a resume (2.1 GB on the
    probe's machine). Now at most 2 * MAX_POINTS a series, every k-th row."""
    import matplotlib.axes

    from shared import pictures

    monkeypatch.setattr(pictures, "MAX_POINTS", 100)
    drawn, plot = {}, matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *args, **kwargs: (
        drawn.update({kwargs.get("label"): args[0]}), plot(ax, *args, **kwargs))[1])
    rows = ({"step": n, "train_loss": 1 / (n + 1), **({"eval_loss": 1.0} if n % 1000 == 0 else {})}
            for n in range(100_000))
    pictures.plot_curves(rows, tmp_path / "curves.png", "run")
    for key, every in (("train_loss", 512), ("eval_loss", 1000)):  # 100,000 / 512 = 196 points; eval: 100, all
        assert list(drawn[key]) == list(range(0, 100_000, every)), (key, drawn[key][:5], len(drawn[key]))


@pytest.mark.slow  # a terminal: a process of its own
@pytest.mark.parametrize("launcher", [(), ("-m", "accelerate.commands.accelerate_cli", "launch", "-q", "--config_file",
                                           "accelerate_configs/cpu.yaml")], ids=["python", "accelerate launch"])
def test_the_progress_bar_on_a_terminal_counts_the_batches_the_run_will_train(env, tmp_path, launcher):
    """On a terminal, a bar with the loss, accuracy and speed (without one, lines: the tensorboard test), and for a
    run of --max_steps 4 in an epoch of 8 batches, 4 batches to go (it showed 8). Under `accelerate launch` too,
    which from accelerate 1.16 passes its process's stderr through a pipe (the bar was gone there)."""
    import fcntl
    import pty
    import termios

    data = cifar_binary_dataset(tmp_path / "data", sizes={"train": 64, "test": 16})
    primary, secondary = pty.openpty()  # stdout and stderr a terminal, as in a shell: the bar is drawn there
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("4H", 24, 160, 0, 0))  # 0 columns: tqdm draws nothing
    process = subprocess.Popen([sys.executable, *launcher, "recipes/cifar_cnn.py", "--data", str(data),
                                "--batch_size", "8", "--max_steps", "4", "--log_every", "2", "--tracker", "none",
                                "--output_dir", str(tmp_path / "run")],
                               cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    drawn = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the run ended: no process holds the terminal any more
            break
        if not chunk:
            break
        drawn += chunk
    os.close(primary)
    assert process.wait(timeout=300) == 0, drawn.decode(errors="replace")[-2000:]
    text = drawn.decode(errors="replace")
    assert "0/4 " in text and "/8 " not in text, text[-2000:]
    assert "epoch 1/" in text and "loss=" in text and "acc=" in text and "samples_per_s=" in text


def test_runs_started_in_the_same_second_get_a_folder_each(tmp_path):
    """The default folder is named by the second: the second run took the first's folder and found its lock."""
    from shared.checkpoints import new_folder

    base = str(tmp_path / "runs" / "cifar_cnn-20261127-080000")
    made = [new_folder(base) for _ in range(3)]
    assert made == [Path(base), Path(f"{base}-2"), Path(f"{base}-3")] and all(path.is_dir() for path in made)


def test_a_wandb_run_whose_service_has_gone_is_replaced_by_a_disabled_one_said_once(capsys):
    """wandb's service process (wandb-core) ends at once on a SIGINT or SIGTERM, and `accelerate launch` of one process
    sends one to every process under it from 1.16: the run's next log or finish then failed in a ConnectionResetError
    traceback, before the stop's checkpoint and the row's line in metrics.jsonl (wandb's tracker is first). In-process,
    a run whose socket is gone stands in; a stop launched is tests/test_stops.py's."""
    from accelerate import PartialState

    from shared.tracking import WandB

    class Gone:
        calls = 0

        def log(self, *args, **kwargs):
            Gone.calls += 1
            raise ConnectionResetError("Connection lost")

        finish = log

    PartialState()  # the trackers' calls are the main process's
    logged, finished = WandB.__new__(WandB), WandB.__new__(WandB)  # no wandb.init: its service is what is gone
    logged.run = finished.run = Gone()
    logged.log({"train_loss": 1.0}, step=3)
    logged.log({"train_loss": 0.9}, step=4)
    logged.finish()
    assert Gone.calls == 1 and logged.run.disabled
    out = capsys.readouterr().out
    assert out.count("wandb: its service process has stopped (ConnectionResetError: Connection lost)") == 1, out
    assert "(wandb/wandb#9963)" in out and "To keep it, signal the training process alone (kill <its pid>)" in out
    finished.finish()  # a stop with no log point after the signal: the finish is the first call that fails
    assert Gone.calls == 2 and finished.run.disabled and "service process has stopped" in capsys.readouterr().out
