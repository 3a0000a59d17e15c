# Call 7: every GPU path of the recipes once (benchmarks/gpu_check.py), on 1e0abc9, the IDX files in
# .gpu_check/fashion-mnist; gpu_check.py directly, as the image has no datasets (nothing here reads it).
unset PYTHONDONTWRITEBYTECODE; export PYTHONUNBUFFERED=1; mkdir -p $OUT/check; S=$(date +%s)
timeout 480 python3 benchmarks/gpu_check.py --out $OUT/check --fashion_mnist .gpu_check/fashion-mnist > $OUT/console.log 2>&1
echo "rc $? in $(( $(date +%s) - S )) s" >> $OUT/console.log; cat $OUT/console.log | tail -40
