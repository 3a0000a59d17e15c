"""What the project prints and writes from names it did not choose: the resume command a stop prints (pasted, it runs
nothing but the run; shown, it holds no secret), and names from files, folders and flags (a terminal shows their
control characters, it never acts on them; a spreadsheet shows a CSV cell as text)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import psutil
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from recipes.cifar_cnn import Config
from shared import checkpoints
from shared.resume import launch_environment, resume_command, shell_word

from conftest import ok, run_here
from tiny_data import cifar_binary_dataset, imagefolder_dataset

HOSTILE_ENVIRONMENT = {
    # kept: what the resume needs; the kernels' settings too, or the pasted command sums in another order
    "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    "OMP_NUM_THREADS": "1", "HF_HOME": "/data/my hf", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    # not needed by a resume: never printed, whatever they hold
    "WANDB_BASE_URL": "https://user:hunter2@wandb.example", "HF_ENDPOINT": "https://u:p@hub.example",
    "WANDB_PASSWORD": "hunter2", "HF_API_SECRET": "s", "WANDB_AUTH": "a", "TORCH_HUB_AUTH": "t",
    "HF_HUB_CREDENTIALS": "c", "hf_token": "t", "wandb_api_key": "k", "accelerate_password": "p",
    "https_proxy": "http://u:p@proxy:3128", "WANDB_$(touch M)": "1", "WANDB_X;touch M;Y": "1", "UNRELATED": "\udcff",
    # needed, but bad: left out alone, and named
    "ACCELERATE_password": "x", "ACCELERATE_X;touch M;Y": "1", "WANDB_DIR": "https://u:p@host/x",
    "WANDB_PROJECT": "a\x1b]0;owned\x07b", "TORCH_HOME": "\udcff",
}
LEFT_OUT = {"ACCELERATE_password", "'ACCELERATE_X;touch M;Y'", "WANDB_DIR", "WANDB_PROJECT", "TORCH_HOME"}


@pytest.fixture
def stopped(tmp_path):
    """A stop's Checkpoints, started from a process with HOSTILE_ENVIRONMENT (read as StopOnSignals reads its
    launcher's)."""
    # A process that says when it runs: just after an exec, /proc/<pid>/environ can still read empty (CI saw {}).
    process = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                               stdout=subprocess.PIPE, env={name.encode(errors="surrogateescape"):
                                                            value.encode(errors="surrogateescape")
                                                            for name, value in HOSTILE_ENVIRONMENT.items()})
    try:
        process.stdout.readline()
        started_in = psutil.Process(process.pid).environ()
    finally:
        process.kill()
        process.communicate()  # reaped, its pipe closed
    stop = checkpoints.StopOnSignals.__new__(checkpoints.StopOnSignals)
    stop.launcher, stop.started_in = None, started_in
    stop.run_dir = tmp_path / "run\x1b[2J"
    stop.cfg = Config(data="my photos\n$(touch M)")
    return stop


def test_the_resume_command_keeps_only_the_launchs_own_variables_and_no_secret(stopped):
    kept, left_out = launch_environment(stopped.started_in)
    assert dict(word.split("=", 1) for word in kept) == {
        "ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "OMP_NUM_THREADS": "1", "HF_HOME": "'/data/my hf'", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert set(left_out) == LEFT_OUT


def test_the_resume_command_runs_nothing_when_pasted_and_prints_no_control_character(stopped, tmp_path):
    """In the folder the run was started in (`cd <folder> && ...`), whose name came from anywhere too."""
    started_in = tmp_path / "project\x1b[2J $(touch M)"
    started_in.mkdir()
    with mock.patch.object(sys, "argv", ["recipes/cifar_cnn.py"]), mock.patch.object(os, "getcwd",
                                                                                   return_value=str(started_in)):
        command, note = resume_command(stopped).split("\n")  # the command, then what it left out
    assert command.isprintable() and note.isprintable() and "hunter2" not in command + note, (command, note)
    assert note.startswith("  (left out: ") and all(name in note for name in LEFT_OUT), note
    cd, launch = command.split(" && ")
    # Pasted into a shell that prints each word and its folder instead of running the recipe, in a folder where
    # `touch M` would show
    pasted = subprocess.run(["bash", "-c", f"recipe() {{ printf '%s\\n' \"$@\"; pwd; env; }}; {cd} && recipe {launch}"],
                            cwd=tmp_path, capture_output=True, text=True, errors="surrogateescape")
    assert pasted.returncode == 0 and not (tmp_path / "M").exists() and not (started_in / "M").exists(), pasted.stderr
    words = pasted.stdout.split("\n")
    assert "my photos\n$(touch M)" in pasted.stdout and str(stopped.run_dir) in words, words
    assert str(started_in) in words, words  # pwd: the shell's folder when the recipe ran


@pytest.mark.parametrize("word", ["plain", "a b", "it's", "\x1b]0;title\x07", "\udcff", "tab\there", "back\\slash\n",
                                  "é ü 名前"])
def test_a_shell_word_is_the_same_word_pasted_and_printable_shown(word):
    quoted = shell_word(word)
    assert quoted.isprintable()
    pasted = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True)
    assert pasted.stdout == word.encode(errors="surrogateescape")


@pytest.mark.slow  # launched: a signal
def test_a_stop_of_a_real_run_names_what_it_left_out(env, data, tmp_path):
    """The line a stop prints, from a real run: the command, then what it left out."""
    out = tmp_path / "run"
    command = [sys.executable, "recipes/cifar_cnn.py", "--data", str(data), "--max_steps", "1", "--output_dir",
               str(out), "--tracker", "none", "--batch_size", "4"]
    # ATEN_CPU_CAPABILITY: the kernels this run computed with (`default`, unvectorized, is one on every CPU), which
    # the pasted command must keep: without it, the machine's own kernels sum in another order (tests/test_stops.py
    # with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with AVX-512: resumes up to 0.78 off)
    faulty = dict(env, WANDB_PASSWORD="hunter2", ACCELERATE_SECRET_THING="hunter2", ATEN_CPU_CAPABILITY="default",
                  PYTHONPATH=str(Path(__file__).parent / "faults"), FAULT_SIGTERM_IN_TRAINING="1")
    ran = subprocess.run(command, cwd=Path(__file__).parents[1], env=faulty, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0 and "hunter2" not in ran.stdout + ran.stderr, ran.stderr[-2000:]
    resume, left_out = ran.stdout.split("continue with:\n")[1].splitlines()[:2]
    assert resume.strip().endswith(f"recipes/cifar_cnn.py --data {data} --output_dir {out} --resume latest"), resume
    assert " ATEN_CPU_CAPABILITY=default " in resume, resume
    assert left_out.strip() == "(left out: ACCELERATE_SECRET_THING; set them again if the run needs them)"
    assert os.path.isdir(out / "checkpoints" / "step_1")


# ------------------------------------------------------------------ names from files: a terminal, a spreadsheet
HOSTILE_CLASSES = ["=cmd|' /C calc'!A0", "+1", "-2", "@SUM(A1)", "\tx", "\rx", "\x1b]0;owned\x07", "\x1b[2J",
                   "ok\nerror: ALL TESTS PASSED", "$\\frac{$"]
SHORT = ("--batch_size", "8", "--max_steps", "1", "--tracker", "none")


def shown(text: str) -> None:
    """Text a terminal would only show: no escape, no bell, no carriage return, and no line forged by a name."""
    assert not set(text) & {"\x1b", "\x07", "\r", "\x9b"}, repr(text[-2000:])
    assert not any(line.startswith("error: ALL TESTS") for line in text.splitlines()), text[-2000:]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return cifar_binary_dataset(tmp_path_factory.mktemp("printed") / "data", sizes={"train": 16, "test": 8})


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> tuple[Path, Path]:
    """A finished run, and its weights re-saved with HOSTILE_CLASSES as the classes their metadata names."""
    root = tmp_path_factory.mktemp("printed")
    ok(run_here("cifar_cnn", "--data", data, "--output_dir", root / "run", *SHORT))
    with safe_open(root / "run" / "model.safetensors", "pt") as f:
        state, about = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    weights = root / "hostile" / "model.safetensors"
    weights.parent.mkdir()
    save_file(state, weights, metadata={**about, "classes": json.dumps(HOSTILE_CLASSES)})
    return data, weights


def test_predictions_show_names_and_their_csv_cells_are_text(trained, tmp_path):
    _, weights = trained
    images = tmp_path / "photos \x1b]0;owned\x07"
    images.mkdir()
    for name in ("=HYPERLINK(1).png", "@x.png", "\x1b[2J.png", "plain.png"):
        Image.new("RGB", (32, 32), (200, 30, 30)).save(images / name)
    result = ok(run_here("predict", "--weights", weights, "--images", images))
    shown(result.stdout + result.stderr)
    output = weights.parent / f"predictions-{images.name}.csv"  # the default: named after the folder
    assert f"wrote {weights.parent}/predictions-photos \\x1b]0;owned\\x07.csv" in result.stdout, result.stdout
    rows = list(csv.reader(output.open(newline="")))[1:]
    assert len(rows) == 4 and {row[0] for row in rows} >= {"'=HYPERLINK(1).png", "'@x.png", "plain.png"}
    for row in rows:
        assert not row[0].startswith(("=", "+", "-", "@", "\t", "\r")), row
        assert not row[1].startswith(("=", "+", "-", "@", "\t", "\r")) and not row[3].startswith(("=", "+", "@")), row
        assert row[1] in HOSTILE_CLASSES or row[1][1:] in HOSTILE_CLASSES, row


def test_a_file_name_that_is_not_utf_8_is_written_to_the_csv_as_its_bytes(trained, tmp_path):
    """A photo named in another encoding (Latin-1's e-acute, the byte 0xe9) ended predict.py in a UnicodeEncodeError
    traceback as the CSV was written; its cell holds the name's own bytes, so that the file can be found by it."""
    _, weights = trained
    images, output = tmp_path / "photos", tmp_path / "predictions.csv"
    images.mkdir()
    Image.new("RGB", (32, 32)).save(images / os.fsdecode(b"caf\xe9.png"), format="PNG")
    result = ok(run_here("predict", "--weights", weights, "--images", images, "--output", output))
    shown(result.stdout + result.stderr)
    assert "caf\\udce9.png: " in result.stdout, result.stdout  # printed escaped
    assert output.read_bytes().splitlines()[1].startswith(b"caf\xe9.png,")


def test_init_from_names_the_classes_it_was_trained_on_without_their_escapes(trained, tmp_path):
    data, weights = trained
    result = ok(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run", *SHORT, "--init_from",
                         weights))
    shown(result.stdout + result.stderr)
    assert "its classifier was trained on =cmd|' /C calc'!A0, +1, -2, @SUM(A1), ..." in result.stdout, result.stdout


def test_a_flag_that_holds_a_newline_is_one_error_line():
    result = run_here("cifar_cnn", "--synthetic", "--batch_size", "1\nerror: ALL TESTS PASSED\x1b[2J")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    shown(result.stderr)


def test_class_names_a_terminal_or_matplotlib_would_act_on_are_drawn_as_text(tmp_path):
    """Class folders named with an escape and with an unbalanced formula: before, matplotlib's formula parser stopped
    the drawing of the confusion matrix in a traceback, after the run. And one named in a script matplotlib's own font
    has no glyphs for: drawn as an empty box, with a UserWarning and its source line at the run's end."""
    from shared.pictures import label

    data = imagefolder_dataset(tmp_path / "data", sizes={"train": 30, "test": 15}, num_classes=3)
    for split in ("train", "test"):
        folders = sorted((data / split).iterdir())
        folders[0].rename(folders[0].with_name("$x_$"))
        folders[1].rename(folders[1].with_name("\x1b]0;owned\x07"))
        folders[2].rename(folders[2].with_name("狗 é"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ok(run_here("cifar_cnn", "--data", data, "--output_dir", tmp_path / "run", *SHORT))
    shown(result.stdout + result.stderr)
    assert (tmp_path / "run" / "confusion_matrix.png").is_file()
    assert not [str(warning.message) for warning in caught if "Glyph" in str(warning.message)]
    assert label("狗 é $x") == "\\u72d7 é \\$x"  # an escape, as printable() writes a control character
