#!/usr/bin/env bash
# bench/step_kernels.py on a small ncu CSV written here: the step between two AdamW updates, its kernels'
# totals, the bytes moved and their rate where ncu measured them, and --compare beside another run.
set -euo pipefail
script=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
header='"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
# write FILE WITH_BYTES: three steps of the same three kernels (time; with bytes: read and written)
write() {
  local id=0
  {
    echo '==PROF== Connected to process 1'
    echo "$header"
    for step in 1 2 3; do
      # ncu writes ns and byte; the other units as it may scale them
      for k in 'void bert::ops::pass<8>(float *)|12500|ns|30000000|20000000|byte' \
               'void bert::ops::gemm(int)|40|us|1|0.5|Gbyte' \
               'void bert::train::adamw_kernel(float *)|0.1|ms|300000|200000|Kbyte'; do
        IFS='|' read -r name time time_unit read_b write_b unit <<<"$k"
        row="\"$id\",\"1\",\"bench\",\"host\",\"$name\",\"1\",\"7\",\"(256, 1, 1)\",\"(64, 1, 1)\",\"0\",\"9.0\",\"Command line profiler metrics\""
        echo "$row,\"gpu__time_duration.sum\",\"$time_unit\",\"$time\""
        if [[ $2 == bytes ]]; then
          echo "$row,\"dram__bytes_read.sum\",\"$unit\",\"$read_b\""
          echo "$row,\"dram__bytes_write.sum\",\"$unit\",\"$write_b\""
        fi
        id=$((id + 1))
      done
    done
  } >"$1"
}
write "$work/bytes.csv" bytes
write "$work/time.csv" time
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }

out=$(python3 "$script" "$work/bytes.csv")
grep -q 'step 1, 3 kernels, 0.152 ms of kernel time' <<<"$out" || fail "the step's kernels"
# 50 MB in 12.5 us: 4.00 TB/s; 1.5 GB in 40 us: 37.50 TB/s; 500 MB in 0.1 ms: 5.00 TB/s
grep -Eq '^ +12\.5 us +1x +0\.050 GB +4\.00 TB/s +ops::pass<8>$' <<<"$out" || fail "the pass's bytes and rate"
grep -Eq '^ +40\.0 us +1x +1\.500 GB +37\.50 TB/s +ops::gemm$' <<<"$out" || fail "Gbyte units"
grep -Eq '^ +100\.0 us +1x +0\.500 GB +5\.00 TB/s +train::adamw_kernel$' <<<"$out" || fail "Kbyte units"

out=$(python3 "$script" "$work/time.csv" --order)
grep -Eq '^ +12\.5 us +1x +ops::pass<8>$' <<<"$out" || fail "time alone: no memory column"
grep -Eq '^ +0 +12\.5 us +ops::pass<8>$' <<<"$out" || fail "--order"

out=$(python3 "$script" "$work/bytes.csv" --compare "$work/time.csv")
grep -Eq '^ +12\.5 us +1x +0\.050 GB +4\.00 TB/s +\| +12\.5 us +1x +ops::pass<8>$' <<<"$out" ||
  fail "--compare beside a run without bytes"

if python3 "$script" "$work/time.csv" --step 3 >/dev/null 2>"$work/err"; then fail "a step past the last update"; fi
grep -q '3 AdamW updates among 9 kernels; step 3 needs 4' "$work/err" || { cat "$work/err"; fail "the error"; }
echo "step_kernels.py: all checks passed"
