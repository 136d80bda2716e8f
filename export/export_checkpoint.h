// Exporting a model end to end, as bert-export does: open any model source (checkpoint, run folder,
// Hugging Face directory), keep a sensitivity plan's quantizers in float, check the tokenizer against
// the one the model was trained with, then write what was asked: a Hugging Face directory, an ONNX file
// (FP32 or Q/DQ; checked by the ONNX checker and, for Q/DQ, TensorRT's rules before it is put in place),
// TensorRT's calibration cache for the FP32 graph, a Triton model repository; the tokenizer travels
// with each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "export/bert_onnx.h"
#include "export/fusion_report.h"
#include "export/trt_cache.h"

namespace bert::exporter {

struct ExportRequest {
  std::string checkpoint;  // checkpoint .h5, its run folder, or a Hugging Face model directory
  std::string onnx_path;   // "" for none
  std::string hf_dir;      // "" for none
  std::string plan;        // sensitivity plan: its quantizers stay in float ("" for none)
  std::string tokenizer;   // "" for the one beside the checkpoint
  ExportOptions options;   // Q/DQ, opset, masked positions (metadata is filled in here)
  // TensorRT's implicit-INT8 calibration cache for the FP32 graph ("" for none), calibrated in ONNX
  // Runtime on batches of these shards.
  std::string trt_cache_path;
  std::vector<std::string> calib_shards;
  int64_t calib_batch_size = 32;
  CacheOptions cache;
  // A Triton Inference Server repository ("" for none); the model is named after the ONNX file's stem
  // unless triton_name is given.
  std::string triton_repo, triton_name;
  int triton_max_batch = 64;
  std::string report_json;  // also write the Q/DQ export's fusion report as JSON here ("" for none)
};

// Does everything `request` asks, or throws UserError naming the flag or file before writing the ONNX
// file (a request the checkpoint cannot meet, a tokenizer it was not trained with, a Q/DQ graph that
// breaks TensorRT's rules). Logs one line per file written.
// A Q/DQ export also prints its fusion report (what TensorRT can run in INT8; export/fusion_report.h).
void export_checkpoint(ExportRequest request);

// Prints the report's table and findings, and writes its JSON to json_path unless that is empty.
void write_fusion_report(const FusionReport& report, const std::string& json_path);

}  // namespace bert::exporter
