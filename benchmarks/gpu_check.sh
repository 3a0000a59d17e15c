#!/usr/bin/env bash
# Every GPU path of the recipes, run once, for correctness (benchmarks/gpu_check.py says what it runs; speed and
# time to accuracy are benchmarks/gpu_speed.sh's): writes gpu_check.log and gpu_check.json under OUT_DIR. It took 6
# minutes on one H200 (2026-11-30, Python keeping its compiled code: benchmarks/BENCHMARKS.md).
#   bash benchmarks/gpu_check.sh [OUT_DIR]                  # default runs/gpu_check-<time>
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh OUT_DIR    # the same steps, tiny, on the CPU (a test runs this)
#   GPU_CHECK_RECIPES="cifar_cnn" ...                       # the per-recipe steps for these recipes only
# On a machine without `datasets` and no network, carry its wheels (downloaded on a machine that has a network, for
# the GPU machine's Python) in GPU_CHECK_WHEELS (default .gpu_check/wheels), e.g. for Python 3.12:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .gpu_check/wheels \
#       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# and the real Fashion-MNIST's IDX files in GPU_CHECK_FASHION_MNIST (default /usr/share/datasets/fashion-mnist).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
WHEELS=${GPU_CHECK_WHEELS:-.gpu_check/wheels}
FASHION_MNIST=${GPU_CHECK_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}

if ! python3 -c "import datasets" 2>/dev/null; then
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "error: the datasets package is missing and $WHEELS holds no wheels: pip install -r requirements.txt," \
             "or carry its wheels there (see the top of this script)" >&2
        exit 1
    fi
    SITE=$(mktemp -d)  # the carried packages, for this check only
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

DRY_RUN=()
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then DRY_RUN=(--dry_run); fi
# shellcheck disable=SC2086  # GPU_CHECK_RECIPES: names separated by spaces, e.g. "cifar_cnn resnet18_fmnist"
exec python3 benchmarks/gpu_check.py --out "$OUT_DIR" --fashion_mnist "$FASHION_MNIST" \
    --recipes ${GPU_CHECK_RECIPES:-cifar_cnn resnet18_fmnist deep_mlp_ckpt} "${DRY_RUN[@]}"
