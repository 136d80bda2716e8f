// The bridge to ONNX Runtime, out of process (scripts/ort_run.js under Node, or scripts/ort_run.py):
// batches as JSON feeds in; the runner's JSON out, or its float outputs streamed back as binary tensors. This library
// never links ONNX or protobuf; eval scores exports through it and export calibrates the FP32 graph's tensors for
// TensorRT's cache.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "data/loader.h"
#include "sys/json.h"

namespace bert::ort {

// The ONNX Runtime runner to use when none is given: $BERT_ORT_SCRIPT, else scripts/ort_run.js (Node) or,
// where there is no node but a python3, scripts/ort_run.py, in the checkout the running program was
// built or unpacked in (found from its own path), else under the current folder.
std::string default_ort_script();

// Whether ONNX Runtime's integer GEMMs (what it runs for the MatMuls of an optimized Q/DQ graph) compute
// exact sums on this CPU: with AVX-512 VNNI or AVX-VNNI. Without either, its u8s8 kernels add pairs of
// u8 x s8 products with vpmaddubsw, whose 16-bit results saturate (255 x 127 x 2 > 32767), so a Q/DQ
// export's outputs there can differ from the engine's (and from TensorRT's) wherever an input row and
// a weight column are both large; weights within [-64, 64] never saturate.
bool integer_kernels_exact();

// Up to max_batches (<= 0: all) batches of the loader.
std::vector<Batch> take_batches(data::ShardLoader& loader, int64_t max_batches);

// The int64 feeds of the exported graph's inputs, one object per batch (masked_lm_positions when the
// export was made with --masked-positions).
Json batch_feeds(const std::vector<Batch>& batches, bool masked_positions);

// Runs `model` on the feeds with `mode` ("" for raw outputs, "--argmax"; see the script; a script ending
// in .py runs under python3, any other under node) and returns its parsed JSON. UserError with ONNX
// Runtime's message when it fails.
Json run_onnx_runtime(const std::string& script, const std::string& mode, const std::string& model, const Json& feeds,
                      const std::string& work_dir);

// Called for every float output of every batch, in batch order: the values are the runner's float32
// bytes, valid during the call only.
using TensorConsumer = std::function<void(int64_t batch, const std::string& name, std::span<const float> values)>;

// Runs `model` on the feeds and hands every float output to `consume` as it arrives (the runner's
// --stream: a pipe, never JSON or files), so memory stays one tensor whatever the outputs' size. UserError
// with ONNX Runtime's message when it fails, or when the stream is malformed.
void stream_onnx_runtime(const std::string& script, const std::string& model, const Json& feeds,
                         const std::string& work_dir, const TensorConsumer& consume);

}  // namespace bert::ort
