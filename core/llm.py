"""LLM: the offline API, in vLLM's shape.

    llm = LLM("smollm2-135m")
    outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outputs[0].text)

generate() queues every prompt and steps the engine until all are done, so the prompts are
batched together exactly as concurrent users' requests are.
"""

from dataclasses import fields

from core.config import EngineConfig
from core.engine.beam_search import BeamSearchOutput, BeamSearchParams
from core.engine.llm_engine import LLMEngine
from core.engine.outputs import RequestOutput
from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter
from core.model.tokenizer import validate_messages


class LLM:
    def __init__(self, model: str = "smollm2-135m", *, loaded=None, **engine_settings):
        """engine_settings: any field of EngineConfig, with its defaults there: block_size,
        num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
        enable_chunked_prefill, scheduling, ... loaded: an already loaded model (toy_models) to share."""
        unknown = sorted(set(engine_settings) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise InvalidParameter(unknown[0], "is not an engine setting (see core.config.EngineConfig)")
        config = EngineConfig(model=model, **engine_settings)
        self.engine = LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. One output per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise InvalidParameter("prompts", "must be a string, a list of token ids, or a list of them")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidParameter("sampling_params", f"has {len(params)} entries for {len(prompts)} prompts")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for seq in seqs:
            self.engine.add_sequence(seq)
        return self._run({s.request_id for s in seqs}, [s.request_id for s in seqs])

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """prompts: as generate's. One BeamSearchOutput per prompt: its beams, best first, each
        with token_ids, text and cum_logprob (vLLM's beam_search; see core/engine/beam_search.py)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise InvalidParameter("prompts", "must be a string, a list of token ids, or a list of them")
        groups = [self.engine.add_beam_search(p, params) for p in prompts]
        while not all(g.is_finished for g in groups):
            self.engine.step()
        return [g.result for g in groups]

    def chat(self, messages, sampling_params: SamplingParams | None = None):
        """messages: [{"role": ..., "content": ...}, ...] -> one RequestOutput (or a list of
        conversations -> a list of outputs). The model's chat template adds the assistant prompt."""
        many = bool(messages) and isinstance(messages[0], list)
        conversations = messages if many else [messages]
        prompts = [self.tokenizer.apply_chat_template(validate_messages(c)) for c in conversations]
        outputs = self.generate(prompts, sampling_params)
        return outputs if many else outputs[0]

    def _run(self, pending: set[str], order: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    done[output.request_id] = output
                    pending.discard(output.request_id)
        return [done[rid] for rid in order]
