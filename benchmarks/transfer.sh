#!/usr/bin/env bash
# What starting from the recipes' own trained weights is worth (--init_from): the ResNet pretrained on the real
# Fashion-MNIST, then fine-tuned on scikit-learn's real handwritten digits (1,797 scans: 1,500 train / 297 test,
# 28x28 as in MNIST, benchmarks/real_images.py), against the same run from scratch: the same flags and steps, seeds
# 0, 1, 2. Writes OUT/transfer.md (mean ± std) and OUT/transfer.jsonl; each run's folder under OUT. A run whose
# summary.json is there is not run again, so a cut measurement goes on where it stopped.
#   bash benchmarks/transfer.sh OUT
#   TRANSFER_CONFIG=accelerate_configs/bf16.yaml TRANSFER_PRETRAIN="--batch_size 512 --epochs 6" bash ... OUT   # GPU
# The digits' IDX files: python benchmarks/real_images.py --sets digits --formats idx (TRANSFER_DIGITS, else the
# cache folder it prints; --sets digits_150: the first 150 training digits only, a small labeled set);
# Fashion-MNIST's: TRANSFER_FASHION_MNIST, else /usr/share/datasets/fashion-mnist.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: bash benchmarks/transfer.sh OUT}
CONFIG=${TRANSFER_CONFIG:-accelerate_configs/cpu.yaml}
FASHION_MNIST=${TRANSFER_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
DIGITS=${TRANSFER_DIGITS:-${XDG_CACHE_HOME:-$HOME/.cache}/accelerate-recipes/real_images/digits/idx}
read -r -a PRETRAIN <<< "${TRANSFER_PRETRAIN:---epochs 2}"  # pretraining flags
read -r -a FINETUNE <<< "${TRANSFER_FINETUNE:---epochs 10}"  # flags of both fine-tuning runs: 110 steps
for folder in "$FASHION_MNIST" "$DIGITS"; do
    [ -d "$folder" ] || { echo "error: no folder $folder (see this script's header)" >&2; exit 1; }
done
mkdir -p "$OUT"

run() {  # run FOLDER FLAGS...: the ResNet recipe into OUT/FOLDER, unless it finished there already
    [ -f "$OUT/$1/summary.json" ] && return 0
    local folder=$1
    shift
    PYTHONUNBUFFERED=1 WANDB_MODE=disabled python3 -m accelerate.commands.launch --config_file "$CONFIG" \
        recipes/resnet18_fmnist.py --tracker none --output_dir "$OUT/$folder" --overwrite "$@" \
        >"$OUT/$folder.log" 2>&1 || { tail -5 "$OUT/$folder.log" >&2; exit 1; }
    tail -1 "$OUT/$folder.log"
}

run pretrain --data "$FASHION_MNIST" "${PRETRAIN[@]}"
for seed in 0 1 2; do
    run "init-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed" --init_from "$OUT/pretrain"
    run "scratch-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed"
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for start in ("init", "scratch"):
    for seed in (0, 1, 2):
        summary = json.loads((out / f"{start}-seed{seed}" / "summary.json").read_text())
        rows.append({"start": start, "seed": seed, "eval_acc": summary["eval_acc"], "steps": summary["steps"],
                     "wall_s": summary["wall_s"]})
pretrain = json.loads((out / "pretrain" / "summary.json").read_text())
(out / "transfer.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
lines = [f"Pretrained: the ResNet on the real Fashion-MNIST, eval_acc {pretrain['eval_acc']:.4f} after "
         f"{pretrain['steps']} steps. Fine-tuned on the real digits (297 test images), {rows[0]['steps']} steps each:",
         "", "| start | eval_acc, seeds 0, 1, 2 | mean ± std |", "|---|---|---|"]
for start, name in (("init", "--init_from the pretrained run"), ("scratch", "from scratch")):
    accs = [row["eval_acc"] for row in rows if row["start"] == start]
    lines.append(f"| {name} | {', '.join(f'{a:.4f}' for a in accs)} | "
                 f"{statistics.mean(accs):.4f} ± {statistics.stdev(accs):.4f} |")
(out / "transfer.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
