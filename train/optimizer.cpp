#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "store/checkpoint.h"
#include "sys/error.h"
#include "sys/parallel.h"
#if BERT_WITH_CUDA
#include "train/optimizer_cuda.h"
#endif

namespace bert::train {

namespace {
constexpr int64_t kGrain = 1 << 16;
}

OptimizerKind parse_optimizer(const std::string& name) { return kOptimizerNames.parse(name, "--optimizer"); }

std::string optimizer_name(OptimizerKind kind) { return kOptimizerNames.name(kind); }

store::OptimizerMoments Optimizer::checkpoint_moments() {
  return {optimizer_name(options_.kind), steps_, m_.data(), v_.data()};
}

Schedule parse_schedule(const std::string& name) { return kScheduleNames.parse(name, "--schedule"); }

std::string schedule_name(Schedule schedule) { return kScheduleNames.name(schedule); }

void OptimizerOptions::validate() const {
  if (!(beta1 >= 0 && beta1 < 1)) throw UserError("--beta1 must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) throw UserError("--beta2 must be in [0, 1)");
  if (!(epsilon > 0)) throw UserError("--adam-epsilon must be positive");
  if (!(weight_decay >= 0 && std::isfinite(weight_decay))) throw UserError("--weight-decay must be >= 0");
}

Optimizer::Optimizer(OptimizerOptions options, ParameterArena<float>& params, std::vector<bool> decays)
    : options_(std::move(options)), params_(params), decays_(std::move(decays)) {
  options_.validate();
  BERT_CHECK(static_cast<int32_t>(decays_.size()) == params.size(), "one decay flag per parameter");
  lr_multiplier_.assign(decays_.size(), 1.0);
  minimum_.assign(decays_.size(), -INFINITY);
  log_space_.assign(decays_.size(), false);
  m_.assign(params.values().numel(), 0.0f);
  v_.assign(params.values().numel(), 0.0f);
  if (params.on_cuda()) {
    const std::size_t bytes = m_.size() * sizeof(float);
    device_m_ = DeviceBuffer(params.device(), bytes);
    device_v_ = DeviceBuffer(params.device(), bytes);
    params.device().fill_zero(device_m_.data(), bytes);
    params.device().fill_zero(device_v_.data(), bytes);
  }
}

void Optimizer::download_moments() {
  if (!params_.on_cuda()) return;
  params_.device().copy_to_host(m_.data(), device_m_.data(), device_m_.bytes());
  params_.device().copy_to_host(v_.data(), device_v_.data(), device_v_.bytes());
}

void Optimizer::upload_moments() {
  if (!params_.on_cuda()) return;
  params_.device().copy_to_device(device_m_.data(), m_.data(), device_m_.bytes());
  params_.device().copy_to_device(device_v_.data(), v_.data(), device_v_.bytes());
}

#if BERT_WITH_CUDA
void Optimizer::prepare_device() {
  BERT_CHECK(device_m_.data(), "the optimizer was made before its arena was placed on the GPU");
  if (!device_control_.data()) {
    device_control_ = DeviceBuffer(params_.device(), sizeof(cuda_impl::UpdateControl));
    const cuda_impl::UpdateControl initial;
    params_.device().copy_to_device(device_control_.data(), &initial, sizeof initial);
  }
  if (!segments_dirty_) return;
  // The per-parameter table, uploaded once (and again after a change).
  std::vector<cuda_impl::Segment> segments(static_cast<size_t>(params_.size()));
  largest_ = 0;
  for (ParamId id = 0; id < params_.size(); ++id) {
    cuda_impl::Segment& s = segments[id];
    s.offset = params_.offset(id);
    s.size = params_.shape(id).numel();
    s.weight_decay = decays_[id] ? static_cast<float>(options_.weight_decay) : 0.0f;
    s.lr_multiplier = static_cast<float>(lr_multiplier_[id]);
    s.has_minimum = std::isfinite(minimum_[id]);
    s.minimum = s.has_minimum ? minimum_[id] : 0.0f;
    s.log_space = log_space_[id];
    largest_ = std::max(largest_, s.size);
  }
  device_segments_ = DeviceBuffer(params_.device(), segments.size() * sizeof(cuda_impl::Segment));
  params_.device().copy_to_device(device_segments_.data(), segments.data(), device_segments_.bytes());
  std::vector<cuda_impl::Chunk> chunks;  // AdamW's blocks: every segment's chunks
  for (ParamId id = 0; id < params_.size(); ++id)
    for (int64_t c = 0; c * cuda_impl::kAdamChunk < std::max<int64_t>(segments[id].size, 1); ++c)
      chunks.push_back({static_cast<int32_t>(id), static_cast<int32_t>(c)});
  device_chunks_ = DeviceBuffer(params_.device(), chunks.size() * sizeof(cuda_impl::Chunk));
  params_.device().copy_to_device(device_chunks_.data(), chunks.data(), device_chunks_.bytes());
  chunk_count_ = static_cast<int>(chunks.size());
  if (options_.kind == OptimizerKind::kLamb)
    device_lamb_partials_ = DeviceBuffer(
        params_.device(), sizeof(double) * cuda_impl::lamb_partials(static_cast<int>(params_.size()), largest_));
  segments_dirty_ = false;
}

void Optimizer::step_on_device(double lr, float c1, float c2, float grad_scale, const void* control) {
  prepare_device();
  const cuda_impl::AdamHyper h{static_cast<float>(lr),
                               static_cast<float>(options_.beta1),
                               static_cast<float>(options_.beta2),
                               c1,
                               c2,
                               static_cast<float>(options_.epsilon),
                               grad_scale};
  const auto* decision = static_cast<const cuda_impl::UpdateControl*>(control);
  float* w = params_.device_values().data();
  const float* g = params_.device_grads().data();
  const auto* segments = device_segments_.as<cuda_impl::Segment>();
  if (options_.kind == OptimizerKind::kLamb)
    cuda_impl::lamb_step(params_.device(), w, g, device_m_.as<float>(), device_v_.as<float>(), segments,
                         static_cast<int>(params_.size()), largest_, h, device_lamb_partials_.as<double>(), decision);
  else {  // AdamW also keeps the arena's BF16 copy of the values (BF16 mixed precision)
    void* w16 = params_.bf16_copy_for_update();
    cuda_impl::adamw_step(params_.device(), w, w16, g, device_m_.as<float>(), device_v_.as<float>(), segments,
                          device_chunks_.as<cuda_impl::Chunk>(), chunk_count_, h, decision);
    if (w16) params_.bf16_copy_updated();
  }
}

const double* Optimizer::queue_step(double lr, double max_norm, Readback& later) {
  BERT_CHECK(params_.on_cuda(), "Optimizer::queue_step runs on a GPU (the CPU steps with step())");
  prepare_device();
  auto* control = device_control_.as<cuda_impl::UpdateControl>();
  if (device_steps_stale_) {  // the host's count (a checkpoint's, or synchronous steps) for the decisions
    const long long steps = steps_;
    params_.device().copy_to_device(&control->steps, &steps, sizeof steps);
    device_steps_stale_ = false;
  }
  const cuda_impl::UpdateRule rule{max_norm, options_.beta1, options_.beta2};
  const double* sum =
      later.read<double>(cuda_impl::queue_sum_of_squares(params_.device(), params_.device_grads().data(),
                                                         params_.device_grads().numel(), control, rule),
                         1);
  step_on_device(lr, 1.0f, 1.0f, 1.0f, control);
  return sum;
}

void Optimizer::flag_nonfinite(std::span<const float* const> device_values) {
  prepare_device();
  auto* control = device_control_.as<cuda_impl::UpdateControl>();
  for (std::size_t i = 0; i < device_values.size(); i += cuda_impl::kMaxFlagged)
    cuda_impl::flag_nonfinite(params_.device(), device_values.data() + i,
                              static_cast<int>(std::min<std::size_t>(cuda_impl::kMaxFlagged, device_values.size() - i)),
                              control);
}
#else
void Optimizer::step_on_device(double, float, float, float, const void*) {
  BERT_CHECK(false, "a CPU-only build has no GPU optimizer");
}
const double* Optimizer::queue_step(double, double, Readback&) {
  BERT_CHECK(false, "a CPU-only build has no GPU optimizer");
  return nullptr;
}
void Optimizer::flag_nonfinite(std::span<const float* const>) {
  BERT_CHECK(false, "a CPU-only build has no GPU optimizer");
}
#endif

void Optimizer::step(double lr, double grad_scale) {
  ++steps_;
  device_steps_stale_ = true;
  const float gs = static_cast<float>(grad_scale);
  const double b1 = options_.beta1, b2 = options_.beta2;
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(b1, steps_)));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(b2, steps_)));
  if (params_.on_cuda()) return step_on_device(lr, c1, c2, gs);
  const float eps = static_cast<float>(options_.epsilon);
  const float b1f = static_cast<float>(b1), b2f = static_cast<float>(b2);
  float* base = params_.values().data();
  const bool lamb = options_.kind == OptimizerKind::kLamb;
  // AdamW: every parameter in linear space is updated in one parallel pass over the arena (a pass per
  // parameter woke the threads some forty times a step for tensors of a few hundred values).
  struct Span {
    int64_t begin, end;  // offsets in the arena
    float wd, lrf, floor_value;
    bool has_floor;
  };
  std::vector<Span> spans;
  for (ParamId id = 0; id < params_.size(); ++id) {
    Parameter<float> p = params_.get(id);
    const int64_t offset = p.value.data() - base, n = p.value.numel();
    float* w = p.value.data();
    const float* g = p.grad.data();
    float* m = m_.data() + offset;
    float* v = v_.data() + offset;
    const float wd = decays_[id] ? static_cast<float>(options_.weight_decay) : 0.0f;
    const double param_lr = lr * lr_multiplier_[id];
    const float lrf = static_cast<float>(param_lr);
    const float floor_value = minimum_[id];
    const bool has_floor = std::isfinite(floor_value);
    if (log_space_[id]) {  // Adam on log w (see set_log_space), the same for AdamW and LAMB
      for (int64_t i = 0; i < n; ++i) {
        const float gl = (g[i] * gs) * w[i];
        m[i] = b1f * m[i] + (1 - b1f) * gl;
        v[i] = b2f * v[i] + (1 - b2f) * gl * gl;
        w[i] *= std::exp(-lrf * (m[i] * c1) / (std::sqrt(v[i] * c2) + eps));
        if (has_floor && !(w[i] >= floor_value)) w[i] = floor_value;
      }
    } else if (!lamb) {
      spans.push_back({offset, offset + n, wd, lrf, floor_value, has_floor});
    } else {
      // First pass: moments and the norms of w and of the update u; second pass: apply u scaled by the
      // trust ratio |w| / |u| (u is recomputed rather than stored).
      double w_norm2 = 0, u_norm2 = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i] * gs;
        m[i] = b1f * m[i] + (1 - b1f) * gi;
        v[i] = b2f * v[i] + (1 - b2f) * gi * gi;
        const float u = (m[i] * c1) / (std::sqrt(v[i] * c2) + eps) + wd * w[i];
        w_norm2 += double(w[i]) * w[i];
        u_norm2 += double(u) * u;
      }
      const double trust = (w_norm2 > 0 && u_norm2 > 0) ? std::sqrt(w_norm2 / u_norm2) : 1.0;
      const float scale = static_cast<float>(param_lr * trust);
      for (int64_t i = 0; i < n; ++i) {
        w[i] -= scale * ((m[i] * c1) / (std::sqrt(v[i] * c2) + eps) + wd * w[i]);
        if (has_floor && !(w[i] >= floor_value)) w[i] = floor_value;
      }
    }
  }
  if (spans.empty()) return;
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  float* wv = base;
  const float* gv = params_.grads().data();
  float* mv = m_.data();
  float* vv = v_.data();
  parallel_for(spans.back().end, kGrain, [&](int64_t lo, int64_t hi) {
    // The first span that ends after lo, then each one that starts before hi.
    auto s = std::upper_bound(spans.begin(), spans.end(), lo, [](int64_t at, const Span& sp) { return at < sp.end; });
    // Locals, and the floor in a loop of its own: the update's loop vectorises (with -fno-math-errno for
    // this file: sqrt's errno branch kept it scalar). The same arithmetic, element by element.
    float* w = wv;
    float* m = mv;
    float* v = vv;
    const float* g = gv;
    const float scale = gs, beta1 = b1f, beta2 = b2f, correct1 = c1, correct2 = c2, epsilon = eps;
    for (; s != spans.end() && s->begin < hi; ++s) {
      const float wd = s->wd, lrf = s->lrf, floor_value = s->floor_value;
      const int64_t first = std::max(lo, s->begin), end = std::min(hi, s->end);
      for (int64_t i = first; i < end; ++i) {
        const float gi = g[i] * scale;
        const float mi = beta1 * m[i] + (1 - beta1) * gi;
        const float vi = beta2 * v[i] + (1 - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float wi = w[i];
        wi -= lrf * (wd * wi);  // decoupled decay first, as torch.optim.AdamW
        wi -= lrf * (mi * correct1) / (std::sqrt(vi * correct2) + epsilon);
        w[i] = wi;
      }
      if (s->has_floor)
        for (int64_t i = first; i < end; ++i) w[i] = w[i] >= floor_value ? w[i] : floor_value;
    }
  });
}

double learning_rate(int64_t step, int64_t total, int64_t warmup, double peak, Schedule schedule) {
  if (step <= warmup && warmup > 0) return peak * static_cast<double>(step) / static_cast<double>(warmup);
  if (step >= total) return 0.0;
  const double remaining =
      static_cast<double>(total - step) / static_cast<double>(std::max<int64_t>(total - warmup, 1));
  return schedule == Schedule::kPoly ? peak * std::sqrt(remaining) : peak * remaining;
}

namespace {
// Sums of fixed blocks, added in order: the same sum whatever the thread count. Within a block, kLanes
// running sums (element i into lane i mod kLanes) added at its end: one running sum was a chain of
// dependent additions, 10x slower (BERT-mini's 11.2M gradients: 16.5 ms against 1.7 on two cores).
double sum_of_squares(TensorView<float> g) {
  const float* gv = g.data();
  const int64_t n = g.numel();
  constexpr int64_t kBlock = 1 << 15;
  constexpr int kLanes = 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> block_sums(static_cast<std::size_t>(blocks));
  parallel_for(blocks, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const float* x = gv;
      const int64_t end = std::min(n, (b + 1) * kBlock);
      double lanes[kLanes] = {};
      int64_t i = b * kBlock;
      for (; i + kLanes <= end; i += kLanes)
        for (int j = 0; j < kLanes; ++j) lanes[j] += double(x[i + j]) * x[i + j];
      for (int j = 0; i < end; ++i, ++j) lanes[j] += double(x[i]) * x[i];
      double s = 0;
      for (double lane : lanes) s += lane;
      block_sums[static_cast<std::size_t>(b)] = s;
    }
  });
  double sum = 0;
  for (double s : block_sums) sum += s;
  return sum;
}
}  // namespace

double gradient_norm(ParameterArena<float>& params) {
  Readback reads(params.device());
  const double* sum = gradient_sum_of_squares(params, reads);
  reads.wait();
  return std::sqrt(*sum);
}

const double* gradient_sum_of_squares(ParameterArena<float>& params, Readback& later) {
#if BERT_WITH_CUDA
  if (params.on_cuda())
    return later.read<double>(cuda_impl::queue_sum_of_squares(params.device(), params.device_grads().data(),
                                                              params.device_grads().numel()),
                              1);
#endif
  const double sum = sum_of_squares(params.grads());
  return later.read<double>(&sum, 1);  // on the CPU: copied at once
}

double clip_factor(double norm, double max_norm) {
  if (max_norm > 0 && std::isfinite(norm) && norm > max_norm)
    return static_cast<double>(static_cast<float>(max_norm / norm));  // the float the update multiplies by
  return 1.0;
}

}  // namespace bert::train
