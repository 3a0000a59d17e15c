# One GPU call: where the README GPU line's start goes, and --compile on this torch. Results under $OUT.
set -u
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled GPU_SPEED_COMMIT=$1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, torchvision, accelerate; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'accelerate', accelerate.__version__)"
  nproc; } > $OUT/console.log 2>&1
# 1. The README's GPU line in new processes (seeds 0, 1), the start phase by phase, eager, in-process.
timeout 220 python3 benchmarks/gpu_speed.py --fashion_mnist .gpu_check/fashion-mnist --budget_s 95 --seeds 2 \
    --recipes resnet18_fmnist --out $OUT/speed --runs /tmp/speedruns >> $OUT/console.log 2>&1
echo "gpu_speed done at $(( $(date +%s) - T0 )) s" >> $OUT/console.log
# 2. The README's GPU line under cProfile, a new process (data cache already made).
S=$(date +%s.%N)
ACCELERATE_MIXED_PRECISION=bf16 timeout 90 python3 -m cProfile -o $OUT/readme.prof recipes/resnet18_fmnist.py \
    --data .gpu_check/fashion-mnist --batch_size 512 --epochs 6 --tracker none --output_dir /tmp/prof >> $OUT/console.log 2>&1
echo "cProfile run: $(python3 -c "print(round($(date +%s.%N) - $S, 2))") s; summary: $(cat /tmp/prof/summary.json)" >> $OUT/console.log
# 3. --compile against eager, cifar_cnn and the ResNet, GPU setting, synthetic data, a new process each.
for r in cifar_cnn resnet18_fmnist; do for c in eager compile; do
  flags=(); [ $c = compile ] && flags=(--compile)
  S=$(date +%s.%N)
  TORCH_LOGS=dynamo timeout 150 python3 -m accelerate.commands.launch --config_file accelerate_configs/bf16.yaml \
      recipes/$r.py --synthetic --batch_size 512 --max_steps ${STEPS:-300} --log_every ${EVERY:-50} --tracker none \
      --output_dir /tmp/c/$r-$c "${flags[@]}" > /tmp/c-$r-$c.log 2>&1
  rc=$?
  python3 - "$r" "$c" "$rc" "$(python3 -c "print(round($(date +%s.%N) - $S, 2))")" >> $OUT/compile.txt <<'PY'
import json, statistics, sys
r, c, rc, wall = sys.argv[1:]
log = open(f"/tmp/c-{r}-{c}.log").read()
try:
    rows = [json.loads(l) for l in open(f"/tmp/c/{r}-{c}/metrics.jsonl")]
    w = [x["samples_per_s"] for x in rows if "train_loss" in x]
    s = json.load(open(f"/tmp/c/{r}-{c}/summary.json"))
    found = {"windows": w, "median_after_first": statistics.median(w[1:]), "train_s": s.get("train_s"),
             "start_s": s.get("start_s"), "wall_s": s.get("wall_s"), "eval_acc": s.get("eval_acc")}
except Exception as e:
    found = {"error": repr(e), "log_tail": log[-1500:]}
print(json.dumps({"recipe": r, "mode": c, "rc": int(rc), "process_s": float(wall),
                  "frames_traced": log.count("start tracing"), "graph_breaks": log.lower().count("graph break"),
                  **found}))
PY
  grep -i "start tracing\|graph break\|recompil" /tmp/c-$r-$c.log | head -20 >> $OUT/compile_log.txt
done; done
echo "all done at $(( $(date +%s) - T0 )) s" >> $OUT/console.log
