"""A small command line for the engine.

    python -m core generate "Once upon a time" --max-tokens 40
    python -m core chat
"""

import argparse
import sys

from core.engine.sampling_params import SamplingParams
from core.errors import InvalidParameter
from core.llm import LLM


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="a name from toy_models (default: smollm2-135m)")
    p.add_argument("--max-tokens", type=int, default=SamplingParams.max_tokens,
                   help=f"default: {SamplingParams.max_tokens}, SamplingParams' own default")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def params_from(args) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=args.stop)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core", description="Run sendlens' engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a prompt")
    gen.add_argument("prompt")
    sampling_args(gen)
    chat = sub.add_parser("chat", help="talk to the model (empty line or Ctrl-D ends)")
    sampling_args(chat)
    args = parser.parse_args(argv)
    try:
        params = params_from(args)
        llm = LLM(args.model)
        if args.command == "generate":
            out = llm.generate(args.prompt, params)[0]
            print(args.prompt + out.text)
            m = out.metrics
            print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, TTFT {m.ttft_s * 1000:.0f} ms, "
                  f"TPOT {(m.tpot_s or 0) * 1000:.0f} ms]", file=sys.stderr)
            return 0
        messages = []
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                return 0
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            out = llm.chat(messages, params)
            print(f"model> {out.text}")
            print(f"[{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} from the prefix cache, "
                  f"{len(out.token_ids)} generated, finish: {out.finish_reason}]", file=sys.stderr)
            messages.append({"role": "assistant", "content": out.text})
    except InvalidParameter as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
