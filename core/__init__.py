"""sendlens' engine: a Llama-style model, paged KV cache, scheduler, sampler and engine loop.

The public API follows vLLM's: LLM, SamplingParams, RequestOutput.
"""

from .config import EngineConfig, ModelConfig, Scheduling
from .engine import LLMEngine
from .engine_loop import EngineLoop, RequestStream
from .errors import ContextLengthExceeded, EngineOverloaded, InvalidParameter
from .llm import LLM
from .outputs import Candidate, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "Candidate", "LLMEngine",
    "EngineLoop", "RequestStream", "EngineConfig", "ModelConfig", "Scheduling",
    "InvalidParameter", "ContextLengthExceeded", "EngineOverloaded",
]
