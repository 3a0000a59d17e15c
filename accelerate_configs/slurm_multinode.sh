#!/bin/bash
# Multi-node training under SLURM with accelerate_configs/multinode.yaml.
# Submit from the repository root:   sbatch accelerate_configs/slurm_multinode.sh
# One task per node; each task runs `accelerate launch`, which starts one process per GPU.
#SBATCH --job-name=cifar_cnn
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%j.out

set -euo pipefail

GPUS_PER_NODE=8
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=29500

# The per-node values come from SLURM and override the template's placeholders.
# \$SLURM_NODEID is expanded by each task on its own node, hence the single quotes.
srun bash -c 'accelerate launch \
    --config_file accelerate_configs/multinode.yaml \
    --num_machines '"$SLURM_NNODES"' \
    --num_processes '"$((SLURM_NNODES * GPUS_PER_NODE))"' \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip '"$MAIN_NODE"' \
    --main_process_port '"$MAIN_PORT"' \
    recipes/cifar_cnn.py'
