// Decode attention on CPU straight from the paged KV cache: no per-layer copy of any sequence's context.
//
// One work item per decode sequence, spread over torch's intra-op threads (at::parallel_for, so
// torch.set_num_threads governs it), longest first. A work item walks its sequence's block table one cache
// block at a time and keeps an online softmax (running max, running sum, unnormalised accumulator) for every
// query head, so each K and V block is read from memory once for all heads (query heads of one KV head share
// its rows). Scores and accumulation are fp32 whatever the cache dtype.
//
// Sliding window (Hugging Face's convention: the query at position p sees keys k with p - window < k <= p):
// the walk starts at the first key in the window, mid-block if need be, so the blocks before it are never
// read, nor their table entries checked (the engine may have freed them: -1 or stale). Soft-capping
// (Gemma 2): each scaled score becomes softcap * tanh(score / softcap) before the softmax.
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

struct Shapes {
  int64_t num_blocks, block_size, num_heads, num_kv_heads, head_dim, group;  // group: Hq / Hkv
  int64_t q_token_stride, q_head_stride, out_token_stride, out_head_stride, table_stride;
};

// n cache values as fp32: the values themselves for fp32 caches, else converted into `buffer`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
    return buffer;
  }
}

// One vector of floats, CONVEYOR_VECTOR_BYTES wide (64: AVX-512, 32: AVX2; set by the build), through the
// GCC/Clang vector extension. Loads and stores go through memcpy: cache rows carry no alignment promise.
#ifndef CONVEYOR_VECTOR_BYTES
#define CONVEYOR_VECTOR_BYTES 32
#endif
typedef float VecF __attribute__((vector_size(CONVEYOR_VECTOR_BYTES)));
constexpr int64_t kLanes = CONVEYOR_VECTOR_BYTES / sizeof(float);

inline VecF load_vec(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_vec(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }

inline float sum_lanes(VecF v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// out[i] = q . k[i] for R rows at once: R independent chains of multiply-adds keep the FPU busy where one
// dot product alone would wait on each add's latency. D: a multiple of kLanes.
template <int R>
inline void dot_rows(const float* q, const float* const* k, int64_t D, float* out, int64_t out_stride) {
  VecF acc[R] = {};
  for (int64_t d = 0; d < D; d += kLanes) {
    const VecF qv = load_vec(q + d);
    for (int i = 0; i < R; ++i) acc[i] += qv * load_vec(k[i] + d);
  }
  for (int i = 0; i < R; ++i) out[i * out_stride] = sum_lanes(acc[i]);
}

// acc[0:D] += sum_r weights[r] * v[r][0:D], four vectors of acc held in registers across the rows.
inline void add_weighted_rows(float* acc, const float* const* v, const float* weights, int64_t rows,
                              int64_t D) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) {
    VecF a0 = load_vec(acc + d), a1 = load_vec(acc + d + kLanes), a2 = load_vec(acc + d + 2 * kLanes),
         a3 = load_vec(acc + d + 3 * kLanes);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = v[r] + d;
      const float w = weights[r];
      a0 += w * load_vec(row);
      a1 += w * load_vec(row + kLanes);
      a2 += w * load_vec(row + 2 * kLanes);
      a3 += w * load_vec(row + 3 * kLanes);
    }
    store_vec(acc + d, a0), store_vec(acc + d + kLanes, a1), store_vec(acc + d + 2 * kLanes, a2),
        store_vec(acc + d + 3 * kLanes, a3);
  }
  for (; d < D; d += kLanes) {
    VecF a = load_vec(acc + d);
    for (int64_t r = 0; r < rows; ++r) a += weights[r] * load_vec(v[r] + d);
    store_vec(acc + d, a);
  }
}

// Asks for a block's cache lines ahead of use: blocks lie anywhere in the cache, and the hardware
// prefetcher stops at every page boundary, so the next block would otherwise start with cold misses.
template <typename scalar_t>
inline void prefetch(const scalar_t* data, int64_t elements) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < elements; i += kLine) __builtin_prefetch(data + i);
}

// Treats denormal floats as zero in this thread while in scope (x86 MXCSR flush-to-zero and
// denormals-are-zero), then restores the caller's mode. Softmax weights of keys far below the maximum land in
// the denormal range, and on x86 every operation on a denormal costs about a hundred cycles: with real
// activations (this engine's own K/V rather than random numbers) that cost 1.13x. They contribute under 1e-38
// to a sum of at least 1.
struct FlushDenormals {
#if defined(__x86_64__)
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Per-thread working memory of one work item, sized once per chunk of work items.
struct Scratch {
  std::vector<float> q, acc, scores, max, sum, rows;  // rows: a block's K or V as fp32 when converted
  std::vector<const float*> k, v;  // [block_size]: the current head's slice of each row of the block
  explicit Scratch(const Shapes& s)
      : q(s.num_heads * s.head_dim), acc(s.num_heads * s.head_dim), scores(s.num_heads * s.block_size),
        max(s.num_heads), sum(s.num_heads), rows(s.block_size * s.num_kv_heads * s.head_dim),
        k(s.block_size), v(s.block_size) {}
};

// Scores of one cache block: scores[h * B + r] = q_h . K[r, h / group], for every query head h.
template <typename scalar_t>
void score_block(const scalar_t* k_block, int64_t rows, const Shapes& s, Scratch& w) {
  const int64_t D = s.head_dim, B = s.block_size;
  const float* data = as_float(k_block, w.rows.data(), rows * s.num_kv_heads * D);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) w.k[r] = data + r * s.num_kv_heads * D + (h / s.group) * D;
    const float* q = w.q.data() + h * D;
    float* scores = w.scores.data() + h * B;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) dot_rows<4>(q, w.k.data() + r, D, scores + r, 1);
    for (; r < rows; ++r) dot_rows<1>(q, w.k.data() + r, D, scores + r, 1);
  }
}

// Gemma 2's logit soft-capping of one block's scaled scores: softcap * tanh(score / softcap).
void cap_block(int64_t rows, float softcap, const Shapes& s, Scratch& w) {
  const float inverse = 1.f / softcap;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    float* scores = w.scores.data() + h * s.block_size;
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) scores[r] = softcap * std::tanh(scores[r] * inverse);
  }
}

// Rescales each head's running state to the block's new max and turns its scores into weights.
void softmax_block(int64_t rows, const Shapes& s, Scratch& w) {
  const int64_t D = s.head_dim, B = s.block_size;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    float* scores = w.scores.data() + h * B;
    const float new_max = std::max(w.max[h], *std::max_element(scores, scores + rows));
    const float decay = std::exp(w.max[h] - new_max);  // 0 on the first block (max starts at -FLT_MAX)
    float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t r = 0; r < rows; ++r) {
      // exp(-87) is about 1.6e-38, the smallest normal float: a farther key's weight was going to vanish
      // anyway, and an argument past it sends glibc's vector exp to its slow scalar path (1.23x slower
      // with real activations).
      scores[r] = std::exp(std::max(scores[r] - new_max, -87.f));
      block_sum += scores[r];
    }
    w.sum[h] = w.sum[h] * decay + block_sum;
    w.max[h] = new_max;
    float* acc = w.acc.data() + h * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] *= decay;
  }
}

template <typename scalar_t>
void accumulate_block(const scalar_t* v_block, int64_t rows, const Shapes& s, Scratch& w) {
  const int64_t D = s.head_dim, B = s.block_size;
  const float* data = as_float(v_block, w.rows.data(), rows * s.num_kv_heads * D);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) w.v[r] = data + r * s.num_kv_heads * D + (h / s.group) * D;
    add_weighted_rows(w.acc.data() + h * D, w.v.data(), w.scores.data() + h * B, rows, D);
  }
}

// The first key a decode query (at position seq_len - 1) sees: seq_len - window, or 0 (window <= 0: none).
inline int64_t first_key(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

// One decode sequence, every head: its visible keys are read once, block by block, in cache order.
template <typename scalar_t>
void attend_one(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
                int64_t seq_len, int64_t window, float scale, float softcap, const Shapes& s, Scratch& w,
                scalar_t* out) {
  const int64_t D = s.head_dim, B = s.block_size, row_elements = s.num_kv_heads * D,
                block_elements = B * row_elements;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    for (int64_t i = 0; i < D; ++i) w.q[h * D + i] = static_cast<float>(q[h * s.q_head_stride + i]) * scale;
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.max.begin(), w.max.end(), -std::numeric_limits<float>::max());
  std::fill(w.sum.begin(), w.sum.end(), 0.f);
  // Keys [start, end) of one block at a time; only the first may start mid-block (the window's first key).
  for (int64_t start = first_key(seq_len, window), end; start < seq_len; start = end) {
    const int64_t block = start / B;
    end = std::min((block + 1) * B, seq_len);
    const int64_t rows = end - start;
    const int64_t offset = table[block] * block_elements + (start - block * B) * row_elements;
    if (end < seq_len) {
      const int64_t next = table[block + 1] * block_elements;
      prefetch(k_cache + next, block_elements), prefetch(v_cache + next, block_elements);
    }
    score_block(k_cache + offset, rows, s, w);
    if (softcap > 0.f) cap_block(rows, softcap, s, w);
    softmax_block(rows, s, w);
    accumulate_block(v_cache + offset, rows, s, w);
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float inv = 1.f / w.sum[h];
    for (int64_t i = 0; i < D; ++i) out[h * s.out_head_stride + i] = static_cast<scalar_t>(w.acc[h * D + i] * inv);
  }
}

// The blocks a sequence's walk reads lie in the cache; those before its window are not read, so not checked.
void check_blocks(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                  const Shapes& s) {
  const int32_t* table = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < seq_lens.size(0); ++seq) {
    const int64_t used = (lens[seq] + s.block_size - 1) / s.block_size;
    TORCH_CHECK(lens[seq] >= 1 && used <= block_tables.size(1), "seq_lens[", seq, "] = ", lens[seq],
                " needs 1..", block_tables.size(1) * s.block_size, " cached tokens");
    for (int64_t b = first_key(lens[seq], window) / s.block_size; b < used; ++b) {
      const int32_t block = table[seq * s.table_stride + b];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "block_tables[", seq, ", ", b, "] = ", block,
                  " is outside the cache's ", s.num_blocks, " blocks");
    }
  }
}

// Sequence ids, longest context first. The threads take them in this order, each its next as it finishes
// one, so no thread is left with the long documents while another idles (a step's sequences come in
// admission order, documents together). Two threads over one, decode attention over a whole bench run: a
// static split of the batch 1.4x, this 1.85x.
std::vector<int64_t> longest_first(const int32_t* lens, int64_t num_seqs) {
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  return order;
}

}  // namespace

// q, out [T, Hq, D] (head dim contiguous); caches [num_blocks, block_size, Hkv, D] contiguous, q's dtype;
// block_tables [S, max_blocks] int32 and seq_lens [S] int32, one row per decode sequence; q_rows [S] int64:
// each decode sequence's row of q and out. window: keys a query sees, itself included (0 or -1: all);
// softcap: the tanh cap of the scaled scores (0: none). Writes only those rows of out.
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_rows,
                  double scale, int64_t window, double softcap, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous head dimension");
  TORCH_CHECK(q.size(2) % kLanes == 0, "head_dim must be a multiple of ", kLanes, ", got ", q.size(2));
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  q_rows.scalar_type() == at::kLong, "block_tables, seq_lens: int32; q_rows: int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() && q_rows.is_contiguous(),
              "block_tables rows, seq_lens and q_rows must be contiguous");
  TORCH_CHECK(window >= -1, "window must be >= 1, or 0 or -1 for none, got ", window);
  TORCH_CHECK(softcap >= 0.0, "softcap must be > 0, or 0 for none, got ", softcap);
  const Shapes s{k_cache.size(0), k_cache.size(1), q.size(1), k_cache.size(2), k_cache.size(3),
                 q.size(1) / k_cache.size(2), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                 block_tables.stride(0)};
  check_blocks(block_tables, seq_lens, window, s);
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const std::vector<int64_t> order = longest_first(lens, num_seqs);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_seqs), 1, [&](int64_t, int64_t) {
      const FlushDenormals flush;
      Scratch w(s);
      for (int64_t i = next++; i < num_seqs; i = next++) {
        const int64_t seq = order[i];
        attend_one(q_ptr + rows[seq] * s.q_token_stride, k_ptr, v_ptr, tables + seq * s.table_stride,
                   lens[seq], window, static_cast<float>(scale), static_cast<float>(softcap), s, w,
                   out_ptr + rows[seq] * s.out_token_stride);
      }
    });
  });
}

int64_t paged_decode_lanes() { return kLanes; }
