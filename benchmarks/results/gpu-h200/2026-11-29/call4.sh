# The README's GPU line as a new user runs it on this image (no wandb here), then as the two lines it prints say.
set -u
export PYTHONUNBUFFERED=1
L=(python3 -m accelerate.commands.launch -q --config_file accelerate_configs/bf16.yaml recipes/resnet18_fmnist.py
   --data .gpu_check/fashion-mnist --batch_size 512 --epochs 6)
timed() {  # $1 name, rest: flags
  name=$1; shift; S=$(date +%s.%N)
  "${L[@]}" --output_dir /tmp/r/$name "$@" > $OUT/$name.log 2>&1; rc=$?
  echo "$name: rc $rc, $(python3 -c "print(round($(date +%s.%N) - $S, 2))") s from the command" >> $OUT/runs.txt
  [ -f /tmp/r/$name/summary.json ] && python3 -c "import json; s=json.load(open('/tmp/r/$name/summary.json')); print({k: round(s[k], 4) for k in ('eval_acc','train_s','start_s','finish_s')})" >> $OUT/runs.txt
}
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}; wandb: $(python3 -c 'import wandb' 2>&1 | tail -1)" > $OUT/runs.txt
timed as_is
unset PYTHONDONTWRITEBYTECODE
timed tensorboard_first --tracker tensorboard
timed tensorboard --tracker tensorboard
find /tmp/r/tensorboard -maxdepth 3 -name 'events.out.tfevents*' | head -2 >> $OUT/runs.txt
cat $OUT/runs.txt; cat $OUT/as_is.log
