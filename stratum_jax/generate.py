"""`python -m stratum_jax.generate`: offline generation from the command line, as one continuous batch.

    python -m stratum_jax.generate --model tiny --prompt "Hello" --prompt "Bonjour" --max-tokens 32
    python -m stratum_jax.generate --model /path/to/hf_dir --prompt-ids 1,2,3 --logprobs 5 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from stratum_jax.config import DEFAULT_COMPILATION_CACHE_DIR, RuntimeConfig
from stratum_jax.request import InvalidRequestError, SamplingParams


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stratum_jax.generate", description=__doc__.splitlines()[0])
    RuntimeConfig.add_cli_args(p)
    p.set_defaults(compilation_cache_dir=DEFAULT_COMPILATION_CACHE_DIR)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    src.add_argument("--prompt-ids", action="append", type=_parse_ids, help="comma-separated token ids")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", dest="request_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=0, help="top-K logprobs per generated token")
    p.add_argument("--prompt-logprobs", type=int, default=0, help="top-K logprobs per prompt token")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p


def _lp_json(entries):
    if entries is None:
        return None
    return [[{"token_id": e.token_id, "logprob": e.logprob} for e in pos] for pos in entries]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = RuntimeConfig.from_cli_args(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.request_seed, stop_strings=tuple(args.stop),
                                ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                                prompt_logprobs=args.prompt_logprobs)
        params.validate(max_tokens_cap=config.max_tokens_cap)
    except ValueError as e:                     # InvalidRequestError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2

    from stratum_jax.compile_watch import enable_persistent_cache
    from stratum_jax.distributed import init_distributed
    from stratum_jax.engine import Engine       # heavy imports after the flags are known to be good
    init_distributed(config)                    # before anything touches a jax backend
    enable_persistent_cache(config.compilation_cache_dir)
    from stratum_jax.model.loader import CheckpointError
    try:
        engine = Engine(config)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if args.prompt_ids:
        prompts = args.prompt_ids
    elif args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], None) for t in args.prompt]
    else:
        prompts = [tok.encode(t) for t in args.prompt]
    try:
        results = engine.generate(prompts, params)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for res in results:
        if args.json:
            print(json.dumps({"token_ids": res.token_ids, "text": res.text,
                              "finish_reason": res.finish_reason.value,
                              "logprobs": _lp_json(res.logprobs),
                              "prompt_logprobs": _lp_json(res.prompt_logprobs)}))
        else:
            print(res.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
