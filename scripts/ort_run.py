#!/usr/bin/env python3
"""Runs an ONNX model in ONNX Runtime (the Python onnxruntime package, CPU) and writes its outputs as JSON:
the same protocol as scripts/ort_run.js, for machines with Python's onnxruntime and no Node (e.g. a GPU
server). `bert-eval --onnx M --ort-script scripts/ort_run.py` uses it.
Usage: python3 scripts/ort_run.py [--argmax | --stream] model.onnx inputs.json outputs.json [optimized.onnx]
inputs.json: one feed {"input_ids": {"dims": [B, T], "data": [...]}, ...} (int64 inputs), or a list of
feeds (batches), giving a list of results. --argmax replaces every float output by the index of its
largest value along the last axis (the first on ties, as the Node runner). --stream sends every float
output back as binary tensors on file descriptor 3, in the Node runner's format. BERT_ORT_OPTIMIZATION: disabled, basic, extended, all.
BERT_ORT_TIMING=file: the time spent in session.run (first batch left out) is written there, as the
Node runner does.
"""
import json
import os
import struct
import sys
import time

import numpy as np
import onnxruntime as ort

LEVELS = {"disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


STREAM_FD = 3


def stream_tensor(batch, name, value):
    """One message of the Node runner's stream: uint32 batch, uint32 name length, name, uint64 count, floats."""
    name_bytes = name.encode("utf-8")
    data = np.ascontiguousarray(value, dtype="<f4")
    message = memoryview(struct.pack("<II", batch, len(name_bytes)) + name_bytes + struct.pack("<Q", data.size)
                         + data.tobytes())
    while message:
        message = message[os.write(STREAM_FD, message):]


def main():
    args = sys.argv[1:]
    argmax = bool(args) and args[0] == "--argmax"
    stream = bool(args) and args[0] == "--stream"
    if argmax or stream:
        args = args[1:]
    if len(args) < 3:
        sys.exit("usage: ort_run.py [--argmax | --stream] model.onnx inputs.json outputs.json [optimized.onnx]")
    model, inputs_path, outputs_path = args[:3]
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[os.environ.get("BERT_ORT_OPTIMIZATION", "all")]
    if len(args) > 3:
        options.optimized_model_filepath = args[3]
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    with open(inputs_path) as f:
        raw = json.load(f)
    batches = raw if isinstance(raw, list) else [raw]
    names = [o.name for o in session.get_outputs()]
    results = []
    timing = {"batches": 0, "sequences": 0, "seconds": 0.0}
    for index, batch in enumerate(batches):
        feeds = {name: np.asarray(t["data"], dtype=np.int64).reshape(t["dims"]) for name, t in batch.items()}
        out = {}
        started = time.perf_counter()
        values = session.run(names, feeds)
        if batch is not batches[0]:  # the first batch is not timed (warm-up), as the Node runner
            timing["seconds"] += time.perf_counter() - started
            timing["batches"] += 1
            timing["sequences"] += next(iter(batch.values()))["dims"][0]
        if stream:
            for name, value in zip(names, values):
                if value.dtype == np.float32:
                    stream_tensor(index, name, value)
            continue
        for name, value in zip(names, values):
            if argmax and value.dtype == np.float32:
                best = value.argmax(axis=-1)
                out[name] = {"dims": list(best.shape), "data": best.reshape(-1).tolist()}
            else:
                out[name] = {"dims": list(value.shape), "data": value.reshape(-1).tolist()}
        results.append(out)
    if os.environ.get("BERT_ORT_TIMING"):
        with open(os.environ["BERT_ORT_TIMING"], "w") as f:
            json.dump(timing, f)
    tmp = outputs_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({} if stream else results if isinstance(raw, list) else results[0], f)
    os.replace(tmp, outputs_path)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the caller shows the log: one line naming the problem
        sys.exit(f"ort_run.py: {e}")
