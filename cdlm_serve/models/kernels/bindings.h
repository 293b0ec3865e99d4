// The extension's Python module, for both builds: the ops and DecodeStack of the ISA namespace
// named by CDLM_ISA (each build's classes live in their own namespace, so that both builds can
// be loaded in one process: pybind11 registers a class by its C++ type).
#pragma once

#include <atomic>

namespace {

// Calls into this build from Python (the tests ask which build ran, and that it ran).
std::atomic<int64_t> kernel_calls{0};

template <typename R, typename... A>
auto counted(R (*f)(A...)) {
  return [f](A... a) -> R {
    kernel_calls.fetch_add(1, std::memory_order_relaxed);
    return f(std::forward<A>(a)...);
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace CDLM_ISA;
  // The kernels touch no Python objects: let other Python threads (the HTTP event loop) run
  // while a decode step computes.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("isa", [] { return std::string(kIsa); }, "the instruction set this build runs on");
  m.def("calls", [] { return kernel_calls.load(std::memory_order_relaxed); },
        "calls into this build's ops and decode steps from Python");
  m.def("linear_bf16", counted(&linear_bf16), "small-M bf16 x @ W^T (+ bias)", nogil);
  m.def("pack_bf16", counted(&pack_bf16), "pack W [N, K] for linear_packed_bf16", nogil);
  m.def("linear_packed_bf16", counted(&linear_packed_bf16), "small-M x @ W^T with a packed W", nogil);
  m.def("linear_split", counted(&linear_split), "x @ W^T (+ bias), N split across threads", nogil);
  m.def("rms_norm_bf16", counted(&rms_norm_bf16), "RMSNorm", nogil);
  m.def("add_rms_norm_bf16", counted(&add_rms_norm_bf16), "residual add + RMSNorm", nogil);
  m.def("silu_mul_bf16", counted(&silu_mul_bf16), "SwiGLU activation", nogil);
  m.def("gelu_mul_bf16", counted(&gelu_mul_bf16), "GELU-tanh gated activation (GeGLU)", nogil);
  m.def("rope_inplace_bf16", counted(&rope_inplace_bf16), "rotate-half RoPE, in place", nogil);
  m.def("decode_attention_bf16", counted(&decode_attention_bf16), "one query per row vs the KV cache", nogil);
  m.def("set_amx", &set_amx, "use AMX tiles in linear_packed_bf16 and linear_q8 where possible");
  m.def("amx_int8", &amx_int8_enabled, "whether linear_q8 runs on AMX-INT8 tiles");
  m.def("amx_int8_calls", &amx_int8_count, "how many linear_q8 products ran on the tiles");
  m.def("argmax_rows", counted(&argmax_rows), "row-wise argmax", nogil);
  m.def("repeat_max", counted(&repeat_max), "KVzip's log max softmax weight per key", nogil);
  m.def("pack_attention_kv", counted(&pack_attention_kv), "pack a layer's K, V for attend_packed_bf16", nogil);
  m.def("attend_packed_bf16", counted(&attend_packed_bf16), "query rows over key ranges of packed K, V", nogil);
  m.def("pack_q8", counted(&pack_q8), "pack Q8_0 codes and scales for linear_q8", nogil);
  m.def("linear_q8", counted(&linear_q8), "small-M x @ W^T with Q8_0 int8 weights (VNNI/AMX)", nogil);
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<std::vector<c10::optional<torch::Tensor>>>, torch::Tensor,
                          int64_t, int64_t, int64_t, double, double, bool, torch::Tensor,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>())
      .def(pybind11::init<std::vector<std::vector<c10::optional<torch::Tensor>>>, torch::Tensor,
                          int64_t, int64_t, int64_t, double, double, bool, torch::Tensor,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          std::vector<bool>, bool>())
      .def("forward",
           [](DecodeStack& self, torch::Tensor x, std::vector<torch::Tensor> keys,
              std::vector<torch::Tensor> values, c10::optional<std::vector<torch::Tensor>> biases,
              std::vector<int64_t> rows, std::vector<int64_t> slots, std::vector<int64_t> attend,
              torch::Tensor cos, torch::Tensor sin) {
             kernel_calls.fetch_add(1, std::memory_order_relaxed);
             return self.forward(x, keys, values, biases, rows, slots, attend, cos, sin);
           },
           nogil)
      .def("forward_windowed",
           [](DecodeStack& self, torch::Tensor x, std::vector<torch::Tensor> keys,
              std::vector<torch::Tensor> values, c10::optional<std::vector<torch::Tensor>> biases,
              std::vector<int64_t> rows, std::vector<int64_t> slots, std::vector<int64_t> attend,
              torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> ring_keys,
              std::vector<torch::Tensor> ring_values, std::vector<int64_t> ring_slots,
              torch::Tensor ring_bias, torch::Tensor ring_cos, torch::Tensor ring_sin) {
             kernel_calls.fetch_add(1, std::memory_order_relaxed);
             return self.forward_windowed(x, keys, values, biases, rows, slots, attend, cos, sin,
                                          ring_keys, ring_values, ring_slots, ring_bias,
                                          ring_cos, ring_sin);
           },
           nogil)
      .def("logits",
           [](DecodeStack& self, torch::Tensor h) {
             kernel_calls.fetch_add(1, std::memory_order_relaxed);
             return self.logits(h);
           },
           nogil)
      .def("int8", &DecodeStack::int8);
}
