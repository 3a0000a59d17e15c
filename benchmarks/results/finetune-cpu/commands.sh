# recipes/finetune.py's CPU speed on 67a6592 + the working tree (finetune.py not yet committed), 2-core AMD EPYC, 2026-11-27; /tmp/photos1000: python -c 'import sys; sys.path.insert(0, "benchmarks"); import real_images; from pathlib import Path; real_images.write(real_images.photos(10, 100, 10, size=128), Path("/tmp/photos1000"), "imagefolder")'
cd /work/main
for size in 224 64; do for cfg in cpu cpu_bf16; do
  out=/tmp/ftspeed/$size-$cfg
  rm -rf $out
  WANDB_MODE=disabled python3 -m accelerate.commands.launch --config_file accelerate_configs/$cfg.yaml recipes/finetune.py --data /tmp/photos1000 --weights none --image_size $size --epochs 1 --tracker none --log_every 5 --output_dir $out > $out.log 2>&1
  echo "$size $cfg rc=$?"; tail -1 $out.log
done; done
