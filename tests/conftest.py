"""Run the recipes the way users do: `accelerate launch --config_file ... recipes/<recipe>.py`,
or `python recipes/<recipe>.py`, in a subprocess, from the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> dict:
    """A clean environment: private caches and home (so no wandb login), no inherited launcher settings."""
    home = tmp_path_factory.mktemp("home")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "ACCELERATE_", "HF_"))}
    clean.update(HOME=str(home), HF_HOME=str(home / "hf"), PYTHONUNBUFFERED="1",
                 HF_HUB_DISABLE_TELEMETRY="1")
    return clean


def launch(env: dict, recipe: str, *args: str, config: str | None = None, use_cpu: bool = False,
           timeout: int = 600) -> subprocess.CompletedProcess:
    """`python recipes/<recipe>.py args` (one process), or with `config`:
    `accelerate launch --config_file accelerate_configs/<config>.yaml recipes/<recipe>.py args`
    (`--config_file <config>` when it is a path to a .yaml file).

    One process runs the same code either way; the launcher adds about 3 s to every run, so tests name
    a config where the launch itself is what they check, or where it starts several processes."""
    script = f"recipes/{recipe}.py"
    if config is None:
        command = [sys.executable, script, *args]
    else:
        # Exactly what the `accelerate launch` command runs, with this interpreter.
        config_file = config if config.endswith(".yaml") else f"accelerate_configs/{config}.yaml"
        command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                   config_file, script, *args]
    run_env = dict(env, ACCELERATE_USE_CPU="true") if use_cpu else env
    return subprocess.run(command, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
                                    f"--- stderr\n{result.stderr[-5000:]}")
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
