// A decode step of one token through every layer in one parallel region. The tensor path
// (decoder.cpp) runs each layer as a dozen ATen calls, each product its own parallel region, and
// everything between the products (RMSNorm, rounding to integers, rotary, the KV write, attention
// below a thousand head-keys, the residual adds) on one thread while the other waits; at one token
// a step that serial work and the calls' own costs were about a third of the forward (README).
// Here the threads enter once, take their share of every phase, and meet at a barrier only where
// a phase needs all of the one before:
//
//   each thread: x += proj; h = rms_norm(x); round h      (the same on every thread: no barrier)
//   qkv = h Wqkv            panels split             | barrier
//   rotary, KV write         KV heads split           | barrier
//   attention, round y       query heads split        | barrier
//   proj = y Wo             panels split             | barrier
//   each thread: x += proj; h = rms_norm(x); round h
//   gate_up = h Wgu          panels split             | barrier
//   silu(gate) * up, round   groups of 32 split       | barrier
//   proj = a Wdown           panels split             | barrier
//
// Every value is computed by the same row function its tensor kernel runs for each row
// (row_kernels.h), on the same inputs, so the step gives the batch path's bits: which thread
// computes a column, a head or a group never changes them (each is one fixed chain). Each thread
// keeps its own copy of the residual stream, updated identically, so that the norms need no
// hand-over. The shared buffers are allocated once a step, each thread's own once as it enters.

#include "decode_step.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace sendlens {
namespace {

// Thread t's share [begin, end) of n items.
struct Share {
  int64_t begin, end;
  Share(int64_t n, int t, int nt) : begin(n * t / nt), end(n * (t + 1) / nt) {}
  Share(int64_t b, int64_t e) : begin(b), end(e) {}
};

// The buffers the threads share.
struct Shared {
  std::vector<float> qkv, qk, y, proj, gate_up;
  Int8Rows y_rows, act_rows;
  Shared(const StepModel& m)
      : qkv((m.H + 2 * m.Hkv) * m.D), qk((m.H + m.Hkv) * m.D), y(m.H * m.D), proj(m.C), gate_up(2 * m.I),
        y_rows(empty_rows<int8_t>(1, m.H * m.D)), act_rows(empty_rows<int8_t>(1, m.I)) {}
};

// The rows of one thread's own: the residual stream, its norm and that rounded.
struct Own {
  std::vector<float> x, h, act;
  Int8Rows h_rows;
  std::vector<float> scratch;  // attention's
  Own(const StepModel& m, const float* embedding)
      : x(embedding, embedding + m.C), h(m.C), act(m.I), h_rows(empty_rows<int8_t>(1, m.C)) {}

  // x += proj (unless first), then h = rms_norm(x, w) rounded: the input of the next product.
  void norm(const StepModel& m, const float* w, const std::vector<float>& proj, bool add) {
    if (add)
      for (int64_t c = 0; c < m.C; ++c) x[c] = x[c] + proj[c];
    rms_norm_row(x.data(), w, m.C, m.eps, h.data());
    round_into<int8_t>(h_rows, 0, h.data(), 127);
  }
};

// This thread's share of the panels of a w^T (a: one row, rounded) into out.
void product(const Int8Rows& a, const Q4Weight& w, float* out, int t, int nt) {
  const Share s(w.panels, t, nt);
  q4_row_panels(a, w.nibbles, w.dm, s.begin, s.end, out);
}

// Columns [from, to) of x, rounded into row 0 of `rows` (whole groups: from and to are multiples
// of 32).
void round_part(Int8Rows& rows, const float* x, int64_t from, int64_t to) {
  round_row<int8_t>(x + from, to - from, 127, rows.xi.data() + from, rows.scale.data() + from / 32,
                    rows.sum.data() + from / 32, rows.isum.data() + from / 32);
}

// The new token's rotated queries and key, and its key and value into layer i's pools: KV heads
// split between threads, each with its query heads.
void rotate_and_store(const StepModel& m, const StepToken& tok, int64_t i, Shared& sh, int t, int nt) {
  const int64_t H = m.H, Hkv = m.Hkv, D = m.D, G = H / Hkv;
  const float* c = m.cos + tok.position * D;
  const float* s = m.sin + tok.position * D;
  const float* qkv = sh.qkv.data();
  const Share kv(Hkv, t, nt);
  for (int64_t h = kv.begin; h < kv.end; ++h) {
    rotary_row(qkv + h * G * D, G, D, D, c, s, sh.qk.data() + h * G * D);       // its queries
    rotary_row(qkv + (H + h) * D, 1, D, D, c, s, sh.qk.data() + (H + h) * D);  // its key
    write_kv_head(tok.k + i * tok.layer_stride, tok.v + i * tok.layer_stride, tok.pools.BS, Hkv, D, tok.slot, h,
                  sh.qk.data() + (H + h) * D, qkv + (H + Hkv + h) * D);
  }
}

// Attention of the token's query heads, split between threads (those of one KV head may part)
// in runs that end on a group of 32, and each thread's heads of y rounded for the output product.
void attend(const StepModel& m, const StepToken& tok, int64_t i, Shared& sh, Own& own, int t, int nt) {
  const int64_t H = m.H, D = m.D, G = H / m.Hkv;
  KvPools pools = tok.pools;
  pools.k = tok.k + i * tok.layer_stride;
  pools.v = tok.v + i * tok.layer_stride;
  const int64_t unit = std::lcm(D, int64_t{32}) / D;  // heads whose rows end on a group of 32
  const Share units(H / unit, t, nt);
  const Share heads(units.begin * unit, units.end * unit);
  for (int64_t h = heads.begin / G; h * G < heads.end; ++h) {
    const int64_t g0 = std::max(heads.begin, h * G) - h * G, g1 = std::min(heads.end, (h + 1) * G) - h * G;
    if (g1 > g0)
      attend_token(pools, sh.qk.data(), sh.y.data(), H, D, h, g0, g1 - g0, tok.seq, tok.position, own.scratch);
  }
  round_part(sh.y_rows, sh.y.data(), heads.begin * D, heads.end * D);
}

// silu(gate) * up, split by groups of 32 between threads, each rounding its groups for the down product.
void activate(const StepModel& m, Shared& sh, Own& own, int t, int nt) {
  const Share groups(m.I / 32, t, nt);
  silu_mul_row(sh.gate_up.data(), m.I, groups.begin * 32, groups.end * 32, own.act.data());
  round_part(sh.act_rows, own.act.data(), groups.begin * 32, groups.end * 32);
}

}  // namespace

void decode_step(const StepModel& m, const StepToken& tok, float* out) {
  Shared sh(m);
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    Own own(m, m.embed + tok.id * m.C);
    for (size_t i = 0; i < m.layers.size(); ++i) {
      const StepLayer& l = m.layers[i];
      own.norm(m, l.attn_norm, sh.proj, i > 0);
      product(own.h_rows, l.qkv, sh.qkv.data(), t, nt);
#pragma omp barrier
      rotate_and_store(m, tok, i, sh, t, nt);
#pragma omp barrier
      attend(m, tok, i, sh, own, t, nt);
#pragma omp barrier
      product(sh.y_rows, l.o, sh.proj.data(), t, nt);
#pragma omp barrier
      own.norm(m, l.mlp_norm, sh.proj, true);
      product(own.h_rows, l.gate_up, sh.gate_up.data(), t, nt);
#pragma omp barrier
      activate(m, sh, own, t, nt);
#pragma omp barrier
      product(sh.act_rows, l.down, sh.proj.data(), t, nt);
#pragma omp barrier
    }
    for (int64_t c = 0; c < m.C; ++c) own.x[c] = own.x[c] + sh.proj[c];
    if (t == 0) rms_norm_row(own.x.data(), m.final_norm, m.C, m.eps, out);
  }
}

}  // namespace sendlens
