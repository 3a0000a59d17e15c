# Is Python compiling torch's sources at every start here, and what does a bytecode cache save?
set -u
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
{ echo "== env"; env | grep -E '^PYTHON|^PIP' ; echo "purelib $SP"
  python3 -c "import sys, importlib.util as u, os, torch; c = u.cache_from_source(torch.__file__); print('dont_write_bytecode', sys.flags.dont_write_bytecode, 'pycache_prefix', sys.pycache_prefix, c, os.path.exists(c))"
  ls -la $SP/torch/__pycache__ 2>&1 | head -4; ls $SP/torch/__pycache__ 2>/dev/null | wc -l
  (touch $SP/torch/.w && rm $SP/torch/.w && echo "site-packages writable") 2>&1
  mount | grep -E ' on / | on /opt' ; find $SP -name '*.pyc' | wc -l; } > $OUT/env.txt 2>&1
run() {  # $1 name, rest: env settings
  name=$1; shift
  S=$(date +%s.%N)
  env "$@" python3 -m accelerate.commands.launch --config_file accelerate_configs/bf16.yaml recipes/resnet18_fmnist.py \
      --data .gpu_check/fashion-mnist --batch_size 512 --epochs 6 --tracker none --output_dir /tmp/r/$name > /tmp/r-$name.log 2>&1
  E=$(date +%s.%N)
  python3 -c "import json,sys; s=json.load(open('/tmp/r/$name/summary.json')); print(json.dumps({'run': '$name', 'process_s': round($E-$S, 2), **{k: round(s[k], 3) for k in ('start_s','train_s','wall_s','finish_s','eval_acc')}}))" >> $OUT/runs.txt 2>&1 || tail -5 /tmp/r-$name.log >> $OUT/runs.txt
}
imp() { S=$(date +%s.%N); env "$@" python3 -c "import torch, accelerate" ; echo "import torch, accelerate $* : $(python3 -c "print(round($(date +%s.%N) - $S, 2))") s" >> $OUT/runs.txt; }
imp A=1; imp A=1
run as_is-1
imp PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=
run pyc-1 PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=
imp PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=
run pyc-2 PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=
run pyc-3 PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE=
run as_is-2
echo "pyc files cached: $(find /tmp/pyc -name '*.pyc' | wc -l)" >> $OUT/runs.txt
env PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= timeout 60 python3 benchmarks/start_cost.py \
    --config accelerate_configs/bf16.yaml --fashion_mnist .gpu_check/fashion-mnist > $OUT/start_cost_pyc.json 2>&1
env PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONDONTWRITEBYTECODE= ACCELERATE_MIXED_PRECISION=bf16 timeout 60 python3 -m cProfile \
    -o $OUT/readme_pyc.prof recipes/resnet18_fmnist.py --data .gpu_check/fashion-mnist --batch_size 512 --epochs 6 \
    --tracker none --output_dir /tmp/prof > /tmp/prof.log 2>&1
cat $OUT/env.txt $OUT/runs.txt
