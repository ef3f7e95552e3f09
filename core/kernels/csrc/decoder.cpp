// The decoder's layers over a paged batch, in C++: the same ATen operations, in the same order
// and with the same arguments, as core/model.py, and the same kernels (kernels.h: attention,
// RMSNorm, rotary embedding and SwiGLU's product, which model.py calls too), so the same bits.
// What it removes is Python: a decode step of SmolLM2 is several hundred small tensor
// operations, and through Python each costs a few microseconds more than the operation itself.
//
// Shapes: T packed tokens, C hidden size, H query heads and Hkv key/value heads of size D.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include "decode_step.h"
#include "kernels.h"

#include <algorithm>
#include <memory>
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
    prepare_step();
  }

  // Whether a step of at most MAX_STEP_TOKENS tokens runs in one parallel region (decode_step.h).
  bool one_region_step() const { return step_ != nullptr; }

  // ids, positions: (T,); k_cache, v_cache: every layer's pools (kv_cache.py); slot_mapping: (T,);
  // block_tables: (S, nb); token_seq: (T,) each token's row of block_tables.
  // -> the final hidden states (T, C), normalized, as Transformer.forward.
  // sink_tokens, window: the KV eviction rule (paged_attention; window 0: every key).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& token_seq, int64_t sink_tokens, int64_t window) {
    py::gil_scoped_release no_gil;  // other Python threads (the web server) run meanwhile
    at::InferenceMode guard;
    if (step_ && ids.size(0) <= sendlens::MAX_STEP_TOKENS)
      return few_tokens(ids, positions, k_cache, v_cache, slot_mapping, block_tables, token_seq, sink_tokens, window);
    // the residual stream x, updated in place: each add and the norm after it are one pass
    at::Tensor x = at::embedding(embed_, ids).contiguous();                     // (T, C)
    at::Tensor h = sendlens::rms_norm(x, layers_.empty() ? final_norm_ : layers_[0].attn_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const at::Tensor a = attention(h, l, k_cache[i], v_cache[i], slot_mapping, block_tables, token_seq,
                                     positions, sink_tokens, window);
      h = sendlens::add_rms_norm(x, a, l.mlp_norm, eps_);                      // x += a
      const at::Tensor& next = i + 1 < layers_.size() ? layers_[i + 1].attn_norm : final_norm_;
      h = sendlens::add_rms_norm(x, mlp(h, l), next, eps_);                     // x += mlp
    }
    return h;
  }

 private:
  // Whether a step of a few tokens can run in one parallel region (decode_step.h: Q4_1 on the engine's
  // own kernel, float tensors, the products' inputs in groups of 32), and its model if so.
  void prepare_step() {
    const int64_t C = embed_.size(1), D = D_;
    if (fmt_ != Q4_1 || products_.product != OWN || sendlens::q4_matmul_isa().empty() ||
        !sendlens::supports_head_dim(D) || (H_ * D) % 32 != 0 || C % 32 != 0 || layers_.empty())
      return;
    for (const at::Tensor& t : {embed_, final_norm_, cos_, sin_})
      if (t.scalar_type() != at::kFloat || !t.is_contiguous()) return;
    auto weight = [](const Linear& l, int64_t K, int64_t N, sendlens::Q4Weight& out) {
      const at::Tensor &nib = l.w[0], &dm = l.w[1];
      if (!nib.is_contiguous() || !dm.is_contiguous() || nib.size(1) * 4 != K || nib.size(0) * 16 != N)
        return false;
      out = {nib.data_ptr<uint8_t>(), dm.data_ptr<at::Half>(), nib.size(0)};
      return true;
    };
    const int64_t I = layers_[0].down.w[0].size(1) * 4;
    if (I % 32 != 0) return;
    auto model = std::make_unique<sendlens::StepModel>(sendlens::StepModel{
        embed_.data_ptr<float>(), final_norm_.data_ptr<float>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(),
        C, I, H_, Hkv_, D, static_cast<float>(eps_), {}});
    for (const Layer& l : layers_) {
      sendlens::StepLayer s{l.attn_norm.data_ptr<float>(), l.mlp_norm.data_ptr<float>(), {}, {}, {}, {}};
      if (!l.attn_norm.is_contiguous() || !l.mlp_norm.is_contiguous() ||
          !weight(l.qkv, C, (H_ + 2 * Hkv_) * D, s.qkv) || !weight(l.o, H_ * D, C, s.o) ||
          !weight(l.gate_up, C, 2 * I, s.gate_up) || !weight(l.down, I, C, s.down))
        return;
      model->layers.push_back(s);
    }
    step_ = std::move(model);
  }

  // A step of a few tokens (decode_step.h), after checking every index it will read or write.
  at::Tensor few_tokens(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& token_seq, int64_t sink_tokens, int64_t window) const {
    const int64_t L = static_cast<int64_t>(layers_.size()), D = D_, Hkv = Hkv_, T = ids.size(0);
    for (const at::Tensor& t : {ids, positions, slot_mapping, token_seq, block_tables})
      TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "decoder: int64 ids, positions, slots and tables");
    TORCH_CHECK(positions.size(0) == T && slot_mapping.size(0) == T && token_seq.size(0) == T,
                "decoder: one position, slot and sequence per token");
    const bool half = k_cache.scalar_type() == at::kBFloat16;
    TORCH_CHECK((half ? bf16_operands() : k_cache.scalar_type() == at::kFloat) &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "decoder: float pools, or bfloat16 pools where attention's operands are bf16 (q4_1)");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() >= 2 && k_cache.size(0) >= L &&
                    v_cache.dim() >= 1 && v_cache.size(0) == k_cache.size(0),
                "decoder: every layer's pools, contiguous");
    const int64_t BS = sendlens::pool_block_size(k_cache.sizes().slice(1), v_cache.sizes().slice(1), Hkv, D, half,
                                                 "decoder");
    TORCH_CHECK(sink_tokens >= 0 && window >= 0, "decoder: sink_tokens and window must be >= 0");
    const int64_t blocks = k_cache.size(1), S = block_tables.size(0), nb = block_tables.size(1);
    const int64_t *id = ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
    const int64_t *slot = slot_mapping.data_ptr<int64_t>(), *seq = token_seq.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < embed_.size(0), "token id ", id[t], " is outside the vocabulary");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "position ", pos[t], " is outside the table");
      TORCH_CHECK(slot[t] >= 0 && slot[t] < blocks * BS, "slot ", slot[t], " is outside the pool");
      TORCH_CHECK(seq[t] >= 0 && seq[t] < S, "token ", t, " names sequence ", seq[t], " of ", S);
      TORCH_CHECK(pos[t] / BS < nb, "a key's block ", pos[t] / BS, " is beyond the block table (", nb, " blocks)");
      const int64_t* table = block_tables.data_ptr<int64_t>() + seq[t] * nb;
      for (int64_t b = 0; b <= pos[t] / BS; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < blocks, "block ", table[b], " is outside the pool");
    }
    const sendlens::StepTokens tokens{T, id, pos, slot, seq, half ? nullptr : k_cache.data_ptr<float>(),
                                      half ? nullptr : v_cache.data_ptr<float>(), k_cache.stride(0),
                                      {nullptr, nullptr, block_tables.data_ptr<int64_t>(), blocks, nb, BS, Hkv,
                                       sink_tokens, window, bf16_operands()},
                                      sendlens::bf16_words(k_cache), sendlens::bf16_words(v_cache)};
    at::Tensor out = at::empty({T, step_->C}, embed_.options());
    sendlens::decode_step(*step_, tokens, out.data_ptr<float>());
    return out;
  }

  // Attention's operands in bfloat16 (paged_attention): Q4_1 on the engine's own products, as
  // model.Attention.bf16_operands decides it in Python.
  bool bf16_operands() const { return fmt_ == Q4_1 && products_.product == OWN; }

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
        sendlens::paged_attention(q, k_cache, v_cache, block_tables, token_seq, positions, sink_tokens, window,
                                  bf16_operands());
    return l.o(y.view({T, H * D}), fmt_, products_);                          // (T, C)
  }

  Format fmt_;
  at::Tensor embed_, final_norm_, cos_, sin_;
  std::vector<Layer> layers_;
  int64_t H_, Hkv_, D_;
  double eps_;
  Products products_;
  std::unique_ptr<sendlens::StepModel> step_;  // set where a step of a few tokens can run in one region
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    std::vector<std::vector<at::Tensor>>, int64_t, int64_t, int64_t, double, int64_t, int64_t,
                    int64_t>())
      .def("forward", &Decoder::forward)
      .def_property_readonly("one_region_step", &Decoder::one_region_step)
      .def_property_readonly_static("max_step_tokens", [](py::object) { return sendlens::MAX_STEP_TOKENS; });
  m.def("write_kv", &sendlens::write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention", &sendlens::paged_attention, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("block_tables"), py::arg("token_seq"), py::arg("positions"), py::arg("sink_tokens") = 0,
        py::arg("window") = 0, py::arg("bf16") = false, py::call_guard<py::gil_scoped_release>());
  m.def("supports_head_dim", &sendlens::supports_head_dim);
  m.def("rms_norm", &sendlens::rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &sendlens::add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &sendlens::rotary, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &sendlens::silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("f32_matmul_available", &sendlens::f32_matmul_available);
  m.def("f32_matmul", &sendlens::f32_matmul, py::call_guard<py::gil_scoped_release>());
  m.def("q4_matmul_isa", &sendlens::q4_matmul_isa);
  m.def("q4_matmul", &sendlens::q4_matmul, py::call_guard<py::gil_scoped_release>());
  m.def("q8_matmul_available", &sendlens::q8_matmul_available);
  m.def("q8_matmul", &sendlens::q8_matmul, py::call_guard<py::gil_scoped_release>());
  m.def("rescore_top", &sendlens::rescore_top, py::arg("logits"), py::arg("emb"), py::arg("hidden"), py::arg("k"),
        py::call_guard<py::gil_scoped_release>());
}
