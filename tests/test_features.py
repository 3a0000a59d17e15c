"""--ema and --tta on a 2-process CPU run (gloo) of cifar_cnn; recipes/predict.py on that run's weights
and on bare state dicts of the other two recipes.

The EMA's exactness (2 processes == 1 process at twice the batch; resume bitwise) is tested with the other
exactness tests, in test_equivalence.py and test_stops.py.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from recipes import cifar_cnn, deep_mlp_ckpt, resnet18_fmnist
from recipes import predict as predict_script
from shared.data import load_image_data
from shared.errors import RecipeError

from conftest import ROOT, ema_state, ok, read_json, read_jsonl, run_here
from tiny_data import CLASSES, cifar_binary_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_binary_dataset(tmp_path_factory.mktemp("features") / "data", sizes={"train": 64, "test": 40})


@pytest.fixture(scope="module")
def run(env, data, tmp_path_factory):
    """12 steps with every feature on (on 2 processes, --ema: test_stops.py and test_deep_mlp_ckpt.py)."""
    out = tmp_path_factory.mktemp("features") / "run"
    result = ok(run_here("cifar_cnn", "--data", data, "--output_dir", out, "--batch_size", "8", "--max_steps", "12",
                         "--ema", "0.5", "--tta", "--tracker", "none"))
    return out, result.stdout


def test_every_file_a_run_writes_is_as_readable_as_a_file_opened_here(run, data, tmp_path, monkeypatch):
    """safetensors (0.8) makes its files 0600, its owner's alone (safetensors #782): model.safetensors, a checkpoint's
    weights and the decode cache were unreadable to a group that shares the run or the cache."""
    from shared import data as data_module

    umask = int(re.search(r"Umask:\s+(\d+)", Path("/proc/self/status").read_text()).group(1), 8)  # Linux's
    monkeypatch.setattr(data_module, "CACHE_DIR", tmp_path)  # a decode of its own, into an empty cache
    load_image_data(str(data), cifar_cnn.IMAGE_SHAPE)
    out, _ = run
    files = [*out.rglob("*"), *tmp_path.glob("*")]
    assert {f.name for f in files} >= {"model.safetensors", "config.json", "optimizer.bin"} and len(files) > 10
    assert {f: oct(f.stat().st_mode) for f in files if f.is_file() and f.stat().st_mode & 0o777 != 0o666 & ~umask} == {}


def test_ema_and_tta_are_evaluated_beside_the_trained_weights(run):
    out, stdout = run
    evaluations = [row for row in read_jsonl(out / "metrics.jsonl") if "eval_acc" in row]
    assert len(evaluations) == 2  # 8 steps an epoch of 64 images in batches of 8: one, and the run's end
    for row in evaluations:
        assert {"eval_acc_tta", "eval_loss_tta", "eval_acc_ema", "eval_loss_ema", "eval_acc_tta_ema"} <= set(row)
    assert evaluations[-1]["eval_loss_ema"] != evaluations[-1]["eval_loss"]  # two sets of weights
    assert "eval_acc_ema" in read_json(out / "summary.json")
    assert any(line.startswith("step 12/12") and "eval_acc_tta_ema" in line for line in stdout.splitlines())


def test_with_ema_model_safetensors_holds_the_average_whatever_the_test_set_says(run):
    out, stdout = run
    with safe_open(out / "model.safetensors", "pt") as f:
        about = f.metadata()
    last = [row for row in read_jsonl(out / "metrics.jsonl") if "eval_acc" in row][-1]
    assert last["eval_loss_ema"] != last["eval_loss"]  # two sets of weights; the test split does not pick one
    done = next(line for line in stdout.splitlines() if line.startswith("done: "))
    assert about["weights"] == "ema" and done.startswith(f"done: EMA weights' eval_acc {last['eval_acc_ema']:.4f} ")
    assert json.loads(about["classes"]) == CLASSES[:10]
    assert json.loads(about["flags"])["ema"] == 0.5
    saved = load_file(out / "model.safetensors")
    checkpoint = out / "checkpoints" / "step_12"
    ema = ema_state(checkpoint)
    assert saved.keys() == ema.keys() and all(torch.equal(saved[k], ema[k]) for k in saved)
    trained = load_file(checkpoint / "model.safetensors")  # accelerate's copy of the trained model: kept too
    assert not all(torch.equal(saved[k], trained[k]) for k in saved)


def test_tta_is_the_mean_of_the_logits_of_an_image_and_its_mirror(env, data, run):
    out, _ = run
    weights = out / "model.safetensors"
    result = ok(run_here("predict", "--evaluate", "--weights", weights, "--recipe", "cifar_cnn", "--tta", "--data",
                         data))
    reported = json.loads(result.stdout.strip().splitlines()[-1])
    model = cifar_cnn.make_model(10).eval()
    predict_script.load_weights(model, weights)
    test_set = load_image_data(str(data), cifar_cnn.IMAGE_SHAPE)[1]
    with torch.no_grad():
        inputs = cifar_cnn.preprocess(test_set.images, training=False)
        plain, mirrored = model(inputs), model(inputs.flip(3))
    labels = test_set.labels
    for logits, suffix in ((plain, ""), ((plain + mirrored) / 2, "_tta")):
        assert reported[f"eval_loss{suffix}"] == pytest.approx(F.cross_entropy(logits, labels).item(), abs=1e-5)
        assert reported[f"eval_acc{suffix}"] == pytest.approx((logits.argmax(1) == labels).float().mean().item())
    # Not the same number by another name: the mirror alone, and the plain logits, give other losses.
    assert F.cross_entropy(mirrored, labels).item() != pytest.approx(reported["eval_loss_tta"], abs=1e-5)
    assert reported["eval_loss"] != pytest.approx(reported["eval_loss_tta"], abs=1e-5)


# ------------------------------------------------------------------ recipes/predict.py
def predict(env, *args):
    return run_here("predict", "--recipe", "cifar_cnn", *args)  # python recipes/predict.py args


@pytest.fixture(scope="module")
def folder(data, tmp_path_factory):
    """The test split as PNG files in per-class subfolders, plus a grayscale image of another size and a note."""
    root = tmp_path_factory.mktemp("photos")
    test_set = load_image_data(str(data), cifar_cnn.IMAGE_SHAPE)[1]
    for n, (image, label) in enumerate(zip(test_set.images, test_set.labels)):
        (root / CLASSES[label]).mkdir(exist_ok=True)
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(root / CLASSES[label] / f"{n}.png")
    Image.new("L", (50, 70), 128).save(root / "gray_50x70.jpg")
    (root / "notes.txt").write_text("not an image")
    return root, test_set


def test_predict_writes_a_row_per_image_and_agrees_with_the_runs_evaluation(env, run, folder, tmp_path):
    out, _ = run
    root, test_set = folder
    csv_path = tmp_path / "predictions.csv"
    result = predict(env, "--weights", out / "model.safetensors", "--images", root, "--output", csv_path,
                     "--top_k", "3")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == len(test_set) + 1 and list(rows[0]) == ["path", "class", "confidence", "top_3"]
    assert "skipped 1 file(s) whose extension names none of the formats read here" in result.stdout
    assert f"({len(rows)} images)" in result.stdout
    for row in rows:
        assert row["class"] in CLASSES[:10] and 0 < float(row["confidence"]) <= 1
        top = row["top_3"].split("; ")
        assert len(top) == 3 and top[0] == f"{row['class']} {row['confidence']}"
    # The test images, read back from PNG, get the classes the run's last evaluation of these weights counted as right.
    labelled = [row for row in rows if "/" in row["path"]]
    accuracy = sum(row["class"] == row["path"].split("/")[0] for row in labelled) / len(labelled)
    with safe_open(out / "model.safetensors", "pt") as f:
        about = f.metadata()
    assert accuracy == pytest.approx(float(about["eval_acc_ema" if about["weights"] == "ema" else "eval_acc"]))
    assert "per class: " in result.stdout
    # One file as --images: its row, named by the file's name, as among the folder's
    ok(predict(env, "--weights", out / "model.safetensors", "--images", root / "gray_50x70.jpg", "--output",
               tmp_path / "one.csv"))
    (alone,) = csv.DictReader((tmp_path / "one.csv").open())
    (among,) = [row for row in rows if row["path"] == "gray_50x70.jpg"]
    assert alone["path"] == among["path"] and alone["class"] == among["class"]
    assert float(alone["confidence"]) == pytest.approx(float(among["confidence"]), abs=1e-4)


def test_ctrl_c_while_predict_reads_the_images_is_one_line_and_keeps_the_csv_it_would_replace(env, run, folder,
                                                                                              tmp_path, monkeypatch):
    """predict.py stopped by Ctrl-C (here, at its third image): one line that names what predict.py writes and when,
    exit status 130, and the CSV that --overwrite would have replaced as it was."""
    out, _ = run
    root, _ = folder
    csv_path = tmp_path / "predictions.csv"
    csv_path.write_text("yesterday's predictions\n")
    read_image, images_read = predict_script.read_image, []

    def interrupted(*args):
        images_read.append(args[0])
        if len(images_read) == 3:
            raise KeyboardInterrupt
        return read_image(*args)

    monkeypatch.setattr(predict_script, "read_image", interrupted)
    result = predict(env, "--weights", out / "model.safetensors", "--images", root, "--output", csv_path, "--overwrite")
    assert result.returncode == 130 and len(images_read) == 3, result.stderr
    assert result.stderr.splitlines() == [
        "stopped by Ctrl-C before there was anything to save (a training run saves a checkpoint from its first step "
        "on, predict.py its CSV once every image is read): run the same command again"]
    assert csv_path.read_text() == "yesterday's predictions\n" and os.listdir(tmp_path) == ["predictions.csv"]


def test_predict_images_with_tta_is_the_mean_of_the_logits_of_an_image_and_its_mirror(env, run, folder, tmp_path):
    """--images --tta: each photo's class and confidence from the mean of its logits and its mirror's, as --evaluate
    --tta counts them (it was ignored: the CSV held the plain logits' classes); without --tta, the plain ones, though
    the weights were trained with --tta."""
    out, _ = run
    root, test_set = folder
    weights = out / "model.safetensors"
    model = cifar_cnn.make_model(10).eval()
    predict_script.load_weights(model, weights)
    with torch.no_grad():
        inputs = cifar_cnn.preprocess(test_set.images, training=False)
        plain, mirrored = model(inputs).softmax(1), model(inputs.flip(3))
        averaged = ((model(inputs) + mirrored) / 2).softmax(1)
    assert (plain - averaged).abs().max() > 1e-3  # the two settings are told apart
    for flags, probabilities in (((), plain), (("--tta",), averaged)):
        csv_path = tmp_path / f"predictions{len(flags)}.csv"
        ok(predict(env, "--weights", weights, "--images", root, "--output", csv_path, *flags))
        rows = {row["path"]: row for row in csv.DictReader(csv_path.open())}
        for n, (label, p) in enumerate(zip(test_set.labels, probabilities)):
            row = rows[f"{CLASSES[label]}/{n}.png"]
            assert float(row["confidence"]) == pytest.approx(p.max().item(), abs=1e-4), (flags, n)
            assert row["class"] == CLASSES[p.argmax()] or p.topk(2).values.diff().abs() < 1e-4, (flags, n)


def test_predict_says_the_links_it_does_not_follow(env, run, folder, tmp_path):
    """A link to a folder under --images (a folder of photos gathered by links) was left out unsaid: fewer rows than
    the user's images, and no line; so was a link whose file is gone. Each is said now: the folder's link as skipped
    (a link to a folder is not followed: it may loop, or lead out of --images), the dead link as unreadable."""
    out, _ = run
    root, _ = folder
    photos = tmp_path / "photos"
    photos.mkdir()
    shutil.copy(root / "gray_50x70.jpg", photos / "a.jpg")
    (photos / "more").symlink_to(root, target_is_directory=True)
    (photos / "gone.png").symlink_to(tmp_path / "deleted.png")
    result = predict(env, "--weights", out / "model.safetensors", "--images", photos, "--output", tmp_path / "p.csv")
    assert result.returncode == 0, result.stderr
    assert [row["path"] for row in csv.DictReader((tmp_path / "p.csv").open())] == ["a.jpg"]
    said = r"skipped 1 file\(s\) whose extension names none of the formats read here \(.*\), or links to folders"
    more = re.escape(str(photos / "more"))
    assert re.search(rf"{said} \(not followed\), e\.g\. {more}\n", result.stdout), result.stdout
    assert f"skipped 1 image file(s) that could not be read, e.g. {photos / 'gone.png'}: no such image file" in \
        result.stdout, result.stdout

def test_predict_writes_beside_the_weights_by_default_and_says_where(env, run, folder, tmp_path):
    """It wrote predictions.csv into the working folder (the repository), and a second call needed --overwrite. A
    checkpoint in a --checkpoint_dir (no run around it) named no classes, and the CSV went into the checkpoint, which
    a later save prunes with it. A checkpoint's CSV then went into the run under the name of the run's weights' CSV:
    it replaced theirs, and read as theirs."""
    out, _ = run
    root, _ = folder
    copy, scratch = tmp_path / "run", tmp_path / "scratch"
    (copy / "checkpoints").mkdir(parents=True)
    (copy / "checkpoints" / "step_12").symlink_to(out / "checkpoints" / "step_12")
    shutil.copytree(out / "checkpoints" / "step_12", scratch / "step_12")  # its own config.json, as every save's
    expected = copy / f"predictions-{root.name}-step_12.csv"
    for weights in (out / "model.safetensors", out / "model.safetensors", copy / "checkpoints" / "step_12",
                    scratch / "step_12"):
        written = out / f"predictions-{root.name}.csv" if weights.name == "model.safetensors" else expected
        written = scratch / expected.name if weights.parent == scratch else written
        result = predict(env, "--weights", weights, "--images", root)
        assert result.returncode == 0 and f"wrote {written} (" in result.stdout, result.stderr
    assert expected.is_file() and not (copy / "checkpoints" / "step_12" / expected.name).exists()
    assert (scratch / expected.name).read_text() == expected.read_text()  # the same classes, from its config.json
    assert not (scratch / "step_12" / expected.name).exists()
    # Beside the checkpoint, the run's weights and a .pt of them: each its own CSV, none replacing another's
    shutil.copy(out / "model.safetensors", copy)
    torch.save(load_file(out / "model.safetensors"), copy / "weights.pt")
    for weights, tag in ((copy / "model.safetensors", ""), (copy / "weights.pt", "-weights")):
        classes = ",".join(read_json(out / "config.json")["classes"])  # which a .pt does not hold
        result = predict(env, "--weights", weights, "--images", root, "--classes", classes)
        assert result.returncode == 0 and f"wrote {copy}/predictions-{root.name}{tag}.csv (" in result.stdout
    assert expected.read_text() == (scratch / expected.name).read_text()  # the checkpoint's, kept


def test_predict_replaces_only_a_csv_it_wrote_says_so_and_names_it_within_a_file_names_limit(env, run, tmp_path):
    """Before, the default CSV replaced a file of the user's with its name, and an --images folder of 250 characters
    ended in an ENAMETOOLONG traceback. A CSV is named by the folder's name alone: one of the same name elsewhere
    replaced the first one's predictions without a word."""
    out, _ = run
    weights = tmp_path / "run" / "model.safetensors"
    weights.parent.mkdir()
    shutil.copy(out / "model.safetensors", weights)
    photos = tmp_path / ("p" * 250)
    photos.mkdir()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(photos / "a.png")
    result = predict(env, "--weights", weights, "--images", photos)
    written = weights.parent / f"predictions-{'p' * 150}.csv"
    assert result.returncode == 0 and f"wrote {written} (1 images)\n" in result.stdout, result.stderr
    elsewhere = tmp_path / "elsewhere" / photos.name
    shutil.copytree(photos, elsewhere)
    result = predict(env, "--weights", weights, "--images", elsewhere)  # its own: replaced, and said
    assert result.returncode == 0 and f"wrote {written} (1 images, replacing the file there before)\n" in result.stdout
    written.write_text("my notes\n")
    result = predict(env, "--weights", weights, "--images", photos)
    assert result.returncode == 1 and f"{written} exists: pass --overwrite" in result.stderr, result.stderr
    assert written.read_text() == "my notes\n"


def test_predict_bad_input_is_one_line_and_keeps_what_is_on_disk(env, run, folder, tmp_path, capsys):
    out, _ = run
    root, _ = folder
    existing = tmp_path / "predictions.csv"
    existing.write_text("mine\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "photo.png").write_text("not a PNG")
    other = tmp_path / "resnet.pt"  # weights of another recipe's model
    torch.save(resnet18_fmnist.make_model(10).state_dict(), other)
    empty = tmp_path / "empty"
    empty.mkdir()
    weights = out / "model.safetensors"
    stopped = tmp_path / "stopped"  # a run folder as a stop leaves it: checkpoints, no weights yet
    shutil.copytree(out / "checkpoints", stopped / "checkpoints")
    shutil.copy(out / "config.json", stopped / "config.json")
    started = tmp_path / "started"  # a run folder before its end and its first checkpoint: its config.json alone
    started.mkdir()
    shutil.copy(out / "config.json", started / "config.json")
    mine = {"recipe": "cifar_cnn"}
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    damaged = tmp_path / "damaged"  # a checkpoint whose weights file was cut short
    shutil.copytree(out / "checkpoints" / "step_12", damaged)
    (damaged / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:5000])
    unparsed = tmp_path / "unparsed.safetensors"  # metadata that is not the recipes' JSON: the weights name nothing
    save_file(load_file(weights), unparsed, metadata={"recipe": "cifar_cnn", "flags": "{not JSON"})
    unimportable, no_recipe = tmp_path / "unimportable.py", tmp_path / "no_recipe.py"
    unimportable.write_text("import a_package_not_installed\n")
    no_recipe.write_text("RECIPE = 'cifar_cnn'\n")
    cases = [
        ((weights, root, existing), mine, f"{existing} exists: pass --overwrite to replace it, or another --output"),
        ((weights, broken, tmp_path / "new.csv"), mine, f"{broken / 'photo.png'} is not a readable image"),
        ((weights, empty, tmp_path / "new.csv"), mine, f"--images {empty} holds no images"),
        ((other, root, tmp_path / "new.csv"), {"recipe": "cifar_cnn", "classes": ",".join(CLASSES[:10])},
         f"--weights {other} does not fit this model"),
        ((other, root, tmp_path / "new.csv"), {}, f"--weights {other}: which recipe builds the model? They name none "
                                                 "of the recipes beside predict.py (a run's model.safetensors names "
                                                 "its own; a .pt, none): pass --recipe PATH"),
        # The run's config.json for its weights: the line named --recipe alone, not the file that names the recipe
        ((out / "config.json", root, tmp_path / "new.csv"), {}, "(a run's model.safetensors names its own"),
        ((weights, root, tmp_path / "new.csv"), {"recipe": "resnet18_fmnist"},  # said first (below)
         f"--weights {weights} does not fit this model ('0.weight' is (32, 3, 5, 5) in the file"),
        ((tmp_path / "none.pt", root, tmp_path / "new.csv"), {}, f"--weights {tmp_path / 'none.pt'}: no such file"),
        ((weights, root, tmp_path / "new.csv"), {"classes": "cat,dog"}, "(2, 64) in the model, and 1 more tensors "
         "differ): pass weights written by this recipe, with the model flags they were trained with (see config.json "
         "beside them), and --classes, where given, with as many names as their classes"),  # was silent on --classes
        ((stopped, root, tmp_path / "new.csv"), mine, f"--weights {stopped / 'model.safetensors'}: no such file: the "
         f"run has not written it (stopped, or still running): pass --weights {stopped / 'checkpoints' / 'step_12'}"),
        ((started, root, tmp_path / "new.csv"), {}, f"--weights {started / 'model.safetensors'}: no such file: pass a "
         "model.safetensors (a run writes it as it finishes)"),  # it named no reason a file a run makes is missing
        ((stopped / "checkpoints", root, tmp_path / "new.csv"), {}, f"--weights {stopped / 'checkpoints'} is a folder "
         f"of checkpoints: pass one, e.g. {stopped / 'checkpoints' / 'step_12'}, the newest"),  # was: which recipe?
        # a FIFO (its read would block): it was "no such file", though it was there
        ((fifo, root, tmp_path / "new.csv"), {"recipe": "cifar_cnn", "classes": ",".join(CLASSES[:10])},
         f"--weights {fifo}: not a regular file: pass a model.safetensors"),
        ((weights, tmp_path / "nothing", tmp_path / "new.csv"), mine, f"--images {tmp_path / 'nothing'}: no such file"),
        ((weights, fifo, tmp_path / "new.csv"), mine, f"--images {fifo}: not a regular file"),  # was: no such file
        ((damaged, root, tmp_path / "new.csv"), {}, f"--weights {damaged / 'model.safetensors'} cannot be read ("
         "SafetensorError: "),
        ((unparsed, root, tmp_path / "new.csv"), {}, f"--weights {unparsed}: which recipe builds the model?"),
        ((weights, root, tmp_path / "new.csv"), {"recipe": "no_such"}, "--recipe no_such: no such recipe: pass the "
         "path of the script that trained the weights, or one of cifar_cnn, deep_mlp_ckpt, "),
        ((weights, root, tmp_path / "new.csv"), {"recipe": str(unimportable)}, f"--recipe {unimportable} cannot be "
         "imported (ModuleNotFoundError: No module named 'a_package_not_installed'): run predict.py where the "
         "recipe's own imports work"),
        ((weights, root, tmp_path / "new.csv"), {"recipe": str(no_recipe)}, f"--recipe {no_recipe} does not define "
         "Config, make_model, preprocess, IMAGE_SHAPE, load_data, evaluate: pass a recipe script"),
    ]
    for (weights_path, images, output), flags, needle in cases:  # in this process: torch starts once
        with pytest.raises(RecipeError) as error:
            predict_script.run(predict_script.Config(str(weights_path), str(images), str(output), **flags))
        assert needle in str(error.value) and "\n" not in str(error.value)
    assert existing.read_text() == "mine\n" and not (tmp_path / "new.csv").exists()
    assert (f"warning: --weights {weights} were trained by cifar_cnn, not by --recipe resnet18_fmnist: its model is "
            "built as asked (a copy, renamed?)\n") in capsys.readouterr().out
    # A copy of the recipe that names itself otherwise (a project's train.py, tools/new_project.py): it was refused,
    # "pass --recipe cifar_cnn or your copy of it", though it was that copy
    project = tmp_path / "my_project" / "train.py"
    project.parent.mkdir()
    source = (ROOT / "recipes" / "cifar_cnn.py").read_text()
    project.write_text(source.replace('\nRECIPE = "cifar_cnn"', '\nRECIPE = "mine"'))
    predict_script.run(predict_script.Config(str(weights), str(root), str(tmp_path / "copy.csv"), recipe=str(project)))
    assert "were trained by cifar_cnn, not by --recipe" in capsys.readouterr().out
    # Without --recipe, the recipe the weights name (one beside predict.py) builds the model
    predict_script.run(predict_script.Config(str(weights), str(root), str(tmp_path / "new.csv")))
    predict_script.run(predict_script.Config(str(weights), str(root), str(tmp_path / "named.csv"), recipe="cifar_cnn"))
    assert (tmp_path / "new.csv").read_text() == (tmp_path / "named.csv").read_text() == (
        tmp_path / "copy.csv").read_text()
    (tmp_path / "new.csv").unlink()
    # The script itself: the same error as one line on stderr and exit status 1, nothing written.
    result = predict(env, "--weights", weights, "--images", broken, "--output", tmp_path / "new.csv")
    assert result.returncode == 1 and result.stderr.startswith(
        f"error: none of the 1 image file(s) of --images could be read: {broken / 'photo.png'} is not a readable")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "new.csv").exists()
    # Among images that can be read, one that cannot is skipped and said (it ended the run, whatever the others)
    shutil.copy(sorted(root.rglob("*.png"))[0], broken / "good.png")
    capsys.readouterr()
    predict_script.run(predict_script.Config(str(weights), str(broken), str(tmp_path / "new.csv")))
    assert [row.split(",")[0] for row in (tmp_path / "new.csv").read_text().splitlines()] == ["path", "good.png"]
    assert (f"skipped 1 image file(s) that could not be read, e.g. {broken / 'photo.png'} is not a readable image"
            in capsys.readouterr().out)


@pytest.mark.parametrize("recipe, classes", [("resnet18_fmnist", 10), ("deep_mlp_ckpt", 100)])
def test_predict_takes_a_bare_state_dict_of_every_recipe(recipe, classes, folder, tmp_path, capsys):
    """A .pt file names neither recipe nor classes: --recipe and --classes do. The colour 32x32 PNGs and the
    grayscale 50x70 JPEG are converted to the recipe's input (28x28 grayscale for the ResNet)."""
    root, test_set = folder
    module = {"resnet18_fmnist": resnet18_fmnist, "deep_mlp_ckpt": deep_mlp_ckpt}[recipe]
    weights = tmp_path / "weights.pt"
    torch.save(module.make_model(classes).state_dict(), weights)
    names = [f"kind {i}" for i in range(classes)]
    output = tmp_path / "predictions.csv"
    predict_script.run(predict_script.Config(str(weights), str(root), str(output), recipe=recipe,
                                                 classes=",".join(names)))
    rows = list(csv.DictReader(output.open()))
    assert len(rows) == len(test_set) + 1 and all(row["class"] in names for row in rows)
    assert f"wrote {output} ({len(rows)} images)" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["resnet18_fmnist", "deep_mlp_ckpt"])
def test_evaluate_of_every_recipe_passes_only_the_flags_it_has(recipe, data, folder, tmp_path, capsys):
    """--evaluate hands the recipe --tta and --batch_size only where its Config has them: the MLP has no --tta
    (found by benchmarks/gpu_check.py on an H200, and the same on a CPU). Asked for, --tta of the MLP is one line,
    for --evaluate and --images alike: its numbers and CSV were the plain model's, unsaid."""
    module = {"resnet18_fmnist": resnet18_fmnist, "deep_mlp_ckpt": deep_mlp_ckpt}[recipe]
    weights = tmp_path / "weights.pt"
    torch.save(module.make_model(10, module.Config()).state_dict(), weights)
    predict_script.run(predict_script.Config(str(weights), evaluate=True, data=str(data), recipe=recipe,
                                             classes=",".join(CLASSES[:10])))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval_samples"] == 40  # the test split
    if recipe == "deep_mlp_ckpt":
        csv = {"images": str(folder[0]), "output": str(tmp_path / "p.csv")}  # --output: the CSV of --images only
        for mode in ({"evaluate": True, "data": str(data)}, csv):
            with pytest.raises(RecipeError, match=r"^deep_mlp_ckpt has no --tta \(its training flips no images\): "
                                                  "run it without --tta$"):
                predict_script.run(predict_script.Config(str(weights), recipe=recipe, classes=",".join(CLASSES[:10]),
                                                         tta=True, **mode))
        assert not (tmp_path / "p.csv").exists()


def test_evaluate_on_data_whose_class_names_differ_from_the_weights_says_so(data, tmp_path, capsys):
    weights = tmp_path / "weights.pt"
    torch.save(resnet18_fmnist.make_model(10, resnet18_fmnist.Config()).state_dict(), weights)
    names = [f"kind {i}" for i in range(10)]
    predict_script.run(predict_script.Config(str(weights), evaluate=True, data=str(data), recipe="resnet18_fmnist",
                                             classes=",".join(names)))
    warning, result = capsys.readouterr().out.strip().splitlines()[-2:]
    assert warning == (f"warning: {data} names its classes {', '.join(CLASSES[:3])}, ..., the weights kind 0, kind 1, "
                       "kind 2, ...: the accuracy below compares label numbers only")
    assert json.loads(result)["eval_samples"] == 40
    # Weights of another number of classes than the data's: no accuracy to compare, one line
    torch.save(resnet18_fmnist.make_model(3, resnet18_fmnist.Config()).state_dict(), weights)
    with pytest.raises(RecipeError, match=re.escape(f"{data} has 10 classes, the weights 3: pass --data of the kind "
                                                    "they were trained on")):
        predict_script.run(predict_script.Config(str(weights), evaluate=True, data=str(data),
                                                 recipe="resnet18_fmnist", classes="a,b,c"))


def test_evaluate_of_a_state_dict_without_data_names_the_recipes_default(tmp_path):
    """A .pt records no data: the data --evaluate would read is the recipe's default, and the line says so, not that
    the weights were trained on it."""
    weights = tmp_path / "weights.pt"
    torch.save(cifar_cnn.make_model(3, cifar_cnn.Config()).state_dict(), weights)
    with pytest.raises(RecipeError, match=re.escape("(recorded; for a .pt/.pth, the recipe's default): "
                                                    "'uoft-cs/cifar10', no folder here")):
        predict_script.run(predict_script.Config(str(weights), evaluate=True, recipe="cifar_cnn", classes="a,b,c"))


@pytest.mark.parametrize("file", ["", "model.safetensors"])
def test_predict_reads_a_checkpoint_folder_beside_its_run_config(file, run, folder, tmp_path):
    """A checkpoint folder, or its model.safetensors (which names no recipe or classes: accelerate wrote it): the
    recipe and classes come from the config.json in the folder. The file alone asked for --recipe, then --classes."""
    out, _ = run
    root, test_set = folder
    output = tmp_path / "predictions.csv"
    predict_script.run(predict_script.Config(str(out / "checkpoints" / "step_12" / file), str(root), str(output)))
    rows = list(csv.DictReader(output.open()))
    assert len(rows) == len(test_set) + 1 and all(row["class"] in CLASSES[:10] for row in rows)


def test_predict_reads_the_weights_an_extended_run_moved_to_finished(data, folder, tmp_path):
    """An extended run moves its earlier weights into finished/<N>_steps/ (README: a run continued past its end):
    that folder, as --weights, asked for --recipe ("which recipe builds the model?"), though its file names it. Its
    run's config.json says it, as for a checkpoint folder; the CSV is the file's, written beside it."""
    out, (root, test_set) = tmp_path / "run", folder
    flags = ("--data", data, "--output_dir", out, "--batch_size", "8", "--tracker", "none")
    ok(run_here("cifar_cnn", *flags, "--max_steps", "2"))
    ok(run_here("cifar_cnn", *flags, "--max_steps", "3", "--resume", "latest"))
    finished = out / "finished" / "2_steps"
    for weights, output in ((finished, "by_folder.csv"), (finished / "model.safetensors", "by_file.csv")):
        predict_script.run(predict_script.Config(str(weights), str(root), str(tmp_path / output)))
    assert (tmp_path / "by_folder.csv").read_text() == (tmp_path / "by_file.csv").read_text()
    assert len((tmp_path / "by_folder.csv").read_text().splitlines()) == len(test_set) + 2  # a header, and the jpg
    predict_script.run(predict_script.Config(str(finished), str(root)))  # the default --output: beside the weights
    assert (finished / f"predictions-{root.name}.csv").read_text() == (tmp_path / "by_file.csv").read_text()


@pytest.mark.parametrize("recipe", ["cifar_cnn", "resnet18_fmnist", "finetune"])
def test_momentum_0_is_plain_sgd(recipe, data, tmp_path):
    """--momentum 0 ended in torch's ValueError traceback ("Nesterov momentum requires a momentum and zero
    dampening"): the recipes' SGD is Nesterov's. With 0 it is plain SGD, and the run trains."""
    from recipes import finetune

    module = {"cifar_cnn": cifar_cnn, "resnet18_fmnist": resnet18_fmnist, "finetune": finetune}[recipe]
    pretrained = {"weights": "none"} if recipe == "finetune" else {}  # finetune.py's: no download
    lr = (0.1,) if recipe == "resnet18_fmnist" else ()  # the ResNet's, scaled to the global batch
    for momentum, nesterov in ((0.0, False), (0.9, True)):
        cfg = module.Config(momentum=momentum, **pretrained)
        optimizer = module.make_optimizer(module.make_model(10, cfg), cfg, *lr)
        assert {(g["momentum"], g["nesterov"]) for g in optimizer.param_groups} == {(momentum, nesterov)}
    flags = ("--weights", "none", "--image_size", "32") if recipe == "finetune" else ()
    out = tmp_path / "run"
    ok(run_here(recipe, "--data", data, "--output_dir", out, "--batch_size", "8", "--max_steps", "2", "--tracker",
                "none", "--momentum", "0", *flags))
    assert read_json(out / "config.json")["momentum"] == 0 and (out / "model.safetensors").is_file()


def test_the_ema_decay_ramps_up_so_a_short_run_forgets_its_first_weights():
    from shared.ema import update_ema

    model = torch.nn.Linear(1, 1, bias=False)
    model.weight.data.fill_(1000.0)  # the first, random weights
    ema = copy.deepcopy(model)
    ema.weight.data.fill_(-7.0)  # what the average held before its first update: overwritten
    expected = 1000.0
    update_ema(ema, model, 0, 0.99)  # the first update copies
    assert ema.weight.item() == expected
    for n in range(1, 100):  # then weights 0: what is left of 1000 is the first weights' share of the average
        model.weight.data.fill_(0.0)
        update_ema(ema, model, n, 0.99)
        decay = min(0.99, (1 + n) / (10 + n))
        expected *= decay
        assert ema.weight.item() == pytest.approx(expected, rel=1e-4)
    assert expected / 1000 < 1e-3  # a fixed 0.99 would still hold 0.99 ** 99 = 37% of them
