"""sendlens' engine: a Llama-style model, paged KV cache, scheduler, sampler and engine loop.

The public API follows vLLM's: LLM, SamplingParams, RequestOutput.
"""

from core.config import EngineConfig, ModelConfig, Scheduling
from core.engine.engine_loop import EngineLoop, RequestStream
from core.engine.llm_engine import LLMEngine
from core.engine.outputs import Candidate, RequestMetrics, RequestOutput
from core.engine.sampling_params import SamplingParams
from core.errors import ContextLengthExceeded, EngineOverloaded, InvalidParameter
from core.llm import LLM

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "Candidate", "LLMEngine",
    "EngineLoop", "RequestStream", "EngineConfig", "ModelConfig", "Scheduling",
    "InvalidParameter", "ContextLengthExceeded", "EngineOverloaded",
]
