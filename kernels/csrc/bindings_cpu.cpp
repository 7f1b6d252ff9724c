// The Python module of the CPU kernels.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // paged_decode(q, k_cache, v_cache, block_tables, seq_lens, q_rows, scale, window, softcap, out)
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (sliding window, soft-cap)");
  m.attr("lanes") = paged_decode_lanes();  // paged_decode: head_dim must be a multiple of it
  m.def("reshape_and_cache", &reshape_and_cache, "new K/V rows into their paged cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of x [T, H] rows");
  m.def("rotate_half_", &rotate_half_, "rotate-half RoPE of x [T, H, D], in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of gate_up [T, 2I]");
  m.def("quant_matmul", &quant_matmul, "x [M, K] fp32 @ an int8/int4 weight [N, K]^T, dequantized in registers");
  m.def("quant_dequantize", &quant_dequantize, "rows [begin, end) of an int8/int4 weight as fp32");
}
