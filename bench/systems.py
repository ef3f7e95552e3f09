"""The systems the benchmark compares, behind one small interface.

Each system runs the same three measurements on the same token ids:
- `decode(prompt, n)`: one request alone; -> output tokens/s after the first (1 / TPOT).
  Ours also runs it with speculative decoding (`decode_ngram`, `decode_self`: prompt lookup and
  self-speculation, SPECULATIVE_TOKENS draft tokens a pass; core/engine/speculative.py).
- `prefill(prompt)`: one request, one output token; -> prompt tokens/s (len / TTFT).
- `serve(prompts, n)`: every prompt at once; -> vLLM's serving metrics (benchmark_serving.py):
  output tokens/s over the whole run, TTFT and TPOT per request (p50, p99).

Ours runs through LLMEngine (continuous batching, prefix caching off so that every repeat
computes its prompt); transformers through `generate()` with a static batch of the same
prompts (all the same length, so no padding); llama.cpp through llama-cpp-python, one sequence.
"""

import time

import numpy as np
import torch

SPECULATIVE_TOKENS = 4   # k of the speculative rows


def serving_metrics(start: float, token_times: list[list[float]]) -> dict:
    """token_times: per request, when each output token was ready (perf_counter seconds)."""
    end = max(t[-1] for t in token_times)
    ttft = [t[0] - start for t in token_times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times if len(t) > 1]
    total = sum(len(t) for t in token_times)
    return {
        "output_tok_s": total / (end - start),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_s": float(np.percentile(tpot, 50)), "tpot_p99_s": float(np.percentile(tpot, 99)),
    }


class Ours:
    def __init__(self, loaded, weight_format: str, num_threads: int):
        from core import EngineConfig, LLMEngine

        self.name = f"ours {weight_format}"
        self.weight_format = weight_format
        self.engine = LLMEngine(EngineConfig(model="smollm2-135m", weight_format=weight_format,
                                             enable_prefix_caching=False, max_num_seqs=64,
                                             num_threads=num_threads), loaded)
        self.engine.warmup(touch_pool=True)  # steady state, as llama.cpp's KV buffer (cleared at start)

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every linear layer and the LM head."""
        return self.engine.view.model.decode_weight_bytes()

    def _run(self, prompts, n, speculation=None):
        from core import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, speculation=speculation,
                                num_speculative_tokens=SPECULATIVE_TOKENS if speculation else None)
        start = time.perf_counter()
        seqs = [self.engine.add_request(list(p), params, arrival_time=start) for p in prompts]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return start, [s.metrics.token_times for s in seqs]

    def decode(self, prompt, n, speculation=None):
        _, (times,) = self._run([prompt], n, speculation)
        return (len(times) - 1) / (times[-1] - times[0])

    def decode_ngram(self, prompt, n):
        return self.decode(prompt, n, "ngram")

    def decode_self(self, prompt, n):
        return self.decode(prompt, n, "self")

    def prefill(self, prompt):
        start, (times,) = self._run([prompt], 1)
        return len(prompt) / (times[0] - start)

    def serve(self, prompts, n):
        return serving_metrics(*self._run(prompts, n))


class Transformers:
    """transformers' LlamaForCausalLM from the same GGUF, `generate()` greedy, static batches."""

    def __init__(self, dtype: torch.dtype):
        import warnings

        import transformers
        from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

        from toy_models.gguf_loader import find_gguf

        path = find_gguf()
        transformers.logging.set_verbosity_error()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=dtype).eval()
        self.name = f"transformers {str(dtype).removeprefix('torch.').replace('float32', 'fp32').replace('bfloat16', 'bf16')}"
        self.times: list[float] = []
        times = self.times

        class Clock(LogitsProcessor):  # called once per generated token, before it is chosen
            def __call__(self, input_ids, scores):
                times.append(time.perf_counter())
                return scores

        self.processors = LogitsProcessorList([Clock()])
        self._run([[1] * 8], 2)

    def _run(self, prompts, n):
        ids = torch.tensor(prompts)
        self.times.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, logits_processor=self.processors, pad_token_id=2)
        end = time.perf_counter()
        # token i is ready when step i+1 starts; the last when generate returns
        ready = self.times[1:] + [end]
        return start, [list(ready)] * len(prompts)

    def decode(self, prompt, n):
        _, (times,) = self._run([prompt], n)
        return (len(times) - 1) / (times[-1] - times[0])

    def prefill(self, prompt):
        start, (times,) = self._run([prompt], 1)
        return len(prompt) / (times[0] - start)

    def serve(self, prompts, n):
        return serving_metrics(*self._run(prompts, n))


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the GGUF file itself (Q4_1, Q8_0 embedding)."""

    def __init__(self, num_threads: int, n_ctx: int):
        from llama_cpp import Llama

        from toy_models.gguf_loader import find_gguf

        self.name = "llama.cpp Q4_1"
        self.llm = Llama(model_path=str(find_gguf()), n_threads=num_threads, n_threads_batch=num_threads,
                         n_ctx=n_ctx, n_batch=512, verbose=False, logits_all=False)
        self.decode([1] * 8, 2)

    def _greedy(self) -> int:
        """The argmax of the last evaluated token's logits (llama.cpp keeps only those)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def decode(self, prompt, n):
        self.llm.reset()
        self.llm.eval(list(prompt))
        times = []
        token = self._greedy()
        for _ in range(n):
            times.append(time.perf_counter())
            self.llm.eval([token])
            token = self._greedy()
        return (len(times) - 1) / (times[-1] - times[0])

    def prefill(self, prompt):
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(prompt))
        self._greedy()
        return len(prompt) / (time.perf_counter() - start)
