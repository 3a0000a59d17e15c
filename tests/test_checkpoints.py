"""Checkpoints that survive anything: an exact resume, a checkpoint folder on another disk, and weights of any layout.

Exactness is judged on the final weights: a run that is stopped and resumed must end bitwise equal to the same run left
alone, with augmentation on (so every RNG state must come back too). The stops themselves (signals and kills, under
each launcher, of 1 and 2 processes) are tests/test_stops.py's: each needs a process of its own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from recipes.cifar_cnn import make_model
from recipes.predict import load_weights
from shared.errors import RecipeError

from conftest import ROOT, assert_bitwise_equal, launch, ok, read_json, read_jsonl, run_here, weights
from tiny_data import cifar_binary_dataset

RUN = ("--batch_size", "8", "--max_steps", "20", "--checkpoint_every", "2", "--keep_checkpoints", "20",
       "--log_every", "1", "--seed", "5", "--tracker", "none")
BARE = ("--recipe", "cifar_cnn", "--classes", ",".join(map(str, range(10))))  # a bare state dict names neither


def tiny_cifar(folder: Path) -> Path:
    """64 training images (8 steps an epoch at batch 8) and 20 test images, as CIFAR-10's binary files."""
    return cifar_binary_dataset(folder / "data", sizes={"train": 64, "test": 20})


def reference_run(data: Path, out: Path) -> Path:
    """The uninterrupted run of 1 process (RUN) that every interrupted one must reproduce (`python
    recipes/cifar_cnn.py` trains the same as `accelerate launch` of cpu.yaml, which tests/test_stops.py launches)."""
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *RUN))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_cifar(tmp_path_factory.mktemp("ck"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    return reference_run(data, tmp_path_factory.mktemp("reference") / "one")


def test_resume_from_a_checkpoint_is_bitwise_exact(data, reference, tmp_path):
    """From step 12, in the middle of epoch 2 (64 images / 8: 8 steps an epoch), a checkpoint with the older names
    of its progress. The stop tests (tests/test_stops.py) resume from other steps: kill -9 at step 11, SIGTERM from
    step 1 on to 1 process and to the launcher of 1, 2 processes from step 10 and after a stop before step 20."""
    step = 12
    checkpoint = reference / "checkpoints" / f"step_{step}"
    # as the recipes wrote it before samples_into_epoch, max_eval_acc and the run's time
    checkpoint = Path(shutil.copytree(checkpoint, tmp_path / "older" / checkpoint.name))
    state = torch.load(checkpoint / "custom_checkpoint_0.pkl", weights_only=True)
    state = {"step": state["step"], "epoch": state["epoch"], "samples_seen": state["samples_into_epoch"],
             "best_eval_acc": state["max_eval_acc"]}
    torch.save(state, checkpoint / "custom_checkpoint_0.pkl")
    out = tmp_path / "resumed"
    result = ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, *RUN, "--resume", checkpoint))
    assert "same configuration: the run continues exactly, to the same weights as a run never stopped" in result.stdout
    assert_bitwise_equal(weights(out), weights(reference))
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row]
    assert steps == list(range(step + 1, 21))  # continued where the checkpoint stopped, each step once


def test_a_save_cut_short_is_removed_by_the_next_save_of_any_step(data, reference, tmp_path):
    """A run killed while it saved step 14 (kill -9, an OOM kill, or accelerate launch's kill 5 s after a SIGTERM)
    leaves checkpoints/partial_step_14, a checkpoint's size. Only a save of step 14 removed it: a run resumed with
    another --checkpoint_every, or saving by the clock (the default), kept it for good. The next save removes it."""
    out = Path(shutil.copytree(reference, tmp_path / "run"))
    checkpoints = out / "checkpoints"
    # The folder as that kill left it: step_12 the newest complete checkpoint, step 14's save unfinished, no weights
    for later in (16, 18, 20):
        shutil.rmtree(checkpoints / f"step_{later}")
    (checkpoints / "step_14").rename(checkpoints / "partial_step_14")
    for name in ("model.safetensors", "summary.json", "curves.png", "confusion_matrix.png"):
        (out / name).unlink()
    result = ok(run_here("cifar_cnn", "--output_dir", out, "--resume", "latest", "--checkpoint_every", "5"))
    assert f"resuming from {checkpoints / 'step_12'}: step 12" in result.stdout
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(
        [f"step_{step}" for step in range(2, 13, 2)] + ["step_15", "step_20"])
    assert_bitwise_equal(weights(out), weights(reference))


def test_without_checkpoint_every_a_checkpoint_is_saved_every_few_minutes(data, tmp_path, monkeypatch):
    """Only the end saved one by default: a crash or kill -9 lost the whole run. Now one about every CHECKPOINT_S
    seconds (here 0: every step; the newest 3 kept), which changes nothing of the training; --checkpoint_every 0
    still saves only at the end."""
    from shared import checkpoints

    monkeypatch.setattr(checkpoints, "CHECKPOINT_S", 0)
    args = ("--data", data, "--batch_size", "8", "--max_steps", "6", "--seed", "5", "--tracker", "none")
    ok(run_here("cifar_cnn", *args, "--output_dir", tmp_path / "timed"))
    ok(run_here("cifar_cnn", *args, "--output_dir", tmp_path / "end", "--checkpoint_every", "0"))
    assert sorted(p.name for p in (tmp_path / "timed" / "checkpoints").iterdir()) == ["step_4", "step_5", "step_6"]
    assert sorted(p.name for p in (tmp_path / "end" / "checkpoints").iterdir()) == ["step_6"]
    assert_bitwise_equal(weights(tmp_path / "timed"), weights(tmp_path / "end"))


class TwoProcesses:
    """An Accelerator of 2 processes to StopOnSignals: this process's rank, the other's row of votes."""

    num_processes, device, is_main_process = 2, torch.device("cpu"), True

    def __init__(self, rank: int, other: list[int]):
        self.rank, self.other = rank, torch.tensor([other])

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        return torch.cat([mine, self.other] if self.rank == 0 else [self.other, mine])


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("main_due, other_due", [(True, False), (False, True), (True, True), (False, False)])
def test_the_main_processs_clock_decides_when_a_checkpoint_is_due(rank, main_due, other_due):
    """Several processes save on the same step or wait for each other in the checkpoint's barrier: the main process's
    clock decides, as their agreement on a stop carries it to every process."""
    from types import SimpleNamespace

    from shared.checkpoints import CHECKPOINT_S, StopOnSignals

    mine, theirs = (main_due, other_due) if rank == 0 else (other_due, main_due)
    stop = StopOnSignals()
    stop.accelerator, stop.cfg = TwoProcesses(rank, [0, 1, int(theirs)]), SimpleNamespace(checkpoint_every=None)
    stop.saved_at -= CHECKPOINT_S if mine else 0
    saved = []
    stop.save = lambda model, step: saved.append(step)
    assert stop.after_step(None, 7, at_log_point=True) is False  # no stop asked
    assert saved == ([7] if main_due else [])


def test_each_file_renamed_into_place_is_on_the_disk_before_its_name(env, data, tmp_path):
    """A rename may reach the disk before the data of the file renamed: a machine that crashes between the two (power
    lost, a node or VM gone) comes back with a checkpoint, model.safetensors or config.json of that name empty or
    zero-filled, and a resume from it fails. Every file a run renames into place must be flushed first (fsync)."""
    log, out = tmp_path / "syncs.tsv", tmp_path / "run"
    ok(launch(dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), RECORD_SYNCS=str(log)), "cifar_cnn", "--data",
              str(data), "--output_dir", str(out), "--batch_size", "8", "--max_steps", "4", "--checkpoint_every", "2",
              "--tracker", "none"))
    synced, renamed, unsynced = set(), set(), []
    for kind, *paths in (line.split("\t") for line in log.read_text().splitlines()):
        if kind == "fsync":
            synced.add(paths[0])
            continue
        source, target = paths  # a file, or a folder of them (a checkpoint)
        files = sorted(Path(target).rglob("*")) if Path(target).is_dir() else [Path(target)]
        for file in (file for file in files if file.is_file()):
            renamed.add(str(file))
            if source + str(file)[len(target):] not in synced:
                unsynced.append(file.name)
    written = {"config.json", "summary.json", "model.safetensors", "checkpoints/step_4/model.safetensors",
               "checkpoints/step_4/optimizer.bin", "checkpoints/step_4/random_states_0.pkl"}
    assert {str(out.resolve() / name) for name in written} <= renamed
    assert any(Path(name).parent.name == "decoded" for name in renamed)  # the decoded images' cache
    assert not unsynced, f"renamed into place before their data was flushed: {unsynced}"


def test_checkpoints_on_another_disk(data, reference, tmp_path):
    """--checkpoint_dir: checkpoints saved, pruned and resumed there (a cluster's scratch disk), recorded in
    config.json, whose record alone never sends a write there: a resume without the flag is one line naming the
    folder. A checkpoints/ link, refused as any link in a run folder, names the flag."""
    out, scratch = tmp_path / "run", tmp_path / "scratch" / "run"
    args = ("--data", data, "--output_dir", out, *RUN)
    ok(run_here("cifar_cnn", *args, "--checkpoint_dir", scratch, "--keep_checkpoints", "2"))
    assert sorted(p.name for p in scratch.iterdir()) == ["step_18", "step_20"] and not (out / "checkpoints").exists()
    assert read_json(out / "config.json")["checkpoint_dir"] == str(scratch)
    shutil.rmtree(scratch / "step_20")  # as if stopped after step 18's checkpoint
    (out / "model.safetensors").unlink()
    one_line(run_here("cifar_cnn", *args, "--resume", "latest"), status=2, *(
        f"keeps its checkpoints in {str(scratch)!r}: pass --checkpoint_dir with that folder",))
    # Another folder, which holds none: was "has no checkpoints: start the run again without --resume"
    one_line(run_here("cifar_cnn", *args, "--resume", "latest", "--checkpoint_dir", tmp_path / "new"), status=2, *(
        f"keeps its checkpoints in {str(scratch)!r}, and --checkpoint_dir {tmp_path / 'new'} holds none: continue "
        "it with that --checkpoint_dir, or move them there first",))
    result = ok(run_here("cifar_cnn", *args, "--resume", "latest", "--checkpoint_dir", scratch))
    assert f"resuming from {scratch / 'step_18'}: step 18" in result.stdout
    assert_bitwise_equal(weights(out), weights(reference))
    linked = tmp_path / "linked"
    shutil.copytree(out, linked)
    (linked / "checkpoints").symlink_to(scratch)
    config = read_json(linked / "config.json")
    (linked / "config.json").write_text(json.dumps({**config, "checkpoint_dir": None}))  # a link, not the flag
    line = one_line(run_here("cifar_cnn", "--data", data, "--output_dir", linked, *RUN, "--resume", "latest"))
    assert "checkpoints' is a symbolic link" in line and "(checkpoints on another disk: --checkpoint_dir DIR)" in line


# ------------------------------------------------------------------ weights files of every layout
@pytest.fixture(scope="module")
def trained(reference):
    return reference


def layouts(run: Path, folder: Path) -> dict[str, Path]:
    state = weights(run)
    files = {}

    def save(name, obj):
        files[name] = folder / name
        torch.save(obj, files[name])

    save("plain.pt", state)
    save("ddp_module_prefix.pt", {f"module.{k}": v for k, v in state.items()})
    save("compiled_orig_mod_prefix.pth", {f"_orig_mod.{k}": v for k, v in state.items()})
    save("wrapped_model.pt", {"model": state, "epoch": 3, "optimizer": {"state": {}, "param_groups": []}})
    save("wrapped_state_dict.pt", {"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3})
    save("wrapped_model_state_dict.pt", {"model_state_dict": state, "epoch": 3, "optimizer_state_dict": {}})
    save("wrapped_under_another_key.pt", {"model_dict": state, "epoch": 3})  # the one state dict it holds
    files["weights.safetensors"] = folder / "weights.safetensors"
    save_file(state, files["weights.safetensors"])
    files["accelerate_checkpoint_folder"] = run / "checkpoints" / "step_20"
    # A file written on a GPU: every storage is tagged cuda:0, and plain torch.load fails on a CPU machine.
    files["saved_on_cuda.pt"] = folder / "saved_on_cuda.pt"
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:0"):
        torch.save(state, files["saved_on_cuda.pt"])
    return files


def test_every_weights_layout_loads_to_the_same_weights(trained, tmp_path):
    expected = weights(trained)
    files = layouts(trained, tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(files["saved_on_cuda.pt"], weights_only=True)  # the file really is a GPU file
    for name, path in files.items():
        model = make_model(10)
        load_weights(model, path)
        assert_bitwise_equal(model.state_dict(), expected, name)


@pytest.mark.parametrize("layout", ["saved_on_cuda.pt", "accelerate_checkpoint_folder"])
def test_evaluate_gives_the_same_accuracy_from_any_layout(env, data, trained, tmp_path, layout):
    path = layouts(trained, tmp_path)[layout]
    about = ("--recipe", "cifar_cnn") if path.is_dir() else BARE
    result = ok(run_here("predict", "--data", data, "--evaluate", "--weights", path, *about))
    assert f'"eval_acc": {read_json(trained / "summary.json")["eval_acc"]}' in result.stdout


def one_line(result, *needles, status=1):
    assert result.returncode == status, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(needle in lines[0] for needle in needles), result.stderr
    return lines[0]


def test_a_malicious_pickle_is_refused_before_it_runs(env, data, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # unpickling it would create a file

    evil = tmp_path / "evil.pt"
    torch.save({"0.weight": Payload()}, evil)
    line = one_line(run_here("predict", "--evaluate", "--weights", evil, *BARE))
    assert "could run code: refused" in line and "io.open" in line  # open() pickles as io.open
    assert not marker.exists()


def test_a_whole_model_pickle_is_refused_with_the_two_lines_that_convert_it(env, data, tmp_path):
    path = tmp_path / "whole_model.pt"
    torch.save(make_model(10), path)
    line = one_line(run_here("predict", "--evaluate", "--weights", path, *BARE))
    assert "torch.load(path, weights_only=False)" in line and "torch.save(model.state_dict()" in line


def test_weights_of_another_model_name_the_first_mismatch(tmp_path):
    path = tmp_path / "other.safetensors"
    state = make_model(10).state_dict()
    state["0.weight"] = torch.zeros(16, 3, 5, 5)
    save_file(state, path)
    with pytest.raises(RecipeError, match=r"'0.weight' is \(16, 3, 5, 5\) in the file, \(32, 3, 5, 5\) in the model"):
        load_weights(make_model(10), path)


@pytest.mark.parametrize("content, keys", [
    ({"model": [1, 2], "epoch": 3}, " (its keys: model, epoch)"),
    ({"a": {"w": torch.zeros(1)}, "b": {"w": torch.zeros(1)}}, " (its keys: a, b)"),  # two: which one is not guessed
    ([torch.zeros(1)], ""),
], ids=["no tensors", "two state dicts", "a list"])
def test_a_torch_file_that_holds_no_state_dict_is_one_line(tmp_path, content, keys):
    """It ended in an AttributeError's traceback ('dict' object has no attribute 'shape')."""
    path = tmp_path / "weights.pt"
    torch.save(content, path)
    with pytest.raises(RecipeError, match=re.escape(f"holds no state dict, names to tensors{keys}: pass a .pt of "
                                                    "model.state_dict(), alone or under 'model'")):
        load_weights(make_model(10), path)


def test_a_truncated_weights_file_is_one_clear_line(env, data, trained, tmp_path):
    path = tmp_path / "truncated.safetensors"
    path.write_bytes((trained / "model.safetensors").read_bytes()[:1000])
    line = one_line(run_here("predict", "--evaluate", "--weights", path, *BARE))
    assert "cannot be read" in line

