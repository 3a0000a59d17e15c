"""The docs name only what exists: every file path, module and flag that README.md, docs/ and BENCHMARKS.md name is
in the repository, and every flag belongs to one of its entry points or to the tool the docs run it with."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
import sys

import pytest
from accelerate.commands.launch import launch_command_parser

from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:recipes|shared|tools|benchmarks|tests|docs|accelerate_configs)/[\w./<>*-]*[\w/>*])")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)")
MODULE = re.compile(r"(?<![\w.])((?:shared|tools)(?:\.\w+)+)")
# Flags of other programs the docs name: pytest and xdist (the test commands), pip, SLURM's sbatch, tensorboard,
# pytorch/examples' --dry-run; a flag the docs say was removed; the examples of a mistyped flag, and a flag's form.
OTHER_TOOLS = {"--dist", "--no-loadscope-reorder", "--index-url", "--signal", "--mem", "--nodes", "--gpus-per-node",
               "--requeue", "--logdir", "--dry-run", "--auto_batch_size", "--bogus", "--max_step", "--name"}


def entry_point_flags() -> set[str]:
    """Every flag of the recipes, predict.py, the tools, the benchmarks, accelerate launch and the test suite."""
    flags = set()
    for script in sorted((ROOT / "recipes").glob("*.py")):
        module = importlib.import_module(f"recipes.{script.stem}")
        if hasattr(module, "Config"):
            for field in dataclasses.fields(module.Config):
                flags |= {f"--{field.name}", f"--no-{field.name}"}
    for script in [*(ROOT / "tools").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                   ROOT / "recipes" / "deep_mlp_sweep.py", ROOT / "tests" / "conftest.py"]:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("add_argument", "addoption"):
                flags |= {arg.value for arg in node.args if isinstance(getattr(arg, "value", None), str)}
    for action in launch_command_parser()._actions:
        flags |= set(action.option_strings)
    return flags | {"--help"}


def named(pattern: re.Pattern) -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), found) for doc in DOCS for found in pattern.findall(doc.read_text())]


def path_exists(path: str) -> bool:
    """A path the docs name is there; a pattern (`recipes/<recipe>.py`, `runs/*`) names at least one that is. A
    sentence's full stop may end it."""
    pattern = re.sub(r"<[^>]*>", "*", path)
    return any(ROOT.glob(pattern)) or any(ROOT.glob(pattern.rstrip(".")))


@pytest.mark.parametrize("doc, path", sorted(set(named(PATH))))
def test_every_path_the_docs_name_exists(doc, path):
    assert path_exists(path), f"{doc} names {path}"


def test_every_flag_the_docs_name_exists():
    known = entry_point_flags() | OTHER_TOOLS
    unknown = sorted({f"{doc}: {flag}" for doc, flag in named(FLAG) if flag not in known})
    assert not unknown, unknown


def test_every_module_the_docs_name_exists():
    for doc, module in named(MODULE):
        name = module.rstrip(".")
        while name.count(".") and not importlib.util.find_spec(name):
            parent, _, attribute = name.rpartition(".")  # shared.ema.update_ema: an attribute of a module
            if importlib.util.find_spec(parent) and hasattr(importlib.import_module(parent), attribute):
                break
            raise AssertionError(f"{doc} names {module}")


def test_shared_init_names_its_modules():
    """shared/__init__.py's docstring lists the modules, a line each: each is there, and each module is listed."""
    listed = re.findall(r"^- (\w+)(?:/)?:", importlib.import_module("shared").__doc__, re.M)
    there = {path.stem if path.is_file() else path.name for path in (ROOT / "shared").iterdir()
             if path.suffix == ".py" and path.stem != "__init__" or path.is_dir() and path.name != "__pycache__"}
    assert set(listed) == there, (sorted(listed), sorted(there))


def test_a_stale_name_fails_the_check():
    """Guards the checks: a path, a pattern and a flag that name nothing are caught (--backbone_lr: what the docs
    named before it was renamed)."""
    assert PATH.findall("see `shared/memory.py`.") == ["shared/memory.py"]
    assert not path_exists("shared/no_such_module.py") and not path_exists("recipes/<recipe>.yaml")
    assert path_exists("recipes/<recipe>.py") and path_exists("shared/data.py.")
    assert "--backbone_lr" not in entry_point_flags() | OTHER_TOOLS


LAUNCH = re.compile(r"accelerate launch ((?:-\S+ )*)--config_file accelerate_configs/(\w+)\.yaml")


def test_every_launch_of_one_process_the_project_gives_is_quiet():
    """Without `-q`, accelerate's one-process launcher ends every failed run in its own CalledProcessError traceback,
    below the recipe's one line: each command a user copies from the README, docs/, a config's or a recipe's header or
    a new project's README passes it. docs/speed.md and benchmarks/ keep the commands they measured, as run."""
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "accelerate_configs").glob("*"),
               *(ROOT / "recipes").glob("*.py"), *(ROOT / "tools").glob("*.py")]
    one_process = {path.stem for path in (ROOT / "accelerate_configs").glob("*.yaml")
                   if re.search(r"^num_processes: 1$", path.read_text(), re.M)}
    assert {"cpu", "1gpu", "fp16"} <= one_process and "2gpu" not in one_process
    loud = [f"{path.relative_to(ROOT)}: {match[0]}" for path in sources if path.name != "speed.md"
            for match in LAUNCH.finditer(path.read_text()) if match[2] in one_process and "-q " not in match[1]]
    assert not loud, loud
    assert LAUNCH.search("accelerate launch --config_file accelerate_configs/cpu.yaml x.py")[1] == ""

def test_what_a_recipe_uses_from_shared_is_what_the_docs_list():
    """docs/your_project.md lists cifar_cnn.py's imported names, the functions it calls and the methods of the objects
    it makes (the README said "at most 12 helpers" when a recipe called 25)."""
    tree = ast.parse((ROOT / "recipes" / "cifar_cnn.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("shared") for alias in node.names}
    objects = {"checkpoints", "window", "order", "step"}  # Checkpoints, tracking.TrainWindow, EpochOrder, CapturedStep
    called = {"functions": set(), "methods": set()}
    for node in ast.walk(tree):
        function = getattr(node, "func", None)
        if isinstance(node, ast.Call) and isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
            name = f"{node.func.value.id}.{node.func.attr}"
            if node.func.value.id in imported and node.func.attr[0].islower():
                called["functions"].add(name)
            elif node.func.value.id in objects:
                called["methods"].add(name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported \
                and node.func.id[0].islower():
            called["functions"].add(node.func.id)
    text = (ROOT / "docs" / "your_project.md").read_text()
    listed = {kind: set(re.findall(r"`([\w.]+)`", text.split(f"- {heading}")[1].split("\n- ")[0]))
              for kind, heading in (("imported", "imported names"), ("functions", "functions called"),
                                    ("methods", "methods of the four objects"))}
    assert listed["imported"] == imported and len(imported) == 12
    assert listed["functions"] == called["functions"] and len(called["functions"]) == 14
    assert listed["methods"] == called["methods"] and len(called["methods"]) == 13


# Underscore names of this project's own, and the standard library's: not a dependency's private API.
OWN_PRIVATE = {"os._exit", "checkpoints.StopOnSignals._agree", "tracking._LOCKS"}


def test_every_private_name_of_a_dependency_the_code_uses_is_listed_in_docs_tests_md():
    """A private name of torch, torchvision, accelerate or datasets may change in any release: each one that the
    recipes, shared/, the benchmarks or the test harness use is listed in docs/tests.md with the quick-tier test that
    runs it, on the floors and on the pins."""
    listed = (ROOT / "docs" / "tests.md").read_text()
    files = [*ROOT.glob("recipes/*.py"), *ROOT.glob("shared/**/*.py"), *ROOT.glob("benchmarks/*.py"),
             ROOT / "tests" / "conftest.py"]
    used = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                used.add((f"{ast.unparse(node.value)}.{node.attr}", node.attr, file.relative_to(ROOT).as_posix()))
            elif isinstance(node, ast.ImportFrom) and node.module and "._" in node.module:
                private = "_" + node.module.split("._")[1].split(".")[0]  # torch.utils._python_dispatch
                used.add((node.module, private, file.relative_to(ROOT).as_posix()))
    missing = [(name, file) for name, private, file in sorted(used)
               if name not in OWN_PRIVATE and not name.startswith(("self.", "cls.")) and private not in listed]
    assert not missing, f"private names used but not listed in docs/tests.md: {missing}"
    assert len(used) > 10  # the walk found the ones listed today


@pytest.mark.slow  # 200 steps under the launcher, as the README runs them
def test_the_readmes_first_run_prints_what_the_readme_shows(env, tmp_path):
    """README.md's offline first run, as written there (in a folder of its own, where its runs/ is made), prints on
    stdout the lines the README shows and no others. Placeholders (<time>, <...>, ...) and times in seconds are free;
    the test metrics within 0.02 of the README's (float sums may differ between CPUs); every other number exact."""
    section = (ROOT / "README.md").read_text().split("## A first run, offline")[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).split()
    shown = re.search(r"prints:\n\n```\n(.+?)\n```", section, re.S).group(1).splitlines()
    assert command[:2] == ["accelerate", "launch"]
    words = [sys.executable, "-m", "accelerate.commands.accelerate_cli",  # the same command, with this interpreter
             *(str(ROOT / word) if "/" in word and (ROOT / word).exists() else word for word in command[1:])]
    result = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # Without a terminal, a run whose training passes 30 s also prints a line every 30 s (TrainWindow.heartbeat): on a
    # slow or busy machine (CI's three workers on two cores took 37 s), which the README says
    heartbeat = re.compile(r"step \d+/200  train_loss [\d.]+  \d+ samples/s \(since the last log point\)")
    printed = [line for line in result.stdout.splitlines() if line.strip() and not heartbeat.fullmatch(line)]
    assert len(printed) == len(shown), "\n".join(printed)
    for line, got in zip(shown, printed):
        # The README's line in pieces: text, and between them a placeholder, a time in seconds or a number.
        pieces = re.split(r"(<[^>]*>|\.\.\.|\d+(?:\.\d+)? s\b|\d+(?:\.\d+)?)", line)
        pattern, numbers = "", []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                pattern += re.escape(piece)
            elif piece.startswith("<") or piece == "...":
                pattern += ".+?"
            elif piece.endswith(" s"):  # the estimate's time left: 90 s and more in minutes
                pattern += r"[\d.]+ (?:s|min)" if pattern == re.escape("about ") else r"[\d.]+ s"
            else:
                pattern, numbers = pattern + r"([\d.]+)", numbers + [piece]
        found = re.fullmatch(pattern, got)
        assert found, f"README: {line}\nprinted: {got}"
        for n, (want, value) in enumerate(zip(numbers, found.groups(), strict=True)):
            metric = "eval_" in line and "." in want  # a test loss or accuracy
            # The estimate's steps end 20 after the first or at 10 s of training, whichever comes first: earlier where
            # a step takes over 0.5 s (0.623 s on CI's 2-core CPU without AVX-512, three workers busy: steps 2-18)
            window_end = line.startswith("about ") and n == len(numbers) - 1
            assert value == want or metric and abs(float(value) - float(want)) <= 0.02 or window_end and int(
                numbers[-2]) < int(value) <= int(want), (line, got)
