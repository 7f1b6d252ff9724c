// Weight-only quantized matrix products on CPU: out [M, N] = x [M, K] @ dequantize(w)^T, x and out fp32.
//
// Layouts (kernels/quant_reference.py is the reference and says the same): the weight's K axis is cut into
// groups of 32; each group has one fp32 scale and, for int4, one fp32 offset (`mins`), so w = scale * q + min.
// - int8: q [N, K] int8, w = scale * q (symmetric; GGUF's Q8_0 block exactly);
// - int4: q [N, K/2] uint8, 16 bytes per group; byte j holds q[j] in its low nibble and q[j + 16] in its
//   high one (GGUF's Q4_0/Q4_1 block order), q in [0, 15] (Q4_1 exactly: w = d * q + m).
//
// Decoding reads every weight once per step, so its speed is the weights' bytes: a group is dequantized to
// fp32 in registers once and multiplied into up to eight rows of x (a step's decode rows) before the next
// group is read. Output rows N are split over torch's intra-op threads. A prefill (many rows of x) is
// compute-bound instead: `dequantize` expands the weight tile by tile and the caller multiplies with the fp32
// GEMM (kernels/quant_linear.py says from how many rows).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kGrainRows = 16;  // output rows per work item: a 576-wide projection spreads over threads

// The 32 weights of one group as four vectors of eight floats.
struct Group {
  __m256 w[4];
};

inline Group int8_group(const int8_t* q, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  Group g;
  for (int i = 0; i < 4; ++i) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    g.w[i] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
  return g;
}

inline Group int4_group(const uint8_t* q, float scale, float min) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 m = _mm256_set1_ps(min);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, nibble);                     // q[0..15]
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);  // q[16..31]
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  Group g;
  for (int i = 0; i < 4; ++i) {
    g.w[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m);
  }
  return g;
}

inline float horizontal_sum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

struct QuantWeight {
  const uint8_t* q;  // int8 or packed int4 bytes, row-major
  const float* scales;  // [N, K / 32]
  const float* mins;  // [N, K / 32]; int4 only
  int64_t k;
  int bits;

  int64_t row_bytes() const { return bits == 8 ? k : k / 2; }

  Group group(int64_t n, int64_t g) const {
    const int64_t groups = k / kGroup;
    const uint8_t* row = q + n * row_bytes();
    if (bits == 8) return int8_group(reinterpret_cast<const int8_t*>(row) + g * kGroup, scales[n * groups + g]);
    return int4_group(row + g * (kGroup / 2), scales[n * groups + g], mins[n * groups + g]);
  }
};

// out[m0 .. m0 + kRows, n] for one weight row n: each group dequantized once, used for every row of x.
// kChains independent accumulators per row of x: an FMA waits 4 cycles for the one before on its chain, so one
// chain per row would leave the FMA units idle when few rows are multiplied (decoding one sequence).
template <int kRows, int kChains>
void rows_times_weight_row(const QuantWeight& w, const float* x, int64_t m0, int64_t n, int64_t n_out,
                           float* out) {
  __m256 acc[kRows][kChains];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.k / kGroup; ++g) {
    const Group group = w.group(n, g);
    for (int r = 0; r < kRows; ++r) {
      const float* xs = x + (m0 + r) * w.k + g * kGroup;
      for (int i = 0; i < 4; ++i) {
        acc[r][i % kChains] = _mm256_fmadd_ps(group.w[i], _mm256_loadu_ps(xs + 8 * i), acc[r][i % kChains]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    out[(m0 + r) * n_out + n] = horizontal_sum(sum);
  }
}

void rows_times_weight(const QuantWeight& w, const float* x, int64_t m, int64_t n_begin, int64_t n_end,
                       int64_t n_out, float* out) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    // Eight rows of x per pass when there are (a group dequantized once for eight; 8 accumulators, 4 weight
    // vectors and a row of x fill 13 of the 16 vector registers), then four, two, one: a speculating
    // request's token and drafts (2 to 9 rows) dequantize each group at most twice.
    int64_t m0 = 0;
    for (; m0 + 8 <= m; m0 += 8) rows_times_weight_row<8, 1>(w, x, m0, n, n_out, out);
    for (; m0 + 4 <= m; m0 += 4) rows_times_weight_row<4, 2>(w, x, m0, n, n_out, out);
    for (; m0 + 2 <= m; m0 += 2) rows_times_weight_row<2, 2>(w, x, m0, n, n_out, out);
    for (; m0 < m; ++m0) rows_times_weight_row<1, 4>(w, x, m0, n, n_out, out);
  }
}

QuantWeight quant_weight(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantized weight: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.element_size() == 1, "quantized weight: q must be a "
              "contiguous 2-D int8/uint8 tensor");
  const int64_t k = bits == 8 ? q.size(1) : 2 * q.size(1);
  TORCH_CHECK(k % kGroup == 0, "quantized weight: K must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
              scales.size(0) == q.size(0) && scales.size(1) == k / kGroup,
              "quantized weight: scales must be a contiguous fp32 [N, K / 32]");
  const float* min_data = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                mins->scalar_type() == at::kFloat, "quantized weight: int4 needs mins shaped as its scales");
    min_data = mins->data_ptr<float>();
  }
  return {static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(), min_data, k,
          static_cast<int>(bits)};
}

}  // namespace

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits) {
  const QuantWeight w = quant_weight(q, scales, mins, bits);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == at::kFloat,
              "quant_matmul: x must be fp32 [M, K] with K = ", w.k);
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), n = q.size(0);
  at::Tensor out = at::empty({m, n}, xc.options());
  const float* x_data = xc.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    rows_times_weight(w, x_data, m, begin, end, n, out_data);
  });
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t row_begin, int64_t row_end) {
  const QuantWeight w = quant_weight(q, scales, mins, bits);
  TORCH_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= q.size(0), "quant_dequantize: rows [",
              row_begin, ", ", row_end, ") out of [0, ", q.size(0), ")");
  at::Tensor out = at::empty({row_end - row_begin, w.k}, scales.options());
  float* out_data = out.data_ptr<float>();
  at::parallel_for(row_begin, row_end, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = out_data + (n - row_begin) * w.k;
      for (int64_t g = 0; g < w.k / kGroup; ++g) {
        const Group group = w.group(n, g);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(row + g * kGroup + 8 * i, group.w[i]);
      }
    }
  });
  return out;
}
