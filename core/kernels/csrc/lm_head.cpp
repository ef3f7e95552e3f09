// The LM head's last step in bf16, q8_0 and q4_1 (model.py's Transformer.logits): the approximate
// product gives every logit, then each row's k largest are recomputed exactly in fp32 against the
// embedding, so that greedy decoding picks what fp32 would and sampling reads exact logits where
// the mass is. In torch that was a top-k over the vocabulary, a gather of k embedding rows per row
// into a (N, k, C) tensor, a product and a sum, each a pass over memory of its own (the README's
// benchmark notes have the timings).
//
// Here, per row (rows split between threads, each row on its own):
// - the k largest in one pass (top_k): a min-heap of the best so far, and the logits
//   64 at a time compared with its smallest, so that after the first few hundred logits almost every vector is
//   passed over with one comparison. Ties go to the earlier token (only a strictly larger logit
//   displaces one), so the set is fixed by the row alone.
// - each candidate's logit as one fixed chain (dot): 16 lanes, each adding its columns in order
//   by multiply-adds, then vec.h's fixed tree; four candidates at a time, independent chains.

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace sendlens {
namespace {

struct Candidate {
  float logit;
  int64_t token;
};
// The heap's order: with `better` as "less", its front is the worst candidate, the one to displace.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
}

// The k largest of x[0, V) (k <= V), ties to the earlier index, in no particular order.
void top_k(const float* x, int64_t V, int64_t k, std::vector<Candidate>& heap) {
  heap.clear();
  for (int64_t j = 0; j < k; ++j) heap.push_back({x[j], j});
  std::make_heap(heap.begin(), heap.end(), better);
  auto offer = [&](int64_t j) {
    if (x[j] > heap.front().logit) {  // strictly: an equal later logit loses the tie
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {x[j], j};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  constexpr int64_t RUN = 4 * LANES;  // logits passed over with one comparison
  int64_t j = k;
  for (; j < V && j % RUN; ++j) offer(j);
  for (; j + RUN <= V; j += RUN) {
    const Vec m = max(max(Vec::load(x + j), Vec::load(x + j + LANES)),
                      max(Vec::load(x + j + 2 * LANES), Vec::load(x + j + 3 * LANES)));
    if (reduce_max(m) > heap.front().logit)
      for (int64_t i = j; i < j + RUN; ++i) offer(i);
  }
  for (; j < V; ++j) offer(j);
}

// Four candidates' exact logits: rows e[0..3] (C,) of the embedding times h (C,).
void dot4(const float* const* e, const float* h, int64_t C, float* out) {
  Vec acc[4] = {Vec::set1(0.0f), Vec::set1(0.0f), Vec::set1(0.0f), Vec::set1(0.0f)};
  for (int64_t c = 0; c < C; c += LANES) {
    const Vec hv = Vec::load(h + c);
    for (int i = 0; i < 4; ++i) acc[i] = fma(Vec::load(e[i] + c), hv, acc[i]);
  }
  for (int i = 0; i < 4; ++i) out[i] = reduce_add(acc[i]);
}

}  // namespace

void rescore_top(const at::Tensor& logits, const at::Tensor& emb, const at::Tensor& hidden, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "rescore_top: logits (N, V) contiguous float");
  TORCH_CHECK(emb.dim() == 2 && emb.is_contiguous() && emb.scalar_type() == at::kFloat && emb.size(0) == logits.size(1),
              "rescore_top: emb (V, C) contiguous float, one row per logit");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat &&
                  hidden.size(0) == logits.size(0) && hidden.size(1) == emb.size(1) && emb.size(1) % LANES == 0,
              "rescore_top: hidden (N, C) contiguous float, C a multiple of ", LANES);
  TORCH_CHECK(k >= 0, "rescore_top: k must be >= 0, not ", k);
  const int64_t N = logits.size(0), V = logits.size(1), C = emb.size(1);
  k = std::min(k, V);
  if (k == 0) return;
  float* ls = logits.data_ptr<float>();
  const float* es = emb.data_ptr<float>();
  const float* hs = hidden.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> heap;
    heap.reserve(k);
    for (int64_t r = begin; r < end; ++r) {
      float* row = ls + r * V;
      top_k(row, V, k, heap);
      heap.resize((k + 3) / 4 * 4, heap.front());  // padded to fours; the copies write the same value
      for (int64_t i = 0; i < k; i += 4) {
        const float* e[4];
        float exact[4];
        for (int c = 0; c < 4; ++c) e[c] = es + heap[i + c].token * C;
        dot4(e, hs + r * C, C, exact);
        for (int c = 0; c < 4; ++c) row[heap[i + c].token] = exact[c];
      }
    }
  });
}

}  // namespace sendlens
