#!/usr/bin/env python3
"""Where one GPU training step's time goes, kernel by kernel, from Nsight Compute's per-kernel durations.

A step is every kernel from just after one AdamW update (train::adamw_kernel) up to and including the next,
so the forward, the backward, the clipping and the update of one whole step. Run ncu over
train-step-bench launched op by op, its kernel times at the GPU's own clocks, then this script on its CSV:

  ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
      ./build/bench/train-step-bench --device cuda --precision bf16 --presets base --batches 64 --seq 128 \\
      --vocab 30522 --steps 2 --warmup 1 --warmup-seconds 0 --no-cuda-graphs --modes qat-fused > step.csv
  python3 bench/step_kernels.py step.csv [--step N] [--order] [--compare other.csv]

(ncu --launch-skip/--launch-count over a range that holds two updates makes it faster.) Prints each kernel's
total and calls in step N (default: the first whole one), longest first; --order lists the step's kernels
in launch order; --compare puts another run's totals beside them (the float step beside the QAT one).
"""
import argparse
import collections
import csv
import sys


def short_name(name):
    """The kernel's name without argument list, namespaces bert:: and anonymous, templates two deep."""
    for noise in ("void ", "(anonymous namespace)::", "<unnamed>::", "bert::"):
        name = name.replace(noise, "")
    out, depth = [], 0
    for ch in name:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        if depth <= 2:
            out.append(ch)
        if ch == ">":
            depth -= 1
    return "".join(out)[:150]


def kernels(path):
    """(name, microseconds) of every kernel in launch order, from ncu's CSV (gpu__time_duration.sum)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if header is None:
        sys.exit(f"{path}: no ncu CSV header (\"Kernel Name\") found")
    rows = []
    for r in csv.DictReader(lines[header:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
        rows.append((r["Kernel Name"], value * scale))
    return rows


def step(rows, n, path):
    """The kernels of the n-th whole step (1 = the first)."""
    ends = [i for i, (name, _) in enumerate(rows)
            if "adamw_kernel" in name and (i + 1 == len(rows) or "adamw_kernel" not in rows[i + 1][0])]
    if len(ends) < n + 1:
        sys.exit(f"{path}: {len(ends)} AdamW updates among {len(rows)} kernels; step {n} needs {n + 1}")
    return rows[ends[n - 1] + 1: ends[n] + 1]


def totals(kernel_list):
    time, calls = collections.Counter(), collections.Counter()
    for name, us in kernel_list:
        time[short_name(name)] += us
        calls[short_name(name)] += 1
    return time, calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv output with gpu__time_duration.sum")
    ap.add_argument("--step", type=int, default=1, help="which whole step (default: %(default)s)")
    ap.add_argument("--order", action="store_true", help="also list the step's kernels in launch order")
    ap.add_argument("--compare", help="another run's CSV: its step's totals beside these")
    a = ap.parse_args()
    mine = step(kernels(a.csv), a.step, a.csv)
    time, calls = totals(mine)
    other_time, other_calls = collections.Counter(), collections.Counter()
    if a.compare:
        other_time, other_calls = totals(step(kernels(a.compare), a.step, a.compare))
    print(f"{a.csv}: step {a.step}, {len(mine)} kernels, {sum(time.values()) / 1e3:.3f} ms of kernel time" +
          (f"; {a.compare}: {sum(other_calls.values())} kernels, {sum(other_time.values()) / 1e3:.3f} ms"
           if a.compare else ""))
    for name in sorted(set(time) | set(other_time), key=lambda k: -max(time[k], other_time[k])):
        line = f"{time[name]:10.1f} us {calls[name]:4d}x"
        if a.compare:
            line += f"  | {other_time[name]:10.1f} us {other_calls[name]:4d}x"
        print(f"{line}  {name}")
    if a.order:
        print("in launch order:")
        for i, (name, us) in enumerate(mine):
            print(f"{i:4d} {us:8.1f} us  {short_name(name)}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # (piped into head)
        sys.exit(0)
