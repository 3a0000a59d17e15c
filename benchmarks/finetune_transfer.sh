#!/usr/bin/env bash
# What fine-tuning buys on real photos' stand-in here (ImageNet weights cannot be downloaded): recipes/finetune.py's
# resnet18 pretrained by this project on the real Fashion-MNIST, then fine-tuned on scikit-learn's real handwritten
# digits (the first 150 training digits, 297 test digits; benchmarks/real_images.py --sets digits_150), three ways,
# against the same run from scratch: the same flags, steps and seeds 0, 1, 2. Writes OUT/finetune_transfer.md (mean
# ± std) and .jsonl; each run's folder under OUT. A run whose summary.json is there is not run again.
#   bash benchmarks/finetune_transfer.sh OUT
#   FT_CONFIG=accelerate_configs/bf16.yaml FT_SIZE=224 bash benchmarks/finetune_transfer.sh OUT   # a GPU
# The digits' IDX files: python benchmarks/real_images.py --sets digits_150 --formats idx (FT_DIGITS, else the
# cache folder it prints); Fashion-MNIST's: FT_FASHION_MNIST, else /usr/share/datasets/fashion-mnist.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: bash benchmarks/finetune_transfer.sh OUT}
CONFIG=${FT_CONFIG:-accelerate_configs/cpu.yaml}
SIZE=${FT_SIZE:-32}  # --image_size: 32 px on a CPU, the digits' and Fashion-MNIST's scale
FASHION_MNIST=${FT_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
DIGITS=${FT_DIGITS:-${XDG_CACHE_HOME:-$HOME/.cache}/accelerate-recipes/real_images/digits_150/idx}
read -r -a PRETRAIN <<< "${FT_PRETRAIN:---epochs 1 --batch_size 128}"
read -r -a FINETUNE <<< "${FT_FINETUNE:---epochs 30 --batch_size 32}"  # 4 steps an epoch: 120 steps
for folder in "$FASHION_MNIST" "$DIGITS"; do
    [ -d "$folder" ] || { echo "error: no folder $folder (see this script's header)" >&2; exit 1; }
done
mkdir -p "$OUT"

run() {  # run FOLDER FLAGS...: finetune.py into OUT/FOLDER, unless it finished there already
    [ -f "$OUT/$1/summary.json" ] && return 0
    local folder=$1
    shift
    PYTHONUNBUFFERED=1 WANDB_MODE=disabled python3 -m accelerate.commands.launch --config_file "$CONFIG" \
        recipes/finetune.py --image_size "$SIZE" --tracker none --output_dir "$OUT/$folder" --overwrite "$@" \
        >"$OUT/$folder.log" 2>&1 || { tail -5 "$OUT/$folder.log" >&2; exit 1; }
    tail -1 "$OUT/$folder.log"
}

run pretrain --data "$FASHION_MNIST" --weights none "${PRETRAIN[@]}"
for seed in 0 1 2; do
    run "frozen-then-all-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed" --init_from "$OUT/pretrain"
    run "all-from-the-start-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed" --init_from "$OUT/pretrain" \
        --freeze_epochs 0
    run "all-at-full-rate-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed" --init_from "$OUT/pretrain" \
        --freeze_epochs 0 --backbone_lr_scale 1
    run "scratch-seed$seed" --data "$DIGITS" "${FINETUNE[@]}" --seed "$seed" --weights none
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
starts = {"frozen-then-all": "pretrained, the classifier alone for an epoch, then every layer",
          "all-from-the-start": "pretrained, every layer from the start (--freeze_epochs 0)",
          "all-at-full-rate": "pretrained, every layer from the start at --lr (--backbone_lr_scale 1)",
          "scratch": "from scratch (--weights none)"}
rows = []
for start in starts:
    for seed in (0, 1, 2):
        summary = json.loads((out / f"{start}-seed{seed}" / "summary.json").read_text())
        rows.append({"start": start, "seed": seed, **{k: summary[k] for k in ("eval_acc", "steps", "wall_s", "train_s")}})
pretrain = json.loads((out / "pretrain" / "summary.json").read_text())
(out / "finetune_transfer.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
lines = [f"Pretrained: finetune.py's resnet18 on the real Fashion-MNIST, eval_acc {pretrain['eval_acc']:.4f} after "
         f"{pretrain['steps']} steps. Fine-tuned on 150 real digits (297 test images), {rows[0]['steps']} steps each:",
         "", "| start | eval_acc, seeds 0, 1, 2 | mean ± std | train_s, mean |", "|---|---|---|---|"]
for start, name in starts.items():
    mine = [row for row in rows if row["start"] == start]
    accs = [row["eval_acc"] for row in mine]
    lines.append(f"| {name} | {', '.join(f'{a:.4f}' for a in accs)} | {statistics.mean(accs):.4f} ± "
                 f"{statistics.stdev(accs):.4f} | {statistics.mean(row['train_s'] for row in mine):.1f} s |")
(out / "finetune_transfer.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
