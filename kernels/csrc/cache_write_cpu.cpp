// A step's new K and V rows into their cache slots on CPU: one row copy per token, where the reference's
// masked index_put makes a dozen small tensors per layer (a quarter of a millisecond per layer and step).
#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace {

template <typename index_t>
void check_slots(const index_t* slots, int64_t tokens, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is outside the cache's ",
                num_slots, " slots");
  }
}

// rows [T, Hkv * D] (each token's heads contiguous, any token stride) -> cache rows [num_slots, Hkv * D].
template <typename index_t>
void copy_rows(const char* rows, int64_t row_stride_bytes, const index_t* slots, int64_t tokens,
               int64_t row_bytes, char* cache) {
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] >= 0) std::memcpy(cache + slots[t] * row_bytes, rows + t * row_stride_bytes, row_bytes);
    }
  });
}

void check_rows_of(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), name, " must have its cache's dtype");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name,
              "'s heads of one token must be contiguous, got strides ", x.strides());
  TORCH_CHECK(cache.is_contiguous(), "the caches must be contiguous");
}

}  // namespace

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& slot_mapping) {
  check_rows_of(k, k_cache, "k");
  check_rows_of(v, v_cache, "v");
  TORCH_CHECK(slot_mapping.is_contiguous(), "slot_mapping must be contiguous");
  const int64_t tokens = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "reshape_and_cache", [&] {
    const index_t* slots = slot_mapping.data_ptr<index_t>();
    check_slots(slots, tokens, num_slots);
    for (auto [x, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
      copy_rows(static_cast<const char*>(x->data_ptr()), x->stride(0) * x->element_size(), slots, tokens,
                row_bytes, static_cast<char*>(cache->data_ptr()));
    }
  });
}
