#!/usr/bin/env python3
"""Plots for a pipeline run (scripts/pipeline.sh), through gnuplot: training_curves.png (loss and MLM
accuracy per logged step, training and held-out, FP32 then QAT continuing from the last FP32 step) and
sensitivity.png (MLM accuracy lost with only each quantizer quantized, most sensitive first).
Usage: python3 scripts/plots.py RUN_DIR"""
import json
import os
import subprocess
import sys


def read_jsonl(path):
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    return rows


def write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(" ".join(str(x) for x in r) + "\n")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/pipeline"
    data = os.path.join(out, "plots")
    os.makedirs(data, exist_ok=True)
    fp32 = read_jsonl(os.path.join(out, "fp32", "metrics.jsonl"))
    qat = read_jsonl(os.path.join(out, "qat", "metrics.jsonl"))
    offset = max((r["step"] for r in fp32), default=0)
    for name, rows, shift in (("fp32", fp32, 0), ("qat", qat, offset)):
        write(os.path.join(data, f"{name}_train.dat"),
              [(r["step"] + shift, r["loss"], r["mlm_accuracy"]) for r in rows if "loss" in r])
        write(os.path.join(data, f"{name}_eval.dat"),
              [(r["step"] + shift, r["eval"]["mlm_loss"] + r["eval"]["nsp_loss"], r["eval"]["mlm_accuracy"])
               for r in rows if "eval" in r])
    sensitivity = {}
    path = os.path.join(out, "sensitivity.json")
    if os.path.exists(path):
        with open(path) as f:
            sensitivity = json.load(f).get("sensitivity", {})
    rows = sorted(sensitivity.get("rows", []), key=lambda r: r["only_this"])[:20]
    fp32_acc = sensitivity.get("fp32", 0.0)
    # No chart of empty bars: where no quantizer alone moves the accuracy (a model still in the MLM plateau)
    # the report says so instead.
    if all(abs(fp32_acc - r["only_this"]) < 5e-5 for r in rows):
        rows = []
        if os.path.exists(os.path.join(out, "sensitivity.png")):
            os.remove(os.path.join(out, "sensitivity.png"))
    write(os.path.join(data, "sensitivity.dat"),
          [(i, 100 * (fp32_acc - r["only_this"]), '"%s"' % r["name"].replace("bert.encoder.", "").replace("_quantizer", ""))
           for i, r in enumerate(rows)])

    script = f"""
set terminal pngcairo noenhanced size 1100,450 font ",10"
set output "{out}/training_curves.png"
set multiplot layout 1,2 title "BERT pretraining (FP32) and QAT (from step {offset})"
set xlabel "step"; set grid
set ylabel "loss (MLM + NSP)"
plot "{data}/fp32_train.dat" u 1:2 w l lw 2 t "FP32 train", \\
     "{data}/fp32_eval.dat" u 1:2 w lp pt 7 t "FP32 held-out", \\
     "{data}/qat_train.dat" u 1:2 w l lw 2 t "QAT train", \\
     "{data}/qat_eval.dat" u 1:2 w lp pt 7 t "QAT held-out"
set ylabel "MLM accuracy"
set key bottom right
plot "{data}/fp32_train.dat" u 1:3 w l lw 2 t "FP32 train", \\
     "{data}/fp32_eval.dat" u 1:3 w lp pt 7 t "FP32 held-out", \\
     "{data}/qat_train.dat" u 1:3 w l lw 2 t "QAT train", \\
     "{data}/qat_eval.dat" u 1:3 w lp pt 7 t "QAT held-out"
unset multiplot
"""
    if rows:
        script += f"""
set terminal pngcairo noenhanced size 1100,{200 + 22 * len(rows)} font ",9"
set output "{out}/sensitivity.png"
unset multiplot
set title "MLM accuracy lost (points) with only this quantizer quantized, most sensitive first (FP32 {fp32_acc:.4f})"
set style fill solid 0.7; set boxwidth 0.7; set grid x; unset key
set ytics nomirror; set xlabel "points lost"; set ylabel ""
set yrange [{len(rows)}:-1]
plot "{data}/sensitivity.dat" u (0.5*$2):1:(0.5*$2):(0.35):ytic(3) w boxxy
"""
    with open(os.path.join(data, "plots.gp"), "w") as f:
        f.write(script)
    try:
        subprocess.run(["gnuplot", os.path.join(data, "plots.gp")], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        print("plots: gnuplot is not installed (scripts/setup.sh installs gnuplot-nox); skipped")
        return
    except subprocess.CalledProcessError as e:
        sys.exit("plots: gnuplot failed: " + e.stderr)
    print(f"plots: {out}/training_curves.png" + (f", {out}/sensitivity.png" if rows else ""))


if __name__ == "__main__":
    main()
