#!/usr/bin/env bash
# The end-to-end demo on its built-in corpus: set-up, build, then the whole pipeline on the demo corpus
# (raw text -> tokenizer -> shards -> pretraining (BERT-mini in BF16 where an NVIDIA GPU is present, else
# the tiny preset in FP32) -> sensitivity -> QAT ->
# Q/DQ and FP32 ONNX export with the TensorRT calibration cache -> ONNX Runtime verification -> report).
# Arguments go to scripts/pipeline.sh (e.g. --steps 2000, or --fixture for a one-minute version).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
bash scripts/pipeline.sh "$@"
