"""Files from anywhere, tried as an attacker would: weights whose metadata names code or data, checkpoints copied
elsewhere, dataset files whose headers or sizes lie (gzip bombs, files that never end), decompression
bombs among images, and flags past their limits. Each case runs the script's main() and must end in one line on
stderr, no traceback, a non-zero exit, no marker file (no code ran), no new decode cache and nothing changed outside
its output folder. Where a memory limit, a FIFO, a kill or a hang is the point, the case launches the real script
under a memory limit and a timeout, and its peak of resident memory is bounded too (docs/troubleshooting.md, Limits):
those are in the slow tier."""

from __future__ import annotations

import codecs
import errno
import gzip
import hashlib
import http.server
import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import threading
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torchvision
from PIL import Image
from safetensors.torch import save_file

from shared import dataset_files
from shared.data import CACHE_DIR
from shared.dataset_files import find_dataset_files, read_pickled_batch
from shared.errors import RecipeError
from shared.pickles import DirectoryReads, check_archive

from conftest import ROOT, assert_bitwise_equal, launch, ok, read_jsonl, run_here, weights
from tiny_data import (
    cifar_binary_dataset,
    cifar_folder,
    cifar_python_folder,
    idx_folder,
    image_splits,
    imagefolder_dataset,
    parquet_dataset,
    random_splits,
    save_to_disk_dataset,
    write_idx,
)

ADDRESS_SPACE = 8 * 2**30  # RLIMIT_AS of each run: torch alone reserves about 5 GiB of address space
PEAK_RSS = 1.5 * 2**30  # what a refused input may cost in resident memory; the attacks below asked for 2.7-27 GB
TIMEOUT_S = 120
SHORT = ("--batch_size", "8", "--max_steps", "4", "--log_every", "1", "--tracker", "none")
# Runs a command under the limits and reports its children's peak resident memory, which the test reads back.
WRAPPER = f"""
import resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE}))
code = subprocess.run(sys.argv[2:]).returncode
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(code)
"""


def snapshot(folder: Path, skip: Path | None = None) -> dict:
    return {p: digest(p) for p in sorted(folder.rglob("*")) if p.is_file() and not (skip and p.is_relative_to(skip))}


def digest(path: Path) -> str | tuple[int, int]:
    """The file's SHA-256; over 64 MiB, its size and modification time: a hostile file may be gigabytes of a sparse
    file's zeros, which took seconds to hash for each snapshot."""
    size = path.stat().st_size
    return hashlib.sha256(path.read_bytes()).hexdigest() if size <= 2**26 else (size, path.stat().st_mtime_ns)


def refused(env, tmp_path: Path, script: str, *args, needle: str, status: int = 1, cwd: Path = ROOT,
            decoded: bool = False, launched: bool = False, variables: dict | None = None) -> str:
    """`python recipes/<script>.py args`, with `variables` set, refused; returns its line. In this process (run_here),
    or `launched`: a real process under the memory limit and the timeout, its peak resident memory bounded too.
    `decoded`: the refusal comes after the data decoded, so the cache may hold it (no test before it on this worker
    may have)."""
    marker, rss = tmp_path / "MARKER", tmp_path.parent / f"{tmp_path.name}.rss"
    cache = Path(env["HF_HOME"]) / "datasets" / "decoded" if launched else CACHE_DIR
    before, cached = snapshot(tmp_path, skip=tmp_path / "out"), set(cache.glob("*")) if cache.exists() else set()
    if launched:
        result = subprocess.run([sys.executable, "-c", WRAPPER, str(rss), sys.executable,
                                 ROOT / f"recipes/{script}.py", *map(str, args)], cwd=cwd,
                                env={k: v for k, v in {**env, **(variables or {})}.items() if v}, capture_output=True,
                                text=True, timeout=TIMEOUT_S)
        peak = int(rss.read_text())
        assert peak < PEAK_RSS, f"peak resident memory {peak / 2**30:.2f} GiB"
    else:
        result = run_here(script, *args, cwd=cwd, env=variables)
    assert not marker.exists(), "the input ran code"
    assert snapshot(tmp_path, skip=tmp_path / "out") == before, "files outside the output folder changed"
    assert decoded or (set(cache.glob("*")) if cache.exists() else set()) == cached, "a failed decode left a cache file"
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("hostile") / "data", sizes={"train": 64, "test": 20})


@pytest.fixture(scope="module")
def run(env, data, tmp_path_factory):
    """A finished cifar_cnn run with a checkpoint at every step (1-4)."""
    out = tmp_path_factory.mktemp("hostile_run") / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *SHORT, "--checkpoint_every", "1",
                "--keep_checkpoints", "10"))
    return out


# ------------------------------------------------------------------ weights whose metadata names code or data
def evil_script(tmp_path: Path) -> Path:
    script = tmp_path / "evil.py"
    script.write_text(f"open({str(tmp_path / 'MARKER')!r}, 'w')\n")
    return script


def weights_with(tmp_path: Path, run: Path, **metadata) -> Path:
    from safetensors import safe_open

    with safe_open(run / "model.safetensors", "pt") as f:
        state, about = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    path = tmp_path / "model.safetensors"
    save_file(state, path, metadata={**about, **{k: v if isinstance(v, str) else json.dumps(v)
                                                for k, v in metadata.items()}})
    return path


@pytest.mark.parametrize("names", ["script", "recipe path", "checkpoint config.json"])
def test_weights_never_choose_the_code_that_runs(env, run, tmp_path, names):
    evil = evil_script(tmp_path)
    images = tmp_path / "photos"
    imagefolder_dataset(images, sizes={"x": 2})
    if names == "checkpoint config.json":
        fake = tmp_path / "fake_run"
        shutil.copytree(run / "checkpoints" / "step_4", fake / "checkpoints" / "step_4")
        config = json.loads((run / "config.json").read_text())
        for folder in (fake, fake / "checkpoints" / "step_4"):  # the run's and the checkpoint's own
            (folder / "config.json").write_text(json.dumps({**config, "script": str(evil), "recipe": str(evil)[:-3]}))
        weights = fake / "checkpoints" / "step_4"
    else:
        meta = {"script": str(evil)} if names == "script" else {"recipe": "../" * 12 + str(evil)[1:-3]}
        weights = weights_with(tmp_path, run, **meta)
    if names == "script":  # the recipe they name is one beside predict.py: it runs, and the script they name never
        (tmp_path / "out").mkdir()
        ok(run_here("predict", "--weights", weights, "--images", images, "--output", tmp_path / "out" / "p.csv"))
        assert not (tmp_path / "MARKER").exists() and (tmp_path / "out" / "p.csv").is_file()
        return
    line = refused(env, tmp_path, "predict", "--weights", weights, "--images", images, "--output",
                   tmp_path / "out" / "p.csv", needle="which recipe builds the model? ")
    assert "a file the weights name is never imported" in line


@pytest.mark.parametrize("metadata, needle", [
    ({"flags": {"data": "someone/a-dataset"}}, "'someone/a-dataset', no folder here (a relative path is read from "
                                                "the folder predict.py is started in): pass --data"),
    ({"flags": {"lr": -1}}, "do not fit cifar_cnn.Config (--lr must be > 0, got -1)"),
    ({"flags": {"batch_norm": "yes"}}, "gives batch_norm = 'yes', not a <class 'bool'>"),
    ({"flags": ["--lr", "1"]}, "holds no flags (a dict)"),
    ({"classes": 5}, "names no classes"),
    ({"classes": [*"abcdefghi", "a"]}, "or a class twice: pass --classes"),  # label 9 would be called a, as 0 is
])
def test_weights_metadata_is_checked_and_never_fetched(env, run, tmp_path, metadata, needle):
    weights = weights_with(tmp_path, run, **metadata)
    refused(env, tmp_path, "predict", "--weights", weights, "--recipe", "cifar_cnn", "--evaluate", needle=needle)


def test_weights_that_are_a_folder_without_weights(env, tmp_path):
    refused(env, tmp_path, "predict", "--weights", "/tmp", "--recipe", "cifar_cnn", "--classes", "a,b",
            "--evaluate", "--data", tmp_path, needle="/tmp/model.safetensors: no such file")


def zip_bomb(path: Path, claim: bool = False) -> None:
    """torch.save's zip, rewritten with its entries deflated (so a tensor of zeros of any size takes a few bytes); or
    (`claim`) stored as torch.save stores them, but the first entry's size in the central directory 2 GiB."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED if claim else zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for name, content in entries:
            archive.writestr(name, content)
    if claim:
        raw = bytearray(path.read_bytes())
        at = raw.index(b"PK\x01\x02")  # the first central directory record; its uncompressed size at offset 24
        raw[at + 24:at + 28] = struct.pack("<I", 2**31)
        path.write_bytes(bytes(raw))


@pytest.mark.slow  # launched: inflated, these would take gigabytes
@pytest.mark.parametrize("claim", [False, True], ids=["deflated", "claims more than the file"])
def test_compressed_weights_are_not_inflated(env, run, tmp_path, claim):
    """A 3.4 MB .pt of deflated entries reached 3.4 GB in predict.py and exited 0."""
    pt = tmp_path / "weights.pt"
    torch.save(weights(run), pt)
    zip_bomb(pt, claim)
    refused(env, tmp_path, "predict", "--weights", pt, "--recipe", "cifar_cnn", "--classes", ",".join("abcdefghij"),
            "--images", tmp_path, "--output", tmp_path / "out" / "p.csv",
            needle="which torch.save never writes: they could inflate to any size, so it is not loaded", launched=True)


@pytest.mark.parametrize("entry", ["resnet50-11ad3fa6.pth", "sub/dir/planted.pth"])
def test_a_cached_weights_file_in_torch_hubs_legacy_zip_format_is_not_extracted(env, data, tmp_path, entry):
    """A zip of one entry at torchvision's cache path is torch.hub's legacy format: torch.hub extracted the entry
    beside it under the entry's own name (over the user's cached ResNet-50 weights, or into new folders) and
    finetune.py trained on it. Read as the exact file, it is no torch.save file: one line, nothing written."""
    cache = tmp_path / "home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    (cache / "resnet50-11ad3fa6.pth").write_bytes(b"the user's cached ResNet-50 weights")
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "resnet18.pth")
    with zipfile.ZipFile(cache / "resnet18-f37072fd.pth", "w") as archive:
        archive.write(tmp_path / "resnet18.pth", entry)
    refused(env, tmp_path, "finetune", "--data", data, "--image_size", "32", *SHORT, "--output_dir", tmp_path / "out",
            needle="resnet18-f37072fd.pth' is damaged or holds a pickle that is refused (not an archive torch.save "
                   "wrote)", decoded=True,
            variables={"TORCH_HOME": str(tmp_path / "home")})


@pytest.mark.slow  # launched: inflated, it would take gigabytes
def test_a_compressed_checkpoint_file_is_not_inflated(env, data, run, tmp_path):
    """A 2.9 MB custom_checkpoint_0.pkl reached 3.5 GB on resume. Here 200 MB of zeros in 0.2 MB."""
    out = unfinished(run, tmp_path)
    (out / "checkpoints" / "step_4" / "custom_checkpoint_0.pkl").write_bytes(saved({"pad": torch.zeros(50_000_000)},
                                                                                  deflated=True))
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
            needle="custom_checkpoint_0.pkl' holds entries of ", launched=True, decoded=True)


# ------------------------------------------------------------------ resumes that would delete or mix histories
def test_a_checkpoint_outside_a_runs_checkpoints_folder_is_refused(env, data, run, tmp_path):
    # A folder of the user's, with a copy of the checkpoint in exports/ and files that look like a run's.
    folder = tmp_path / "mine"
    shutil.copytree(run, folder)
    shutil.copytree(run / "checkpoints" / "step_3", folder / "exports" / "step_3")
    args = ("--data", data, *SHORT, "--keep_checkpoints", "1")
    refused(env, folder, "cifar_cnn", *args, "--resume", folder / "exports" / "step_3",
            needle="is not in a run's checkpoints/ folder")
    refused(env, folder, "cifar_cnn", *args, "--resume", run / "checkpoints" / "step_3", "--output_dir", folder,
            needle="which holds another run")
    # Into a new folder it continues as a new run: the same weights as the run never stopped.
    out = tmp_path / "new"
    ok(run_here("cifar_cnn", *args, "--resume", folder / "exports" / "step_3", "--output_dir", out))
    assert_bitwise_equal(weights(out), weights(run))


def test_an_older_checkpoint_starts_a_branch_and_the_later_history_is_moved_aside(env, data, run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    args = ("--data", data, *SHORT, "--checkpoint_every", "1", "--keep_checkpoints", "10", "--output_dir", out)
    result = ok(run_here("cifar_cnn", *args, "--max_steps", "6", "--resume", out / "checkpoints" / "step_2"))
    aside = next((out / "abandoned").glob("after_step_2-*"))
    assert f"the later history (step_3, step_4) moved to {aside}" in result.stdout
    assert sorted(p.name for p in aside.iterdir()) == ["config.json", "confusion_matrix.png", "curves.png",
                                                       "metrics.jsonl", "model.safetensors", "step_3", "step_4",
                                                       "summary.json"]
    assert digest(aside / "confusion_matrix.png") == digest(run / "confusion_matrix.png")
    assert snapshot(aside / "step_4") == {aside / "step_4" / p.relative_to(run / "checkpoints" / "step_4"): h
                                          for p, h in snapshot(run / "checkpoints" / "step_4").items()}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{n}" for n in range(1, 7)]
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert steps == [1, 2, 3, 4, 5, 6]  # one history: the new branch after step 2
    resumed = ok(run_here("cifar_cnn", *args, "--max_steps", "7", "--resume", "latest"))
    assert f"resuming from {out / 'checkpoints' / 'step_6'}: step 6" in resumed.stdout


def test_a_branch_that_cannot_be_moved_aside_is_one_line_and_nothing_moves(env, data, run, tmp_path, monkeypatch):
    """abandoned/ that cannot hold the later history (read-only: the system refuses the first copy into it, here
    told to, since root writes in read-only folders): a traceback before. Refused before anything moves. (A file
    named abandoned is refused at the start: test_a_file_where_a_run_makes_a_folder_is_refused_before_the_run.)"""
    out = tmp_path / "out"
    shutil.copytree(run, out)
    before = snapshot(out)

    def read_only(*args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(shutil, "copy2", read_only)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out, "--resume",
            out / "checkpoints" / "step_2", needle="must be a folder you can write in (and the run's folders too), "
            "with room on its disk, then resume again; nothing was deleted")
    assert snapshot(out) == before


def test_a_full_disk_during_a_branch_moves_nothing(env, data, run, tmp_path, monkeypatch):
    """The copies into abandoned/ need room on the disk, and they came after the moves: a full disk left the later
    checkpoints moved aside and the run's copies missing. The copies come first now; the moves, renames, need none."""
    out = tmp_path / "out"
    shutil.copytree(run, out)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copy2", full_disk)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out, "--resume",
            out / "checkpoints" / "step_2", needle="failed (No space left on device): ")
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [f"step_{n}" for n in range(1, 5)]
    assert (out / "curves.png").exists() and (out / "summary.json").exists() and (out / "model.safetensors").exists()


def test_the_resume_report_compares_with_the_configuration_that_wrote_the_checkpoint(env, data, run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    args = ("--data", data, *SHORT, "--output_dir", out, "--lr", "0.1", "--resume", out / "checkpoints" / "step_2")
    for _ in range(2):  # the second run finds the run's config.json written by the first, with --lr 0.1
        result = ok(run_here("cifar_cnn", *args))
        assert "changed since the checkpoint: lr 0.05 -> 0.1" in result.stdout, result.stdout


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)], ids=["plain", "overwrite"])
def test_a_folder_that_never_held_a_run_is_left_as_it_is(env, data, tmp_path, overwrite):
    """Neither a run nor empty: with or without --overwrite nothing is written into it (its metrics.jsonl was
    appended to, and a later resume of it failed)."""
    folder = tmp_path / "mine"
    for name in ("checkpoints", "wandb", "tensorboard", "abandoned"):
        (folder / name).mkdir(parents=True)
        (folder / name / "notes.txt").write_text("mine")
    (folder / "metrics.jsonl").write_text('{"step": 1, "mine": true}\n')
    refused(env, folder, "cifar_cnn", "--data", data, *SHORT, "--output_dir", folder, *overwrite,
            needle="holds files but no run of these recipes")


def unfinished(run: Path, tmp_path: Path) -> Path:
    """A copy of the finished run without its weights: a resume has its last evaluation and files to write."""
    out = tmp_path / "out"
    shutil.copytree(run, out)
    (out / "model.safetensors").unlink()
    return out


LINKS = [("curves.png", "file"), ("confusion_matrix.png", "file"), ("metrics.jsonl", "file"), ("metrics.jsonl", "none"),
         ("summary.tmp", "none"), (".write_test", "none"), ("abandoned", "folder"), ("checkpoints/step_4", "folder"),
         ("checkpoints", "folder"), ("config.json", "file")]


# --overwrite deletes what a run wrote: the links it met (checkpoints/ and step_4 ended in tracebacks)
OVERWRITTEN_LINKS = [("checkpoints", "folder"), ("checkpoints/step_4", "folder"), ("curves.png", "file")]


@pytest.mark.parametrize("name, target, how", [(*link, "resume") for link in LINKS]
                         + [(*link, "overwrite") for link in OVERWRITTEN_LINKS])
def test_a_link_in_a_run_folder_is_refused_before_anything_is_written(env, data, run, tmp_path, name, target, how):
    """A run folder from elsewhere with a symbolic link in it: written through, it changed files outside the run
    (curves.png, metrics.jsonl, a dangling link's target, abandoned/'s), and --overwrite or pruning ended in a
    traceback. The link's target (outside the run) and the run are left as they were."""
    out, outside = unfinished(run, tmp_path), tmp_path / "outside"
    if target == "file":
        outside.write_bytes((out / name).read_bytes() if (out / name).is_file() else b"mine")
    elif target == "folder":
        shutil.copytree(out / name, outside) if (out / name).is_dir() else outside.mkdir()
        (outside / "mine.txt").write_text("mine")
    shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(outside)
    before = snapshot(out)
    flag = ("--resume", "latest") if how == "resume" else ("--overwrite",)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, *flag,
            needle=f"{str(out / name)!r} is a symbolic link: nothing in a run folder is written or read through one")
    assert snapshot(out) == before and os.path.lexists(out / name) and (target == "none") != outside.exists()


@pytest.mark.parametrize("how", ["resume", "overwrite"])
def test_hard_links_in_a_run_folder_keep_their_other_names_bytes(env, data, run, tmp_path, how):
    """A hard link cannot be told from the file: every file a run writes whole is written under a temporary name and
    renamed over it, every file it removes is unlinked, and it appends only to files this launch made (metrics.jsonl
    is rewritten under a new name at a resume first; TensorBoard starts a new event file): the link's other name, a
    file outside the run, keeps its bytes. (Before, curves.png and confusion_matrix.png were rewritten in place.)"""
    out = unfinished(run, tmp_path) if how == "resume" else tmp_path / "out"
    if how == "overwrite":
        shutil.copytree(run, out)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.planted").write_bytes(b"events")
    names = ["metrics.jsonl", "config.json", "summary.json", "curves.png", "confusion_matrix.png",
             "checkpoints/step_1/model.safetensors", "tensorboard/events.out.tfevents.planted"]
    names += ["model.safetensors"] if how == "overwrite" else []
    (tmp_path / "outside").mkdir()
    for name in names:
        os.link(out / name, tmp_path / "outside" / name.replace("/", "_"))
    before = snapshot(tmp_path / "outside")
    flags = ("--resume", "latest", "--max_steps", "6") if how == "resume" else ("--overwrite",)
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *SHORT[:-2], "--tracker", "tensorboard", *flags,
                "--checkpoint_every", "1", "--keep_checkpoints", "1"))
    assert snapshot(tmp_path / "outside") == before
    assert not (out / "checkpoints" / "step_1").exists() and (out / "model.safetensors").exists()


def test_wandbs_own_links_are_allowed(env, data, run, tmp_path):
    """wandb links its logs and its latest run in wandb/, and replaces the links instead of writing through them."""
    out = unfinished(run, tmp_path)
    (out / "wandb" / "offline-run-1").mkdir(parents=True)
    (out / "wandb" / "latest-run").symlink_to("offline-run-1")
    ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest"))
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("line", ["not json", '{"loss": 1}', '{"step": "3"}', "[1, 2]", "[" * 100_000,
                                  '{"step": 1, "x": "' + "a" * 2**21 + '"}'],
                         ids=["not json", "no step", "text step", "a list", "nested", "2 MiB"])
def test_a_metrics_row_that_is_no_row_is_one_line_and_nothing_is_lost(env, data, run, tmp_path, line):
    """Such rows ended a resume in a traceback; a 347 MB metrics.jsonl took 4.6 GB. Rows are read one at a time."""
    out = unfinished(run, tmp_path)
    with (out / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    before = snapshot(out)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
            needle=f"metrics.jsonl line {len(before and (run / 'metrics.jsonl').read_text().splitlines()) + 1} is "
            "not a metrics row (a JSON object with an integer step, under 1 MiB)")
    assert snapshot(out) == before and not list(out.glob("*.tmp*"))


def test_a_metrics_file_of_a_key_a_row_is_read_back_in_bounded_memory(tmp_path):
    """Each row may name a key of its own: a resume's summary (the last value of each key) and curves.png (a series
    each) kept them all: a 39 MB file took 0.25 GB more to draw than a run's file. They keep the first MAX_KEYS now
    (a run logs a few dozen), and the summary only numbers."""
    from shared.pictures import MAX_KEYS, plot_curves, read_rows
    from shared.resume import cut_metrics

    small, hostile = tmp_path / "small.jsonl", tmp_path / "hostile.jsonl"
    small.write_text("".join(json.dumps({"step": i, "train_loss": 1.0, "epoch": i / 10}) + "\n" for i in range(10)))
    hostile.write_text("".join(json.dumps({"step": i, f"train_k{i}": 1.0}) + "\n" for i in range(20_000)))  # 0.8 MB
    peaks = []
    tracemalloc.start()
    try:
        summary = cut_metrics(SimpleNamespace(metrics=hostile, labels={}), 10**6)
        peaks.append(tracemalloc.get_traced_memory()[1])
        for path in (small, hostile):  # drawn: matplotlib's own memory, then that of the file's series
            tracemalloc.reset_peak()
            plot_curves(read_rows(path), tmp_path / "curves.png", "run")
            peaks.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()
    assert len(summary) == MAX_KEYS and len(hostile.read_text().splitlines()) == 20_001  # kept whole, resume marked
    # Of a row's values, the summary keeps numbers, as a run logs them: these texts' 5 MiB went into summary.json
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"step": 0, f"text{i}": "a" * 2**19}) + "\n" for i in range(10)))
    assert cut_metrics(SimpleNamespace(metrics=texts, labels={}), 1) == {"step": 0}
    assert peaks[0] < 2**20 and peaks[2] - peaks[1] < 5 * 2**20, [f"{peak / 2**20:.1f} MiB" for peak in peaks]


def test_text_in_a_metrics_row_is_not_drawn(env, data, run, tmp_path):
    """Text values failed at the final plot, after training."""
    out = unfinished(run, tmp_path)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    rows[0] = json.dumps({**json.loads(rows[0]), "train_loss": "abc", "train_acc": None, "grad_norm": [1]})
    (out / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest"))
    assert (out / "curves.png").stat().st_size > 0 and (out / "model.safetensors").is_file()


def test_a_config_nested_past_the_recursion_limit(env, data, run, tmp_path):
    """In the checkpoint (the resume report) the run goes on and says it cannot compare; as the run's own config.json
    the folder is no run of these recipes."""
    out = unfinished(run, tmp_path)
    (out / "checkpoints" / "step_4" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    result = ok(run_here("cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out, "--resume",
                         "latest"))  # two steps past the checkpoint: the report compares
    assert "no readable config.json in " in result.stdout
    (out / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
            needle="holds files but no run of these recipes")


@pytest.mark.parametrize("run_id", ["../../elsewhere", "a:b", "", "x" * 65, "caf\u00e9"])
def test_a_run_id_that_is_no_plain_name_is_no_run_to_continue(env, data, run, tmp_path, run_id):
    """A resume continues the wandb run of the id in config.json: wandb refused one with / or : in a UsageError
    traceback. Such a folder is no run of these recipes, refused in one line, with wandb as its tracker too."""
    out = unfinished(run, tmp_path)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "run_id": run_id}))
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--tracker", "wandb", "--max_steps", "6",
            "--output_dir", out, "--resume", "latest", variables={"WANDB_MODE": "offline"},
            needle="no config.json with a run_id of letters and digits")


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "curves.png", "confusion_matrix.png"])
def test_a_folder_where_a_run_writes_a_file_is_refused_before_the_run(env, data, run, tmp_path, name):
    """Resumed, the run ended in an IsADirectoryError traceback: at its first row (metrics.jsonl), or after its
    training, as it wrote its summary or pictures; --overwrite deleted the folder and what it held. Refused at the
    start, the folder kept."""
    out = unfinished(run, tmp_path)
    (out / name).unlink()
    (out / name).mkdir()
    (out / name / "mine.txt").write_text("mine")
    for start in (("--resume", "latest"), ("--overwrite",)):
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out, *start,
                needle=f"{out / name} is a folder, where a run keeps its {name}: rename it")
        assert (out / name / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("name, tracker", [("wandb", "wandb"), ("tensorboard", "tensorboard"), ("finished", "none"),
                                           ("abandoned", "none")])
def test_a_file_where_a_run_makes_a_folder_is_refused_before_the_run(env, data, run, tmp_path, name, tracker):
    """wandb and TensorBoard ended a resume in a traceback at their start (NotADirectoryError, FileExistsError); a
    finished run extended failed after its training to move its weights into finished/, and the line said to free
    space. Refused at the start, the file kept."""
    out = tmp_path / "out"
    shutil.copytree(run, out)  # finished: a longer run moves its weights into finished/
    (out / name).write_text("mine")
    for start in (("--resume", "latest"), ("--overwrite",)):
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--tracker", tracker, "--max_steps", "6",
                "--output_dir", out, *start, variables={"WANDB_MODE": "offline"},
                needle=f"{out / name} is no folder, where a run keeps its {name}: rename it")
        assert (out / name).read_text() == "mine"


def test_a_file_where_a_checkpoint_is_saved_is_named_not_a_full_disk(env, data, run, tmp_path):
    """A file checkpoints/partial_step_5 (from elsewhere) where the save of step 5 makes its folder: the line said
    "free space" on a disk with room. It names the file now, which stays."""
    out = unfinished(run, tmp_path)
    partial = out / "checkpoints" / "partial_step_5"
    partial.write_text("mine")
    line = refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--checkpoint_every", "1",
                   "--output_dir", out, "--resume", "latest",
                   needle="saving the checkpoint of step 5 failed (File exists")
    assert line.endswith(f"; move {partial} aside or make it writable, then continue with --resume latest"), line
    assert partial.read_text() == "mine"


def test_a_checkpoint_is_resumed_only_under_the_name_of_its_step(env, data, run, tmp_path):
    """A checkpoint copied under another step's name (step_2 as step_99): --resume latest took it for the newest, its
    line said it was "older than the run's newest checkpoint (step_99)", itself, and moved the run's later history
    aside. A save that did not finish (partial_step_<N>, here without its random states), named with --resume, was
    resumed "re-seeded" from a checkpoint "written by 0 process(es)". Both refused in one line; nothing moves."""
    out = unfinished(run, tmp_path)
    checkpoints = out / "checkpoints"
    shutil.copytree(checkpoints / "step_2", checkpoints / "step_99")
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out,
            "--resume", "latest", needle=f"--resume {checkpoints / 'step_99'} holds step 2: its folder was renamed "
            "or copied; name it step_2 or move it aside, then resume")
    os.replace(checkpoints / "step_99", checkpoints / "partial_step_5")
    (checkpoints / "partial_step_5" / "random_states_0.pkl").unlink()
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--max_steps", "6", "--output_dir", out,
            "--resume", checkpoints / "partial_step_5", needle="a checkpoint whose save did not finish: resume from "
            "a complete one")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["partial_step_5", "step_1", "step_2", "step_3", "step_4"]
    assert not (out / "abandoned").exists()


def test_a_checkpoint_dir_that_holds_none_of_the_runs_checkpoints_names_where_they_are(env, data, run, tmp_path):
    """--checkpoint_dir added to the resume of a run that saved its checkpoints in its own folder: the line said the
    run had none and to start it again without --resume. It names the run's folder; the run and its checkpoints stay;
    with them moved there, the run continues."""
    out, elsewhere = unfinished(run, tmp_path), tmp_path / "out" / "scratch"
    line = refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
                   "--checkpoint_dir", elsewhere, status=2, needle=f"keeps its checkpoints in "
                   f"{str(out / 'checkpoints')!r}, and --checkpoint_dir {elsewhere} holds none")
    assert line.endswith("continue it with no --checkpoint_dir, or move them there first (see --help)"), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
    shutil.move(out / "checkpoints", elsewhere)
    result = ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
                         "--checkpoint_dir", elsewhere))
    assert f"resuming from {elsewhere / 'step_4'}: its last step (4)" in result.stdout
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow  # launched: a FIFO read would block the test forever
def test_a_fifo_in_a_checkpoint_is_refused_instead_of_blocking(env, data, run, tmp_path):
    """A FIFO among a checkpoint's files blocked the resume forever (it survived SIGTERM and its launcher's death)."""
    out = unfinished(run, tmp_path)
    (out / "checkpoints" / "step_4" / "random_states_0.pkl").unlink()
    os.mkfifo(out / "checkpoints" / "step_4" / "random_states_0.pkl")
    copy = tmp_path / "elsewhere" / "step_2"  # --resume of a checkpoint folder outside the run: checked too
    shutil.copytree(run / "checkpoints" / "step_2", copy)
    (copy / "random_states_0.pkl").unlink()
    os.mkfifo(copy / "random_states_0.pkl")
    for flags in (("--output_dir", out, "--resume", "latest"), ("--output_dir", tmp_path / "new", "--resume", copy)):
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, *flags, needle="random_states_0.pkl' is a FIFO, "
                "socket or device, not a regular file", launched=True)
    # A FIFO as the config.json of the run a checkpoint folder sits in, read to find whether it is a run: no run
    os.mkfifo(tmp_path / "elsewhere" / "config.json")
    (tmp_path / "elsewhere" / "checkpoints").mkdir()
    shutil.copytree(run / "checkpoints" / "step_2", tmp_path / "elsewhere" / "checkpoints" / "step_2")
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--resume",
            tmp_path / "elsewhere" / "checkpoints" / "step_2", needle="is not in a run's checkpoints/ folder",
            launched=True)


def test_a_second_run_in_a_folder_in_use_is_refused(env, data, run, tmp_path):
    """Two runs started at once in one folder: the winner carried the loser's config.json and a foreign metrics row.
    The first run holds a lock on the folder (taken here by the test, as a running run holds it)."""
    import fcntl

    out = unfinished(run, tmp_path)
    before = snapshot(out)
    descriptor = os.open(out, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    try:
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
                needle="is in use by another run, still running: wait for it to end, or pass another --output_dir")
    finally:
        os.close(descriptor)
    assert snapshot(out) == before
    ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest"))


@pytest.mark.slow  # launched: the process kills itself
def test_a_kill_while_metrics_are_rewritten_at_a_resume_loses_nothing(env, data, run, tmp_path):
    """A resume rewrites metrics.jsonl up to its checkpoint's step; a SIGKILL in the middle left a 363 MB file empty."""
    out = unfinished(run, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    killed = launch(dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), FAULT_KILL_WRITING="metrics"), "cifar_cnn",
                    "--data", str(data), *SHORT, "--output_dir", str(out), "--resume", "latest")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (out / "metrics.jsonl").read_bytes() == before


def test_resume_of_a_checkpoint_at_a_one_part_relative_path(env, data, run, tmp_path):
    shutil.copytree(run / "checkpoints" / "step_2", tmp_path / "step_2")
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--resume", "step_2", cwd=tmp_path,
            needle="--resume step_2 is not in a run's checkpoints/ folder")


def test_resume_latest_of_a_folder_without_a_run(env, data, tmp_path):
    """Refused before the data is read (the cache untouched): from another folder than the run's, the recipe's
    defaults took its hub data, fetched for nothing, before the line."""
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--resume", "latest", "--output_dir",
            tmp_path / "out", status=2, needle=f"--resume latest: no run in {tmp_path / 'out'} (looked for "
            f"{tmp_path / 'out' / 'config.json'})")


@pytest.mark.parametrize("tampered", [{"step": "3"}, {"max_eval_acc": 5.0}, {"wall_s": -1e9}, {"pieces": 10**15},
                                      {"train_s": float("nan")}], ids=str)
def test_a_checkpoint_whose_progress_is_not_counts(env, data, run, tmp_path, tampered):
    """Counters out of their ranges were reported as they were (an accuracy of 5.0, -1e9 s, 10^15 launches)."""
    copy = tmp_path / "out"
    shutil.copytree(run, copy)
    progress = copy / "checkpoints" / "step_2" / "custom_checkpoint_0.pkl"
    torch.save({**torch.load(progress, weights_only=True), **tampered}, progress)
    before = snapshot(copy)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", copy, "--resume",
            progress.parent, needle="its progress is not counts of steps, epochs and samples")
    assert snapshot(copy) == before


# ------------------------------------------------------------------ dataset files whose headers lie
def gzip_of_zeros(path: Path, header: bytes, zeros: int) -> None:
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(header)
        for _ in range(zeros // 2**24):
            f.write(bytes(2**24))
        f.write(bytes(zeros % 2**24))


def idx_gzip_bomb(folder: Path) -> str:  # 2 GiB of zeros (2 MB gzipped) behind a header that claims 20 images
    gzip_of_zeros(folder / "t10k-images-idx3-ubyte.gz", bytes([0, 0, 8, 3]) + struct.pack(">3I", 20, 28, 28), 2**31)
    return "is more than 15,696 bytes, not what its header says ((20, 28, 28))"


def idx_inflates(folder: Path) -> str:  # one image of 12,000 x 12,000 zeros: 144 MB from 140 KB (a 1 MB one: 1.5 GB)
    gzip_of_zeros(folder / "train-images-idx3-ubyte.gz", bytes([0, 0, 8, 3]) + struct.pack(">3I", 1, 12000, 12000),
                  144_000_000)
    return "claims 144,000,000 bytes of data in "


def idx_claims_too_much(folder: Path) -> str:  # one image of 2^32 x 2^32 pixels: 2^64 bytes
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bytes([0, 0, 8, 3, 0, 0, 0, 1]) + b"\xff" * 8))
    return "bytes of data, over the 4 GiB a dataset file may hold here"


def idx_claims_too_many(folder: Path) -> str:  # 2^32 images: fewer bytes a file, but too many to convert
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bytes([0, 0, 8, 3]) + b"\xff" * 4 + bytes(
        [0, 0, 0, 28, 0, 0, 0, 28])))
    return "4,294,967,315 images of 1x28x28 take 3136.0 GiB decoded, more than the"


def idx_label_outside_the_named_classes(folder: Path) -> str:
    """Fashion-MNIST, told by its published test labels, names ten classes: a training label of 200 is refused, not
    taken as class 200 of 201."""
    real = Path("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")
    if not real.exists():
        pytest.skip(f"no real Fashion-MNIST test labels at {real}: apt-get install dataset-fashion-mnist")
    shutil.copy(real, folder / real.name)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", np.zeros((10_000, 28, 28), np.uint8))
    labels = np.zeros(50, np.uint8)
    labels[7] = 200
    write_idx(folder / "train-labels-idx1-ubyte.gz", labels)
    return "'train' has labels outside 0..9"


def idx_fifo(folder: Path) -> str:  # a FIFO blocks its reader forever
    (folder / "train-images-idx3-ubyte.gz").unlink()
    os.mkfifo(folder / "train-images-idx3-ubyte")
    return "train-images-idx3-ubyte' is not a regular file (a FIFO, socket, device or folder)"


def idx_zero_length(folder: Path) -> str:
    write_idx(folder / "train-images-idx3-ubyte.gz", np.zeros((0, 28, 28), np.uint8))
    return "holds no data (its header says (0, 28, 28))"


def idx_too_wide(folder: Path) -> str:  # 50 images of 1 x 1,000,000 (50 MB): 36.5 GiB once 28 pixels high
    write_idx(folder / "train-images-idx3-ubyte.gz", np.zeros((50, 1, 1_000_000), np.uint8))
    return "images of 1000000x1 pixels, resized to 28000000x28 before the centre crop, take 36.5 GiB"


LAUNCHED = pytest.mark.slow  # under the memory limit, or where a read would block forever: launched


@pytest.mark.parametrize("damage", [pytest.param(idx_gzip_bomb, marks=LAUNCHED), pytest.param(idx_claims_too_much,
                                    marks=LAUNCHED), pytest.param(idx_claims_too_many, marks=LAUNCHED),
                                    idx_label_outside_the_named_classes,
                                    pytest.param(idx_fifo, marks=LAUNCHED), idx_zero_length,
                                    pytest.param(idx_too_wide, marks=LAUNCHED), idx_inflates])
def test_idx_files_that_lie(env, tmp_path, damage):
    folder = idx_folder(tmp_path / "fashion-mnist", random_splits((28, 28)))
    needle = damage(folder)
    refused(env, tmp_path, "resnet18_fmnist", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle=needle, launched=damage in (idx_gzip_bomb, idx_claims_too_much, idx_claims_too_many, idx_fifo,
                                               idx_too_wide))


def test_cifar_class_names_that_never_end(env, tmp_path):
    """A names file of 2 GiB (sparse: no disk used) in one line: read no further than a names file may hold."""
    folder = cifar_folder(tmp_path / "cifar-10-batches-bin", random_splits((3, 32, 32)), [str(i) for i in range(10)])
    with open(folder / "batches.meta.txt", "wb") as f:
        f.truncate(2**31)
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle="batches.meta.txt is not up to 256 class names of up to 100 characters (one per line)")


class Call:
    """Pickles as `function(*args)`: what a hostile pickle asks the unpickler to do."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


class ShapedArray:
    """An array's pickle with a shape of our choosing and the bytes of our choosing."""

    def __init__(self, shape, raw):
        self.shape, self.raw = shape, raw

    def __reduce__(self):
        reconstruct, args, (version, _, dtype, fortran, _) = np.empty(0, np.uint8).__reduce__()
        return reconstruct, args, (version, self.shape, dtype, fortran, self.raw)


def laughs(depth: int = 60):
    """A list that is 2^depth zeros when walked, a few hundred bytes when pickled (shared references)."""
    nested = [0] * 10
    for _ in range(depth):
        nested = [nested, nested]
    return nested


@pytest.mark.parametrize("key, value, needle", [
    (b"data", Call(os.system, "touch MARKER"), "refused (it would call posix.system)"),
    pytest.param(b"data", Call(np.ndarray, (2**40,)), "it would call numpy.ndarray", marks=LAUNCHED),  # 1 TiB
    pytest.param(b"data", ShapedArray((2**20, 3072), b"\0" * 3072), "an array that is not uint8 bytes of its own shape",
                 marks=LAUNCHED),  # 3 GiB
    # The names a CIFAR pickle may call, called otherwise: bytes in another encoding, an array of another class
    (b"data", Call(codecs.encode, "x" * 3072, "utf-16"), "a _codecs.encode that is not bytes written as latin-1 text"),
    (b"data", Call(np.empty(0).__reduce__()[0], np.dtype, (0,), b"b"), "it would build an array of another class"),
    (b"labels", laughs(), "its 'labels' are not"),
    (b"labels", [2**70] * 10, "its 'labels' are not"),
    (b"labels", list(range(2_100_000)), "more than 2,000,000 pickle operations"),
])
def test_cifar_pickles_that_lie(env, tmp_path, key, value, needle):
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    batch = pickle.loads((folder / "data_batch_2").read_bytes(), encoding="bytes")
    batch[key] = value
    (folder / "data_batch_2").write_bytes(pickle.dumps(batch, protocol=4))
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out", needle=needle,
            cwd=tmp_path, launched=isinstance(value, ShapedArray) or "numpy.ndarray" in needle)


def test_a_cifar_array_reconstructed_without_its_state(env, tmp_path):
    """NEWOBJ of NumPy's _reconstruct with no BUILD after it: an array stand-in never given its shape or bytes (an
    AttributeError's traceback before)."""
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    (folder / "data_batch_2").write_bytes(b"\x80\x02}(X\x04\x00\x00\x00datacnumpy.core.multiarray\n_reconstruct\n)"
                                          b"\x81u.")
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle="data_batch_2: its 'data' is not uint8 rows of 3,072 bytes")


def colliding_keys(count: int) -> bytes:
    """A pickled dict of `count` integer keys of one hash (k * (2^61 - 1)), written opcode by opcode: building the dict
    here would take as long as the attack."""
    keys = [(k * (2**61 - 1)).to_bytes(16, "little") for k in range(1, count + 1)]
    return b"\x80\x02}(" + b"".join(b"\x8a\x10" + key + b"K\x00" for key in keys) + b"u."


@pytest.mark.parametrize("raw, needle", [
    # LONG_BINPUT 2^27: the C unpickler grew its memo to 2^28 slots, zeroed (2.5 GB), before it read on
    (b"\x80\x02}r" + struct.pack("<I", 2**27) + b".", "more than 2,000,000 pickle operations or memo entries"),
    # 2,200,000 operations, then no opcode at all: refused at the limit, without walking on
    (b"\x80\x02" + b"N0" * 1_100_000 + b"\xff.", "more than 2,000,000 pickle operations or memo entries"),
    (colliding_keys(30_000), "more than 4,096 integers past 32 bits"),  # 21 s to build; 100,000: past 90 s
], ids=["memo index", "operations", "colliding keys"])
def test_cifar_pickles_that_would_cost_what_they_claim(env, tmp_path, raw, needle):
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    (folder / "data_batch_2").write_bytes(raw)
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"data_batch_2 is not a plain CIFAR pickle, refused ({needle}")


def test_a_cifar_pickle_larger_than_any_published_one_is_refused_before_it_is_read(env, tmp_path):
    """400 MB of text that widens once decoded peaked at 3,322 MB, and was accepted: free memory was the only bound."""
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    with open(folder / "data_batch_2", "r+b") as f:
        f.truncate(300 * 2**20)  # sparse: no disk used, and never read
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle="data_batch_2 is 314,572,800 bytes, more than a CIFAR pickle holds (256 MiB")


@pytest.mark.slow  # launched: before the fix the interpreter crashed
def test_a_cifar_pickle_with_a_key_nested_300000_deep(env, tmp_path):
    """A tuple nested 300,000 deep as a dict key: hashing it crashed the process (SIGSEGV), with no line at all."""
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    (folder / "data_batch_2").write_bytes(b"\x80\x02}()" + b"\x85" * 300_000 + b"K\x00u.")  # (((),),...): 0
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle="data_batch_2 is not a plain CIFAR pickle, refused (more than 50,000 tuples)", launched=True)


def reused_text(count: int, names: bool) -> bytes:
    """A CIFAR pickle of one 2 MB latin-1 text, written once and used `count` times: as _codecs.encode's argument for
    `count` keys (each call would copy it), or (`names`) as the bytes of every class name (each decode would)."""
    text = ("\xe9" * 2**21).encode()  # BINUNICODE: UTF-8, 2 bytes a character
    first = b"c_codecs\nencode\nq\x01X" + struct.pack("<I", len(text)) + text + b"q\x02X\x06\x00\x00\x00latin1\x86R"
    if names:  # {'label_names': [bytes, bytes, ...]}, the same object each time
        return b"\x80\x02}X\x0b\x00\x00\x00label_names](" + first + b"q\x03" + b"h\x03" * (count - 1) + b"es."
    return b"\x80\x02}(" + b"".join(b"X\x04\x00\x00\x00" + f"k{i:03}".encode() + (
        first if i == 0 else b"h\x01h\x02X\x06\x00\x00\x00latin1\x86R") for i in range(count)) + b"u."


@pytest.mark.parametrize("file, names", [("data_batch_2", False), ("batches.meta", True)], ids=["encode", "names"])
def test_a_cifar_pickle_that_reuses_one_long_text_copies_it_at_most_once(tmp_path, file, names):
    """One 2 MB text used 256 times: every encode (a 400 MB text 8 times reached 3.3 GB) or decode copied it, 512 MB
    before; now each text costs its size once, and the file is refused."""
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    (folder / file).write_bytes(reused_text(256, names))
    tracemalloc.start()
    try:
        needle = r"of up to 100 characters \(its 'label_names' list\)" if names else "data_batch_2: its 'data'"
        with pytest.raises(RecipeError, match=needle):
            find_dataset_files(folder).read(str(folder), (3, 32, 32), "bilinear")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MB for a file of {(folder / file).stat().st_size / 2**20:.0f} MB"


def test_a_cifar_pickle_is_read_only_where_6_times_its_size_is_free(tmp_path, monkeypatch):
    """Read, checked and unpickled, a text with one 4-byte character takes 4 bytes a character (100 MB of one peaked
    at 590 MB): a file is read only where the free memory holds it 6 times over, else refused before it is read."""
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({"batch_label": "a" * 2**20 + "\U0001F600"}, protocol=4))
    monkeypatch.setattr(dataset_files, "free_memory", lambda: 5 * path.stat().st_size)
    with pytest.raises(RecipeError, match=r"data_batch_1 claims 1,048,6\d\d bytes of data, over the 4 GiB a dataset "
                                          r"file may hold here \(or the 0.0 GiB of free memory 6 times over\)"):
        read_pickled_batch(path)
    monkeypatch.setattr(dataset_files, "free_memory", lambda: 7 * path.stat().st_size)
    assert len(read_pickled_batch(path)["batch_label"]) == 2**20 + 1


def test_a_cifar_pickled_splits_files_are_bounded_together(env, tmp_path):
    """Five files of 900 MiB (sparse: no disk used), each within the limit, 4.4 GiB together: refused before any is
    read, naming the split (two files reached 3.2 GB before, and the refusal blamed a good one)."""
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            f.truncate(900 * 2**20)
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out",
            needle="cifar-10-batches-py/train files claims 4,718,592,000 bytes of data, over the 4 GiB")


def two_central_directories(seen_by_zipfile: bytes, seen_by_torch: bytes) -> bytes:
    """Two zips in one file, each with its own central directory, and two zip64 end records: Python's zipfile takes
    the one just before the zip64 locator, torch's reader (miniz) the one the locator points to."""
    def parts(raw: bytes) -> tuple[bytes, bytes, int]:  # the entries, the central directory, its count
        end = raw.rindex(b"PK\x05\x06")
        _, _, _, count, _, size, offset, _ = struct.unpack("<4s4H2LH", raw[end:end + 22])
        return raw[:offset], raw[offset:offset + size], count

    def zip64_end(count: int, size: int, offset: int) -> bytes:
        return struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, offset)

    (entries_a, directory_a, count_a), (entries_b, directory_b, count_b) = parts(seen_by_zipfile), parts(seen_by_torch)
    directory_b, at = bytearray(directory_b), 0
    while at < len(directory_b):  # torch's entries come after zipfile's: move each record's local header offset
        name, extra, comment = struct.unpack("<3H", directory_b[at + 28:at + 34])
        struct.pack_into("<L", directory_b, at + 42, struct.unpack_from("<L", directory_b, at + 42)[0] + len(entries_a))
        at += 46 + name + extra + comment
    out = entries_a + entries_b
    out += directory_b + zip64_end(count_b, len(directory_b), len(out))
    end_b = len(out) - 56
    out += directory_a + zip64_end(count_a, len(directory_a), len(out))
    return out + struct.pack("<4sLQL", b"PK\x06\x07", 0, end_b, 1) + struct.pack(
        "<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)


def saved(obj, deflated: bool = False) -> bytes:
    """torch.save's bytes of `obj`; `deflated`: its entries rewritten deflated."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    if not deflated:
        return buffer.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as copy:
        for entry in source.infolist():
            copy.writestr(entry.filename, source.read(entry))
    return out.getvalue()


@pytest.mark.parametrize("content, needle", [
    # zipfile saw a 3-float state dict, stored; torch.load read 200 MB of deflated zeros out of 0.9 MB
    (lambda: two_central_directories(saved({"w": torch.zeros(3)}), saved({"w": torch.zeros(50_000_000)}, True)),
     "holds entries of 200,000,"),
    # a file that does not start as a zip is the old format to torch.load, whatever zipfile finds at its end: its
    # pickles are read (here 5,000 integers past 32 bits as keys), not the archive zipfile checked
    (lambda: colliding_keys(5_000) + saved({"w": torch.zeros(3)}), "(more than 4,096 integers past 32 bits)"),
    # a data.pkl of 200 KB for one tensor: no state dict is that
    (lambda: saved({"w": torch.zeros(3), "note": "x" * 200_000}), "(a data.pkl of more than 1,024 bytes for each of "
                                                                   "its 1 tensors)"),
], ids=["two central directories", "stub before the zip", "data.pkl past its tensors"])
def test_a_torch_file_is_checked_as_torch_load_reads_it(tmp_path, content, needle):
    path = tmp_path / "weights.pt"
    path.write_bytes(content())
    with pytest.raises(RecipeError, match=re.escape(needle)):
        check_archive(path)


def test_a_torch_files_entry_sizes_are_those_of_the_central_directory_torchs_reader_read(tmp_path):
    """check_archive takes the sizes from the central directory torch's reader read (through DirectoryReads), with
    the reader's names and offsets: on an honest file, the sizes Python's zipfile reads. torch 2.11 has no public
    or private call that gives them (2.12 added get_record_size)."""
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(1000), "b": torch.ones(3)}, path)
    with DirectoryReads(path) as file:
        sizes = file.entry_sizes(torch._C.PyTorchFileReader(file))
    with zipfile.ZipFile(path) as archive:
        assert sizes == {info.filename.split("/", 1)[1]: info.file_size for info in archive.infolist()}
    assert sizes["data/0"] == 4000 and len(file.directories) == 1


def test_a_torch_file_of_more_records_than_the_limit_is_refused_before_its_directory_is_parsed(tmp_path, monkeypatch):
    """A 106 MB file of a million empty records took 12 s and 1.4 GB to check (torch.load: 1.6 s, 0.7 GB): refused
    from the reader's count of them, before Python's zipfile makes an object of each."""
    from shared import pickles

    path = tmp_path / "weights.pt"
    torch.save({f"w{i}": torch.zeros(1) for i in range(6)}, path)  # 6 tensors: 12 records
    pickles.check_archive(path)
    monkeypatch.setattr(pickles, "MAX_RECORDS", 10)
    with pytest.raises(RecipeError, match=re.escape("(12 records, more than the 10 a file of weights or a checkpoint")):
        pickles.check_archive(path)


def test_a_torch_file_in_the_old_format_claiming_6_gib_allocates_nothing_first(tmp_path):
    """torch's format before 1.6 is checked as pickles read from the file: a file's read(n) allocated the 6 GiB a
    1 KB file claimed before it found them missing. Read through a map of the file, it allocates what is there."""
    path = tmp_path / "weights.pt"
    path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 6 * 2**30) + b"x" * 1000)  # BINBYTES8 of 6 GiB
    tracemalloc.start()
    try:
        missing = "(expected 6442450944 bytes in a bytes8, but only 1000 remain)"
        with pytest.raises(RecipeError, match=re.escape(missing)):
            check_archive(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**24, f"{peak / 2**20:.0f} MB allocated"


def test_a_checkpoint_pickle_that_would_run_code_is_refused_before_accelerate_loads_it(env, data, run, tmp_path):
    """accelerate loads the pickles of the objects registered for checkpointing (the progress counters, --ema's
    model) with weights_only=False, which calls any function a pickle names: each is read with weights_only=True
    first, and a checkpoint from anywhere that names one (os.system here) is refused, the one before it named."""
    out = unfinished(run, tmp_path)
    pickled = out / "checkpoints" / "step_4" / "custom_checkpoint_0.pkl"
    torch.save({**torch.load(pickled, weights_only=True), "step": Call(os.system, "touch MARKER")}, pickled)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest", cwd=tmp_path,
            needle=f"custom_checkpoint_0.pkl is corrupt or holds more than tensors and numbers (UnpicklingError): "
                   f"resume from the one before it: --resume {out / 'checkpoints' / 'step_3'}", decoded=True)


@pytest.mark.parametrize("data_pkl, needle", [
    (colliding_keys(30_000), "a data.pkl of more than 1,024 bytes for each of its 0 tensors"),
    (b"\x80\x02}r" + struct.pack("<I", 2**27) + b".", "more than 2,000,000 pickle operations or memo entries"),
], ids=["colliding keys", "memo index"])
def test_a_checkpoint_pickle_of_colliding_keys_is_refused_before_torch_load(env, data, run, tmp_path, data_pkl,
                                                                             needle):
    """The colliding keys as a checkpoint's data.pkl: torch's weights_only unpickler took 94-120 s, then a traceback.
    Refused for its size against its tensors; under that size, its pickle is checked as a CIFAR pickle is."""
    out = unfinished(run, tmp_path)
    pickled = out / "checkpoints" / "step_4" / "custom_checkpoint_0.pkl"
    with zipfile.ZipFile(pickled) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(pickled, "w") as archive:  # stored entries, as torch.save writes them
        for name, content in entries:
            archive.writestr(name, data_pkl if name.endswith("/data.pkl") else content)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", out, "--resume", "latest",
            needle=f"custom_checkpoint_0.pkl' is damaged or holds a pickle that is refused ({needle})", decoded=True)


@pytest.mark.parametrize("names, needle", [
    (laughs(), "batches.meta is not up to 256 class names of up to 100 characters (its 'label_names' list)"),
    ([str(i) for i in range(9)] + [10**20000], "is not up to 256 class names of up to 100 characters (its 'label_"),
    # Claims 2^40 bytes it lacks: the C unpickler would allocate them before reading; genops refuses first.
    pytest.param(None, "batches.meta is not a plain CIFAR pickle, refused (expected 1099511627776 bytes in a bytes8, "
                 "but only 4", marks=LAUNCHED),
])
def test_cifar_pickled_class_names_that_lie(env, tmp_path, names, needle):
    folder = cifar_python_folder(tmp_path / "cifar-10-batches-py", random_splits((3, 32, 32)),
                                 [str(i) for i in range(10)])
    meta = (pickle.dumps({"label_names": names}, protocol=4) if names is not None
            else b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"abc.")
    (folder / "batches.meta").write_bytes(meta)
    refused(env, tmp_path, "cifar_cnn", "--data", folder, *SHORT, "--output_dir", tmp_path / "out", needle=needle,
            launched=names is None)


def integer_labels(folder: Path, highest: int) -> Path:
    """A parquet dataset whose 'label' is a plain integer column (no ClassLabel), one training label `highest`."""
    import datasets

    folder.mkdir()
    for split, dataset in image_splits(sizes={"train": 16, "test": 4}).items():
        dataset = dataset.cast_column("label", datasets.Value("int64"))
        dataset = dataset.map(lambda row, i: {"label": highest if i == 3 and split == "train" else row["label"]},
                              with_indices=True)
        dataset.to_parquet(str(folder / f"{split}.parquet"))
    return folder


@pytest.mark.slow  # launched: a 4 GB list of names before the fix
def test_a_label_of_two_to_the_forty_is_refused(env, tmp_path):
    """One label of 2^40 in a 16-row parquet built a 4 GB list of class names, and the line said lower --batch_size."""
    refused(env, tmp_path, "cifar_cnn", "--data", integer_labels(tmp_path / "data", 2**40), *SHORT, "--output_dir",
            tmp_path / "out", needle="its 'label' column makes 1,099,511,627,777 classes, over the 100,000 a recipe "
            "trains: fix the labels", launched=True)


@pytest.mark.slow  # launched: 80 GB asked for before the fix
def test_a_run_of_100000_classes_draws_no_confusion_matrix(env, tmp_path):
    """Labels up to 99,999: the confusion matrix asked for 80 GB after training. Above 1,000 classes it is no
    picture to read, and is left out; the run ends as usual."""
    out = tmp_path / "out"
    ok(launch(env, "cifar_cnn", "--data", str(integer_labels(tmp_path / "data", 99_999)), *SHORT, "--output_dir",
              str(out)))
    assert (out / "model.safetensors").is_file() and not (out / "confusion_matrix.png").exists()
    assert json.loads((out / "config.json").read_text())["classes"][-1] == "99999"


@pytest.mark.slow  # launched: it inflates
def test_a_parquet_file_that_inflates_is_refused_before_a_page_is_read(env, tmp_path):
    """A 52 KB parquet file reached 3.6 GB before a vague line. This one: 3 KB on disk, 100 MB decompressed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"x": [bytes(100_000_000)]}), tmp_path / "data" / "train.parquet", compression="zstd")
    refused(env, tmp_path, "cifar_cnn", "--data", tmp_path / "data", *SHORT, "--output_dir", tmp_path / "out",
            needle="train.parquet takes 100,000,052 bytes or more once read (decompressed, then its values), from",
            launched=True)


def one_image_in_every_row(rows: int):
    """datasets' image column (bytes, path) holding one 120 KB PNG of noise in each of `rows` rows, as a dictionary:
    the PNG once, then an index a row."""
    import pyarrow as pa

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)).save(buffer, "PNG")
    png = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([buffer.getvalue()]))
    return pa.StructArray.from_arrays([png, pa.nulls(rows, pa.string())], names=["bytes", "path"])


@pytest.mark.slow  # launched: the memory limit is the point
def test_a_parquet_file_whose_dictionary_repeats_an_image_is_refused_before_it_is_read(env, tmp_path):
    """One 120 KB PNG in each of 20,000 rows, written as a dictionary (the value once, then an index a row): 121 KB on
    disk, whose pages claim 123 KB decompressed. datasets' reader wrote every row's copy out: the run peaked at 5.7 GB
    resident before a vague line. 2.4 GB of values once read, refused first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 20_000
    table = pa.table({"image": one_image_in_every_row(rows), "label": pa.array(np.arange(rows) % 2)})
    (tmp_path / "data").mkdir()
    for split in ("train", "test"):  # store_schema=False: read back as plain binary, as any other writer's file is
        pq.write_table(table, tmp_path / "data" / f"{split}.parquet", store_schema=False)
    line = refused(env, tmp_path, "cifar_cnn", "--data", tmp_path / "data", *SHORT, "--output_dir", tmp_path / "out",
                   needle="test.parquet takes ", launched=True)
    values = int(line.split("test.parquet takes ")[1].split(" ")[0].replace(",", ""))  # the pages claim 123 KB
    assert values > 2 * 10**9 and (f"bytes or more once read (decompressed, then its values), from "
                                   f"{(tmp_path / 'data' / 'test.parquet').stat().st_size:,} on disk") in line


def test_a_parquet_file_of_one_value_in_many_rows_is_refused_from_its_footer(tmp_path):
    """10,000,000 rows of one label and no image: 81 KB on disk (a run of one value takes a few bytes), whose pages
    claim 74 KB decompressed; the reader makes 8 bytes of each value, and a file of 10^9 rows would make 8 GB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.dataset_files import check_datasets_folder

    rows = 10_000_000
    image = pa.nulls(rows, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"image": image, "label": pa.array(np.zeros(rows, np.int64))}),
                   tmp_path / "data" / "train.parquet")
    read = r"train.parquet takes 240,000,000 bytes or more once read \(decompressed, then its values\)"
    with pytest.raises(RecipeError, match=read):
        check_datasets_folder(tmp_path / "data")


@pytest.mark.parametrize("nest", ["struct", "list", "map"])
def test_a_dictionarys_values_are_counted_inside_any_nesting(tmp_path, nest):
    """One 1,000-byte value in each of 1,000 rows, as a dictionary inside a struct, a list or a map: 1,000,000 bytes
    once read, whatever holds it (a map's entries failed list_flatten)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.dataset_files import read_size

    rows = 1000
    value = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array([b"v" * 1000]))
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32))
    column = {"struct": lambda: pa.StructArray.from_arrays([value], names=["bytes"]),
              "list": lambda: pa.ListArray.from_arrays(offsets, value),
              "map": lambda: pa.MapArray.from_arrays(offsets, pa.array(["k"] * rows), value)}[nest]()
    pq.write_table(pa.table({"x": column}), tmp_path / "train.parquet", store_schema=False)
    counted = read_size(tmp_path / "train.parquet", pq.read_metadata(tmp_path / "train.parquet"), 10**9)
    assert rows * 1000 <= counted < rows * 1000 + 100 * rows  # the values, and 8 bytes a value of each column


def test_a_parquet_file_whose_pages_are_damaged_is_one_line_naming_it(tmp_path):
    """Its first page header overwritten: the count of its values reads every page, and says which file failed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.dataset_files import check_datasets_folder

    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "train.parquet"
    pq.write_table(pa.table({"image": [bytes(range(256)) * 4] * 100}), file)
    raw = bytearray(file.read_bytes())
    raw[4:40] = b"\x7f" * 36  # after the magic "PAR1": the first page's header
    file.write_bytes(bytes(raw))
    with pytest.raises(RecipeError, match="train.parquet is not a readable parquet file \\(OSError: "):
        check_datasets_folder(tmp_path / "data")


@pytest.mark.slow  # a read that would block forever: launched, under the timeout
def test_a_fifo_named_as_a_parquet_file_is_refused_instead_of_blocking(env, tmp_path):
    """A FIFO named train-0.parquet in --data blocked the parquet check's read of its footer for ever."""
    (tmp_path / "data" / "data").mkdir(parents=True)
    os.mkfifo(tmp_path / "data" / "data" / "train-0.parquet")
    refused(env, tmp_path, "cifar_cnn", "--data", tmp_path / "data", *SHORT, "--output_dir", tmp_path / "out",
            needle="train-0.parquet' is not a regular file (a FIFO, socket, device or folder): replace it by the "
                   "parquet file", launched=True)


SAVED_NAMES = {  # a save_to_disk folder whose JSON names a file or a split outside it (a real one, at tmp_path/x*)
    "an absolute data file": ("train/state.json", "_data_files", "ABSOLUTE"),
    "a data file above": ("train/state.json", "_data_files", "../../x.arrow"),
    "a split above": ("dataset_dict.json", "splits", "../x"),
    "an absolute data file of a Dataset saved alone": ("state.json", "_data_files", "ABSOLUTE"),
}


@pytest.mark.parametrize("file, key, name", SAVED_NAMES.values(), ids=SAVED_NAMES)
def test_a_saved_dataset_is_read_only_inside_its_folder(env, tmp_path, file, key, name):
    """load_from_disk reads each file a split's state.json names and each split dataset_dict.json names, wherever the
    name points: another dataset on the machine became the training set."""
    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (arrow,) = (data / "train").glob("*.arrow")
    shutil.copy(arrow, tmp_path / "x.arrow")
    shutil.copytree(data / "train", tmp_path / "x")
    if file == "state.json":  # a Dataset saved alone, not a DatasetDict: its folder is the split's
        data = data / "train"
    name = str(tmp_path / "x.arrow") if name == "ABSOLUTE" else name
    saved = json.loads((data / file).read_text())
    (data / file).write_text(json.dumps({**saved, key: ["train", name] if key == "splits" else [{"filename": name}]}))
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{file} names {name!r}, which is not a name inside its folder")


@pytest.mark.parametrize("file, text", [("dataset_dict.json", '{"splits": "train"}'),  # a str, not a list
                                        ("dataset_dict.json", '["train", "test"]'),  # a list, not a dict
                                        ("train/state.json", '{"_data_files": 3}'), ("train/state.json", '{"_data')])
def test_a_saved_dataset_whose_json_is_not_as_save_to_disk_writes_it_is_one_line(env, tmp_path, file, text):
    """The JSON files that name a save_to_disk folder's splits and files are read before datasets reads them: one
    that is not what save_to_disk writes (another type, a file cut short) is refused in a line naming it."""
    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (data / file).write_text(text)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{data / file} is missing, damaged or over 16,777,216 bytes, not as save_to_disk writes it: write "
                   "the dataset again with save_to_disk")


def test_a_saved_dataset_that_names_its_file_twice_is_refused(env, tmp_path):
    """load_from_disk read the file as often as state.json named it: the training set doubled, silently (and a list
    of one name can be millions long)."""
    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    state = json.loads((data / "train" / "state.json").read_text())
    (data / "train" / "state.json").write_text(json.dumps({**state, "_data_files": state["_data_files"] * 2}))
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"state.json names {state['_data_files'][0]['filename']!r} twice")


@pytest.mark.slow  # a read that would block forever: launched, under the timeout
def test_a_fifo_in_a_saved_dataset_is_refused_instead_of_blocking(env, tmp_path):
    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (arrow,) = (data / "test").glob("*.arrow")
    arrow.unlink()
    os.mkfifo(arrow)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{arrow.name}' is not a regular file (a FIFO, socket, device or folder)", launched=True)


def test_a_compressed_arrow_file_in_a_saved_dataset_is_refused_before_it_inflates(env, tmp_path):
    """load_from_disk inflates a compressed arrow file whole: 46 KB of zstd took 1.5 GB. save_to_disk never writes
    one. This one: 300 MB of zeros in one image, about 10 KB on disk."""
    import pyarrow as pa

    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (arrow,) = (data / "train").glob("*.arrow")
    schema = pa.ipc.open_stream(pa.memory_map(str(arrow))).schema
    zeros = pa.Array.from_buffers(pa.binary(), 1, [None, pa.py_buffer(np.array([0, 300_000_000], np.int32)),
                                                     pa.py_buffer(bytes(300_000_000))])
    image = pa.StructArray.from_arrays([zeros, pa.array([None], pa.string())], names=["bytes", "path"])
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(
            sink, schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(pa.table([image, pa.array([0])], schema=schema))
    assert arrow.stat().st_size < 100_000
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{arrow.name} is compressed or holds a dictionary, which save_to_disk never writes")
    arrow.write_bytes(b"not an arrow stream, its first 4 bytes read as a length")
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{arrow.name} is not a readable arrow file (ArrowInvalid")


@pytest.mark.slow  # launched: the memory limit is the point
def test_a_dictionary_in_a_saved_dataset_is_refused_before_it_is_written_out(env, tmp_path):
    """An arrow file whose image column is a dictionary: one 120 KB PNG shared by 20,000 rows, 444 KB on disk. The run
    peaked at 2.8 GB before datasets' own error (a binary array over 2 GB); fewer rows train at that cost. datasets has
    no feature for a dictionary, so save_to_disk never writes one."""
    import pyarrow as pa

    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (arrow,) = (data / "train").glob("*.arrow")
    schema, rows = pa.ipc.open_stream(pa.memory_map(str(arrow))).schema, 20_000
    table = pa.table([one_image_in_every_row(rows), pa.array(np.arange(rows) % 2)], names=schema.names,
                     metadata=schema.metadata)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{arrow.name} is compressed or holds a dictionary, which save_to_disk never writes", launched=True)


def test_offsets_past_a_saved_datasets_buffers_are_refused_before_a_row_is_read(env, tmp_path):
    """An arrow file whose image bytes' offsets run backwards (the first image ends after the second): load_from_disk
    maps the file, and pyarrow trusts the offsets into its buffers, so a row was read from outside them, a SystemError
    traceback here; offsets past the buffers ended in a MemoryError (or a crash). Each batch is validated first."""
    import pyarrow as pa

    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (arrow,) = (data / "train").glob("*.arrow")
    table = pa.ipc.open_stream(arrow.read_bytes()).read_all().combine_chunks()  # a copy: the file is rewritten
    images = table.column(0).chunk(0)
    raw = images.field("bytes")  # datasets' Image: a struct of the file's bytes and its path
    offsets = np.frombuffer(raw.buffers()[1], np.int32)[raw.offset:raw.offset + len(raw) + 1].copy()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    backwards = pa.Array.from_buffers(raw.type, len(raw), [raw.buffers()[0], pa.py_buffer(offsets), raw.buffers()[2]])
    images = pa.StructArray.from_arrays([backwards, images.field("path")], fields=list(images.type))
    table = pa.table([images, table.column(1)], schema=table.schema)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle=f"{arrow.name} is not a readable arrow file (ArrowInvalid: ")


def test_an_imagefolders_metadata_naming_a_file_outside_it_is_refused_with_datasets_reason(env, tmp_path):
    """datasets refuses a metadata.jsonl whose file_name leaves the folder; its reason was hidden behind
    "DatasetGenerationError: An error occurred while generating the dataset", and is the line's now."""
    data = imagefolder_dataset(tmp_path / "photos", sizes={"train": 4, "test": 2})
    for split in ("train", "test"):
        names = sorted(path.relative_to(data / split).as_posix() for path in (data / split).rglob("*.png"))
        names[0] = "../../outside.png" if split == "train" else names[0]
        (data / split / "metadata.jsonl").write_text("".join(json.dumps({"file_name": name, "note": "x"}) + "\n"
                                                             for name in names))
    line = refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
                   needle="(ValueError: Invalid metadata file_name '../../outside.png': `file_name` must be a relative")
    assert line.startswith(f"error: could not read a dataset from {data} (ValueError: ")


def test_a_local_folder_is_read_by_its_files_names_not_by_its_readme(env, tmp_path):
    """load_dataset(folder) follows a README.md's `configs`, whose data_files may name files anywhere (hf:// ones on
    the hub too): here another folder's 40 images, unchecked by the parquet bound, trained on instead of these 16."""
    parquet_dataset(tmp_path / "other", sizes={"train": 40, "test": 8})
    data = parquet_dataset(tmp_path / "data", sizes={"train": 16, "test": 8})
    (data / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                    f"    path: {tmp_path / 'other' / 'train.parquet'}\n  - split: test\n"
                                    f"    path: ../other/test.parquet\n---\n")
    ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["train_size"] == 16



def test_an_image_a_dataset_names_by_a_url_is_never_fetched(env, tmp_path):
    """An image given by its path alone is read from that path on this machine (docs/files_from_anywhere.md); a URL
    there is one line, and the server it names hears nothing."""
    requests = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            requests.append(self.path)
            self.send_error(404)

    with http.server.HTTPServer(("127.0.0.1", 0), Recorder) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}/photo.png"
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
        data = tmp_path / "data"
        data.mkdir()
        for split in ("train", "test"):
            table = datasets.Dataset.from_dict({"image": [{"bytes": None, "path": url}] * 4, "label": [0, 1, 0, 1]},
                                               features=features).data.table  # to_parquet would fetch it to embed it
            pq.write_table(table, data / f"{split}.parquet")
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
                needle=f"'train' image 0 ({url}): no such image file on this machine")
        server.shutdown()
    assert requests == []

# ------------------------------------------------------------------ images
def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(path: Path, width: int, height: int, rows: int | None = None, first: bytes = b"", then: bytes = b"") -> Path:
    """A grayscale PNG of zeros, `rows` of its rows present (all by default): 30000x30000 is about 1 MB. `first`:
    chunks before IHDR; `then`: chunks between IHDR and the pixels."""
    compressor, parts = zlib.compressobj(1), []
    row = bytes(width + 1)  # filter byte, then the pixels
    for _ in range(height if rows is None else rows):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + first + chunk(b"IHDR", ihdr) + then + chunk(b"IDAT", b"".join(parts))
                     + chunk(b"IEND", b""))
    return path


def test_a_grayscale_image_is_decoded_once_as_one_channel_for_a_colour_recipe(tmp_path):
    """A 9,400 px grayscale PNG went through PIL's RGB (4 bytes a pixel) and two copies of it: 1.7 GB at its peak in
    the probe, 930 MB over the process here. Now one channel, seen as three: the same values as PIL's L -> RGB."""
    from shared import images

    pixels = np.random.default_rng(0).integers(0, 256, (300, 200), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "gray.png")  # 2-D uint8: mode L
    decoded, own = images.decode(tmp_path / "gray.png", 3, "gray.png")
    with Image.open(tmp_path / "gray.png") as image:
        expected = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    assert own == 1 and decoded.shape == (3, 300, 200) and decoded.stride(0) == 0 and torch.equal(decoded, expected)


def test_an_image_path_that_is_no_regular_file_is_named_as_such_unread(tmp_path):
    """A FIFO (or a folder) where an image file was expected was said to be "no such image file on this machine": it
    is there, but is refused before any read (a FIFO's would block for ever)."""
    from shared import images

    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "folder.jpg").mkdir()
    for name in ("pipe.png", "folder.jpg"):
        with pytest.raises(RecipeError) as error:
            images.decode(tmp_path / name, 3, name)
        assert str(error.value) == (f"{name} is not a regular file (a FIFO, socket, device or folder): replace it by "
                                    "the image file")
    with pytest.raises(RecipeError, match="^gone.png: no such image file on this machine"):
        images.decode(tmp_path / "gone.png", 3, "gone.png")


ONE_BY_ONE = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))


@pytest.mark.parametrize("first, then, needle", [
    (chunk(b"tEXt", b"Comment\0hi"), b"", "its first chunk is not IHDR"),
    (chunk(b"prIv", b"x"), b"", "its first chunk is not IHDR"),
    (ONE_BY_ONE, b"", "it has a second IHDR chunk"),  # the 1 x 1 first: PIL took the last
    (b"", ONE_BY_ONE, "it has a second IHDR chunk"),
    (b"", chunk(b"prIv", b"") * 100_001, "it has more than 100,000 chunks"),  # PIL kept each: 16 million, 2.4 GB
], ids=["text first", "private first", "two IHDRs", "IHDR again", "too many chunks"])
def test_a_png_is_read_as_its_specification_reads_it_before_pil_opens_it(tmp_path, first, then, needle):
    """Each with one row of pixels of 9,400: before, PIL decoded the rest black (or the 1 x 1 image), exit 0."""
    from shared import images

    photo = png(tmp_path / "odd.png", 9400, 9400, rows=1, first=first, then=then)
    opened = []
    with mock.patch.object(images.Image, "open", lambda *args: opened.append(args)):
        with pytest.raises(RecipeError, match=f"odd.png is not a readable image \\(ValueError: {needle}"):
            images.decode(photo, 1, "odd.png")
    assert not opened


def a_decompression_bomb(folder: Path) -> str:
    png(folder / "bomb.png", 30000, 30000, rows=1)  # the header alone decides
    return "bomb.png) has more than 89,478,485 pixels"


def large_images(folder: Path) -> str:
    first = png(folder / "large_0.png", 13000, 13000)
    for n in range(1, 12):
        shutil.copy(first, folder / f"large_{n}.png")
    return "large_0.png) has more than 89,478,485 pixels"


def a_truncated_png(folder: Path) -> str:
    raw = (folder / "0.png").read_bytes()
    (folder / "0.png").write_bytes(raw[:len(raw) // 2])
    return "0.png) is not a readable image"


def a_png_of_one_row(folder: Path) -> str:
    """Its compressed pixels end after the first row: PIL decoded the rest as black, without an error."""
    png(folder / "0.png", 32, 32, rows=1)
    return "0.png) is not a readable image (ValueError: image file is truncated: its compressed pixels end before"


def a_png_of_damaged_pixels(folder: Path) -> str:
    """Its compressed pixels are no zlib stream: zlib's error, neither an OSError nor a ValueError, was a traceback."""
    raw = bytearray((folder / "0.png").read_bytes())
    at = raw.index(b"IDAT") + 4  # the first bytes of the chunk's data: the zlib header
    raw[at:at + 2] = b"\x78\x00"  # not a multiple of 31, as zlib's header check requires
    (folder / "0.png").write_bytes(bytes(raw))
    return ("0.png) is not a readable image (ValueError: its compressed pixels are damaged (Error -3 while "
            "decompressing data: incorrect header check))")


def text_named_png(folder: Path) -> str:
    (folder / "0.png").write_text("not an image")
    return "0.png) is not a readable image of a format read here (BMP, GIF, JPEG, PNG, PPM, TIFF, WEBP): convert it"


def many_scans(scans: int, side: int = 600) -> bytes:
    """A progressive grayscale JPEG of `side` x `side` pixels (6 scans from PIL), its last scan repeated to make `scans`
    (libjpeg warns of each repeat, and decodes it over the whole image again)."""
    buffer = io.BytesIO()
    Image.new("L", (side, side)).save(buffer, "JPEG", progressive=True)
    data = buffer.getvalue()
    last = data[data.rfind(b"\xff\xda"):-2]  # the last scan, up to the end marker
    return data[:-2] + last * (scans - 6) + b"\xff\xd9"


def a_jpeg_of_many_scans(folder: Path) -> str:
    (folder / "scans.jpg").write_bytes(many_scans(1000))
    return "scans.jpg) is not a readable image (ValueError: it has more than 256 scans, each decoded over the whole"


def a_thin_image(folder: Path) -> str:  # 1 x 40,000,000 (39 KB), under PIL's limit: 114 GiB once in colour and resized
    png(folder / "thin.png", 40_000_000, 1)
    return "thin.png): images of 40000000x1 pixels, resized to 1280000000x32 before the centre crop, take 114.4 GiB"


@pytest.mark.parametrize("damage", [pytest.param(a_decompression_bomb, marks=LAUNCHED),
                                    pytest.param(large_images, marks=LAUNCHED), a_truncated_png, a_png_of_one_row,
                                    a_png_of_damaged_pixels, text_named_png, a_jpeg_of_many_scans,
                                    pytest.param(a_thin_image, marks=LAUNCHED)])
def test_images_that_lie(env, tmp_path, damage):
    data = imagefolder_dataset(tmp_path / "photos", sizes={"train": 20, "test": 10})
    needle = damage(data / "train" / "class_0")
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out", needle=needle,
            launched=damage in (a_decompression_bomb, large_images, a_thin_image))


def test_a_png_is_checked_for_its_rows_without_reading_what_follows_them(tmp_path):
    """A PNG of 32 x 32 pixels followed by 200 MB (sparse: no disk used): the rows' check read the whole file."""
    from shared import images

    photo = png(tmp_path / "long.png", 32, 32)
    with open(photo, "ab") as f:
        f.truncate(200 * 2**20)
    tracemalloc.start()
    try:
        assert images.decode(photo, 1, "long.png")[0].shape == (1, 32, 32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**24, f"{peak / 2**20:.0f} MB allocated"


@pytest.mark.parametrize("scans", [10, 256, 257])
def test_a_jpeg_of_more_scans_than_libjpeg_writes_is_refused_before_it_is_decoded(tmp_path, scans):
    """Each scan of a progressive JPEG is decoded over the whole image: before, any number was, and 10,000 scans of
    2,000 x 2,000 pixels (164 KB) took 13.6 s, 1,000 of 8,000 x 8,000 took 22 s (PIL 13). At most 256 now, as
    NVIDIA's nvImageCodec allows."""
    from shared import images

    photo = tmp_path / "scans.jpg"
    photo.write_bytes(many_scans(scans))
    if scans <= 256:
        assert images.decode(photo, 1, "scans.jpg")[0].shape == (1, 600, 600)
        return
    opened = []
    with mock.patch.object(images.Image, "open", lambda *args, **kwargs: opened.append(args)):
        with pytest.raises(RecipeError, match="scans.jpg is not a readable image \\(ValueError: it has more than 256 "
                                              "scans, each decoded over the whole image"):
            images.decode(photo, 1, "scans.jpg")
    assert not opened


def test_a_jpegs_scans_are_counted_across_the_pieces_it_is_read_in(tmp_path):
    """256 start-of-scan markers, and a 257th across the first 1 MiB piece's end (check_jpeg reads 1 MiB at a time)."""
    from shared.image_files import check_jpeg

    data = b"\xff\xd8" + b"\xff\xda" * 256
    photo = tmp_path / "scans.jpg"
    photo.write_bytes(data + bytes(2**20 - 1 - len(data)) + b"\xff\xda")
    with pytest.raises(ValueError, match="more than 256 scans"):
        check_jpeg(photo)
    check_jpeg(data)  # 256: accepted


@pytest.mark.parametrize("side, needle", [
    pytest.param(30000, "bomb.png has more than 89,478,485 pixels", marks=LAUNCHED),  # launched: a bomb
    # One row of pixels: PIL decoded the rest as black, and predict.py gave it a prediction, exit 0
    (9400, "bomb.png is not a readable image (ValueError: image file is truncated: its compressed pixels end before "
           "its last row)"),
], ids=["over PIL's limit", "rows end early"])
def test_predict_refuses_a_png_that_lies(env, run, tmp_path, side, needle):
    photos = tmp_path / "photos"
    photos.mkdir()
    png(photos / "bomb.png", side, side, rows=1)
    (tmp_path / "out").mkdir()
    refused(env, tmp_path, "predict", "--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images",
            photos, "--output", tmp_path / "out" / "p.csv", needle=needle, launched=side == 30000)


# An EPS of 32 x 32 points whose PostScript loops for ever: Debian's Ghostscript, run by PIL, hung the run.
ENDLESS_EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n{ } loop\nshowpage\n"


@pytest.mark.parametrize("script", ["cifar_cnn", "predict"])
def test_an_eps_image_never_runs_ghostscript(env, run, tmp_path, monkeypatch, script):
    """PIL knows an EPS by its bytes, whatever the file is named, and hands it to Ghostscript, a PostScript interpreter:
    with Debian's gs, the loop above hung the run, and another file wrote into /tmp. Here a stand-in `gs` first on the
    PATH leaves the marker if anything runs it (PIL runs `gs --version` first): before, a file named .png in a dataset
    and a .eps given to predict.py each ran it."""
    from PIL import EpsImagePlugin

    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None, raising=False)  # PIL 13 looks for gs once a process
    programs = tmp_path / "bin"
    programs.mkdir()
    (programs / "gs").write_text(f"#!/bin/sh\ntouch '{tmp_path / 'MARKER'}'\nexit 1\n")
    (programs / "gs").chmod(0o755)
    variables = {"PATH": f"{programs}:{os.environ['PATH']}"}
    if script == "cifar_cnn":
        data = imagefolder_dataset(tmp_path / "photos", sizes={"train": 20, "test": 10})
        (data / "train" / "class_0" / "0.png").write_bytes(ENDLESS_EPS)
        refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
                needle="0.png) is not a readable image of a format read here (BMP, GIF, JPEG, PNG, PPM, TIFF, WEBP)",
                variables=variables)
    else:
        photos = tmp_path / "photos"
        photos.mkdir()
        (photos / "drawing.eps").write_bytes(ENDLESS_EPS)
        (tmp_path / "out").mkdir()
        refused(env, tmp_path, "predict", "--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images",
                photos, "--output", tmp_path / "out" / "p.csv", needle="holds no images (1 other files)",
                variables=variables)
        (photos / "photo.png").write_bytes(ENDLESS_EPS)  # beside a .eps, an EPS named .png: one line, and skipped
        refused(env, tmp_path, "predict", "--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images",
                photos, "--output", tmp_path / "out" / "p.csv", variables=variables,
                needle="photo.png is not a readable image of a format read here (BMP, GIF, JPEG, PNG, PPM, TIFF, WEBP)")


@pytest.mark.slow  # launched: the memory limit is the point
def test_photos_that_would_not_fit_under_the_memory_limit_decoded_are_refused_first(env, tmp_path):
    """99 photos decoded at 4,681 px (--image_size 4,096, the largest, at resnet18's resize) take 6.1 GiB: less than
    this machine's free memory, more than the run's address space leaves (ulimit -v, as a cluster sets it). Refused
    before decoding, with the size and what to do."""
    data = imagefolder_dataset(tmp_path / "photos", sizes={"train": 72, "test": 27}, num_classes=3)
    line = refused(env, tmp_path, "finetune", "--data", data, "--weights", "none", "--image_size", "4096", *SHORT,
                   "--output_dir", tmp_path / "out", needle="99 images of 3x4681x4681 take 6.1 GiB decoded, more than",
                   launched=True)
    assert "use smaller images (finetune.py: --image_size) or fewer" in line


def predict_args(run: Path, tmp_path: Path) -> list:
    photos = imagefolder_dataset(tmp_path / "photos", sizes={"x": 2})
    return ["--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images", photos]


def test_predict_writes_around_a_planted_link(env, run, tmp_path):
    """A predictions.csv.tmp link in the working folder had the CSV written into its target. (The temporary name
    ends in the process id: predict.py runs in this process here.)"""
    (tmp_path / "out").mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    (tmp_path / "out" / f"p.csv.tmp{os.getpid()}").symlink_to(outside)
    ok(run_here("predict", *predict_args(run, tmp_path), "--output", tmp_path / "out" / "p.csv"))
    assert outside.read_text() == "mine" and len((tmp_path / "out" / "p.csv").read_text().splitlines()) == 3


def test_predict_walks_a_tree_1500_folders_deep(env, run, tmp_path, deep_tree):
    """rglob recursed, and its RecursionError was a traceback."""
    bottom = deep_tree(tmp_path / "photos", 1500)
    shutil.copy(next((imagefolder_dataset(tmp_path / "one", sizes={"x": 1})).rglob("*.png")), bottom / "a.png")
    (tmp_path / "out").mkdir()
    csv = tmp_path / "out" / "p.csv"
    ok(run_here("predict", "--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images",
                tmp_path / "photos", "--output", csv))
    assert len(csv.read_text().splitlines()) == 2


def past_path_max(root: Path) -> Path:
    """root/<255 d's>/... 17 folders deep, past the system's path limit (4,096 bytes), made through each folder's
    descriptor: no path that long can be passed to mkdir."""
    root.mkdir(parents=True, exist_ok=True)
    folder = os.open(root, os.O_RDONLY)
    for _ in range(17):
        os.mkdir("d" * 255, dir_fd=folder)
        below = os.open("d" * 255, os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = below
    os.close(folder)
    return root


@pytest.mark.parametrize("where", ["predict --images", "a resumed run's folder"])
def test_a_tree_deeper_than_the_path_limit_is_one_line(env, data, run, tmp_path, tmp_path_factory, where):
    """os.scandir's ENAMETOOLONG was a traceback. (Outside tmp_path: the matrix's snapshot could not walk it.)"""
    deep = tmp_path_factory.mktemp("deep")
    if where == "predict --images":
        (tmp_path / "out").mkdir()
        args = ("predict", "--weights", run / "model.safetensors", "--recipe", "cifar_cnn", "--images",
                past_path_max(deep), "--output", tmp_path / "out" / "p.csv")
    else:
        shutil.copytree(run, deep / "run")
        past_path_max(deep / "run" / "notes")
        args = ("cifar_cnn", "--data", data, *SHORT, "--output_dir", deep / "run", "--resume", "latest")
    refused(env, tmp_path, *args, needle=f"cannot list the folders under {deep}", decoded=True)
    assert not (deep / "run" / "checkpoints" / "step_5").exists()


@pytest.mark.parametrize("flag", ["--data", "--output_dir"])
def test_a_name_that_is_not_utf8_is_one_line(env, tmp_path, flag):
    """Bytes of another encoding: datasets and safetensors' cache ended in tracebacks, and a run folder's name trained
    a whole run, then failed in matplotlib."""
    name = f"{tmp_path}/caf\udce9"  # how Python reads the Latin-1 name b"caf\xe9" from a command line
    args = {"--data": ("--data", name, "--output_dir", tmp_path / "out"), "--output_dir": ("--synthetic",
            "--output_dir", name)}[flag]
    refused(env, tmp_path, "cifar_cnn", *args, *SHORT, status=2, needle=f"error: {flag} '{tmp_path}/caf\\udce9' is "
            "not UTF-8 (a name in another encoding, which datasets, safetensors and matplotlib refuse): rename it")


def test_a_hundred_thousand_words_on_the_command_line_are_one_line_at_once(env, tmp_path):
    """argparse took more than 120 s over 100,000 unknown flags (quadratic), then listed each in its error."""
    line = refused(env, tmp_path, "cifar_cnn", *(f"--x{n}" for n in range(100_000)), status=2,
                   needle="100,000 words on the command line, more than a recipe's flags take (1,000)")
    assert len(line) < 200


@pytest.mark.parametrize("output, needle", [("missing/p.csv", "its folder is missing"),
                                            ("", "exists and is no .csv file (kept)"),
                                            ("fifo", "exists and is no .csv file (kept)")],
                         ids=["missing folder", "a folder", "a FIFO"])
def test_predict_output_that_cannot_be_a_file(env, run, tmp_path, output, needle):
    """Even with --overwrite: a FIFO or a device (--output /dev/null) was renamed over, so that, run as root,
    /dev/null became a file of predictions."""
    (tmp_path / "out").mkdir()
    if output == "fifo":
        os.mkfifo(tmp_path / "out" / "fifo")
    refused(env, tmp_path, "predict", *predict_args(run, tmp_path), "--output", tmp_path / "out" / output,
            "--overwrite", needle=f"{needle}: pass another file name in an existing folder")
    assert [path.name for path in (tmp_path / "out").iterdir()] == ([output] if output == "fifo" else [])  # no .tmp
    assert output != "fifo" or (tmp_path / "out" / "fifo").is_fifo()  # still the FIFO it was


@pytest.mark.parametrize("target", ["weights", "an image", "config.json"])
def test_predict_output_over_a_file_that_is_no_csv_is_refused(env, run, tmp_path, target):
    """Even with --overwrite: --output the model.safetensors being read replaced the weights with the CSV of their
    predictions (an image of --images, a run's config.json: the same). --overwrite replaces a .csv only."""
    args = predict_args(run, tmp_path)
    args[1] = Path(shutil.copy(run / "model.safetensors", tmp_path))  # in tmp_path: refused() sees it unchanged
    (tmp_path / "config.json").write_text((run / "config.json").read_text())
    output = {"weights": args[1], "an image": next(args[5].rglob("*.png")), "config.json": tmp_path / "config.json"}
    refused(env, tmp_path, "predict", *args, "--output", output[target], "--overwrite",
            needle=f"error: --output {output[target]}: exists and is no .csv file (kept): pass another file name in "
            "an existing folder")


@pytest.mark.parametrize("evaluate", [False, True], ids=["predict", "evaluate"])
def test_nan_weights_are_refused(env, data, run, tmp_path, evaluate):
    """predict.py labelled every image with confidence nan and exited 0; --evaluate printed a NaN loss."""
    state = weights(run)
    state = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, tmp_path / "nan.safetensors")
    args = predict_args(run, tmp_path)
    args[1] = tmp_path / "nan.safetensors"
    rest = ("--evaluate", "--data", data) if evaluate else ("--output", tmp_path / "out" / "p.csv")
    refused(env, tmp_path, "predict", *args[:4], "--classes", ",".join("abcdefghij"),
            *(rest if evaluate else (*args[4:], *rest)), needle="holds NaN or infinite weights (a run that diverged)")


def test_a_newline_in_a_file_name_stays_in_the_one_line(env, run, tmp_path):
    """The name's author chose the second half of a split line: in the line that skips it among readable images, and
    in the error line where it is the only image."""
    args = predict_args(run, tmp_path)
    (args[-1] / "x" / "x.png\nerror: all fine.png").write_text("not an image")
    readable = sorted((args[-1] / "x").rglob("*.png"))[0]
    shutil.copy(readable, readable.with_name("y.png\nerror: all fine too.png"))  # in the first rows printed
    (tmp_path / "out").mkdir()
    printed = ok(run_here("predict", *args, "--output", tmp_path / "out" / "p.csv")).stdout.splitlines()
    assert any("y.png\\nerror: all fine too.png: class_" in line for line in printed), printed
    skipped = [line for line in printed if line.startswith("skipped 1 image file(s) that could not be read")]
    assert len(skipped) == 1 and "x.png\\nerror: all fine.png" in skipped[0], printed
    assert not any(line.startswith("error: all fine") for line in printed)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "x.png\nerror: all fine.png").write_text("not an image")
    line = refused(env, tmp_path, "predict", *args[:-1], alone, "--output", tmp_path / "out" / "q.csv",
                   needle="is not a readable image")
    assert "x.png\\nerror: all fine.png" in line


def test_a_one_class_imagefolder_is_told_how_folders_make_classes(env, tmp_path):
    """The line said to add a ClassLabel column: an imagefolder's classes are its folders."""
    data = imagefolder_dataset(tmp_path / "photos", sizes={"train": 6, "test": 3}, num_classes=1)
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out",
            needle="each class's images go directly in a folder named after it (train/<class>/<image>), two classes")


@pytest.mark.parametrize("weights, needle", [
    (b"", "cannot be read (SafetensorError"), (b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "cannot be read (")],
    ids=["empty", "damaged"])
def test_predict_names_a_damaged_weights_file_as_such(env, tmp_path, weights, needle):
    """It said "names no classes: pass --classes"."""
    (tmp_path / "model.safetensors").write_bytes(weights)
    (tmp_path / "out").mkdir()
    refused(env, tmp_path, "predict", "--weights", tmp_path / "model.safetensors", "--recipe", "cifar_cnn",
            "--images", tmp_path, "--output", tmp_path / "out" / "p.csv", needle=needle)


def test_a_protocol_4_pickle_is_refused_in_one_line(env, tmp_path):
    """torch's 2-line note on the protocol came first."""
    (tmp_path / "w.pt").write_bytes(pickle.dumps({"w": torch.zeros(2)}, protocol=4))
    (tmp_path / "out").mkdir()
    refused(env, tmp_path, "predict", "--weights", tmp_path / "w.pt", "--recipe", "cifar_cnn", "--classes", "a,b",
            "--images", tmp_path, "--output", tmp_path / "out" / "p.csv", needle="holds pickled Python objects")


@pytest.mark.parametrize("variables, needle", [
    pytest.param({"WORLD_SIZE": "2"}, "the environment sets WORLD_SIZE=2, but no launcher started this process",
                 marks=LAUNCHED),
    pytest.param({"WORLD_SIZE": "2", "RANK": "1"}, "the environment sets WORLD_SIZE=2, but no launcher started this "
                 "process", marks=LAUNCHED),
    ({"LOCAL_WORLD_SIZE": "abc"}, "the environment sets LOCAL_WORLD_SIZE='abc', not a count of processes"),
    ({"WANDB_MODE": "bogus"}, "the environment sets WANDB_MODE='bogus': wandb takes online, offline or disabled"),
    pytest.param({"HF_HOME": "FILE", "HF_DATASETS_CACHE": ""}, "/datasets/decoded (Not a directory): set HF_HOME",
                 marks=LAUNCHED),
    ({"ACCELERATE_MIXED_PRECISION": "bfloat16"}, "the environment sets ACCELERATE_MIXED_PRECISION='bfloat16': "
     "accelerate takes one of no, fp8, fp16, bf16"),
    ({"ACCELERATE_USE_CPU": "maybe"}, "the environment sets ACCELERATE_USE_CPU='maybe': set it to true or false"),
], ids=["stale WORLD_SIZE", "stale WORLD_SIZE and RANK", "LOCAL_WORLD_SIZE", "WANDB_MODE", "HF_HOME a file",
        "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"])
def test_a_broken_environment_is_one_line_within_seconds(env, data, tmp_path, variables, needle):
    """A WORLD_SIZE left in the shell made a single process wait forever for a second one (a launch: refused() times
    out at 120 s); HF_HOME is read once, at the process's start (a launch); a mistyped ACCELERATE_MIXED_PRECISION
    trained in float32, recorded as 'precision bfloat16'; the others ended in tracebacks."""
    (tmp_path / "FILE").write_text("not a folder")
    changed = {k: str(tmp_path / v) if v == "FILE" else v for k, v in variables.items()}
    refused(env, tmp_path, "cifar_cnn", "--data", data, *SHORT, "--tracker", "wandb", "--output_dir", tmp_path / "out",
            needle=needle, decoded=True, variables=changed, launched=bool({"WORLD_SIZE", "HF_HOME"} & set(variables)))


@pytest.mark.parametrize("saved", ["ClassLabel", "integers", "one Dataset"])
def test_holding_out_a_test_split_writes_nothing_into_the_data_folder(env, tmp_path, saved):
    """datasets' train_test_split wrote its indices (cache-*.arrow) beside the split's files: into --data; and so did
    its unique(), counting the held-out split's classes (integer labels). A Dataset saved alone (its state.json at the
    top, no dataset_dict.json) is its train split."""
    data = tmp_path / "data"
    splits = image_splits(sizes={"train": 20})
    if saved == "integers":
        splits = splits.cast_column("label", datasets.Value("int64"))
    (splits["train"] if saved == "one Dataset" else splits).save_to_disk(str(data))
    before = snapshot(data)
    result = ok(run_here("cifar_cnn", "--data", data, *SHORT, "--output_dir", tmp_path / "out"))
    assert "holding out 10% of 'train'" in result.stdout and snapshot(data) == before
    assert json.loads((tmp_path / "out" / "config.json").read_text())["test_size"] == 2


def test_the_held_out_split_is_the_one_datasets_train_test_split_makes():
    """The same split as datasets' own train_test_split(test_size=0.1, seed=0) makes, for any size."""
    from shared.data import pick_splits

    for size in (2, 37, 1234):
        rows = datasets.Dataset.from_dict({"x": list(range(size))})
        theirs = rows.train_test_split(test_size=0.1, seed=0)
        ours = pick_splits(datasets.DatasetDict(train=rows), "rows")
        assert [split["x"] for split in ours] == [theirs["train"]["x"], theirs["test"]["x"]]


def test_a_validation_split_is_the_test_split_where_there_is_no_test_split_and_the_run_says_so(capsys):
    """docs/data.md: without a 'test' split, a 'validation' split is the test split. The run said nothing of it: its
    test accuracy was the validation split's, unsaid."""
    from shared.data import pick_splits

    rows = {"train": datasets.Dataset.from_dict({"x": [0, 1, 2, 3, 4]}),
            "validation": datasets.Dataset.from_dict({"x": [0, 1, 2]})}
    train, test = pick_splits(datasets.DatasetDict(rows), "rows")
    assert train["x"] == [0, 1, 2, 3, 4] and test["x"] == [0, 1, 2]
    assert capsys.readouterr().out == "rows has no 'test' split: testing on its 'validation' split (3 images)\n"
    rows["test"] = datasets.Dataset.from_dict({"x": [7]})
    assert pick_splits(datasets.DatasetDict(rows), "rows")[1]["x"] == [7] and capsys.readouterr().out == ""


def test_a_dataset_of_one_example_and_no_test_split_is_one_line(env, tmp_path):
    """datasets' train_test_split cannot split one row: its ValueError was a traceback."""
    (tmp_path / "data").mkdir()
    image_splits(sizes={"train": 1})["train"].to_parquet(str(tmp_path / "data" / "train.parquet"))
    refused(env, tmp_path, "cifar_cnn", "--data", tmp_path / "data", *SHORT, "--output_dir", tmp_path / "out",
            needle="holds 1 example(s) and no 'test' split: a run needs at least one example to train on and one to "
            "test on")


# ------------------------------------------------------------------ flags past their limits
@pytest.mark.parametrize("args, needle, status", [
    (("--grad_accum", "100000", "--max_steps", "3"), "make no full step of 800000", 1),
    (("--seed", "99999999999"), "--seed must be below 2**31, got 99999999999", 2),
    (("--momentum", "nan"), "--momentum must be a finite number, got nan", 2),  # it said "lower --lr"
])
def test_flags_past_their_limits(env, data, tmp_path, args, needle, status):
    refused(env, tmp_path, "cifar_cnn", "--data", data, "--batch_size", "8", "--tracker", "none", "--output_dir",
            tmp_path / "out", *args, needle=needle, status=status, decoded=True)  # a step needs the data's size


def test_the_marker_check_can_fail(tmp_path):
    """Guards the matrix: the evil script does create the marker when it is run."""
    evil = evil_script(tmp_path)
    subprocess.run([sys.executable, str(evil)], check=True)
    assert (tmp_path / "MARKER").exists()
    os.remove(tmp_path / "MARKER")
