#!/usr/bin/env bash
# Speed and time to accuracy on one GPU, in at most 8 minutes on one H100 (benchmarks/gpu_speed.py says what it
# measures): writes gpu_speed.json, its log, a profile trace and its top operations under OUT_DIR; the runs' own
# folders (config, metrics, weights) under runs/gpu_speed-<time>/, or GPU_SPEED_RUNS. It needs what the recipes need
# and no more (no datasets: generated data and the IDX files), so nothing is installed on the GPU machine.
#   bash benchmarks/gpu_speed.sh [OUT_DIR]                   # default benchmarks/results/gpu-<name>/ (h100, h200, ...)
#   GPU_SPEED_CPU=1 bash benchmarks/gpu_speed.sh OUT_DIR     # the same measurements, tiny, on the CPU (a test runs this)
#   GPU_SPEED_RECIPES="cifar_cnn" ...                        # the per-recipe rows for these recipes only
#   GPU_SPEED_BUDGET_S=420 ...                               # no measurement starts after this many seconds
# The real Fashion-MNIST's IDX files: GPU_SPEED_FASHION_MNIST, else /usr/share/datasets/fashion-mnist (Debian's
# dataset-fashion-mnist), else .gpu_check/fashion-mnist: a copy carried to a GPU machine that has no such package.
set -euo pipefail
cd "$(dirname "$0")/.."

FASHION_MNIST=${GPU_SPEED_FASHION_MNIST:-}
for folder in /usr/share/datasets/fashion-mnist .gpu_check/fashion-mnist; do
    if [ -z "$FASHION_MNIST" ] && [ -d "$folder" ]; then FASHION_MNIST=$folder; fi
done
if [ -z "$FASHION_MNIST" ]; then
    echo "error: no Fashion-MNIST IDX files: apt-get install dataset-fashion-mnist, or copy them to" \
         ".gpu_check/fashion-mnist, or set GPU_SPEED_FASHION_MNIST" >&2
    exit 1
fi

ARGS=(--fashion_mnist "$FASHION_MNIST" --budget_s "${GPU_SPEED_BUDGET_S:-420}")
if [ $# -gt 0 ]; then ARGS+=(--out "$1"); fi
if [ -n "${GPU_SPEED_RUNS:-}" ]; then ARGS+=(--runs "$GPU_SPEED_RUNS"); fi
if [ "${GPU_SPEED_CPU:-0}" = 1 ]; then ARGS+=(--dry_run); fi
# shellcheck disable=SC2086  # GPU_SPEED_RECIPES: names separated by spaces
if [ -n "${GPU_SPEED_RECIPES:-}" ]; then ARGS+=(--recipes $GPU_SPEED_RECIPES); fi
PYTHONUNBUFFERED=1 WANDB_MODE=disabled exec python3 benchmarks/gpu_speed.py "${ARGS[@]}"
