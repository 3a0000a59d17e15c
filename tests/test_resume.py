"""Resumes that bend: another length, another number of processes, other settings.

A run of 64 training images, batch 8, every label different (64 classes), so the labels each process
trains on say which samples it used. 1 process: 8 steps an epoch; 2 processes: 4.
  A  1 process, 12 steps: ends in the middle of epoch 2 (32 of its 64 samples)
  B  A resumed on 2 processes with --max_steps 20: the length and the world size change at once
  C  B's checkpoint of step 16 (the middle of epoch 3) resumed on 1 process
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.checkpoints import Progress
from shared.data import EpochOrder
from shared.loop import SCHEDULE_RULE, one_cycle_lr
from shared.resume import check_resume

from conftest import ROOT, launch, ok, read_json, read_jsonl, run_here
from tiny_data import save_to_disk_dataset

# The three recipes run one loop (test_layout.py keeps them in step), and their resumes are bitwise tested in
# test_checkpoints.py and test_stops.py: the resumes that bend run on resnet18_fmnist, whose learning rate also follows
# the world size.
SHAPES = {"cifar_cnn": (3, 32, 32), "resnet18_fmnist": (1, 28, 28)}
# --ema 1e-6 averages over about one step: the average must equal the trained weights, BatchNorm statistics included,
# also on 2 processes, where each process's statistics differ (their exactness over a resume: test_stops.py).
RUN = ("--batch_size", "8", "--log_every", "1", "--checkpoint_every", "4", "--seed", "3", "--tracker", "none",
       "--ema", "1e-6")


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Per image shape: 64 training images, each its own class; 32 test images (16 a batch: each process gets some)."""
    folder = tmp_path_factory.mktemp("labelled")
    return {shape: save_to_disk_dataset(folder / "x".join(map(str, shape)), sizes={"train": 64, "test": 32},
                                        shape=shape, num_classes=64) for shape in set(SHAPES.values())}


def recorded(env: dict, folder: Path) -> dict:
    """An environment in which every training loss records its labels into folder/rank<R>.txt."""
    folder.mkdir(parents=True)
    return dict(env, PYTHONPATH=str(ROOT / "tests" / "faults"), RECORD_TRAINING_LABELS=str(folder))


def batches(folder: Path, rank: int) -> list[list[int]]:
    return [[int(x) for x in line.split()] for line in (folder / f"rank{rank}.txt").read_text().splitlines()]


def order(seed: int, epoch: int) -> list[int]:
    """The samples of an epoch in training order: a permutation that depends only on (seed, epoch)."""
    sampler = EpochOrder(64, seed)  # the recipes' own sampler
    sampler.set_position(epoch)
    return list(sampler)


def lrs(run: Path) -> dict[int, float]:
    return {row["step"]: row["lr"] for row in read_jsonl(run / "metrics.jsonl") if "lr" in row}


def test_the_schedule_is_torchs_one_cycle_as_a_function_of_the_step():
    """Bitwise torch's OneCycleLR (pct_start 0.2, linear), which the recipes' measured numbers were run with."""
    for total_steps in [1, 2, 3, 4, *range(6, 120), 1000]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps, pct_start=0.2,
                                                       anneal_strategy="linear", cycle_momentum=False)
        for step in range(total_steps):
            assert one_cycle_lr(step, total_steps, 0.05) == schedule.get_last_lr()[0], (step, total_steps)
            optimizer.step()
            schedule.step()
    # 5 steps, where OneCycleLR divides by zero: the peak first, then down to the end.
    assert [one_cycle_lr(step, 5, 1.0) for step in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 4e-6], abs=1e-5)


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("recipe", ["resnet18_fmnist"])  # one recipe is enough (above SHAPES); cifar_cnn passes too
def test_longer_and_on_another_number_of_processes(env, labelled, tmp_path, recipe):
    data = str(labelled[SHAPES[recipe]])
    run, labels = tmp_path / "run", tmp_path / "labels"
    ok(launch(recorded(env, labels / "A"), recipe, "--data", data, "--output_dir", str(run), *RUN, "--max_steps", "12"))
    peak_a = read_json(run / "config.json").get("effective_lr", 2e-3 if recipe == "deep_mlp_ckpt" else 0.05)

    # B: 1 -> 2 processes, 12 -> 20 steps, from the end of a finished run
    b = ok(launch(recorded(env, labels / "B"), recipe, "--data", data, "--output_dir", str(run), *RUN,
                  "--max_steps", "20", "--resume", "latest", config="2gpu", use_cpu=True)).stdout
    config = read_json(run / "config.json")
    assert config["world_size"] == 2 and config["total_steps"] == 20 and config["resumed_step"] == 12
    assert config["lr_schedule"] == SCHEDULE_RULE
    assert f"resuming from {run / 'checkpoints' / 'step_12'}: step 12, epoch 2 after 32 of its 64 samples" in b
    for change in ("max_steps 12 -> 20", "total_steps 12 -> 20", "world_size 1 -> 2", "global_batch_size 8 -> 16"):
        assert change in b.split("changed since the checkpoint: ")[1].splitlines()[0]
    assert ("the sample order continues exactly: the rest of epoch 2 is the 32 samples not yet trained on, "
            "in global batches of 16") in b
    assert "written by 1 process(es), this run has 2" in b and "bitwise equality holds only on the same world size" in b
    assert f"length 12 -> 20 steps, set by --max_steps (its 20 wins over --epochs), learning rate: {SCHEDULE_RULE}" in b
    peak_b = config.get("effective_lr", peak_a)
    if recipe == "resnet18_fmnist":  # --lr_scaling sqrt follows the global batch: 8 -> 16
        assert peak_b == pytest.approx(peak_a * 2 ** 0.5) and "effective_lr" in b
        assert f"lr 0.1 for batch 128 -> {peak_b:.4g} (sqrt scaling)" in b
    rates = lrs(run)
    assert list(rates) == list(range(1, 21))  # A's 12 points kept, B's 8 appended, each step once
    assert [rates[s] for s in range(1, 13)] == [one_cycle_lr(s - 1, 12, peak_a) for s in range(1, 13)]
    # After the resume, every step uses the rate of a 20-step run, and the last one ends the schedule.
    assert [rates[s] for s in range(13, 21)] == [one_cycle_lr(s - 1, 20, peak_b) for s in range(13, 21)]
    assert rates[20] == pytest.approx(peak_b / 25 / 1e4, rel=1e-12)

    a0, b0, b1 = batches(labels / "A", 0), batches(labels / "B", 0), batches(labels / "B", 1)
    assert len(a0) == 12 and len(b0) == len(b1) == 8 and all(len(x) == 8 for x in a0 + b0 + b1)
    # Epoch 2, interrupted: A's last 4 batches, then B's first 2 rounds (rank 0 then rank 1 in each).
    epoch_2 = sum(a0[8:], []) + b0[0] + b1[0] + b0[1] + b1[1]
    assert sorted(epoch_2) == list(range(64))  # every sample exactly once
    assert epoch_2 == order(3, 1)  # and in the order of a run never stopped
    assert sum(a0[:8], []) == order(3, 0)
    assert sum((b0[i] + b1[i] for i in range(2, 6)), []) == order(3, 2)  # epoch 3 on 2 processes

    # C: B's checkpoint in the middle of epoch 3 (2 of its 4 rounds done), resumed on 1 process
    c_run = tmp_path / "c"
    c = ok(launch(recorded(env, labels / "C"), recipe, "--data", data, "--output_dir", str(c_run), *RUN,
                  "--max_steps", "20", "--resume", str(run / "checkpoints" / "step_16"))).stdout
    assert "step 16, epoch 3 after 32 of its 64 samples" in c and "world_size 2 -> 1" in c
    assert "the rest of epoch 3 is the 32 samples not yet trained on, in global batches of 8" in c
    assert "written by 2 process(es), this run has 1" in c and "length" not in c
    c0 = batches(labels / "C", 0)
    assert len(c0) == 4
    epoch_3 = b0[2] + b1[2] + b0[3] + b1[3] + sum(c0, [])
    assert sorted(epoch_3) == list(range(64)) and epoch_3 == order(3, 2)
    assert read_json(c_run / "summary.json")["epochs"] == pytest.approx(3.0)
    for evaluation in [row for row in read_jsonl(run / "metrics.jsonl") if "eval_acc" in row]:  # A's and B's
        assert evaluation["eval_loss_ema"] == pytest.approx(evaluation["eval_loss"], abs=1e-5)
        assert evaluation["eval_acc_ema"] == evaluation["eval_acc"]
    peak_c = read_json(c_run / "config.json").get("effective_lr", peak_a)
    assert [lrs(c_run)[s] for s in range(17, 21)] == [one_cycle_lr(s - 1, 20, peak_c) for s in range(17, 21)]


def test_a_changed_seed_says_the_order_is_not_exact_and_a_changed_grad_accum_keeps_whole_steps(env, labelled, tmp_path):
    data, run = str(labelled[(3, 32, 32)]), tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "3"))
    out = ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "5", "--seed", "4",
                      "--grad_accum", "2", "--resume", "latest")).stdout
    assert "seed 3 -> 4" in out and "grad_accum 1 -> 2" in out
    assert ("the sample order is NOT a run's never stopped (seed changed): the rest of epoch 1 follows another order, "
            "so some of its samples are trained on twice and others not at all") in out
    # 3 steps of 8 samples, then steps of 2 batches: the first step after the resume is whole too (the micro-batch
    # counter saved with the checkpoint, 3, would have ended it after 1 batch).
    epochs = {row["step"]: row["epoch"] for row in read_jsonl(run / "metrics.jsonl") if "lr" in row}
    assert epochs == {1: 8 / 64, 2: 16 / 64, 3: 24 / 64, 4: 40 / 64, 5: 56 / 64}


def test_the_same_data_by_another_path_from_another_folder_continues_the_run_exactly(env, labelled, tmp_path):
    """A relative --data is read from the folder a run is started in. Resumed from another folder, the run asks for
    --data; given as another path to the same folder, it was taken for another sample order ("NOT a run's never
    stopped"), though each epoch's order is (seed, epoch)'s permutation of the training set's size: the run continues
    exactly, to the weights of the run it branched from. predict.py's predictions of the finished run's weights go
    with them into abandoned/ (they stayed beside the branch's weights, read as theirs); a file of yours stays."""
    data, run = labelled[(3, 32, 32)], tmp_path / "run"
    flags = (*RUN, "--max_steps", "6", "--checkpoint_every", "3")
    ok(run_here("cifar_cnn", "--data", data.name, "--output_dir", run, *flags, cwd=data.parent))
    (run / "predictions-photos.csv").write_text("path,class,confidence,top_3\r\na.png,cat,0.9,cat 0.9\r\n")
    (run / "predictions-mine.csv").write_text("my notes\n")
    resume = ("--output_dir", run, "--resume", run / "checkpoints" / "step_3")
    asked = run_here("cifar_cnn", *resume, cwd=tmp_path)
    assert asked.returncode == 2 and (f"records --data '{data.name}', which is no folder here (a relative path is "
                                      "read from the folder a run is started in): pass --data") in asked.stderr
    out = ok(run_here("cifar_cnn", "--data", data, *resume, cwd=tmp_path)).stdout
    assert f"changed since the checkpoint: data '{data.name}' -> '{data}'\nthe sample order continues exactly\n" in out
    branched = next((run / "abandoned").iterdir())  # the run's steps 4 to 6, before the resume
    assert (branched / "predictions-photos.csv").is_file() and not (run / "predictions-photos.csv").exists()
    assert (run / "predictions-mine.csv").read_text() == "my notes\n"
    assert read_json(run / "summary.json")["eval_loss"] == read_json(branched / "summary.json")["eval_loss"]
    assert all(torch.equal(a, b) for a, b in zip(load_file(run / "model.safetensors").values(),
                                                  load_file(branched / "model.safetensors").values(), strict=True))


def test_a_relative_data_is_found_from_another_folder_by_the_run_folder_alone(env, labelled, tmp_path):
    """A run started in ~/project with --data photos and --output_dir runs/x, continued from another folder with
    --resume latest --output_dir ~/project/runs/x (what its folder alone says), or with --resume of one of its
    checkpoints: it asked for --data. The folder it was started in is the run folder given (a checkpoint's:
    runs/x/checkpoints/step_<N>), less the --output_dir it recorded; the data is read from there, the change said, and
    recorded whole for the next resume; of a checkpoint in a --checkpoint_dir, the --output_dir given. A run folder
    renamed since gives no such folder: asked, as before."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    data = shutil.copytree(labelled[(3, 32, 32)], project / "photos")
    elsewhere.mkdir()
    flags = (*RUN, "--data", "photos", "--max_steps", "3")
    ok(run_here("cifar_cnn", *flags, "--output_dir", "runs/x", cwd=project))
    run = project / "runs" / "x"
    out = ok(run_here("cifar_cnn", "--output_dir", run, "--resume", "latest", "--max_steps", "6", cwd=elsewhere)).stdout
    assert f"data 'photos' -> '{data}'" in out and "the sample order continues exactly\n" in out, out
    assert read_json(run / "summary.json")["steps"] == 6 and read_json(run / "config.json")["data"] == str(data)
    # --resume of a checkpoint, which records the first run's --data photos: read from its run folder the same way
    checkpoint = run / "checkpoints" / "step_3"
    out = ok(run_here("cifar_cnn", "--resume", checkpoint, "--output_dir", "branch", "--max_steps", "6",
                      cwd=elsewhere)).stdout
    assert f"data 'photos' -> '{data}'" in out and read_json(elsewhere / "branch" / "config.json")["data"] == str(data)
    # A checkpoint in a --checkpoint_dir of its own, on a scratch disk that holds a photos/ of its own too: its run is
    # the --output_dir given, not the checkpoint's two folders up (the scratch disk's photos/ was read)
    scratch = tmp_path / "scratch"
    shutil.copytree(data, scratch / "photos")
    ok(run_here("cifar_cnn", *flags, "--output_dir", "runs/w", "--checkpoint_dir", scratch / "ck", cwd=project))
    out = ok(run_here("cifar_cnn", "--resume", scratch / "ck" / "step_3", "--checkpoint_dir", scratch / "ck",
                      "--output_dir", project / "runs" / "w", "--max_steps", "6", cwd=elsewhere)).stdout
    assert f"data 'photos' -> '{data}'" in out, out
    # Renamed: the run folder given no longer ends with the one recorded, so nothing is guessed
    ok(run_here("cifar_cnn", *flags, "--output_dir", "runs/y", cwd=project))
    renamed = run.parent / "z"
    (run.parent / "y").rename(renamed)
    asked = run_here("cifar_cnn", "--output_dir", renamed, "--resume", "latest", "--max_steps", "6", cwd=elsewhere)
    assert asked.returncode == 2 and "records --data 'photos', which is no folder here" in asked.stderr


def test_a_checkpoint_without_its_config_json_still_resumes_and_says_so(tmp_path, capsys):
    checkpoint = tmp_path / "copied" / "step_16"  # copied out of its run folder: no ../../config.json
    checkpoint.mkdir(parents=True)
    progress = Progress()
    progress.step, progress.epoch, progress.samples_into_epoch = 16, 2, 32
    check_resume(checkpoint, {"train_size": 64, "total_steps": 20}, progress)
    assert capsys.readouterr().out.splitlines() == [
        f"resuming from {checkpoint}: step 16, epoch 3 after 32 of its 64 samples",
        f"no readable config.json in {checkpoint}: what changed since it cannot be listed"]


def test_a_flag_the_recipe_no_longer_has_is_said_not_called_the_same_configuration(tmp_path, capsys):
    """A checkpoint of a run whose recipe had a flag this one has not (another version of it, an edited copy): it said
    "same configuration: the run continues exactly", and the flag was gone unsaid. A key that is no name is no flag,
    and not printed (the file may come from anywhere: an escape sequence would reach the terminal), nor are keys
    past its first 1,000."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_5"
    checkpoint.mkdir(parents=True)
    now = {"train_size": 60, "data": "d", "total_steps": 8, "versions": {}}
    (checkpoint / "config.json").write_text(json.dumps({**now, "label_smoothing": 0.1, "run_id": "ab12",
                                                        "\x1b[2J": 1}))
    progress = Progress()
    progress.step = 5
    check_resume(checkpoint, now, progress)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "changed since the checkpoint: label_smoothing 0.1 -> no such flag", "the sample order continues exactly"]
    # A file of 100,000 such keys: a line of the first 1,000 keys' (a run records about 60), not of every one
    (checkpoint / "config.json").write_text(json.dumps({**now, **{f"flag_{i}": i for i in range(100_000)}}))
    check_resume(checkpoint, now, progress)
    listed = capsys.readouterr().out.splitlines()[1]
    assert listed.startswith("changed since the checkpoint: flag_0 0 -> no such flag, flag_1 1 -> no such flag, ")
    assert listed.count(" -> no such flag") == 1000 - len(now), len(listed)


def test_a_larger_epochs_where_max_steps_wins_says_the_length_is_unchanged(tmp_path, capsys):
    """A run of --max_steps 4 resumed with --epochs 50: "changed since the checkpoint: epochs 30 -> 50", and no word
    that the run stays 4 steps long, its --max_steps winning over --epochs. Without --max_steps, --epochs sets it."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    before = {"train_size": 64, "epochs": 30, "max_steps": 4, "total_steps": 4, "lr_schedule": "one cycle",
              "versions": {}}
    (checkpoint / "config.json").write_text(json.dumps(before))
    progress = Progress()
    progress.step, progress.samples_into_epoch = 2, 16
    check_resume(checkpoint, {**before, "epochs": 50}, progress)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "changed since the checkpoint: epochs 30 -> 50", "the sample order continues exactly",
        "length 4 -> 4 steps, set by --max_steps (its 4 wins over --epochs), learning rate: one cycle"]
    (checkpoint / "config.json").write_text(json.dumps({**before, "max_steps": None}))
    check_resume(checkpoint, {**before, "max_steps": None, "epochs": 50, "total_steps": 400}, progress)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "length 4 -> 400 steps, set by --epochs, learning rate: one cycle"


def test_a_resume_onto_less_data_counts_its_position_in_the_checkpoints_epoch(tmp_path, capsys):
    """It said "epoch 1 after 640 of its 60 samples": the checkpoint's position against the new data's size."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"train_size": 3000, "data": "big", "total_steps": 8}))
    progress = Progress()
    progress.step, progress.samples_into_epoch = 5, 640
    check_resume(checkpoint, {"train_size": 60, "data": "small", "total_steps": 8, "versions": {}}, progress)
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"resuming from {checkpoint}: step 5, epoch 1 after 640 of its 3000 samples",
        "changed since the checkpoint: train_size 3000 -> 60, data 'big' -> 'small'"]


def test_a_resume_under_other_versions_says_so_and_promises_no_bits(tmp_path, capsys):
    """A run moved to a machine with another torch: the line said "the run continues exactly, to the same weights as
    a run never stopped", which another release's kernels need not keep."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_5"
    checkpoint.mkdir(parents=True)
    before = {"train_size": 64, "total_steps": 8, "versions": {"torch": "2.15.0", "accelerate": "1.15.0"}}
    progress = Progress()
    progress.step, progress.samples_into_epoch = 5, 40
    moved = "other versions than the checkpoint's: torch 2.15.0 -> 2.11.0: the same steps, perhaps not to the same bits"
    for versions, lines in (({"torch": "2.11.0", "accelerate": "1.15.0"}, [
            moved, "same configuration: the sample order continues exactly"]),
            ({"torch": "2.15.0", "accelerate": "1.15.0", "datasets": None}, [  # one it did not record: unknown
            "same configuration: the run continues exactly, to the same weights as a run never stopped"])):
        for recorded in (before, {**before, "versions": "2.15"}):  # a config.json from anywhere: any JSON
            (checkpoint / "config.json").write_text(json.dumps(recorded))
            check_resume(checkpoint, {**before, "versions": versions}, progress)
            printed = capsys.readouterr().out.splitlines()[1:]
            assert printed == lines if recorded is before else printed[-1].startswith("same configuration: ")
    # datasets, imported by accelerate on 2 processes, not by a resume on 1 reading IDX files: the same datasets, not
    # used (it said "datasets 5.2.0 -> None")
    recorded = {**before, "versions": {**before["versions"], "datasets": "5.2.0"}}
    (checkpoint / "config.json").write_text(json.dumps(recorded))
    check_resume(checkpoint, {**before, "versions": {**before["versions"], "datasets": None}}, progress)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "same configuration: the run continues exactly, to the same weights as a run never stopped"]



def test_what_a_checkpoints_config_json_holds_is_printed_cut_to_a_length(tmp_path, capsys):
    """A config.json from anywhere may hold a value of megabytes: each was printed whole, one line of up to 16 MiB."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step_5"
    checkpoint.mkdir(parents=True)
    long = "x" * 10**6
    before = {"train_size": long, "data": long, "total_steps": long, "versions": {"torch": long}}
    (checkpoint / "config.json").write_text(json.dumps(before))
    progress = Progress()
    progress.step, progress.samples_into_epoch = 5, 40
    check_resume(checkpoint, {"train_size": 64, "data": "mine", "total_steps": 8, "versions": {"torch": "2.11.0"},
                              "lr_schedule": "one cycle"}, progress)
    lines = capsys.readouterr().out.splitlines()
    starts = ("resuming from", "other versions", "changed since", "the sample order is NOT", "length")
    assert len(lines) == len(starts) and all(map(str.startswith, lines, starts)), lines
    assert max(map(len, lines)) < 1_000 and f"data '{'x' * 199} -> 'mine'" in lines[2], lines

def test_no_two_seeds_share_an_epoch_order():
    """Seeding epoch e of seed s with s + e gave seed 1 the orders of seed 0, one epoch later: "3 seeds" were not."""
    assert len({tuple(order(seed, epoch)) for seed in range(4) for epoch in range(4)}) == 16


def test_a_run_is_continued_by_its_folder_alone_and_an_extension_keeps_the_finished_run(labelled, tmp_path):
    """`--resume latest --output_dir RUN` and nothing more continues with the run's own flags (its config.json): with
    the defaults instead (batch 128, 10 epochs), a resumed run of batch 8 went on for hundreds of steps and replaced its
    model.safetensors. A finished run is refused; given a longer --max_steps, the one flag typed, it is extended, which
    it says before its first step, and the finished run's files move to finished/<steps>_steps/ only as it finishes,
    with predict.py's predictions of its weights (they stayed, read as the longer run's), and no file of yours."""
    data, run = str(labelled[(3, 32, 32)]), tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "4", "--lr", "0.02"))
    (run / "predictions-photos.csv").write_text("path,class,confidence,top_3\r\na.png,cat,0.9,cat 0.9\r\n")
    (run / "predictions-mine.csv").write_text("my notes\n")
    names = ("model.safetensors", "summary.json", "predictions-photos.csv")
    finished = {name: (run / name).read_bytes() for name in names}
    again = run_here("cifar_cnn", "--resume", "latest", "--output_dir", run)
    assert again.returncode == 1
    assert f"{run} already finished its 4 steps: raise --max_steps (its 4 wins over --epochs) to train on" in (
        again.stderr)
    out = ok(run_here("cifar_cnn", "--resume", "latest", "--output_dir", run, "--max_steps", "6")).stdout
    assert "changed since the checkpoint: max_steps 4 -> 6, total_steps 4 -> 6\n" in out  # nothing else
    extending = "extending the finished run to 6 steps: its model.safetensors and summary.json stay until this run"
    assert out.index(extending) < out.index("done: ")
    config = read_json(run / "config.json")
    assert (config["batch_size"], config["lr"], config["seed"], config["max_steps"], config["data"]) == (8, 0.02, 3, 6,
                                                                                                         data)
    assert read_json(run / "summary.json")["steps"] == 6
    assert {name: (run / "finished" / "4_steps" / name).read_bytes() for name in finished} == finished
    assert (run / "model.safetensors").read_bytes() != finished["model.safetensors"]
    assert not (run / "predictions-photos.csv").exists() and (run / "predictions-mine.csv").read_text() == "my notes\n"


def test_a_stop_while_a_finished_run_is_extended_keeps_its_finished_files(labelled, tmp_path, monkeypatch):
    """The stop's summary.json and curves.png replaced the finished run's, which the extension keeps until it
    finishes: its record in finished/ then said neither its steps nor its curves."""
    from shared.checkpoints import Checkpoints

    data, run = str(labelled[(3, 32, 32)]), tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "4"))
    names = ("model.safetensors", "summary.json", "curves.png", "confusion_matrix.png")
    finished = {name: (run / name).read_bytes() for name in names}
    after_step = Checkpoints.after_step

    def sigterm_at_step_5(self, model, step, at_log_point):  # as StopOnSignals' handler does, in this process
        self.signal = self.signal or ("SIGTERM" if step == 5 else None)
        return after_step(self, model, step, at_log_point)

    monkeypatch.setattr(Checkpoints, "after_step", sigterm_at_step_5)
    stopped = ok(run_here("cifar_cnn", "--resume", "latest", "--output_dir", run, "--max_steps", "8")).stdout
    assert "stopped by SIGTERM at step 5, checkpoint saved" in stopped
    assert {name: (run / name).read_bytes() for name in names} == finished
    monkeypatch.undo()
    ok(run_here("cifar_cnn", "--resume", "latest", "--output_dir", run))
    assert {name: (run / "finished" / "4_steps" / name).read_bytes() for name in names} == finished
    assert read_json(run / "summary.json")["steps"] == 8


def test_a_run_stopped_at_its_last_step_finishes_with_the_whole_runs_summary(labelled, tmp_path, monkeypatch):
    """A stop at the last step saves its checkpoint before the weights; the resume evaluates and writes them. Its
    summary.json held only what that piece logged: the last training loss, accuracy, learning rate, gradient norm and
    epoch were gone (and with them the runs table's columns). A resumed run's summary now starts from metrics.jsonl's
    rows up to the checkpoint, as wandb's summary of a resumed run does; here after a stop at step 2 too, whose
    resume's mark on curves.png (a row "resumed") is no value of the summary."""
    from shared.checkpoints import Checkpoints

    data, reference, run = str(labelled[(3, 32, 32)]), tmp_path / "reference", tmp_path / "run"
    args = ("cifar_cnn", "--data", data, *RUN, "--max_steps", "4")
    ok(run_here(*args, "--output_dir", reference))
    after_step = Checkpoints.after_step
    for stop in (2, 4):
        def sigterm_at(self, model, step, at_log_point):  # as StopOnSignals' handler does, in this process
            self.signal = self.signal or ("SIGTERM" if step == stop else None)
            return after_step(self, model, step, at_log_point)

        monkeypatch.setattr(Checkpoints, "after_step", sigterm_at)
        resume = ("--resume", "latest") if stop == 4 else ()
        stopped = ok(run_here(*args, "--output_dir", run, *resume)).stdout
        assert f"stopped by SIGTERM at step {stop}, checkpoint saved" in stopped
    monkeypatch.undo()
    assert "its last step (4), the run stopped before writing its final files" in ok(
        run_here("cifar_cnn", "--resume", "latest", "--output_dir", run)).stdout
    finished, whole = read_json(run / "summary.json"), read_json(reference / "summary.json")
    assert finished.keys() == whole.keys() and finished["pieces"] == 3
    for key in ("step", "steps", "epoch", "lr", "train_loss", "train_acc", "grad_norm", "eval_loss", "eval_acc"):
        assert finished[key] == whole[key], key


@pytest.mark.parametrize("field, value, needle", [
    ("data", "someone/their_dataset", "records --data 'someone/their_dataset', which is no folder here (a relative "
                                      "path is read from the folder a run is started in): pass --data to continue (a "
                                      "run folder never makes a run fetch what it names)"),
    ("data", "x" * 5000, f"records --data '{'x' * 200}', which is no folder here"),  # too long for a path: no traceback
    ("epochs", "ten", "(the flags --resume continues with): argument --epochs: invalid int value: 'ten'"),
    ("lr", [1], "(the flags --resume continues with): argument --lr: invalid float value: '[1]'"),
    ("batch_size", "8 --overwrite", "argument --batch_size: invalid int value: '8 --overwrite'"),
    ("seed", -1, "(the flags --resume continues with): --seed must be >= 0, got -1")],
    ids=["data from the hub", "data too long for a path", "epochs", "lr", "batch_size", "seed"])
def test_a_run_folders_flags_are_checked_as_typed_ones(labelled, tmp_path, field, value, needle):
    """A run folder may come from anywhere: each value its config.json records goes through the flag's own parsing
    and checks, and a bad one is one line that names the file; a --data it names is never fetched."""
    data, run = str(labelled[(3, 32, 32)]), tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "4"))
    config = read_json(run / "config.json")
    (run / "config.json").write_text(json.dumps({**config, field: value}))
    result = run_here("cifar_cnn", "--resume", "latest", "--output_dir", run, "--max_steps", "6")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0] and str(run / "config.json") in lines[0]


@pytest.mark.parametrize("value", [2**70, "a\0b"], ids=["a number", "a NUL"])
def test_a_run_folders_checkpoint_dir_that_is_no_path_is_no_checkpoint_folder(labelled, tmp_path, value):
    """--resume CHECKPOINT --output_dir RUN asks whether the checkpoint is in the --checkpoint_dir that RUN's
    config.json records, a value from a file: a number was a TypeError traceback, a NUL resolve's ValueError."""
    data, run = str(labelled[(3, 32, 32)]), tmp_path / "run"
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", run, *RUN, "--max_steps", "4"))
    (run / "config.json").write_text(json.dumps({**read_json(run / "config.json"), "checkpoint_dir": value}))
    ok(run_here("cifar_cnn", "--resume", run / "checkpoints" / "step_4", "--output_dir", run, "--max_steps", "6"))
    assert read_json(run / "summary.json")["steps"] == 6
