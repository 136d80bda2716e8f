// Fake quantization with the LSQ scale gradient on a CUDA device, forward and backward side by side
// like core/ops_quantize.cpp. It divides by the scale and rounds half to even (rintf) exactly as
// QuantizeLinear does, so the GPU agrees bit for bit with the CPU and the ONNX export. The scale
// gradient is summed per channel in fixed-size blocks in double, in a fixed order.
#include "core/cuda/fake_quantize.cuh"
#include "core/ops_cuda.h"

namespace bert::ops::cuda_impl {

// The output in the activation dtype (BF16 in mixed precision: q s rounded to 8 mantissa bits, which
// for |q| <= 256 is q times s rounded once); x, often an F32 weight, in its own.
Var fake_quantize(Graph<float>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped) {
  const int64_t n = g.shape(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  BERT_CHECK(channels <= 65535, "fake_quantize on a GPU: at most 65535 channels");
  const cuda::QuantizeLaunch q{g.value(scale).data(),    nullptr,    n,      channels, static_cast<float>(qmin),
                               static_cast<float>(qmax), grad_scale, clipped};
  const DType in_type = g.dtype(x), out_type = g.activation_dtype();
  Var y = g.emit(g.shape(x), {x, scale}, out_type);
  cuda::with_element_type(out_type, [&](auto out_tag) {
    cuda::with_element_type(in_type, [&](auto in_tag) {
      using Y = typename decltype(out_tag)::type;
      using X = typename decltype(in_tag)::type;
      const int width = cuda::pack_width(sizeof(Y), sizeof(X), q.per_channel(), {g.data(x), g.data(y)});
      cuda::launch_fake_quantize_forward(g, q, cuda::typed<Y>(g.data(y)),
                                         cuda::TensorSource<X>{cuda::typed<X>(g.data(x)), nullptr}, width);
    });
  });
  g.on_backward(y, [=](Graph<float>& g) {
    const auto dx = g.requires_grad(x) ? g.raw_grad_target(x) : Graph<float>::RawGradTarget{nullptr, false};
    cuda::QuantizeLaunch back = q;
    back.scale_grad = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    cuda::with_element_type(out_type, [&](auto out_tag) {
      cuda::with_element_type(in_type, [&](auto in_tag) {
        using Y = typename decltype(out_tag)::type;
        using X = typename decltype(in_tag)::type;
        void* dy = g.grad_data(y);
        const int width = cuda::pack_width(sizeof(Y), sizeof(X), q.per_channel(), {dy, g.data(x), dx.data});
        cuda::launch_fake_quantize_backward(g, back, cuda::typed<Y>(dy),
                                            cuda::TensorSource<X>{cuda::typed<X>(g.data(x)), cuda::typed<X>(dx.data)},
                                            width, dx.accumulate);
      });
    });
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
