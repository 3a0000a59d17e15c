"""benchmarks/gpu_check.sh, the prepared GPU correctness check, run as a dry run on the CPU (GPU_CHECK_CPU=1): every
step it takes on a GPU but two (gpu_check.py says which), tiny, so that it cannot rot before a GPU comes, with only the
assertions a CPU run can prove: a run resumed after SIGTERM to the launcher ends bitwise as the run never stopped,
predict.py evaluates the saved weights as the run did, a compiled run saves plain weights. The steps it takes for each
recipe are one code path with the recipe's name: here for cifar_cnn (GPU_CHECK_RECIPES); the MLP runs in the sweep."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT
from tiny_data import idx_folder, random_splits

pytestmark = pytest.mark.slow  # a benchmark's dry run


def test_the_gpu_check_runs_every_step_on_the_cpu(env, tmp_path):
    fashion = idx_folder(tmp_path / "fashion-mnist", random_splits((28, 28), sizes=(64, 20)))
    out = tmp_path / "check"
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                            env=dict(env, GPU_CHECK_CPU="1", GPU_CHECK_FASHION_MNIST=str(fashion),
                                     GPU_CHECK_RECIPES="cifar_cnn"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((out / "gpu_check.json").read_text())
    steps = figures["steps"]
    assert figures["dry_run"] and all(step["ok"] for step in steps.values()), json.dumps(steps, indent=1)[-3000:]
    for recipe in ("cifar_cnn",):
        # On the CPU a resumed run is bitwise the uninterrupted one: the comparison holds.
        resumed = steps[f"{recipe} resume"]
        assert resumed["resumed_vs_reference_max_abs"] == 0.0 and "again_vs_reference_max_abs" not in resumed
        assert 2 <= resumed["stopped_at_step"] < resumed["of_steps"]
        predicted = steps[f"{recipe} predict on the CPU"]  # here: predict.py against the run's own evaluation
        assert abs(predicted["eval_acc_cpu"] - predicted["eval_acc_gpu"]) <= 1e-4  # at most one of 10,000 images
        for precision in ("float32", "bf16"):  # fp16: on a GPU only
            assert steps[f"{recipe} {precision}"]["steps"] == 6 and steps[f"{recipe} {precision}"]["device"] == "cpu"
    assert steps["cifar_cnn bf16"]["mixed_precision"] == "bf16"
    assert steps["cifar_cnn compile"]["plain_weight_names"] and steps["cifar_cnn compile"]["steps"] == 6
    assert set(steps["deep_mlp_sweep memory"]["batch_16"]) == {"0", "2"}  # none and 2 segments (2,5,10 on a GPU)
