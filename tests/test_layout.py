"""A recipe is meant to be copied: with shared/ beside it, into a project of its own."""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
from PIL import Image

from conftest import ROOT, ok, read_json, read_jsonl
from tiny_data import save_to_disk_dataset


@pytest.mark.slow  # a project of its own: processes with nothing of the repository on their path
def test_one_command_makes_a_project_that_runs_its_readme_and_a_metric_is_one_edit(env, tmp_path):
    """tools.new_project, then the README's commands inside the project, with nothing of the repository on the path;
    one edit of metric_sums adds top-2 accuracy to training, evaluation, the run's files and predict.py."""
    data = save_to_disk_dataset(tmp_path / "data", sizes={"train": 64, "test": 20})
    project = tmp_path / "my_project"
    ok(subprocess.run([sys.executable, str(ROOT / "tools" / "new_project.py"), str(project), "--from", "cifar_cnn",
                       "--data", str(data)], cwd=tmp_path, env=env, capture_output=True, text=True))  # from anywhere
    train = project / "train.py"
    one_metric = '    return {"acc": (logits.argmax(dim=1) == labels).sum()}\n'
    two = one_metric.replace("}", ', "top2": (logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1).sum()}')
    assert train.read_text().count(one_metric) == 1
    train.write_text(train.read_text().replace(one_metric, two))
    readme = (project / "README.md").read_text()
    assert readme.startswith("# my_project\n")
    commands = readme.split("```bash\n")[1].split("```")[0].splitlines()[2:]  # after the install and smoke run
    short = "--batch_size 8 --log_every 1 --checkpoint_every 3 --tracker none"
    photos = project / "my_photos"
    photos.mkdir()
    for n in range(3):
        Image.new("RGB", (40, 40), (80 * n, 90, 200)).save(photos / f"{n}.png")
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    outputs = []
    # The resume as the README says it: the run's folder and the one flag that changes (its flags are in config.json)
    for command, extra in zip(commands, (f"--max_steps 3 {short} --output_dir runs/RUN", "--max_steps 6", "", "", "")):
        words = shlex.split(command + " " + extra)
        launcher = ([sys.executable, "-m", "accelerate.commands.accelerate_cli"] if words[0] == "accelerate"
                    else [sys.executable])
        outputs.append(ok(subprocess.run(launcher + words[1:], cwd=project, env=clean, capture_output=True,
                                         text=True, timeout=600)).stdout)
    run = project / "runs" / "RUN"
    rows = read_jsonl(run / "metrics.jsonl")
    assert [row["step"] for row in rows if "train_loss" in row] == [1, 2, 3, 4, 5, 6]  # resumed at step 3
    assert all("train_top2" in row and row["train_top2"] >= row["train_acc"] for row in rows if "train_loss" in row)
    assert all("eval_top2" in row and row["eval_top2"] >= row["eval_acc"] for row in rows if "eval_loss" in row)
    summary, config = read_json(run / "summary.json"), read_json(run / "config.json")
    assert summary["pieces"] == 2 and config["recipe"] == "my_project" and config["data"] == str(data)
    assert (config["batch_size"], config["checkpoint_every"], config["tracker"]) == (8, 3, "none")
    assert "(RUN: the folder a run printed; it continues with the flags its config.json records" in readme
    # a header and a row per image, in the run's folder (the project's own folder keeps its files)
    assert len((run / "predictions-my_photos.csv").read_text().splitlines()) == 4
    assert "wrote runs/RUN/predictions-my_photos.csv (3 images)" in outputs[2]
    evaluated = json.loads(outputs[3].strip().splitlines()[-1])
    table = outputs[4].splitlines()  # the runs table, a metric_sums entry among its columns
    assert len(outputs) == 5 and "eval_top2" in table[-1]  # among the columns --all adds
    assert any(line.startswith("| RUN | my_project |") for line in table)
    assert evaluated["eval_top2"] == summary["eval_top2"] and evaluated["eval_samples"] == 20
    # predict.py found train.py without --recipe: the one beside it whose RECIPE is the name the weights record
    assert "--recipe" not in "".join(commands[2:4])


@pytest.mark.slow  # processes with nothing of the repository on their path
def test_a_recipe_copied_beside_shared_runs_outside_the_repository(env, tmp_path):
    """The other way to copy: recipes/ beside shared/, as in this repository, under another name."""
    project = tmp_path / "my_project"  # nothing of the repository on its path
    script = project / "recipes" / "train.py"
    script.parent.mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "cifar_cnn.py", script)
    shutil.copytree(ROOT / "shared", project / "shared", ignore=shutil.ignore_patterns("__pycache__"))
    clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    out, data = project / "run", save_to_disk_dataset(tmp_path / "data", sizes={"train": 64, "test": 20})
    ok(subprocess.run([sys.executable, str(script), "--data", str(data), "--batch_size", "8", "--max_steps", "5",
                       "--log_every", "1", "--tracker", "none", "--output_dir", str(out)],
                      cwd=project, env=clean, capture_output=True, text=True, timeout=600))
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "train_loss" in row] == [1, 2, 3, 4, 5]
    assert (out / "model.safetensors").exists() and (out / "checkpoints" / "step_5").is_dir()
    # Using the model from the copy: predict.py takes the renamed script by its path.
    shutil.copy(ROOT / "recipes" / "predict.py", script.parent / "predict.py")
    evaluated = ok(subprocess.run([sys.executable, str(script.parent / "predict.py"), "--weights",
                                   str(out / "model.safetensors"), "--recipe", str(script), "--evaluate"],
                                  cwd=project, env=clean, capture_output=True, text=True, timeout=600))
    metrics = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert metrics["eval_acc"] == read_json(out / "summary.json")["eval_acc"] and metrics["eval_samples"] == 20


# What each recipe's evaluate(), train() and main() do differently from cifar_cnn's, on purpose: its model's
# arguments, resnet's learning-rate scaling and SyncBatchNorm, the MLP's flat inputs, no channels_last and no --tta.
# Anything else that differs is a fix made to one loop and not to the others. (accelerate's tests/test_examples.py
# keeps its feature examples in step with the complete one the same way: by diffing them.) After a deliberate
# change, paste the diff the failure prints.
INTENDED = {
    ("finetune", "evaluate"): """
    - inputs = preprocess(images, training=False)
    + inputs = preprocess(images, training=False, cfg=cfg)
""",
    ("finetune", "train"): """
    - with accelerator.local_main_process_first():  # one process per machine decodes into the machine's cache
    + with accelerator.local_main_process_first():  # one download and one decode per machine, into its caches
    + # The pretrained file first: missing or damaged, it is said before the images' decode (10 s and more)
    + pretrained = None if cfg.resume or cfg.init_from else pretrained_state(cfg)  # else the weights are there
    + load_pretrained(model, pretrained, cfg)
    + classifier = model.get_submodule(classifier_name(model))  # the new layer, trained from the first step
    - def train_step(images, labels):  # one batch; on one GPU, a CUDA graph of it is replayed (shared/loop.py)
    - with accelerator.accumulate(model):  # DDP syncs gradients only on the last batch of each accumulation
    - inputs = preprocess(images, cfg.augment)
    - if cfg.channels_last:  # after preprocessing: the crop's gather returns a plain NCHW tensor
    + # One batch, eager: never a CUDA graph (shared/loop.py), as unfreezing changes what the step computes, which a
    + # graph captured while frozen would not follow.
    + def train_step(images, labels):
    + # DDP syncs gradients only on the last batch of each accumulation, and never while frozen (no_sync): it
    + # would wait for the gradients of every layer it wrapped. The classifier's alone are averaged below.
    + with accelerator.accumulate(model), accelerator.no_sync(model) if frozen else contextlib.nullcontext():
    + inputs = preprocess(images, cfg.augment, cfg)
    + if cfg.channels_last:  # after preprocessing: the crop returns a plain NCHW tensor
    + if frozen and accelerator.sync_gradients:  # the mean over the processes, as DDP's
    + for param in classifier.parameters():
    + param.grad = accelerator.reduce(param.grad, "mean")
    - step = loop.CapturedStep(train_step, optimizer, loop.graph_setting(accelerator, cfg))
    + # Frozen: the new classifier alone. The pretrained layers need no gradient, so autograd records no backward
    + # through them (a frozen step is their forward and the classifier's backward); BatchNorm's statistics stay.
    + frozen = progress.epoch < cfg.freeze_epochs
    + model.requires_grad_(not frozen)
    + classifier.requires_grad_(True)
    + for module in model.modules() if frozen else []:
    + if isinstance(module, nn.BatchNorm2d):  # what every torchvision classifier normalizes with
    + module.eval()
    - step.set_lr(lr)
    - loss, logits, grad_norm = step(images, labels)
    + for group in optimizer.param_groups:  # the pretrained layers: a share of it
    + group["lr"] = lr * cfg.backbone_lr_scale if group["backbone"] else lr
    + loss, logits, grad_norm = train_step(images, labels)
""",
    ("resnet18_fmnist", "train"): """
    + peak_lr = scaled_lr(cfg, global_batch_size)
    + if cfg.sync_bn and accelerator.num_processes > 1:
    + # BatchNorm normalizes each process's own b images: 2 processes x b do not normalize like 1 x 2b (the
    + # exact-equivalence tests use a BatchNorm-free model). SyncBatchNorm all-reduces the statistics at every
    + # BatchNorm layer. Accumulated batches still differ: they run one after another, with nothing to sync.
    + if accelerator.device.type == "cpu":
    + raise RecipeError("--sync_bn needs GPUs: PyTorch's SyncBatchNorm does not run on CPU tensors")
    + model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    - optimizer = make_optimizer(model, cfg)
    + optimizer = make_optimizer(model, cfg, peak_lr)
    - f"global batch {global_batch_size}, {total_steps} steps ({run_epochs:.3g} epochs) | {run_dir}")
    + f"global batch {global_batch_size}, {total_steps} steps ({run_epochs:.3g} epochs) | "
    + f"lr {cfg.lr} for batch {REFERENCE_BATCH} -> {peak_lr:.4g} ({cfg.lr_scaling} scaling) | "
    + f"{run_dir}")
    - global_batch_size=global_batch_size, total_steps=total_steps,
    + global_batch_size=global_batch_size, effective_lr=peak_lr, total_steps=total_steps,
    - inputs = preprocess(images, cfg.augment)
    + inputs = preprocess(images, cfg.augment, cfg.erase)
    - # One bad batch can take a step large enough to kill every ReLU; the clip bounds it.
    + # Early steps at the peak rate moved the weights faster than BatchNorm's running statistics could
    + # follow (test loss 102 at the peak); the clip bounds each step.
    - lr = loop.one_cycle_lr(progress.step, total_steps, cfg.lr)  # a function of the step, no state
    + lr = loop.one_cycle_lr(progress.step, total_steps, peak_lr)  # a function of the step, no state
""",
    ("deep_mlp_ckpt", "evaluate"): '''
    - """Test loss and accuracy over every process, and the predictions in test-set order. With --tta, also those of
    - each image's logits averaged with its mirror's (eval_loss_tta, eval_acc_tta): training flips, so both count."""
    + """Test loss and accuracy over every process, and the predictions in test-set order. (No --tta here: this
    + recipe trains without flips, so a mirrored image is not one it learned.)"""
    - inputs = preprocess(images, training=False)
    - if cfg.channels_last:  # the layout the model was trained in
    - inputs = inputs.contiguous(memory_format=torch.channels_last)
    - outputs = {"": model(inputs)}
    - if cfg.tta:
    - outputs["_tta"] = (outputs[""] + model(inputs.flip(3))) / 2
    + logits = model(preprocess(images))
    - outputs, labels = accelerator.gather_for_metrics((outputs, labels))
    - for suffix, logits in outputs.items():
    - sums[f"eval_loss{suffix}"] += loss_fn(logits, labels, reduction="sum")
    - for name, value in metric_sums(logits, labels).items():
    - sums[f"eval_{name}{suffix}"] += value
    - predictions.append(outputs[""].argmax(dim=1))
    + logits, labels = accelerator.gather_for_metrics((logits, labels))
    + sums["eval_loss"] += loss_fn(logits, labels, reduction="sum")
    + for name, value in metric_sums(logits, labels).items():
    + sums[f"eval_{name}"] += value
    + predictions.append(logits.argmax(dim=1))
''',
    ("deep_mlp_ckpt", "train"): """
    - if cfg.channels_last:
    - model = model.to(memory_format=torch.channels_last)
    - # optimizer step. The processes hold the same weights, so the same average; BatchNorm's running statistics too.
    + # optimizer step. The processes hold the same weights, so the same average (LayerNorm keeps no statistics).
    - inputs = preprocess(images, cfg.augment)
    - if cfg.channels_last:  # after preprocessing: the crop's gather returns a plain NCHW tensor
    - inputs = inputs.contiguous(memory_format=torch.channels_last)
    - logits = model(inputs)
    + logits = model(preprocess(images))
    - # One bad batch can take a step large enough to kill every ReLU; the clip bounds it.
    + # Adam scales each step by the gradient's own size, so the clip changed nothing measurable here
    + # (0.281 on real photos either way); it bounds the step after a rare outlier batch.
    - if ema is not None:  # BatchNorm statistics differ between processes: the main process's, as DDP does
    + if ema is not None:  # buffers from the main process, as DDP does (this model has none)
""",
}


def function_lines(recipe: str, name: str) -> list[str]:
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return source.splitlines()[start - 1:node.end_lineno]


@pytest.mark.parametrize("recipe", ["resnet18_fmnist", "deep_mlp_ckpt", "finetune"])
@pytest.mark.parametrize("name", ["evaluate", "train", "main"])
def test_the_training_loops_stay_in_step(recipe, name):
    changed = [f"{line[0]} {line[1:].strip()}"
               for line in difflib.unified_diff(function_lines("cifar_cnn", name), function_lines(recipe, name),
                                                lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    intended = [line.strip() for line in INTENDED.get((recipe, name), "").strip().splitlines()]
    assert changed == intended, (f"{recipe}.{name}() differs from cifar_cnn's in more (or less) than intended; "
                                 "make the same fix in every recipe, or update INTENDED:\n" + "\n".join(changed))


@pytest.mark.parametrize("recipe", ["cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt"])
def test_a_recipe_imports_at_most_12_names_from_shared(recipe):
    """docs/style.md's budget: a reader learns a dozen helpers, not a framework."""
    tree = ast.parse((ROOT / "recipes" / f"{recipe}.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").split(".")[0] == "shared" for alias in node.names]
    assert 0 < len(names) <= 12, names


@pytest.mark.parametrize("place", ["inside shared", "below a file"])
def test_new_project_refuses_a_place_it_cannot_be(tmp_path, place):
    """Inside shared/ it copied itself into itself (1,687 files); below a file it ended in a traceback."""
    (tmp_path / "a_file").write_text("mine")
    target = ROOT / "shared" / "my_project" if place == "inside shared" else tmp_path / "a_file" / "my_project"
    result = subprocess.run([sys.executable, "-m", "tools.new_project", str(target), "--from", "cifar_cnn"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert not target.exists() and (tmp_path / "a_file").read_text() == "mine"


def test_new_project_commands_paste_into_a_shell_whatever_the_names(tmp_path, capsys):
    """A folder or --data with a space or a quote: the printed `cd my proj && ...` and the README's `--data my data`
    were split by the shell into other words (cd: too many arguments)."""
    from tools import new_project

    folder, data = tmp_path / "my proj", "my data/it's"
    new_project.main([str(folder), "--from", "cifar_cnn", "--data", data])
    cd = capsys.readouterr().out.splitlines()[1]
    assert shlex.split(cd)[:4] == ["cd", str(folder), "&&", "accelerate"], cd
    readme = (folder / "README.md").read_text()
    (command,) = [line for line in readme.splitlines() if " --data " in line]
    assert shlex.split(command)[-2:] == ["--data", data], command
    assert f'data: str = "{data}"' in (folder / "train.py").read_text()


@pytest.mark.parametrize("existed", [False, True])
def test_new_project_that_fails_midway_leaves_its_folder_free_for_the_next_try(tmp_path, monkeypatch, existed):
    """A full disk after train.py was written left a half-made project, and the next try was refused: 'already
    exists and is not empty'."""
    from tools import new_project

    target = tmp_path / "deep" / "my_project"
    if existed:
        target.mkdir(parents=True)  # an empty folder made for it: it stays, empty

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(new_project.shutil, "copytree", full_disk)
    with pytest.raises(SystemExit) as stopped:
        new_project.main([str(target), "--from", "cifar_cnn"])
    assert stopped.value.code == 1
    assert (sorted(target.iterdir()) == []) if existed else not target.exists()
    monkeypatch.undo()
    new_project.main([str(target), "--from", "cifar_cnn"])
    assert (target / "train.py").is_file() and (target / "shared" / "data.py").is_file()


def test_new_project_from_a_partial_copy_names_what_it_lacks(tmp_path, monkeypatch, capsys):
    """recipes/, shared/ and tools/ copied without requirements.txt: the failed read was said as 'cannot write the
    project into my_project (No such file or directory): pick a writable place with room'."""
    from tools import new_project

    partial = tmp_path / "partial"
    for name in ("recipes", "shared", "accelerate_configs", "tools"):
        shutil.copytree(ROOT / name, partial / name, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(new_project, "ROOT", partial)
    target = tmp_path / "my_project"
    with pytest.raises(SystemExit) as stopped:
        new_project.main([str(target), "--from", "cifar_cnn"])
    assert stopped.value.code == 2 and not target.exists()
    assert capsys.readouterr().err == (f"error: {partial} lacks requirements.txt, which a project copies: run this "
                                       "tool from a whole copy of the recipes repository\n")


def test_the_budget_counts_what_a_copier_reads(tmp_path):
    """tools.budget: tokens without comments, docstrings and layout; an import inside a function is opt-in."""
    from tools import budget

    file = tmp_path / "x.py"
    file.write_text('"""Its docstring."""\n\nimport os  # a comment\n\n\ndef f(a):\n    """Doc."""\n    return a + 1\n'
                    "\n\ndef g():\n    from shared.images import read_image\n    return read_image\n")
    assert budget.tokens(file) == 12 + 13  # import os; def f(a): return a + 1; def g(): from ... return read_image
    assert budget.shared_imports(file) == ({ROOT / "shared" / "__init__.py"}, {ROOT / "shared" / "images.py"})
    file.write_text("from shared import tracking\nfrom shared.errors import RecipeError\n")
    assert budget.shared_imports(file)[0] == {ROOT / "shared" / name for name in (
        "__init__.py", "tracking.py", "errors.py")}
    file.write_text('x = f"{a + b!r:>{width}} and {c}"\n')  # Python 3.12 splits it in pieces: one token all the same
    assert budget.tokens(file) == 3


def test_the_budget_fails_over_a_ceiling_and_prints_what_is_over_its_budget(capsys):
    """tools.budget's exit status: over a budget without a ceiling, or over its ceiling, fails; over a budget within
    its ceiling (what was over when the budgets came) is printed and passes, so that the count can only fall."""
    from tools import budget

    ceilings = {"a: default path": 12_000}
    assert budget.report([("a: default path", 11_500, 11_000), ("b: recipe", 2_000, 3_000)], ceilings) == 0
    assert "over budget: a: default path 11,500 > 11,000 (within its ceiling 12,000" in capsys.readouterr().out
    assert budget.report([("a: default path", 12_001, 11_000)], ceilings) == 1
    assert budget.report([("b: recipe", 3_001, 3_000)], ceilings) == 1
    assert budget.report([("b: recipe", 3_000, 3_000)], ceilings) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "every budget met"
    # each ceiling names a count that exists
    assert all(name.rsplit(": ", 1)[-1] in budget.BUDGETS or name == "opt-in" for name in budget.CEILINGS)


def test_the_budget_piped_to_a_reader_that_ends_first_ends_quietly():
    """`python -m tools.budget | head -1`: head ends after its line, and the rest met a closed pipe: a BrokenPipeError
    traceback at the exit's flush. Now the pipe's signal ends it, as it ends a Unix tool. Here the reader is gone from
    the start."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    result = subprocess.run([sys.executable, "-m", "tools.budget"], cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE,
                            text=True)
    os.close(write_end)
    assert result.returncode == -signal.SIGPIPE and result.stderr == "", result.stderr


@pytest.mark.slow  # what a new process imports
def test_a_recipe_imports_no_opt_in_module_when_it_starts():
    """The opt-in modules (tools.budget: imported only inside a function) stay out of a recipe's start: IDX and
    CIFAR's files, the checks on pickles and torch files, the pictures and matplotlib."""
    from tools import budget

    opt_in = sorted(set((ROOT / "shared").rglob("*.py")) - budget.default_path(ROOT / "recipes" / "cifar_cnn.py"))
    modules = [".".join(file.relative_to(ROOT).with_suffix("").parts) for file in opt_in]
    assert {"shared.dataset_files", "shared.pickles", "shared.pictures"} <= set(modules)
    probe = "import sys; import recipes.cifar_cnn; print([m for m in sys.argv[1:] if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe, *modules, "matplotlib"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_every_name_imported_from_the_project_exists():
    """The scripts run rarely (a benchmark, the GPU check) import names of shared/, recipes/ and tools/ that a change
    may move or rename: benchmarks/finetune_speed.py kept importing read_rows from shared.tracking after it moved to
    shared/pictures.py, a traceback at its start that no test ran into. Every `from <project module> import name`, at
    any depth of any Python file here, names a module or an attribute that exists."""
    missing = []
    for path in sorted(p for folder in ("recipes", "shared", "tools", "benchmarks", "tests")
                       for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("shared", "recipes", "tools"):
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}"
                            for alias in node.names if not names_something(module, alias.name)]
    assert not missing, missing


def names_something(module, name: str) -> bool:
    """`from module import name` finds an attribute of the module, or a submodule of a package."""
    return hasattr(module, name) or hasattr(module, "__path__") and importlib.util.find_spec(
        f"{module.__name__}.{name}") is not None
