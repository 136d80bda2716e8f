// TensorRT's calibration cache for the implicit INT8 path (docs/export.md): a
// header line, then "<tensor name>: <hex>" per tensor, <hex> the IEEE-754 float32 bits of scale =
// amax / 127, most significant byte first. Keyed by the FP32 export's tensor names and covering the
// floating-point activation tensors of that graph (LayerNorm, GELU, softmax and residual outputs too),
// calibrated on exactly the graph written (with --masked-positions, that one). TensorRT deprecated this
// implicit path in 10.1; the explicit Q/DQ export is the recommended way to run BERT in INT8.
#pragma once

#include <onnx/onnx_pb.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "data/loader.h"

namespace bert::exporter {

// Every float tensor a node of the graph computes (types from ONNX shape inference).
std::vector<std::string> activation_tensors(const onnx::ModelProto& model);

// The tensors the cache gives a scale: the activation tensors except those no INT8 scale suits — the
// attention-mask path and the masked pre-softmax scores (values near -10000 beside the real scores),
// and the tensors inside a GELU or LayerNorm written as several nodes (TensorRT fuses the op; its
// internals are never INT8 inputs).
std::vector<std::string> cache_tensors(const onnx::ModelProto& model);

// The tensors of known range: the outputs of Softmax (the attention probabilities), Tanh and Sigmoid,
// all within [-1, 1]. Every calibrator gives them amax 1 (quant::calibrated_amax).
std::set<std::string> bounded_tensors(const onnx::ModelProto& model);

// A copy of the model with these tensors added as graph outputs (to observe them in ONNX Runtime).
onnx::ModelProto with_outputs(const onnx::ModelProto& model, const std::vector<std::string>& names);

struct CacheOptions {
  // max | percentile | entropy | mse. Max (TensorRT's MinMaxCalibration) by default, as NVIDIA advises
  // for NLP models: entropy's KL search clips BERT's rare large activations (docs/quantization.md).
  std::string calibrator = "max";
  double percentile = 99.99;
  int64_t batches = 16;
  int trt_version = 8601;         // major*1000 + minor*100 + patch
  std::string ort_script;         // scripts/ort_run.js
  std::string work_dir;           // for the files exchanged with ONNX Runtime
  bool masked_positions = false;  // the graph takes masked_lm_positions (export --masked-positions)
};

// Calibrates every cache tensor of the FP32 export on the loader's batches (histograms collected
// in ONNX Runtime, amax by the chosen calibrator here) and returns {tensor name: amax}.
std::map<std::string, double> calibrate_tensors(const onnx::ModelProto& fp32, data::ShardLoader& loader,
                                                const CacheOptions& options);

// Writes the cache atomically; the header names the algorithm TensorRT's calibrator class expects.
void write_trt_cache(const std::string& path, const std::map<std::string, double>& amax, const CacheOptions& options);

// {tensor name: scale} from a cache file (UserError naming the file and line on a malformed entry).
std::map<std::string, float> read_trt_cache(const std::string& path, std::string* header = nullptr);

// The 8 hex digits of a float's bits, most significant first ("3c010204" for 1/127), and back.
std::string float_hex(float value);
float hex_float(const std::string& hex);

}  // namespace bert::exporter
