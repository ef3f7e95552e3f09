// A step of a few tokens through every layer in one parallel region (decode_step.cpp), for Q4_1
// weights on the engine's own kernel: what the C++ decoder runs when a step carries at most
// MAX_STEP_TOKENS tokens (one reader decoding alone, a few readers, a speculative verify pass).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#include "row_kernels.h"

namespace sendlens {

// One Q4_1 weight as gemm.pack_q4_1_native packs it: panels of 16 output columns.
struct Q4Weight {
  const uint8_t* nibbles;  // (panels, K/4, 32)
  const at::Half* dm;      // (panels, K/32, 2, 16)
  int64_t panels;
};

struct StepLayer {
  const float* attn_norm;  // (C,)
  const float* mlp_norm;   // (C,)
  Q4Weight qkv, o, gate_up, down;
};

struct StepModel {
  const float* embed;       // (V, C)
  const float* final_norm;  // (C,)
  const float* cos;         // (positions, D)
  const float* sin;
  int64_t C, I, H, Hkv, D;
  float eps;
  std::vector<StepLayer> layers;
};

// The most tokens a step runs in one region; more take the tensor path, whose products tile rows.
constexpr int64_t MAX_STEP_TOKENS = 8;

// The step's T tokens: each one's id, position, KV slot and row of the block tables, and every
// layer's pools (layer i's keys at k + i * layer_stride, its values at v + i * layer_stride; in
// bfloat16 pools, k16 and v16 instead, k and v null).
struct StepTokens {
  int64_t T;
  const int64_t* ids;
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* seqs;
  float* k;
  float* v;
  int64_t layer_stride;
  KvPools pools;  // the block tables and the pools' shape (its k and v are set per layer)
  uint16_t* k16 = nullptr;
  uint16_t* v16 = nullptr;
};

// The tokens' final hidden states, normalized (Transformer.forward's rows) -> out (T, C). The
// caller has checked every index (the ids, the positions against the tables, the slots, the blocks).
void decode_step(const StepModel& model, const StepTokens& tokens, float* out);

}  // namespace sendlens
