#!/usr/bin/env bash
# Data parallelism on the GPUs of one machine (bert-train --nproc N, NCCL): the GPU tests (the NCCL one
# needs two GPUs), the loss curve of N GPUs against one GPU with the same global batch, the scaling of
# BERT-mini and BERT-base from 1 to N GPUs, and the faults: Ctrl-C stops every rank with one checkpoint
# that --resume continues, and a killed rank ends the job with its name while the last checkpoint stays.
# Run on a machine with an NVIDIA GPU, from the repository root, with the bundle and the demo corpus as for
# bench/gpu_pretrain.sh:
#   bash bench/gpu_multi.sh [RESULTS_DIR]
# Environment: GPUS (2), CURVE_STEPS (300), BERT_NCCL_LIBRARY (default: PyTorch's nvidia-nccl wheel when
# Python finds one, else libnccl.so.2 from the library path).
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-runs/gpu-multi}
gpus=${GPUS:-2}
mkdir -p cache "$results"
[ -d gpu-bundle ] || tar -xJf gpu-bundle.tar.xz
[ -f cache/corpus/manifest.json ] || tar -C cache -xJf cache-gpu/corpus.tar.xz
if [ -z "${BERT_NCCL_LIBRARY:-}" ]; then
  nccl=$(python3 -c 'import glob, os, sys
print(next((f for p in sys.path for f in glob.glob(os.path.join(p, "nvidia/nccl/lib/libnccl.so.2"))), ""))' 2>/dev/null || true)
  [ -z "$nccl" ] || export BERT_NCCL_LIBRARY=$nccl
fi
export NCCL_NVLS_ENABLE=0  # NVLink multicast off
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "NCCL: ${BERT_NCCL_LIBRARY:-libnccl.so.2 from the library path}"
} | tee "$results/machine.txt"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== GPU tests"
  bash gpu-bundle/run.sh tests > "$results/gpu-tests.txt" 2>&1 || echo "GPU tests FAILED"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests from .* ran" "$results/gpu-tests.txt"
fi

OUT=cache BERT_DATA="bash gpu-bundle/run.sh bert-data" bash scripts/demo_data.sh > "$results/data.log" 2>&1
D=cache/data
run() { bash gpu-bundle/run.sh "$@"; }
common=(--device cuda --train "$D/shards/train" --tokenizer "$D/spm.model" --lr 1e-3 --warmup 0.1
  --eval-every 0)

echo "== loss curve: 1 GPU x batch 256 against $gpus GPUs x batch $((256 / gpus)), BERT-mini, FP32, no dropout"
steps=${CURVE_STEPS:-300}
run bert-train "${common[@]}" --precision fp32 --preset mini --dropout 0 --steps "$steps" --batch-size 256 --log-every 10 \
  --out runs/multi-curve-1 > "$results/curve-1.log" 2>&1
run bert-train "${common[@]}" --precision fp32 --preset mini --dropout 0 --steps "$steps" --batch-size $((256 / gpus)) --log-every 10 \
  --nproc "$gpus" --out "runs/multi-curve-$gpus" > "$results/curve-$gpus.log" 2>&1
compare() {  # windowed MLM + NSP loss of two runs' metrics.jsonl
  python3 - "$1" "$2" <<'PY'
import json, sys
def losses(path):
    return {r["step"]: r["mlm_loss"] + r["nsp_loss"] for r in map(json.loads, open(path)) if "mlm_loss" in r}
one, many = losses(sys.argv[1]), losses(sys.argv[2])
steps = sorted(set(one) & set(many))
worst = max(abs(many[s] - one[s]) / one[s] for s in steps)
for s in steps[:: max(1, len(steps) // 10)] + [steps[-1]]:
    print(f"step {s:>5}: 1 GPU {one[s]:.4f}  several {many[s]:.4f}")
print(f"largest relative difference of the windowed loss over {len(steps)} windows: {worst:.5f}")
PY
}
compare runs/multi-curve-1/metrics.jsonl "runs/multi-curve-$gpus/metrics.jsonl" | tee "$results/curve.txt"
echo "== QAT from the 1-GPU model: 1 GPU x 256 against $gpus GPUs, 100 steps"
qat=(--init-from runs/multi-curve-1/checkpoint.h5 --qat --calib-batches 4 --preset mini --dropout 0 --steps 100
  --log-every 10 --precision fp32)
run bert-train "${common[@]}" "${qat[@]}" --batch-size 256 --out runs/multi-qat-1 > "$results/qat-1.log" 2>&1
run bert-train "${common[@]}" "${qat[@]}" --batch-size $((256 / gpus)) --nproc "$gpus" --out "runs/multi-qat-$gpus" \
  > "$results/qat-$gpus.log" 2>&1
compare runs/multi-qat-1/metrics.jsonl "runs/multi-qat-$gpus/metrics.jsonl" | tee "$results/qat.txt"

echo "== scaling (TF32, per-GPU batch fixed; seq/s of steps 41-80, the first 40 warm up)"
for model in "mini 256" "base 64"; do
  set -- $model
  for n in 1 "$gpus"; do
    run bert-train "${common[@]}" --precision tf32 --preset "$1" --steps 80 --batch-size "$2" --log-every 40 --nproc "$n" \
      --out "runs/multi-scale-$1-$n" > "$results/scale-$1-$n.log" 2>&1
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f'$1 batch $2/GPU, $n GPU(s): {r[\"sequences_per_second\"]:.0f} seq/s')" \
      "runs/multi-scale-$1-$n/metrics.jsonl" | tee -a "$results/scaling.txt"
  done
done

# The gradient exchange not overlapped with the backward pass: one bucket, started when backward ends.
run bert-train "${common[@]}" --precision tf32 --preset base --steps 80 --batch-size 64 --log-every 40 --nproc "$gpus" \
  --bucket-mb 100000 --out "runs/multi-scale-base-$gpus-one-bucket" > "$results/scale-base-$gpus-one-bucket.log" 2>&1
python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f'base batch 64/GPU, $gpus GPU(s), one bucket at the end of backward: {r[\"sequences_per_second\"]:.0f} seq/s')" \
  "runs/multi-scale-base-$gpus-one-bucket/metrics.jsonl" | tee -a "$results/scaling.txt"

echo "== Ctrl-C on the launcher, then --resume"
# The launcher runs in the foreground of its own background job: $! is bert-train itself (run.sh execs it).
stop_run=(bash gpu-bundle/run.sh bert-train "${common[@]}" --precision tf32 --preset mini --steps 3000 --batch-size 128 --log-every 100
  --nproc "$gpus" --out runs/multi-stop)
wait_for() {  # wait_for LOG PATTERN: until a line of LOG matches (60 s at most)
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
rm -rf runs/multi-stop
"${stop_run[@]}" > "$results/stop.log" 2>&1 &
launcher=$!
wait_for "$results/stop.log" "step    500/" || true
kill -INT $launcher
status=0
wait $launcher || status=$?
echo "launcher exit status after SIGINT: $status" | tee "$results/faults.txt"
grep -E "stopped at step|rank|error" "$results/stop.log" | tail -n 4 | tee -a "$results/faults.txt"
"${stop_run[@]}" --resume --stop-at 1500 > "$results/resume.log" 2>&1 || echo "resume exit status $?" | tee -a "$results/faults.txt"
grep -E "resuming|stopped at step|done|error" "$results/resume.log" | tail -n 3 | tee -a "$results/faults.txt"

echo "== a killed rank"
"${stop_run[@]}" --resume --save-every 500 > "$results/kill.log" 2>&1 &
launcher=$!
wait_for "$results/kill.log" "step   2200/" || true
ls -l --time-style=+%T runs/multi-stop/checkpoint.h5 | tee -a "$results/faults.txt"
for pid in $(pgrep -P $launcher); do
  if tr '\0' '\n' < /proc/$pid/environ | grep -qx "BERT_RANK=1"; then kill -9 "$pid"; echo "killed rank 1 (pid $pid)"; fi
done | tee -a "$results/faults.txt"
status=0
wait $launcher || status=$?
echo "launcher exit status after kill -9 of rank 1: $status" | tee -a "$results/faults.txt"
tail -n 2 "$results/kill.log" | tee -a "$results/faults.txt"
ls -l --time-style=+%T runs/multi-stop/ | tee -a "$results/faults.txt"
run bert-eval --device cuda --checkpoint runs/multi-stop --shards "$D/shards/heldout" --mlm-accuracy --max-batches 5 \
  2>&1 | tail -n 3 | tee -a "$results/faults.txt"
"${stop_run[@]}" --resume --stop-at 2500 > "$results/resume2.log" 2>&1 || echo "resume exit status $?" | tee -a "$results/faults.txt"
grep -E "resuming|done|error" "$results/resume2.log" | tail -n 2 | tee -a "$results/faults.txt"
tar -C "$(dirname "$results")" -czf "$results.tar.gz" "$(basename "$results")"  # one file to fetch
