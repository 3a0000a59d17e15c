# One call on one H200 (torch 2.11 image, no wandb or datasets), at HEAD after the restructuring of issue 76, run as
# `bash call1.sh` from the repository root with the IDX files in .gpu_check/fashion-mnist:
# 1) the GPU paths a user takes: an exact resume with the CUDA graph, eager, finetune.py and its extension,
#    --init_from into both recipes, predict.py on the runs; 2) the README's GPU line, verbatim but for the data
#    folder, then with --tracker none twice (the first writes Python's compiled copies); 3) benchmarks/gpu_check.py
#    (every GPU path, for correctness) in the time left. CPU try: CFG=accelerate_configs/cpu.yaml CB=8 DEADLINE=...
set -u
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
S0=$(date +%s); DEADLINE=${DEADLINE:-500}  # seconds from the start after which nothing new starts
DATA=${DATA:-.gpu_check/fashion-mnist}; CFG=${CFG:-accelerate_configs/bf16.yaml}; R=${R:-/tmp/r}; OUT=${OUT:-/tmp/out}
mkdir -p $OUT; rm -rf $R
L=(python3 -m accelerate.commands.launch -q --config_file $CFG)
python3 -c "import torch, torchvision, accelerate; print(torch.__version__, torchvision.__version__, accelerate.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" > $OUT/check.log 2>&1
# 1) the user's paths
C=(recipes/resnet18_fmnist.py --synthetic --batch_size ${CB:-512} --max_steps 40 --checkpoint_every 20
   --keep_checkpoints 5 --tracker none)
F=(recipes/finetune.py --synthetic --weights none --image_size 64 --tracker none)
{
  "${L[@]}" "${C[@]}" --output_dir $R/ra; echo "ra rc $?"
  "${L[@]}" "${C[@]}" --output_dir $R/rc --resume $R/ra/checkpoints/step_20; echo "rc rc $?"
  "${L[@]}" "${C[@]}" --output_dir $R/rd --no-cuda_graph; echo "rd rc $?"
  python3 -c "
from safetensors.torch import load_file
a, c, d = (load_file('$R/' + n + '/model.safetensors') for n in ('ra', 'rc', 'rd'))
for n, o in (('resumed', c), ('eager', d)):
    print('ra vs', n, max((a[k].float() - o[k].float()).abs().max().item() for k in a))"
  "${L[@]}" "${C[@]}" --output_dir $R/ri --init_from $R/ra --max_steps 20; echo "ri (init_from ra) rc $?"
  "${L[@]}" "${F[@]}" --output_dir $R/ft --max_steps 30; echo "ft rc $?"
  "${L[@]}" "${F[@]}" --output_dir $R/ft --resume latest --max_steps 40; echo "ft extend rc $?"
  "${L[@]}" "${F[@]}" --output_dir $R/fi --init_from $R/ft --max_steps 10; echo "fi (init_from ft) rc $?"
  for run in ft fi; do python3 -c "import json; s=json.load(open('$R/$run/summary.json')); print('$run', s['steps'], s.get('pieces'), round(s['eval_acc'], 4))"; done
  python3 recipes/predict.py --weights $R/ft --evaluate; echo "predict ft rc $?"
  python3 recipes/predict.py --weights $R/ra/model.safetensors --evaluate; echo "predict ra rc $?"
  python3 recipes/predict.py --weights $R/rc --evaluate; echo "predict rc rc $?"
} >> $OUT/check.log 2>&1
echo "paths done at $(( $(date +%s) - S0 )) s" >> $OUT/check.log
# 2) the README's line
R1=(recipes/resnet18_fmnist.py --data $DATA --batch_size ${RB:-512} --epochs ${RE:-6} ${RX:-})
{
  "${L[@]}" "${R1[@]}" --output_dir $R/readme; echo "readme verbatim rc $?"
  for name in first again; do
    S=$(date +%s.%N); "${L[@]}" "${R1[@]}" --tracker none --output_dir $R/$name; rc=$?; E=$(date +%s.%N)
    python3 -c "
import json; s = json.load(open('$R/$name/summary.json'))
print(json.dumps({'run': '$name', 'rc': $rc, 'process_s': round($E - $S, 2), **{k: round(s[k], 4) for k in ('eval_acc', 'train_s', 'wall_s', 'start_s', 'steps')}}))"
  done
} > $OUT/readme.log 2>&1
echo "readme done at $(( $(date +%s) - S0 )) s" >> $OUT/check.log
# 3) every GPU path, in the time left (each step is saved as it ends)
LEFT=$(( DEADLINE - ($(date +%s) - S0) )); mkdir -p $OUT/gc
[ "$LEFT" -gt 30 ] && timeout $LEFT python3 benchmarks/gpu_check.py --out $OUT/gc --fashion_mnist $DATA ${GC_ARGS:-} > $OUT/gc/console.log 2>&1
echo "gpu_check rc $? in $(( $(date +%s) - S0 )) s (had $LEFT s)" >> $OUT/check.log
rm -rf $OUT/gc/runs
grep -vE "^\s*$" $OUT/check.log | grep -E "rc |vs|^ft |^fi |eval_acc|rror|Traceback|done|cpu|cuda|H200|[0-9]\.[0-9]+ " | tail -40
cat $OUT/readme.log | tail -8; tail -5 $OUT/gc/console.log
