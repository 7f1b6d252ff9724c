// The CPU kernels of one extension (built by kernels/cpu_extension.py), bound in bindings_cpu.cpp.
#pragma once

#include <torch/extension.h>

// paged_decode_cpu.cpp
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& q_rows,
                  double scale, int64_t window, double softcap, at::Tensor out);  // window, softcap: 0 = none
int64_t paged_decode_lanes();

// fused_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotate_half_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// cache_write_cpu.cpp
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& slot_mapping);

// quant_linear_cpu.cpp: weight-only int8/int4 (groups of 32; kernels/quant_reference.py has the layouts)
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits);
at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                            int64_t bits, int64_t row_begin, int64_t row_end);
