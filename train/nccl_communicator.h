// Data parallelism across GPUs: one process per GPU, collectives through NVIDIA's NCCL.
//
// NCCL is loaded when the first communicator is made (libnccl.so.2 from the library search path, or the
// file BERT_NCCL_LIBRARY names), so the programs start, and train on one GPU, where it is missing.
#pragma once

#include <memory>

#include "core/device.h"
#include "train/communicator.h"
#include "train/process_group.h"

namespace bert::train {

// Joins `group`: rank 0 creates NCCL's connection id and publishes it in group.rendezvous; the others
// read it there (waiting up to BERT_RENDEZVOUS_TIMEOUT seconds, default 300). Collectives run on
// `device`'s stream (a GPU; it must outlive the communicator). UserError when the build has no CUDA,
// NCCL cannot be loaded, or the ranks cannot connect.
std::unique_ptr<Communicator> nccl_communicator(const ProcessGroup& group, const Device& device);

// Whether NCCL can be loaded here (never throws).
bool nccl_available();

}  // namespace bert::train
