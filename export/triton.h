// A Triton Inference Server model repository for an exported model: <repo>/<name>/1/model.onnx and
// <repo>/<name>/config.pbtxt for the ONNX Runtime backend, with the graph's own input/output names,
// types and dynamic dimensions (the batch axis is Triton's, the others -1 or fixed).
#pragma once

#include <onnx/onnx_pb.h>

#include <string>

namespace bert::exporter {

std::string triton_config(const onnx::ModelProto& model, const std::string& name, int max_batch_size);
// Writes both files (each atomically); returns the model folder.
std::string write_triton_repository(const onnx::ModelProto& model, const std::string& repository,
                                    const std::string& name, int max_batch_size = 64);

}  // namespace bert::exporter
