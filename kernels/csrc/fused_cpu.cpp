// The element-wise work around a decoder layer's matmuls, fused on CPU: RMSNorm, rotate-half RoPE and SwiGLU.
//
// In eager PyTorch each of these is four to six passes over [T, H]-sized tensors, each writing a fresh tensor
// (RMSNorm: square, mean, scale, weight; RoPE: negate, concatenate, two products, a sum; SwiGLU: silu, product).
// Here each is one pass that reads its inputs once and writes once, row by row, over torch's intra-op threads.
// The arithmetic is the one transformers does, in fp32 whatever the tensors' dtype; results are rounded to it
// where transformers rounds (see each function), so outputs differ from eager only by fp32 rounding.
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

// Rows per work item: a step's few decode rows stay on one thread, a prefill chunk's spread out.
constexpr int64_t kGrainRows = 64;
constexpr float kMaxExpArg = 88.f;  // exp(88) = 1.65e38 < FLT_MAX

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t x_stride, const scalar_t* weight, float eps, int64_t rows,
                   int64_t dim, scalar_t* out) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = x + t * x_stride;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      scalar_t* dst = out + t * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        // transformers: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): rounded to the dtype, then weighted.
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(row[i]) * inv_rms);
        dst[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

// x rounded to scalar_t and back: where eager PyTorch stores an intermediate in the tensors' dtype.
template <typename scalar_t>
inline float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// x [T, H, D] in place: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]).
template <typename scalar_t>
void rotate_rows(scalar_t* x, int64_t token_stride, int64_t head_stride, int64_t heads, const scalar_t* cos,
                 const scalar_t* sin, int64_t rows, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos + t * dim;
      const scalar_t* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* v = x + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(v[i]), hi = static_cast<float>(v[i + half]);
          // Each product rounded to the dtype before the sum, as eager's x * cos + rotate_half(x) * sin.
          v[i] = static_cast<scalar_t>(rounded<scalar_t>(lo * static_cast<float>(c[i])) -
                                       rounded<scalar_t>(hi * static_cast<float>(s[i])));
          v[i + half] = static_cast<scalar_t>(rounded<scalar_t>(hi * static_cast<float>(c[i + half])) +
                                              rounded<scalar_t>(lo * static_cast<float>(s[i + half])));
        }
      }
    }
  });
}

// out [T, I] = silu(gate) * up, gate_up [T, 2I] = [gate | up] per row.
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gate_up, int64_t gu_stride, int64_t rows, int64_t inner,
                       scalar_t* out) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = gate_up + t * gu_stride;
      const scalar_t* up = gate + inner;
      scalar_t* dst = out + t * inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) {
        const float g = static_cast<float>(gate[i]);
        // transformers: silu(gate) rounded to the dtype, then the product. exp's argument is capped below
        // log(FLT_MAX): under -ffast-math the division becomes a reciprocal estimate refined by a Newton step,
        // which turns exp(-g) = inf (g < -88.7) into inf * 0 = NaN; capped, silu(g) is g / 1.65e38, about 0.
        const scalar_t activated = static_cast<scalar_t>(g / (1.f + std::exp(std::min(-g, kMaxExpArg))));
        dst[i] = static_cast<scalar_t>(static_cast<float>(activated) * static_cast<float>(up[i]));
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows, got sizes ",
              t.sizes(), " strides ", t.strides());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [", x.size(1), "] of x's dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(), static_cast<float>(eps),
                  x.size(0), x.size(1), out.data_ptr<scalar_t>());
  });
  return out;
}

void rotate_half_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be a CPU [T, H, D] tensor with a contiguous, even head dimension, got sizes ", x.sizes());
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->is_contiguous() && table->dim() == 2 && table->size(0) == x.size(0) &&
                    table->size(1) == x.size(2) && table->scalar_type() == x.scalar_type(),
                "cos and sin must be contiguous [", x.size(0), ", ", x.size(2), "] of x's dtype, got ",
                table->sizes());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotate_half_", [&] {
    rotate_rows(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), x.size(1), cos.data_ptr<scalar_t>(),
                sin.data_ptr<scalar_t>(), x.size(0), x.size(2));
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's last dimension must be even, got ", gate_up.size(1));
  const int64_t inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), inner}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), gate_up.size(0), inner,
                      out.data_ptr<scalar_t>());
  });
  return out;
}
