#!/usr/bin/env bash
# 2026-11-27, a 2-core AMD EPYC with avx512_bf16, torch 2.14.1. After: recipes/finetune.py with the frozen layers
# at requires_grad False. Before: the same data, flags and cache on ae53f83 (the frozen epoch computed every gradient
# and dropped the backbone's), from a worktree of that commit.
python benchmarks/finetune_speed.py --out /tmp/ftcpu --config cpu --sizes 64 224 --images 1000
python benchmarks/finetune_speed.py --out /tmp/ftcpu --config cpu_bf16 --sizes 64 224 --images 1000
git worktree add /tmp/oldtree ae53f83 && cd /tmp/oldtree
for size in 64 224; do for cfg in cpu cpu_bf16; do
    decoded=$([ $size = 64 ] && echo 73 || echo 256)
    TORCH_HOME=/tmp/ftcpu/torch_home HF_HOME=/tmp/ftcpu/hf accelerate launch --config_file accelerate_configs/$cfg.yaml \
        recipes/finetune.py --data /tmp/ftcpu/images-1000-${decoded}px --image_size $size --batch_size 32 --epochs 2 \
        --freeze_epochs 1 --log_every 3 --tracker none --output_dir /tmp/oldft-$cfg-$size --overwrite
done; done   # then benchmarks/finetune_speed.py's phases() on each folder
