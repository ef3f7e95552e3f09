// A step of a few tokens through every layer in one parallel region. The tensor path
// (decoder.cpp) runs each layer as a dozen ATen calls, each product its own parallel region, and
// everything between the products (RMSNorm, rounding to integers, rotary, the KV write, attention
// below a thousand head-keys, the residual adds) on one thread while the other waits; at one token
// a step that serial work and the calls' own costs were about a third of the forward (README).
// With at most MAX_STEP_TOKENS tokens (decode_step.h) the same holds, each phase once per token.
// Here the threads enter once, take their share of every phase, and meet at a barrier
// (step_barrier.h) only where a phase needs all of the one before:
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
#include "step_barrier.h"

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

// The buffers the threads share, a row per token.
struct Shared {
  std::vector<float> qkv, qk, y, proj, gate_up;  // (T, ...)
  Int8Rows y_rows, act_rows;
  Shared(const StepModel& m, int64_t T)
      : qkv(T * (m.H + 2 * m.Hkv) * m.D), qk(T * (m.H + m.Hkv) * m.D), y(T * m.H * m.D), proj(T * m.C),
        gate_up(T * 2 * m.I), y_rows(empty_rows<int8_t>(T, m.H * m.D)), act_rows(empty_rows<int8_t>(T, m.I)) {}
};

// The rows of one thread's own: the residual stream, its norm and that rounded.
struct Own {
  int64_t T;
  std::vector<float> x, h, act;  // (T, C), (T, C), (T, I)
  Int8Rows h_rows;
  std::vector<float> scratch;    // attention's
  Own(const StepModel& m, const StepTokens& tok) : T(tok.T), x(T * m.C), h(T * m.C), act(T * m.I),
                                                   h_rows(empty_rows<int8_t>(T, m.C)) {
    for (int64_t r = 0; r < T; ++r) std::copy_n(m.embed + tok.ids[r] * m.C, m.C, x.data() + r * m.C);
  }

  // x += proj (unless first), then h = rms_norm(x, w) rounded: the input of the next product.
  void norm(const StepModel& m, const float* w, const std::vector<float>& proj, bool add) {
    if (add)
      for (int64_t c = 0; c < T * m.C; ++c) x[c] = x[c] + proj[c];
    for (int64_t r = 0; r < T; ++r) {
      rms_norm_row(x.data() + r * m.C, w, m.C, m.eps, h.data() + r * m.C);
      round_into<int8_t>(h_rows, r, h.data() + r * m.C, 127);
    }
  }
};

// This thread's share of the panels of a w^T (a: T rows, rounded) into out (T, 16 panels).
void product(const Int8Rows& a, int64_t T, const Q4Weight& w, float* out, int t, int nt) {
  const Share s(w.panels, t, nt);
  q4_row_panels(a, T, w.nibbles, w.dm, s.begin, s.end, out, w.panels * 16);
}

// Columns [from, to) of row r's x, rounded into row r of `rows` (whole groups: from and to are
// multiples of 32).
void round_part(Int8Rows& rows, int64_t r, const float* x, int64_t from, int64_t to) {
  const int64_t K = rows.K, K32 = K / 32;
  round_row<int8_t>(x + from, to - from, 127, rows.xi.data() + r * K + from, rows.scale.data() + r * K32 + from / 32,
                    rows.sum.data() + r * K32 + from / 32, rows.isum.data() + r * K32 + from / 32);
}

// The tokens' rotated queries and keys, and their keys and values into layer i's pools: KV heads
// split between threads, each with its query heads.
void rotate_and_store(const StepModel& m, const StepTokens& tok, int64_t i, Shared& sh, int t, int nt) {
  const int64_t H = m.H, Hkv = m.Hkv, D = m.D, G = H / Hkv;
  const Share kv(Hkv, t, nt);
  for (int64_t r = 0; r < tok.T; ++r) {
    const float* c = m.cos + tok.positions[r] * D;
    const float* s = m.sin + tok.positions[r] * D;
    const float* qkv = sh.qkv.data() + r * (H + 2 * Hkv) * D;
    float* qk = sh.qk.data() + r * (H + Hkv) * D;
    for (int64_t h = kv.begin; h < kv.end; ++h) {
      rotary_row(qkv + h * G * D, G, D, D, c, s, qk + h * G * D);       // its queries
      rotary_row(qkv + (H + h) * D, 1, D, D, c, s, qk + (H + h) * D);  // its key
      if (tok.k16)
        write_kv_head(tok.k16 + i * tok.layer_stride, tok.v16 + i * tok.layer_stride, tok.pools.BS, Hkv, D,
                      tok.slots[r], h, qk + (H + h) * D, qkv + (H + Hkv + h) * D);
      else
        write_kv_head(tok.k + i * tok.layer_stride, tok.v + i * tok.layer_stride, tok.pools.BS, Hkv, D, tok.slots[r],
                      h, qk + (H + h) * D, qkv + (H + Hkv + h) * D);
    }
  }
}

// Attention of each token's query heads, split between threads (those of one KV head may part)
// in runs that end on a group of 32, and each thread's heads of y rounded for the output product.
void attend(const StepModel& m, const StepTokens& tok, int64_t i, Shared& sh, Own& own, int t, int nt) {
  const int64_t H = m.H, Hkv = m.Hkv, D = m.D, G = H / Hkv;
  KvPools pools = tok.pools;
  if (tok.k16) {
    pools.k16 = tok.k16 + i * tok.layer_stride;
    pools.v16 = tok.v16 + i * tok.layer_stride;
  } else {
    pools.k = tok.k + i * tok.layer_stride;
    pools.v = tok.v + i * tok.layer_stride;
  }
  const int64_t unit = std::lcm(D, int64_t{32}) / D;  // heads whose rows end on a group of 32
  const Share units(H / unit, t, nt);
  const Share heads(units.begin * unit, units.end * unit);
  for (int64_t r = 0; r < tok.T; ++r) {
    const float* q = sh.qk.data() + r * (H + Hkv) * D;
    float* y = sh.y.data() + r * H * D;
    for (int64_t h = heads.begin / G; h * G < heads.end; ++h) {
      const int64_t g0 = std::max(heads.begin, h * G) - h * G, g1 = std::min(heads.end, (h + 1) * G) - h * G;
      if (g1 > g0)
        attend_token(pools, q, y, H, D, h, g0, g1 - g0, tok.seqs[r], tok.positions[r], own.scratch);
    }
    round_part(sh.y_rows, r, y, heads.begin * D, heads.end * D);
  }
}

// silu(gate) * up, split by groups of 32 between threads, each rounding its groups for the down product.
void activate(const StepModel& m, Shared& sh, Own& own, int t, int nt) {
  const Share groups(m.I / 32, t, nt);
  for (int64_t r = 0; r < own.T; ++r) {
    float* act = own.act.data() + r * m.I;
    silu_mul_row(sh.gate_up.data() + r * 2 * m.I, m.I, groups.begin * 32, groups.end * 32, act);
    round_part(sh.act_rows, r, act, groups.begin * 32, groups.end * 32);
  }
}

}  // namespace

void decode_step(const StepModel& m, const StepTokens& tok, float* out) {
  const int64_t T = tok.T;
  Shared sh(m, T);
  const int threads = at::get_num_threads();
  StepBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    barrier.join(nt);
    Own own(m, tok);
    for (size_t i = 0; i < m.layers.size(); ++i) {
      const StepLayer& l = m.layers[i];
      own.norm(m, l.attn_norm, sh.proj, i > 0);
      product(own.h_rows, T, l.qkv, sh.qkv.data(), t, nt);
      barrier.wait();
      rotate_and_store(m, tok, i, sh, t, nt);
      barrier.wait();
      attend(m, tok, i, sh, own, t, nt);
      barrier.wait();
      product(sh.y_rows, T, l.o, sh.proj.data(), t, nt);
      barrier.wait();
      own.norm(m, l.mlp_norm, sh.proj, true);
      product(own.h_rows, T, l.gate_up, sh.gate_up.data(), t, nt);
      barrier.wait();
      activate(m, sh, own, t, nt);
      barrier.wait();
      product(sh.act_rows, T, l.down, sh.proj.data(), t, nt);
      barrier.wait();
    }
    for (int64_t c = 0; c < T * m.C; ++c) own.x[c] = own.x[c] + sh.proj[c];
    if (t == 0)
      for (int64_t r = 0; r < T; ++r) rms_norm_row(own.x.data() + r * m.C, m.final_norm, m.C, m.eps, out + r * m.C);
  }
}

}  // namespace sendlens
