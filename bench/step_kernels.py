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
Where the CSV also holds dram__bytes_read.sum and dram__bytes_write.sum (--metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum), each line also gives the kernels' GB
moved to and from memory and their rate (TB/s): how near a pass is to the memory's bandwidth (3.35 TB/s on
an H100 SXM, 4.8 on an H200).
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


# ncu's units (it writes "ns" and "byte" for these metrics; the long and scaled forms where it chooses them).
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
              "second": 1e6}  # to microseconds
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9}
MEMORY = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def kernels(path):
    """(name, microseconds, bytes or None) of every kernel in launch order, from ncu's CSV
    (gpu__time_duration.sum; the bytes where dram__bytes_read.sum and dram__bytes_write.sum are there too)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    header = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if header is None:
        sys.exit(f"{path}: no ncu CSV header (\"Kernel Name\") found")
    by_id = {}  # ncu's kernel ID -> [name, us, bytes, memory metrics seen]
    for r in csv.DictReader(lines[header:]):
        metric = r.get("Metric Name")
        if metric != "gpu__time_duration.sum" and metric not in MEMORY:
            continue
        k = by_id.setdefault(r["ID"], [r["Kernel Name"], None, 0.0, 0])
        value = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit") or ("ns" if metric == "gpu__time_duration.sum" else "byte")
        if metric == "gpu__time_duration.sum":
            if unit not in TIME_UNITS:
                sys.exit(f"{path}: {metric} in unknown unit {unit!r}")
            k[1] = value * TIME_UNITS[unit]
        else:
            if unit not in BYTE_UNITS:
                sys.exit(f"{path}: {metric} in unknown unit {unit!r}")
            k[2] += value * BYTE_UNITS[unit]
            k[3] += 1
    return [(name, us, moved if seen == len(MEMORY) else None)
            for name, us, moved, seen in by_id.values() if us is not None]


def step(rows, n, path):
    """The kernels of the n-th whole step (1 = the first)."""
    ends = [i for i, (name, _, _) in enumerate(rows)
            if "adamw_kernel" in name and (i + 1 == len(rows) or "adamw_kernel" not in rows[i + 1][0])]
    if len(ends) < n + 1:
        sys.exit(f"{path}: {len(ends)} AdamW updates among {len(rows)} kernels; step {n} needs {n + 1}")
    return rows[ends[n - 1] + 1: ends[n] + 1]


def totals(kernel_list):
    """Per short name: total microseconds, calls, and bytes moved (None unless every call has them)."""
    time, calls, moved = collections.Counter(), collections.Counter(), {}
    for name, us, b in kernel_list:
        key = short_name(name)
        time[key] += us
        calls[key] += 1
        moved[key] = None if b is None or (key in moved and moved[key] is None) else moved.get(key, 0.0) + b
    return time, calls, moved


def memory_column(moved, us):
    """GB moved and the rate in TB/s, or blanks."""
    if moved is None or us <= 0:
        return " " * 19
    return f"{moved / 1e9:7.3f} GB {moved / (us * 1e-6) / 1e12:5.2f} TB/s"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv output with gpu__time_duration.sum")
    ap.add_argument("--step", type=int, default=1, help="which whole step (default: %(default)s)")
    ap.add_argument("--order", action="store_true", help="also list the step's kernels in launch order")
    ap.add_argument("--compare", help="another run's CSV: its step's totals beside these")
    a = ap.parse_args()
    mine = step(kernels(a.csv), a.step, a.csv)
    time, calls, moved = totals(mine)
    other_time, other_calls, other_moved = collections.Counter(), collections.Counter(), {}
    if a.compare:
        other_time, other_calls, other_moved = totals(step(kernels(a.compare), a.step, a.compare))
    show_memory = any(v is not None for v in list(moved.values()) + list(other_moved.values()))
    print(f"{a.csv}: step {a.step}, {len(mine)} kernels, {sum(time.values()) / 1e3:.3f} ms of kernel time" +
          (f"; {a.compare}: {sum(other_calls.values())} kernels, {sum(other_time.values()) / 1e3:.3f} ms"
           if a.compare else ""))
    for name in sorted(set(time) | set(other_time), key=lambda k: -max(time[k], other_time[k])):
        line = f"{time[name]:10.1f} us {calls[name]:4d}x"
        if show_memory:
            line += " " + memory_column(moved.get(name), time[name])
        if a.compare:
            line += f"  | {other_time[name]:10.1f} us {other_calls[name]:4d}x"
            if show_memory:
                line += " " + memory_column(other_moved.get(name), other_time[name])
        print(f"{line}  {name}")
    if a.order:
        print("in launch order:")
        for i, (name, us, b) in enumerate(mine):
            extra = " " + memory_column(b, us) if show_memory else ""
            print(f"{i:4d} {us:8.1f} us{extra}  {short_name(name)}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # (piped into head)
        sys.exit(0)
