"""A checkpoint folder belongs to its run. Every checkpoint holds its run's config.json (and so its run id), partial
ones too; pruning, --resume latest and --overwrite act only on the run's own; a --checkpoint_dir that holds anything
else is refused before anything is written, in one line that says what was found, and loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_errors import one_line, snapshot  # one line on stderr, exit 1; every file's hash

from shared.checkpoints import Checkpoints, list_checkpoints, run_id
from shared.errors import RecipeError
from shared.resume import check_checkpoint_folder

from conftest import hooked, ok, read_json, run_here
from tiny_data import cifar_binary_dataset

RUN = ("--batch_size", "4", "--tracker", "none")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return cifar_binary_dataset(tmp_path_factory.mktemp("folder") / "data", sizes={"train": 32, "test": 8})


def run(data: Path, out: Path, checkpoints: Path, *args) -> object:
    return run_here("cifar_cnn", "--data", data, *RUN, "--output_dir", out, "--checkpoint_dir", checkpoints, *args)


@pytest.fixture(scope="module")
def run_a(data, tmp_path_factory) -> tuple[Path, Path]:
    """Run A: 6 steps, a checkpoint every 2, keeping 2, in a folder of its own outside its run folder."""
    root = tmp_path_factory.mktemp("a")
    ok(run(data, root / "a", root / "shared", "--max_steps", "6", "--checkpoint_every", "2", "--keep_checkpoints", "2"))
    return root / "a", root / "shared"


def test_every_checkpoint_records_its_runs_id(run_a):
    out, checkpoints = run_a
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_4", "step_6"]
    assert {run_id(p) for p in checkpoints.iterdir()} == {read_json(out / "config.json")["run_id"]}


def test_another_run_is_refused_a_checkpoint_folder_in_use_and_nothing_is_lost(data, run_a, tmp_path):
    """Run B given run A's folder: before, B's pruning deleted A's checkpoints and B's --resume latest continued A's."""
    a, checkpoints = run_a
    before = snapshot(checkpoints)
    result = run(data, tmp_path / "b", checkpoints, "--max_steps", "6", "--checkpoint_every", "1",
                 "--keep_checkpoints", "1")
    one_line(result, f"--checkpoint_dir {checkpoints} holds 'step_4', a checkpoint of run "
                    f"'{read_json(a / 'config.json')['run_id']}'")
    assert snapshot(checkpoints) == before and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", ["step_4", "partial_step_4", "partial_step_3"])
def test_a_run_that_starts_writing_into_the_folder_after_this_ones_start_is_named_and_kept(data, tmp_path, name):
    """The start's check (above) cannot see a run started later with the same --checkpoint_dir: its checkpoint, where
    this run is about to save one, or its save in progress of any step (this run's own unfinished saves are removed
    at each save), is found at the save; nothing of either run is overwritten."""
    checkpoints = tmp_path / "shared"

    def another_run_first(save):
        def hooked_save(self, model, step):
            if step == 4:  # the other run's checkpoint of this step, just written
                (checkpoints / name).mkdir()
                (checkpoints / name / "config.json").write_text('{"run_id": "0ther000", "recipe": "cifar_cnn"}')
            return save(self, model, step)
        return hooked_save

    with hooked(Checkpoints, "save", another_run_first):
        result = run(data, tmp_path / "a", checkpoints, "--max_steps", "6", "--checkpoint_every", "2")
    one_line(result, f"{checkpoints / name} exists but this run did not write it: is another run writing to "
                     f"{checkpoints}? Nothing overwritten; pass another ")
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted(["step_2", name])
    assert run_id(checkpoints / name) == "0ther000"
    assert run_id(checkpoints / "step_2") == read_json(tmp_path / "a" / "config.json")["run_id"]


def test_a_file_for_a_checkpoint_folder_is_refused_before_the_training(data, tmp_path):
    """A file (a FIFO too) named by --checkpoint_dir: the run trained up to its first checkpoint, then its save failed
    ('Not a directory') with nothing saved, the training lost."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    result = run(data, tmp_path / "out", mine, "--max_steps", "2")
    one_line(result, f"cannot list the folders under {mine} (Not a directory): it must be a folder")
    assert mine.read_text() == "mine" and not (tmp_path / "out").exists()


def test_a_users_own_step_folders_are_refused_and_kept(data, tmp_path):
    """A folder of the user's that happens to hold step_1..step_5 (notes): before, three were deleted at the first
    save, exit 0."""
    mine = tmp_path / "mine"
    for n in range(1, 6):
        (mine / f"step_{n}").mkdir(parents=True)
        (mine / f"step_{n}" / "notes.txt").write_text(f"notes {n}")
    before = snapshot(mine)
    result = run(data, tmp_path / "run", mine, "--max_steps", "4", "--checkpoint_every", "1", "--keep_checkpoints", "2")
    one_line(result, "holds 'step_1', no checkpoint of this run", "pass an empty or new folder")
    assert snapshot(mine) == before


def test_overwrite_replaces_the_replaced_runs_checkpoints_and_keeps_its_own(data, tmp_path):
    """Run B overwrites run A, both keeping checkpoints in one folder: before, B pruned its own step_3 and its
    --resume latest continued A's step_6."""
    out, checkpoints = tmp_path / "run", tmp_path / "ck"
    ok(run(data, out, checkpoints, "--max_steps", "6", "--checkpoint_every", "2", "--keep_checkpoints", "2"))
    ok(run(data, out, checkpoints, "--max_steps", "5", "--checkpoint_every", "3", "--keep_checkpoints", "2",
           "--seed", "1", "--overwrite"))
    b = read_json(out / "config.json")["run_id"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_3", "step_5"]
    assert {run_id(p) for p in checkpoints.iterdir()} == {b}
    (out / "model.safetensors").unlink()  # as if stopped after its last checkpoint, before its weights
    resumed = ok(run(data, out, checkpoints, "--resume", "latest"))
    assert f"resuming from {checkpoints / 'step_5'}" in resumed.stdout


def test_overwrite_is_refused_before_anything_is_deleted_where_another_run_has_checkpoints(data, run_a, tmp_path):
    """Before, --overwrite deleted the replaced run's weights and metrics, then failed on a checkpoint it did not
    write ("exists but this run did not write it")."""
    out, checkpoints = tmp_path / "run", tmp_path / "ck"
    ok(run(data, out, checkpoints, "--max_steps", "2", "--checkpoint_every", "1"))
    (checkpoints / "step_4").symlink_to(run_a[1] / "step_4")  # not even a copy: refused as a link first
    (checkpoints / "step_4").unlink()
    (checkpoints / "step_4").mkdir()
    (checkpoints / "step_4" / "config.json").write_bytes((run_a[1] / "step_4" / "config.json").read_bytes())
    before = snapshot(tmp_path)
    result = run(data, out, checkpoints, "--max_steps", "6", "--checkpoint_every", "2", "--overwrite")
    one_line(result, "holds 'step_4', a checkpoint of run")
    assert snapshot(tmp_path) == before


def test_a_link_in_a_checkpoint_folder_is_one_line(data, tmp_path):
    """A step_0 link: before, the first pruning ended in shutil.rmtree's traceback."""
    checkpoints = tmp_path / "ck"
    checkpoints.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (checkpoints / "step_0").symlink_to(tmp_path / "elsewhere")
    result = run(data, tmp_path / "run", checkpoints, "--max_steps", "2", "--checkpoint_every", "1")
    one_line(result, "is a symbolic link")
    assert (checkpoints / "step_0").is_symlink() and (tmp_path / "elsewhere").is_dir()


def test_pruning_and_latest_see_only_the_runs_own_checkpoints(tmp_path):
    """Two runs writing into one folder at once pass the check at the start: each still sees only its own."""
    for step, run in ((1, "aaaa"), (2, "bbbb"), (3, "aaaa"), (4, "bbbb")):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "config.json").write_text(f'{{"run_id": "{run}"}}')
    (tmp_path / "step_5").mkdir()  # no config.json: no run's
    assert [p.name for p in list_checkpoints(tmp_path, "aaaa")] == ["step_1", "step_3"]
    run_dir = tmp_path.parent / f"{tmp_path.name}-run"  # beside the checkpoint folder
    with pytest.raises(RecipeError, match="holds 'step_2', a checkpoint of run 'bbbb'"):
        check_checkpoint_folder(tmp_path, "aaaa", run_dir)
    assert check_checkpoint_folder(tmp_path / "new", None, run_dir) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / ".shared_check").write_text("x")  # left by a start of several nodes killed in its check
    assert check_checkpoint_folder(tmp_path / "mine", "aaaa", run_dir) == [tmp_path / "mine" / ".shared_check"]
    assert check_checkpoint_folder(run_dir / "ck", None, run_dir) == []  # a folder of its own, in the run's


def test_the_run_folder_or_one_above_it_is_no_checkpoint_folder(data, tmp_path):
    """--checkpoint_dir runs/x --output_dir runs/x: the start found it empty and saved step_<N> beside config.json,
    then the resume refused it ("holds 'config.json', no checkpoint of this run"). Now the start refuses it."""
    run_dir = tmp_path / "runs" / "x"
    for folder in (run_dir, run_dir.parent, run_dir / ".."):
        one_line(run(data, run_dir, folder, "--max_steps", "2"), f"--checkpoint_dir {folder} holds the run folder "
                 f"{run_dir}: pass a folder of its own (on a scratch disk, say), or leave it out for "
                 f"{run_dir / 'checkpoints'}")
        assert not run_dir.exists()


def test_a_synthetic_runs_recorded_data_is_no_flag_of_its_resume(tmp_path):
    """A --synthetic run records data "SYNTHETIC data", which --resume latest refused as a --data naming no folder."""
    from recipes.cifar_cnn import Config
    from shared.resume import recorded_flags

    (tmp_path / "config.json").write_text('{"recipe": "cifar_cnn", "synthetic": true, "data": "SYNTHETIC data", '
                                          '"batch_size": 4}')
    words, _ = recorded_flags(Config(resume="latest", output_dir=str(tmp_path)), ["--resume", "latest"])
    assert sorted(words) == ["--batch_size=4", "--synthetic"]
