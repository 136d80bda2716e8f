// Optimizers over the parameter arena (AdamW, LAMB), the learning-rate schedule and global-norm
// gradient clipping. The optimizer's moments are two flat buffers shaped like the arena, so a step is
// one pass over memory (LAMB adds a per-tensor norm pass). When the arena is on a GPU, the moments live
// there too and a step is one kernel launch (train/optimizer.cu); the host copies of the moments are
// for checkpoints and are synchronised only when asked (download_moments, upload_moments).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/aligned.h"
#include "core/arena.h"
#include "core/readback.h"
#include "sys/enum_names.h"

namespace bert::store {
struct OptimizerMoments;  // store/checkpoint.h
}

namespace bert::train {

enum class OptimizerKind { kAdamW, kLamb };
inline constexpr EnumNames<OptimizerKind, 2> kOptimizerNames{
    {{{OptimizerKind::kAdamW, "adamw"}, {OptimizerKind::kLamb, "lamb"}}}};
// "adamw" | "lamb" (UserError naming --optimizer otherwise), and back.
OptimizerKind parse_optimizer(const std::string& name);
std::string optimizer_name(OptimizerKind kind);

// Decay of the learning rate after warmup: linear, or polynomial with power 0.5 (NVIDIA's BERT recipe).
enum class Schedule { kLinear, kPoly };
inline constexpr EnumNames<Schedule, 2> kScheduleNames{{{{Schedule::kLinear, "linear"}, {Schedule::kPoly, "poly"}}}};
Schedule parse_schedule(const std::string& name);  // "linear" | "poly", else UserError naming --schedule
std::string schedule_name(Schedule schedule);

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double beta1 = 0.9, beta2 = 0.999;
  double epsilon = 1e-6;       // BERT's value
  double weight_decay = 0.01;  // decoupled; only on parameters marked in `decays`
  void validate() const;       // UserError naming the flag
};

class Optimizer {
 public:
  // `decays[id]`: whether parameter id gets weight decay (not biases and LayerNorm parameters).
  Optimizer(OptimizerOptions options, ParameterArena<float>& params, std::vector<bool> decays);

  // One update from the gradients in the arena, at learning rate lr, each gradient multiplied by
  // grad_scale as it is read (global-norm clipping: clip_factor; the arena's gradients are left as they
  // are, and the update is bit for bit the one from gradients scaled beforehand).
  //  AdamW (Loshchilov & Hutter, as torch.optim.AdamW): w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)
  //  LAMB (You et al.): u = m_hat / (sqrt(v_hat) + eps) + wd * w;  w -= lr * (|w| / |u|) * u, per tensor
  void step(double lr, double grad_scale = 1.0);
  // The same queued on the arena's GPU with the decision left to the device, so the host need not wait for
  // the step's losses and norm: the update is skipped where a value flagged by flag_nonfinite() or the
  // gradients' norm is NaN or infinite, else made with the gradients scaled by clip_factor(norm, max_norm),
  // exactly as step(lr, clip_factor(...)) (the device counts the steps). Queues the gradients' sum of
  // squares (gradient_sum_of_squares) and returns where it will be once `later` has waited. Once the host
  // knows the decision, it tells queued_step_taken() whether the update was made (steps() counts it then).
  const double* queue_step(double lr, double max_norm, Readback& later);
  // Queues a check of up to 4 device scalars (a step's losses) for queue_step's decision.
  void flag_nonfinite(std::span<const float* const> device_values);
  void queued_step_taken(bool updated) { steps_ += updated ? 1 : 0; }
  // Parameter `id` learns at lr * multiplier (e.g. quantizer scales at their own rate). Default 1.
  void set_lr_multiplier(ParamId id, double multiplier) {
    lr_multiplier_.at(id) = multiplier;
    segments_dirty_ = true;
  }
  // After each update parameter `id` is clamped to at least `minimum` (NaN included): quantizer scales
  // stay positive.
  void set_minimum(ParamId id, float minimum) {
    minimum_.at(id) = minimum;
    segments_dirty_ = true;
  }
  // Parameter `id` (positive values: quantizer scales) learns its logarithm: the moments follow the
  // gradient with respect to log w (w dL/dw) and the update multiplies, w *= exp(-lr * m_hat /
  // (sqrt(v_hat) + eps)), with no weight decay and no LAMB trust ratio. Each step then moves w by about
  // the same FRACTION whatever its size; Adam on w itself moves every value by about lr, which wipes out
  // small scales (a weight scale of 1e-3 at lr 1e-4 is gone in ten steps). Values stay positive.
  void set_log_space(ParamId id, bool log_space = true) {
    log_space_.at(id) = log_space;
    segments_dirty_ = true;
  }
  int64_t steps() const { return steps_; }
  const OptimizerOptions& options() const { return options_; }

  // Moments, for checkpoints: flat buffers in the arena's layout.
  TensorView<float> first_moment() { return TensorView<float>(m_.data(), Shape{static_cast<int64_t>(m_.size())}); }
  TensorView<float> second_moment() { return TensorView<float>(v_.data(), Shape{static_cast<int64_t>(v_.size())}); }
  void set_steps(int64_t steps) {
    steps_ = steps;
    device_steps_stale_ = true;
  }
  // The host moments as a checkpoint reads and writes them (after a load, set_steps(moments.steps)).
  store::OptimizerMoments checkpoint_moments();
  // The device moments to and from the host copies above (no-ops on the CPU).
  void download_moments();
  void upload_moments();

 private:
  OptimizerOptions options_;
  ParameterArena<float>& params_;
  std::vector<bool> decays_;
  std::vector<double> lr_multiplier_;
  std::vector<float> minimum_;  // -inf: none
  std::vector<bool> log_space_;
  AlignedVector<float> m_, v_;
  DeviceBuffer device_m_, device_v_, device_segments_, device_chunks_;  // on the arena's GPU
  DeviceBuffer device_lamb_partials_;                                   // LAMB's per-block norms
  DeviceBuffer device_control_;     // queue_step's decision (cuda_impl::UpdateControl)
  bool device_steps_stale_ = true;  // the decision's step count differs from steps_
  int chunk_count_ = 0;
  bool segments_dirty_ = true;
  int64_t largest_ = 0;
  void prepare_device();
  // control: the device's decision (queue_step), or nullptr (c1, c2, grad_scale as given).
  void step_on_device(double lr, float c1, float c2, float grad_scale, const void* control = nullptr);
  int64_t steps_ = 0;
};

// Linear warmup from 0 to `peak` over `warmup` steps, then linear or polynomial (power 0.5) decay to 0
// at `total`. Steps count from 1.
double learning_rate(int64_t step, int64_t total, int64_t warmup, double peak, Schedule schedule = Schedule::kLinear);

// Global L2 norm of all gradients (on the arena's device), summed in double in a fixed order (the same on
// any thread count); inf or NaN when a gradient is not finite. Waits for the device (a training step
// queues gradient_sum_of_squares instead).
double gradient_norm(ParameterArena<float>& params);
// The same queued on the arena's device, without waiting: the sum of squares (the norm's square) is at the
// returned address once `later` has waited (core/readback.h).
const double* gradient_sum_of_squares(ParameterArena<float>& params, Readback& later);

// Global-norm clipping: the factor that brings gradients of norm `norm` to at most max_norm (1 when they
// are within it, when max_norm <= 0 (no clipping) or when the norm is not finite). Optimizer::step
// applies it as it reads the gradients.
double clip_factor(double norm, double max_norm);

}  // namespace bert::train
