#!/usr/bin/env python3
"""Combines one bench/speed.sh run (ours.jsonl, torch-*.jsonl) into one table: ours vs
PyTorch's best thread setting per configuration (FP32 step and evaluation; QAT step against PyTorch's QAT
step, torch_step_bench.py --qat, where it ran), as ratios, and achieved GFLOP/s against the SGEMM
ceiling measured in the same run. Writes DIR/speed.md and prints it."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
ours = [json.loads(l) for l in (out / "ours.jsonl").read_text().splitlines() if l.strip()]
ceiling = next(r["gflops"] for r in ours if r["kind"] == "sgemm")
steps = {(r["preset"], r["batch"], r["mode"]): r for r in ours if r["kind"] == "step"}
torch = {}
for f in sorted(out.glob("torch-*.jsonl")):
    for line in f.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        key = (r["preset"], r["batch"]) + (("qat",) if r.get("qat") else ())
        r["setting"] = f"set_num_threads({r['threads']}), OMP={r['omp']}, OPENBLAS={r['openblas']}"
        if key not in torch or r["seq_per_s"] > torch[key]["seq_per_s"]:
            torch[key] = r
        torch.setdefault(("all",) + key, []).append(r)

lines = [f"SGEMM 2048^3 ceiling (same run, our kernel path): {ceiling:.1f} GFLOP/s", "",
         "| preset | batch | step GFLOP | ours FP32 seq/s | GFLOP/s | % of SGEMM | PyTorch seq/s (best) | ours / PyTorch "
         "| ours QAT seq/s | QAT / FP32 step | PyTorch QAT seq/s (best) | ours / PyTorch QAT | eval seq/s ours "
         "| eval seq/s PyTorch |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for (preset, batch, mode), r in steps.items():
    if mode != "fp32":
        continue
    q = steps.get((preset, batch, "qat"))
    t = torch.get((preset, batch))
    tq = torch.get((preset, batch, "qat"))
    qat_vs = f"{tq['seq_per_s']:.1f} | **{q['seq_per_s'] / tq['seq_per_s']:.2f}x**" if q and tq else "- | -"
    lines.append(
        f"| {preset} | {batch} | {r['step_gflop']:.1f} | {r['seq_per_s']:.1f} | {r['gflops']:.1f} | "
        f"{100 * r['gflops'] / ceiling:.0f}% | {t['seq_per_s']:.1f} | **{r['seq_per_s'] / t['seq_per_s']:.2f}x** | "
        f"{q['seq_per_s']:.1f} | {q['step_s'] / r['step_s']:.2f} | {qat_vs} | {r['eval_seq_per_s']:.1f} | "
        f"{t['eval_seq_per_s']:.1f} |"
        if t and q else f"| {preset} | {batch} | (incomplete) |")
lines += ["", "PyTorch thread settings tried (training seq/s):", ""]
for key, rows in torch.items():
    if key[0] == "all":
        lines.append(f"- {'/'.join(map(str, key[1:]))}: " + "; ".join(f"{r['setting']}: {r['seq_per_s']:.1f}" for r in rows))
text = "\n".join(lines) + "\n"
(out / "speed.md").write_text(text)
print(text)
