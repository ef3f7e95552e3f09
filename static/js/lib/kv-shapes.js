// The KV cache's size from a model's shape: the presets from the models' public configs
// (static/data/models.json, with each source), the number formats, and the values a token leaves
// in the cache. One file that the KV memory calculator, the economics widget and their server side
// (app/widgets/kv_memory.py) all read. MLA (DeepSeek-V2/V3) caches kv_lora_rank + qk_rope_head_dim
// values per layer and token instead of K and V per head.

import MODELS from "../../data/models.json" with { type: "json" };

export const PRESETS = MODELS.presets;

export const DTYPES = MODELS.dtypes;

// Values the cache holds per token: K and V for every layer and KV head, or MLA's latent + RoPE key.
export function valuesPerToken(shape) {
  if (shape.mla) return shape.layers * (shape.mla.latent + shape.mla.rope);
  return 2 * shape.layers * shape.kvHeads * shape.head;
}
