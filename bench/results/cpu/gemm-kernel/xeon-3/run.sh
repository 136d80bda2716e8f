#!/usr/bin/env bash
# After the arena-wide AdamW, blocked norm and one-pass layer-norm backward: same measurements.
# 2.11 at 16 threads (two repetitions, interleaved), per-op profiles of both, and 1-thread speed.
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
for rep in 1 2; do
  OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 32,128 --modes fp32,qat \
    --steps 5 --warmup 2 --json $OUT/ours-t16-rep$rep.json > $OUT/ours-t16-rep$rep.log 2>&1; cat $OUT/ours-t16-rep$rep.log
  python3 bench/torch_step_bench.py --presets tiny,mini --batches 32,128 --steps 5 --warmup 2 --threads 16 \
    --flush-denormals > $OUT/torch-t16-rep$rep.json 2>&1; cat $OUT/torch-t16-rep$rep.json
done
OMP_NUM_THREADS=16 bash gpu-bundle/run.sh train-step-bench --presets mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 --profile-shapes > $OUT/profile-mini-t16.log 2>&1
python3 bench/torch_step_bench.py --presets mini --batches 128 --steps 3 --warmup 1 --threads 16 --flush-denormals \
  --profile > $OUT/torch-profile-mini-t16.json 2> $OUT/torch-profile-mini-t16.log
OMP_NUM_THREADS=1 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t1.log 2>&1; cat $OUT/ours-t1.log
OMP_NUM_THREADS=4 bash gpu-bundle/run.sh train-step-bench --presets tiny,mini --batches 128 --modes fp32 --steps 3 \
  --warmup 1 > $OUT/ours-t4.log 2>&1; cat $OUT/ours-t4.log
