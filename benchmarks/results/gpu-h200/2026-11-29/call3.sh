# The note on this image, then its own fix (unset PYTHONDONTWRITEBYTECODE): the README's GPU line, new processes.
set -u
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
run() {  # $1 name, $2 seed
  S=$(date +%s.%N)
  python3 -m accelerate.commands.launch --config_file accelerate_configs/bf16.yaml recipes/resnet18_fmnist.py \
      --data .gpu_check/fashion-mnist --batch_size 512 --epochs 6 --seed $2 --tracker none --output_dir /tmp/r/$1 > $OUT/$1.log 2>&1
  E=$(date +%s.%N)
  python3 -c "import json; s=json.load(open('/tmp/r/$1/summary.json')); print(json.dumps({'run': '$1', 'seed': $2, 'process_s': round($E-$S, 2), 'note': 'compiles torch' in open('$OUT/$1.log').read(), **{k: round(s[k], 4) for k in ('start_s','train_s','wall_s','finish_s','eval_acc')}}))" >> $OUT/runs.txt 2>&1 || tail -5 $OUT/$1.log >> $OUT/runs.txt
}
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}" >> $OUT/runs.txt
run as_is 0
unset PYTHONDONTWRITEBYTECODE
run kept_first 0
run kept_s0 0
run kept_s1 1
run kept_s2 2
cat $OUT/runs.txt; head -3 $OUT/as_is.log
