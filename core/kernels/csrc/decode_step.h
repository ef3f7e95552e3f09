// A decode step of one token through every layer in one parallel region (decode_step.cpp), for
// Q4_1 weights on the engine's own kernel: what the C++ decoder runs when a step carries a single
// token, the case of one reader decoding alone.
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

// Where the token goes: its id, position, KV slot and row of the block tables, and every layer's
// pools (layer i's keys at k + i * layer_stride, its values at v + i * layer_stride).
struct StepToken {
  int64_t id, position, slot, seq;
  float* k;
  float* v;
  int64_t layer_stride;
  KvPools pools;  // the block tables and the pools' shape (its k and v are set per layer)
};

// The token's final hidden state, normalized (Transformer.forward's row) -> out (C,). The caller
// has checked every index (the id, the position against the tables, the slot, the blocks).
void decode_step(const StepModel& model, const StepToken& token, float* out);

}  // namespace sendlens
