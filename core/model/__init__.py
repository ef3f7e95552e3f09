"""The model and what runs it: a Llama-style Transformer (model, attention, moe, linear), its
paged KV cache, the tokenizer and detokenizer, the C++ decoder's wrapper (native_decoder), the
model runner (builds and packs the model and the KV pool, turns a scheduled step into tensors)
and the sampler (logits -> tokens).
"""
