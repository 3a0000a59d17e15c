# 1) toward 6 s of training: the README's GPU line and variants, real Fashion-MNIST, new processes, compiled copies
#    kept; 2) the GPU paths a user takes on this image's torch: an exact resume with the CUDA graph, finetune.py and
#    its extension, predict.py on both.
set -u
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
DATA=${DATA:-.gpu_check/fashion-mnist}; CFG=${CFG:-accelerate_configs/bf16.yaml}; R=${R:-/tmp/r}
L=(python3 -m accelerate.commands.launch -q --config_file $CFG)
timed() {  # $1 name, rest: flags for the ResNet on the real data
  name=$1; shift; S=$(date +%s.%N)
  "${L[@]}" recipes/resnet18_fmnist.py --data $DATA --tracker none --output_dir $R/$name "$@" > $OUT/$name.log 2>&1
  rc=$?; E=$(date +%s.%N)
  python3 - "$name" "$rc" "$S" "$E" "$R" >> $OUT/runs.jsonl <<'PY'
import json, sys
name, rc, s, e, r = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
row = {"run": name, "rc": rc, "process_s": round(e - s, 2)}
try:
    summ = json.load(open(f"{r}/{name}/summary.json"))
    row |= {k: round(summ[k], 4) for k in ("eval_acc", "train_s", "wall_s", "start_s", "samples_per_s", "steps")}
    row["eval_accs"] = [round(p["eval_acc"], 4) for p in map(json.loads, open(f"{r}/{name}/metrics.jsonl"))
                        if "eval_acc" in p and "train_s" not in p]
except Exception as error:
    row["error"] = repr(error)
print(json.dumps(row))
PY
}
SPEED=${SPEED:-1}
if [ "$SPEED" = 1 ]; then
  timed base_first --batch_size 512 --epochs 6 --seed 0
  timed base --batch_size 512 --epochs 6 --seed 0
  timed nocl --batch_size 512 --epochs 6 --seed 0 --no-channels_last
  for s in 0 1 2; do timed b1024_s$s --batch_size 1024 --epochs 6 --seed $s; done
  for s in 0 1 2; do timed e5_s$s --batch_size 512 --epochs 5 --seed $s; done
fi
# 2) the check
C=(recipes/resnet18_fmnist.py --synthetic --batch_size ${CB:-512} --max_steps 40 --checkpoint_every 20
   --keep_checkpoints 5 --tracker none)
{
  "${L[@]}" "${C[@]}" --output_dir $R/ra; echo "ra rc $?"
  "${L[@]}" "${C[@]}" --output_dir $R/rc --resume $R/ra/checkpoints/step_20; echo "rc rc $?"
  "${L[@]}" "${C[@]}" --output_dir $R/rd --no-cuda_graph; echo "rd rc $?"
  python3 -c "
from safetensors.torch import load_file
a, c, d = (load_file('$R/' + n + '/model.safetensors') for n in ('ra', 'rc', 'rd'))
for n, o in (('resumed', c), ('eager', d)):
    print('ra vs', n, max((a[k].float() - o[k].float()).abs().max().item() for k in a))"
  F=(recipes/finetune.py --synthetic --weights none --image_size 64 --tracker none --output_dir $R/ft)
  "${L[@]}" "${F[@]}" --max_steps 30; echo "ft rc $?"
  "${L[@]}" "${F[@]}" --resume latest --max_steps 40; echo "ft extend rc $?"
  python3 -c "import json; s=json.load(open('$R/ft/summary.json')); print('ft', s['steps'], s['pieces'], round(s['eval_acc'], 4))"
  python3 recipes/predict.py --weights $R/ft --evaluate; echo "predict ft rc $?"
  python3 recipes/predict.py --weights $R/ra/model.safetensors --evaluate; echo "predict ra rc $?"
} > $OUT/check.log 2>&1
python3 -c "import torch, torchvision, accelerate; print(torch.__version__, torchvision.__version__, accelerate.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" >> $OUT/check.log 2>&1
cat $OUT/runs.jsonl 2>/dev/null; grep -E "rc |vs|^ft |eval_acc|error|Traceback|[0-9]\.[0-9]+ " $OUT/check.log | tail -30
