#!/usr/bin/env bash
# One prepared GPU call: the README's GPU command on the real Fashion-MNIST, seeds 0-2, each a new process; then
# finetune.py's frozen and unfrozen steps (benchmarks/finetune_speed.py) at 224 and 64 px in bf16.
# Run on 2026-11-27 (one NVIDIA H200) as `bash .gpu_check/session.sh $OUT bf16 6 10000`, with the real
# Fashion-MNIST copied to .gpu_check/fashion-mnist; that run's process times were lost (it used bc, absent there).
# Usage: bash .gpu_check/session.sh OUT [CONFIG] [EPOCHS] [IMAGES]   (CPU dry run: cpu 1 200 "--max_steps 3")
set -uo pipefail
OUT=${1:?}; CONFIG=${2:-bf16}; EPOCHS=${3:-6}; IMAGES=${4:-10000}; EXTRA=${5:-}
WORK=/tmp/gpu_session; mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1 HF_HOME=$WORK/hf
{ nvidia-smi -L; python3 -c "import torch, torchvision, accelerate; print(torch.__version__, torchvision.__version__, accelerate.__version__)"; nproc; } 2>&1 | tee "$OUT/machine.txt"
for seed in 0 1 2; do
    start=$(date +%s%N)
    python3 -m accelerate.commands.launch --config_file accelerate_configs/$CONFIG.yaml recipes/resnet18_fmnist.py \
        --data .gpu_check/fashion-mnist --batch_size 512 --epochs "$EPOCHS" --seed "$seed" --tracker none \
        --output_dir "$WORK/fmnist-seed$seed" $EXTRA > "$WORK/fmnist-seed$seed.log" 2>&1
    echo "seed $seed exit $? process_ms $(( ($(date +%s%N) - start) / 1000000 ))" | tee -a "$OUT/fmnist.txt"
    tail -2 "$WORK/fmnist-seed$seed.log" | tee -a "$OUT/fmnist.txt"
done
python3 benchmarks/finetune_speed.py --out "$WORK/ft" --config "$CONFIG" --sizes 224 64 --images "$IMAGES" 2>&1 | tail -3
python3 benchmarks/finetune_speed.py --out "$WORK/ft" --config "$CONFIG" --sizes 224 --images "$IMAGES" --batch_size 256 2>&1 | tail -3
cp "$WORK/ft/finetune_speed.jsonl" "$OUT/" 2>/dev/null
tar czf "$OUT/runs.tar.gz" -C "$WORK" --exclude='*.safetensors' --exclude='checkpoints' --exclude='hf' --exclude='images-*' --exclude='torch_home' . 2>/dev/null
ls -la "$OUT"
