# Call 2 (the same session, a new machine): the compile step that call 1's deadline cut, and a Ctrl-C to a GPU run
# whose lines go through `| tee`, as a terminal sends it (SIGINT to the whole process group, tee included).
set -u
export PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE
DATA=${DATA:-.gpu_check/fashion-mnist}; CFG=${CFG:-accelerate_configs/1gpu.yaml}; OUT=${OUT:-/tmp/out}; R=${R:-/tmp/r2}
mkdir -p $OUT; rm -rf $R
cat > /tmp/ctrl_c.py <<'PY'
import os, signal, subprocess, sys, time
command, after, log = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with open(log, "w") as stderr:  # stdout goes to tee, as in a terminal; the launcher's stderr to the log
    p = subprocess.Popen(["bash", "-c", command], start_new_session=True, stderr=stderr,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after)
    os.killpg(p.pid, signal.SIGINT)
    print("exit", p.wait(timeout=120))
PY
python3 /tmp/ctrl_c.py "python3 -m accelerate.commands.launch -q --config_file $CFG recipes/cifar_cnn.py --synthetic \
  --max_steps 1000000 --tracker none --output_dir $R/tee ${CX:-} | tee $OUT/tee.log" ${AFTER:-25} $OUT/tee-stderr.log
ls $R/tee $R/tee/checkpoints; tail -3 $OUT/tee.log; tail -4 $OUT/tee-stderr.log
python3 - "$DATA" "$OUT" ${GC_DRY:-} <<'PY'
import argparse, sys
sys.path.insert(0, "benchmarks")
import gpu_check as g
dry = len(sys.argv) > 3
args = argparse.Namespace(out=sys.argv[2] + "/gc", dry_run=dry, fashion_mnist=sys.argv[1], recipes=["resnet18_fmnist"])
check = g.Check(args)
recipe = "cifar_cnn" if dry else "resnet18_fmnist"
check.step(f"{recipe} bf16", check.precision, recipe, "bf16")
check.step(f"{recipe} compile", check.compile, recipe)
PY
rm -rf $OUT/gc/runs
