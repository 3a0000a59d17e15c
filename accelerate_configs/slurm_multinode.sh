#!/bin/bash
# Multi-node training under SLURM with accelerate_configs/multinode.yaml, preemption-safe.
# Submit from the repository root:   sbatch accelerate_configs/slurm_multinode.sh
# One task per node; each task runs `accelerate launch`, which starts one process per GPU.
# Settings come from the environment (sbatch passes it on), e.g.
#   RECIPE=recipes/resnet18_fmnist.py RECIPE_FLAGS="--epochs 10" sbatch accelerate_configs/slurm_multinode.sh
# On nodes without GPUs (a test cluster): GPUS_PER_NODE=1 ACCELERATE_USE_CPU=true sbatch --gpus-per-node=0 ...
# Tested that way (tests/test_multinode.py): on two SLURM nodes, stopped by SIGTERM to this script and by a preempting
# job, requeued, resumed to the same weights.
#SBATCH --job-name=recipe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append        # a requeued job appends to its first run's output instead of overwriting it
#SBATCH --requeue                 # a preempted or timed-out job may go back into the queue
#SBATCH --signal=B:TERM@120       # SIGTERM to this script 120 s before the time limit

set -euo pipefail

RECIPE=${RECIPE:-recipes/cifar_cnn.py}
RECIPE_FLAGS=${RECIPE_FLAGS:-}                   # more flags for the recipe, e.g. "--epochs 10 --checkpoint_every 500"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                # processes per node
MAIN_PORT=${MAIN_PORT:-29500}                    # a free TCP port on the first node
# A requeued job keeps its job id, so it finds its own run folder and continues it.
OUTPUT_DIR=${OUTPUT_DIR:-runs/$(basename "$RECIPE" .py)-slurm-${SLURM_JOB_ID}}
# torchrun forwards the SIGTERM to the training processes, then kills them after this many seconds (its default,
# 30, is less than the 120 s this job is given): time to finish a step, an evaluation and the checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The first node's address as SLURM reaches it (NodeAddr: its host name unless the cluster set an address).
MAIN_IP=$(scontrol show node "$MAIN_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
preempt_time() { scontrol show job "$SLURM_JOB_ID" | grep -o 'PreemptTime=[^ ]*' || true; }
PREEMPT_TIME=$(preempt_time)
# What a restart finds decides how it goes on: the newest complete checkpoint (a partial_step_* is ignored), a
# finished run (its model.safetensors and curves.png, the last file its end writes: exit 0; weights without it, an end
# cut short, are written again by --resume latest), or this job's own run folder with no complete checkpoint yet
# (killed before its first one: the run starts again, --overwrite replacing only the files a run writes).
RESUME=""
if compgen -G "$OUTPUT_DIR/checkpoints/step_*" >/dev/null; then RESUME="--resume latest"; fi
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$OUTPUT_DIR/model.safetensors" ] \
        && [ -f "$OUTPUT_DIR/curves.png" ]; then
    echo "job $SLURM_JOB_ID, start $SLURM_RESTART_COUNT: $OUTPUT_DIR already finished" \
         "(model.safetensors, curves.png); nothing to do"
    exit 0
fi
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -z "$RESUME" ] && [ -f "$OUTPUT_DIR/config.json" ]; then
    RESUME="--overwrite"
fi
STARTING=${RESUME:-(new run)}
[ "$RESUME" = "--overwrite" ] && STARTING="--overwrite (restarted with no complete checkpoint: the run starts again)"
echo "job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES node(s) x $GPUS_PER_NODE, rendezvous" \
     "$MAIN_IP:$MAIN_PORT, $RECIPE -> $OUTPUT_DIR $STARTING"

# On SIGTERM to this script (the time limit near, or `scancel --signal=TERM --batch`): pass it on to the training
# processes, which finish their step, save a checkpoint and exit 0; then put this job back in the queue.
# Not `kill -TERM` to srun: srun turns a SIGTERM into a SIGKILL of every task. `scancel --signal`
# without --batch signals the job's steps (here, the srun's tasks), not this script.
requeue() {
    echo "SIGTERM: waiting for the checkpoint, then requeueing job $SLURM_JOB_ID"
    scancel --signal=TERM "$SLURM_JOB_ID"
    wait "$TRAINING" || true
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap requeue TERM

# The per-node values come from SLURM and override the template's placeholders.
# $SLURM_NODEID is expanded by each task on its own node, hence the single quotes.
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch -q \
    --config_file accelerate_configs/multinode.yaml \
    --num_machines '"$SLURM_NNODES"' \
    --num_processes '"$((SLURM_NNODES * GPUS_PER_NODE))"' \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip '"$MAIN_IP"' \
    --main_process_port '"$MAIN_PORT"' \
    '"$RECIPE"' --output_dir '"$OUTPUT_DIR"' '"$RESUME $RECIPE_FLAGS" &
TRAINING=$!
status=0
wait "$TRAINING" || status=$?
# SLURM's own preemption (a job of a higher partition; PreemptMode) sends SIGTERM to the training processes, not to
# this script, and kills them after GraceTime: they saved a checkpoint and stopped. Requeue, or the job would end
# here, unfinished, as COMPLETED. SLURM sets the job's PreemptTime when it preempts it.
if [ "$(preempt_time)" != "$PREEMPT_TIME" ]; then
    echo "preempted: the training processes saved a checkpoint; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
# gloo (processes on CPUs) can abort a process as it exits, after its run has ended (pytorch#179291,
# docs/troubleshooting.md): the launchers then report a failure. Only that race's own signature counts as the run's
# success: this start's output (this job's log, from its start line) holds the main process's last line ("done:",
# printed after every file and tracker was written and the processes' last barrier), and every process failure
# torchrun reports in it is a SIGABRT (exitcode -6). A crash while writing the pictures, the summary or to wandb
# comes before that line, or is no SIGABRT: the job fails.
LOG=$(scontrol show job "$SLURM_JOB_ID" | grep -o 'StdOut=[^ ]*' | cut -d= -f2 || true)
if [ "$status" != 0 ] && [ -f "$LOG" ]; then
    THIS_START=$(sed -n "/^job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}:/,\$p" "$LOG")
    FAILURES=$(grep -E 'exitcode +: ' <<<"$THIS_START" || true)
    if grep -q '^done: ' <<<"$THIS_START" && [ -n "$FAILURES" ] && ! grep -qvE 'exitcode +: -6 ' <<<"$FAILURES"; then
        echo "job $SLURM_JOB_ID: the run finished ($OUTPUT_DIR/model.safetensors); a process aborted after it" \
             "(SIGABRT, exit $status: gloo's exit race, docs/troubleshooting.md), so the job ends as completed"
        exit 0
    fi
fi
exit "$status"
