"""The engine: requests in, one step at a time, outputs out (after vLLM's and nano-vllm's engine/).

llm_engine (LLMEngine: schedule -> run -> postprocess -> record), engine_loop (the engine on a
thread of its own, for the web app), scheduler and block_manager (which sequences run, where
their KV blocks live), sequence, sampling_params, outputs, trace and step_recorder (each step's
record), view (the one read-only window the app reads the engine through).
"""
