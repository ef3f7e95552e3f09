// The decoder's layers over a paged batch, in C++: the same ATen operations, in the same order
// and with the same arguments, as core/model.py, and the same kernels (kernels.h: attention,
// RMSNorm, rotary embedding and SwiGLU's product, which model.py calls too), so the same bits.
// What it removes is Python: a decode step of SmolLM2 is several hundred small tensor
// operations, and through Python each costs a few microseconds more than the operation itself.
//
// Shapes: T packed tokens, C hidden size, H query heads and Hkv key/value heads of size D.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include "kernels.h"

#include <algorithm>
#include <vector>

namespace {

enum Format : int64_t { FP32 = 0, BF16 = 1, Q4_1 = 2, Q8_0 = 3 };
enum Product : int64_t { OWN = 0, ONEDNN = 1, PLAIN = 2 };  // gemm.Product, as native.py numbers it

// How gemm.PackedLinear multiplies, handed over by native.py: with the engine's kernels (f32_matmul,
// q4_matmul), oneDNN's on prepacked weights, or PyTorch's plain products; the fewest rows a product
// runs with (PackedLinear.min_rows); Q4_GROUP.
struct Products {
  Product product;
  int64_t min_rows, q4_group;
};

// oneDNN's matmul on a weight in its blocked layout (gemm.linear_prepacked), through the
// dispatcher: the operator is registered by PyTorch's oneDNN bindings, not declared in ATen's headers.
at::Tensor linear_prepacked(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor pad_rows(const at::Tensor& x, int64_t multiple) {
  const int64_t n = x.size(0);
  const int64_t rows = std::max(multiple, ((n + multiple - 1) / multiple) * multiple);
  if (rows == n) return x;
  return at::cat({x, x.new_zeros({rows - n, x.size(1)})});
}

// One linear layer's weight in the engine's format (gemm.PackedLinear) and its product.
struct Linear {
  std::vector<at::Tensor> w;  // fp32, bf16: (weight, maybe prepacked); q4_1: two; q8_0: two (own) or
                              // four (the two 4-bit halves, linear.PackedQ8_0)

  at::Tensor operator()(const at::Tensor& x, Format fmt, const Products& p) const {
    if (fmt == Q8_0) {
      if (p.product == OWN) return sendlens::q8_matmul(x, w[0], w[1]);
      const at::Tensor xb = x.to(at::kBFloat16);  // hi(x) + lo(x), as PackedQ8_0 sums them
      return at::_weight_int4pack_mm_for_cpu(xb, w[0], p.q4_group, w[1]) +
             at::_weight_int4pack_mm_for_cpu(xb, w[2], p.q4_group, w[3]);
    }
    if (fmt == Q4_1) {
      return p.product == OWN ? sendlens::q4_matmul(x, w[0], w[1])
                              : at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[0], p.q4_group, w[1]);
    }
    if (p.product == OWN) {
      return fmt == FP32 ? sendlens::f32_matmul(x, w[0])
                         : sendlens::f32_matmul(x.to(at::kBFloat16), w[0]).to(at::kBFloat16);
    }
    const int64_t n = x.size(0);
    const at::Tensor padded = pad_rows(x.to(fmt == FP32 ? at::kFloat : at::kBFloat16), p.min_rows);
    return (p.product == ONEDNN ? linear_prepacked(padded, w[0]) : at::linear(padded, w[0])).slice(0, 0, n);
  }
};

struct Layer {
  at::Tensor attn_norm, mlp_norm;
  Linear qkv, o, gate_up, down;
};

class Decoder {
 public:
  Decoder(int64_t fmt, at::Tensor embed, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
          std::vector<std::vector<at::Tensor>> layers, int64_t H, int64_t Hkv, int64_t D, double eps,
          int64_t product, int64_t min_rows, int64_t q4_group)
      : fmt_(static_cast<Format>(fmt)), embed_(embed), final_norm_(final_norm), cos_(cos), sin_(sin),
        H_(H), Hkv_(Hkv), D_(D), eps_(eps), products_{static_cast<Product>(product), min_rows, q4_group} {
    const size_t per_linear = fmt_ == Q4_1 ? 2 : fmt_ == Q8_0 ? (products_.product == OWN ? 2 : 4) : 1;
    for (auto& t : layers) {  // attn_norm, mlp_norm, then qkv, o, gate_up, down
      TORCH_CHECK(t.size() == 2 + 4 * per_linear, "a layer takes ", 2 + 4 * per_linear, " tensors");
      Layer l{t[0], t[1], {}, {}, {}, {}};
      Linear* linears[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (size_t i = 0; i < 4; ++i)
        linears[i]->w.assign(t.begin() + 2 + i * per_linear, t.begin() + 2 + (i + 1) * per_linear);
      layers_.push_back(std::move(l));
    }
  }

  // ids, positions: (T,); k_cache, v_cache: every layer's pools (kv_cache.py); slot_mapping: (T,);
  // block_tables: (S, nb); token_seq: (T,) each token's row of block_tables.
  // -> the final hidden states (T, C), normalized, as Transformer.forward.
  // sink_tokens, window: the KV eviction rule (paged_attention; window 0: every key).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& token_seq, int64_t sink_tokens, int64_t window) {
    py::gil_scoped_release no_gil;  // other Python threads (the web server) run meanwhile
    at::InferenceMode guard;
    at::Tensor x = at::embedding(embed_, ids);                                  // (T, C)
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      x = x + attention(sendlens::rms_norm(x, l.attn_norm, eps_), l, k_cache[i], v_cache[i],
                        slot_mapping, block_tables, token_seq, positions, sink_tokens, window);
      x = x + mlp(sendlens::rms_norm(x, l.mlp_norm, eps_), l);
    }
    return sendlens::rms_norm(x, final_norm_, eps_);
  }

 private:
  at::Tensor mlp(const at::Tensor& x, const Layer& l) const {
    return l.down(sendlens::silu_mul(l.gate_up(x, fmt_, products_)), fmt_, products_);  // (T, C)
  }

  at::Tensor attention(const at::Tensor& x, const Layer& l, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& token_seq,
                       const at::Tensor& positions, int64_t sink_tokens, int64_t window) const {
    const int64_t T = x.size(0), H = H_, Hkv = Hkv_, D = D_;
    const at::Tensor qkv = l.qkv(x, fmt_, products_).to(at::kFloat);          // (T, (H + 2 Hkv) D)
    const at::Tensor qk =                                                      // q and k at once
        sendlens::rotary(qkv.slice(1, 0, (H + Hkv) * D).view({T, H + Hkv, D}), cos_, sin_, positions);
    const at::Tensor q = qk.slice(1, 0, H), k = qk.slice(1, H);                // (T, H, D), (T, Hkv, D)
    const at::Tensor v = qkv.slice(1, (H + Hkv) * D).view({T, Hkv, D});
    sendlens::write_kv(k_cache, v_cache, slot_mapping, k, v);
    const at::Tensor y =
        sendlens::paged_attention(q, k_cache, v_cache, block_tables, token_seq, positions, sink_tokens, window);
    return l.o(y.view({T, H * D}), fmt_, products_);                          // (T, C)
  }

  Format fmt_;
  at::Tensor embed_, final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  int64_t H_, Hkv_, D_;
  double eps_;
  Products products_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    std::vector<std::vector<at::Tensor>>, int64_t, int64_t, int64_t, double, int64_t, int64_t,
                    int64_t>())
      .def("forward", &Decoder::forward);
  m.def("write_kv", &sendlens::write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &sendlens::paged_attention, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("block_tables"), py::arg("token_seq"), py::arg("positions"), py::arg("sink_tokens") = 0,
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("supports_head_dim", &sendlens::supports_head_dim);
  m.def("rms_norm", &sendlens::rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &sendlens::rotary, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &sendlens::silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("f32_matmul_available", &sendlens::f32_matmul_available);
  m.def("f32_matmul", &sendlens::f32_matmul, py::call_guard<py::gil_scoped_release>());
  m.def("q4_matmul_isa", &sendlens::q4_matmul_isa);
  m.def("q4_matmul", &sendlens::q4_matmul, py::call_guard<py::gil_scoped_release>());
  m.def("q8_matmul_available", &sendlens::q8_matmul_available);
  m.def("q8_matmul", &sendlens::q8_matmul, py::call_guard<py::gil_scoped_release>());
}
