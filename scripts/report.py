#!/usr/bin/env python3
"""Collects a pipeline run's JSON results (scripts/pipeline.sh) into report.json and report.md, and prints
the comparison table: FP32, PTQ (each calibrator), QAT, the QAT model on the engine's integer kernels, and
both exports in ONNX Runtime, with MLM and NSP accuracy, MLM loss, model size, INT8 inference speed, and the
sensitivity ranking's top entries. Standard library only."""
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/pipeline"
    sets = [s for s in ("heldout", "brown") if os.path.exists(os.path.join(out, f"compare_{s}.json"))]
    if not sets:
        sys.exit(f"report: no results in {out} (run scripts/pipeline.sh first)")
    rows = {}  # mode -> {set: metrics}
    sizes = {}
    speed = {}  # set -> sequences/s of fp32, fake-quant and int8 on the engine
    for s in sets:
        for r in load(os.path.join(out, f"compare_{s}.json"))["compare"]:
            rows.setdefault(r["mode"], {})[s] = r
        fp32_onnx = load(os.path.join(out, f"onnx_fp32_{s}.json"))
        int8_onnx = load(os.path.join(out, f"onnx_int8_{s}.json"))
        rows.setdefault("qat", {})[s] = int8_onnx["metrics"]
        rows.setdefault("onnx-fp32 (ORT)", {})[s] = fp32_onnx["onnx"]
        rows.setdefault("onnx-int8-qdq (ORT)", {})[s] = int8_onnx["onnx"]
        sizes = {"fp32": fp32_onnx["model"], "int8": int8_onnx["model"]}
        int8_path = os.path.join(out, f"int8_{s}.json")
        if os.path.exists(int8_path):
            integer = load(int8_path)["int8"]
            modes = {m["mode"]: m for m in integer["modes"]}
            rows.setdefault("qat-int8 (engine)", {})[s] = dict(modes["int8"], agreement=integer["agreement_with_fake_quant"])
            speed.setdefault(s, {"kernel": integer["kernel"], "layers": integer["integer_layers"],
                                 **{m: modes[m]["sequences_per_second"] for m in modes}})
    sensitivity = load(os.path.join(out, "sensitivity.json")).get("sensitivity", {})
    top = sorted(sensitivity.get("rows", []), key=lambda r: r["only_this"])[:5]
    plan = sensitivity.get("keep_float", [])

    order = (["fp32"] + sorted(m for m in rows if m.startswith("ptq-")) +
             ["qat", "qat-int8 (engine)", "onnx-fp32 (ORT)", "onnx-int8-qdq (ORT)"])
    report = {"sets": sets, "modes": {m: rows[m] for m in order if m in rows}, "model_size": sizes, "int8_speed": speed,
              "sensitivity_top": top, "plan_keep_float": plan}
    with open(os.path.join(out, "report.json.tmp"), "w") as f:
        json.dump(report, f, indent=2)
    os.replace(os.path.join(out, "report.json.tmp"), os.path.join(out, "report.json"))

    def cell(m, s, key):
        v = rows.get(m, {}).get(s, {}).get(key)
        return "-" if v is None or (key == "mlm_loss" and m.endswith("(ORT)")) else f"{v:.4f}"

    header = "| mode | " + " | ".join(f"{s} MLM acc | {s} MLM loss | {s} NSP acc" for s in sets) + " |"
    recipe_path = os.path.join(out, "recipe.json")
    trained = ""
    if os.path.exists(recipe_path):
        r = load(recipe_path)
        if "model" in r:
            trained = (f" Model: {'BERT-' + r['model'] if r['model'] != 'fixture' else 'the fixture model'}, "
                       f"{r['steps']:,} pretraining steps on {r['trained_on']}, then {r['qat_steps']:,} QAT steps.")
    lines = ["# Pipeline report", "", f"Results in `{out}`.{trained}", "", header,
             "|---|" + "---:|" * (3 * len(sets))]
    for m in order:
        if m in rows:
            lines.append(f"| {m} | " + " | ".join(
                f"{cell(m, s, 'mlm_accuracy')} | {cell(m, s, 'mlm_loss')} | {cell(m, s, 'nsp_accuracy')}" for s in sets) + " |")
    base = rows["fp32"][sets[0]]
    lines += ["", f"Baselines ({sets[0]}): most-frequent-token MLM accuracy "
                  f"{base['mlm_baseline_most_frequent_token_accuracy']:.4f}, NSP majority {base['nsp_baseline_majority_accuracy']:.4f}. "
                  "ONNX Runtime rows are argmax accuracies (no loss).", ""]
    if sizes:
        lines.append(f"Model size: {sizes['fp32']['parameters']:,} parameters, {sizes['fp32']['fp32_megabytes']:.1f} MB in FP32; "
                     f"{sizes['int8']['deployed_megabytes']:.1f} MB with the {sizes['int8']['int8_weight_parameters']:,} "
                     "quantized weights in INT8.")
    for s, v in speed.items():
        lines.append(f"INT8 inference on the engine's integer kernels ({v['kernel']}, {v['layers']} linear layers), {s}: "
                     f"{v['int8']:.1f} sequences/s, {v['int8'] / v['fp32']:.2f}x FP32 ({v['fp32']:.1f}), "
                     f"{v['int8'] / v['fake-quant']:.2f}x the fake-quantized model; predictions equal to the "
                     f"fake-quantized model's: {rows['qat-int8 (engine)'][s]['agreement']:.4f}.")
    # A model in the MLM plateau predicts frequent tokens whatever the context: INT8 can hardly change that,
    # so its comparisons with FP32 show little. Models past it score 4-7x the most-frequent-token baseline
    # (tiny after 10,000 steps, mini), models in it about 2x.
    fp32_mlm, most_frequent = base["mlm_accuracy"], base["mlm_baseline_most_frequent_token_accuracy"]
    if most_frequent > 0 and fp32_mlm < 3 * most_frequent:
        lines += [f"**The FP32 model is still in the MLM plateau**: its accuracy {fp32_mlm:.4f} is "
                  f"{fp32_mlm / most_frequent:.1f}x the most-frequent-token baseline {most_frequent:.4f} (models past "
                  "the plateau reach 4-7x). It mostly predicts frequent tokens whatever the context, so INT8 and FP32 "
                  "can hardly differ here and the sensitivity ranking carries little signal. Train longer "
                  "(`--steps`; where an NVIDIA GPU is present the demo trains BERT-mini for 10,000 BF16 steps by "
                  "itself, past the plateau) for a comparison that means something.", ""]
    sens_fp32 = sensitivity.get("fp32")
    flat = sens_fp32 is not None and all(abs(sens_fp32 - r["only_this"]) < 5e-5 for r in sensitivity.get("rows", []))
    lines += ["", "Most sensitive quantizers (MLM accuracy with only this one quantized):", ""]
    lines += [f"- `{r['name']}`: {r['only_this']:.4f} (all but this: {r['all_but_this']:.4f})" for r in top]
    lines += ["", f"Plan: {len(plan)} quantizer(s) kept in float" + (": " + ", ".join(f"`{p}`" for p in plan) if plan else "."), ""]
    if flat:
        lines += ["No quantizer alone moves the MLM accuracy by 0.0001 or more, so there is no sensitivity chart.", ""]
    for png, title in (("training_curves.png", "Training curves"), ("sensitivity.png", "Sensitivity")):
        if os.path.exists(os.path.join(out, png)) and not (flat and png == "sensitivity.png"):
            lines += [f"![{title}]({png})", ""]
    recipe_path, fusion_path = os.path.join(out, "recipe.json"), os.path.join(out, "export", "fusion.json")
    if os.path.exists(recipe_path) and os.path.exists(fusion_path):
        recipe, fusion = load(recipe_path), load(fusion_path)
        layers = fusion["layers"]
        residual = sum(l["residual_inputs_quantized"] for l in layers), sum(l["residual_inputs"] for l in layers)
        ready = sum(1 for l in layers if l["int8_ready"] and l["attention_fusable"])
        lines += ["## Quantization recipe", "",
                  f"QAT for {recipe['qat_steps']} steps from the FP32 checkpoint at learning rate {recipe['lr']:g}: scales "
                  f"initialised by the {recipe['calibrator']} calibrator ({recipe['percentile']}) on "
                  f"{recipe['calib_batches']} training batches, then {recipe['scales']} (scales at {recipe['scale_lr_mult']}x "
                  f"the learning rate), with the sensitivity plan's quantizers kept in float. Placement: TensorRT's fast "
                  "path (one input scale for Q, K and V, Q/DQ after P V, both residual-add inputs quantized), weights "
                  f"per channel. TensorRT calibration cache of the FP32 export: the {recipe['trt_cache_calibrator']} "
                  "calibrator.", "",
                  f"Fusion report of the Q/DQ export (`bert-export --report`): {ready} of {len(layers)} encoder layers "
                  "run every GEMM and both attention matmuls in INT8 with the fused INT8 attention pattern complete; "
                  f"{residual[0]} of {residual[1]} residual-add inputs quantized"
                  + ("." if fusion["clean"] else "; findings: " + "; ".join(fusion["findings"]) + "."), ""]
        report["recipe"], report["fusion"] = recipe, {"clean": fusion["clean"], "layers_ready": ready}
        with open(os.path.join(out, "report.json.tmp"), "w") as f:
            json.dump(report, f, indent=2)
        os.replace(os.path.join(out, "report.json.tmp"), os.path.join(out, "report.json"))
    lines += ["Artifacts: `export/bert-fp32.onnx` (+ `bert-fp32.trt.cache`, TensorRT calibration cache), "
              "`export/bert-int8-qdq.onnx` (explicit Q/DQ), tokenizers beside them, and a Triton model repository "
              "in `triton/`.", ""]
    with open(os.path.join(out, "report.md.tmp"), "w") as f:
        f.write("\n".join(lines))
    os.replace(os.path.join(out, "report.md.tmp"), os.path.join(out, "report.md"))

    print(f"{'mode':<22}" + "".join(f"{s + ' MLM':>14}{s + ' NSP':>14}" for s in sets))
    for m in order:
        if m in rows:
            print(f"{m:<22}" + "".join(f"{cell(m, s, 'mlm_accuracy'):>14}{cell(m, s, 'nsp_accuracy'):>14}" for s in sets))
    for s, v in speed.items():
        print(f"INT8 engine ({v['kernel']}) on {s}: {v['int8']:.1f} sequences/s, {v['int8'] / v['fp32']:.2f}x FP32")
    if sizes:
        print(f"size: FP32 {sizes['fp32']['fp32_megabytes']:.1f} MB, INT8 weights {sizes['int8']['deployed_megabytes']:.1f} MB")
    print(f"report: {os.path.join(out, 'report.md')}")


if __name__ == "__main__":
    main()
