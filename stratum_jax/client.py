"""`python -m stratum_jax.client`: a small gRPC client of stratum.v1 for a quick try.

    python -m stratum_jax.client "Tell me a story" --stream --max-tokens 64
    python -m stratum_jax.client --health
    python -m stratum_jax.client --metrics
    python -m stratum_jax.client --count-tokens "How long is this?"
    python -m stratum_jax.client --cost "How much is this?" --max-tokens 256
    python -m stratum_jax.client --profile 20 --profile-name warm-decode

The API key comes from --api-key or $STRATUM_API_KEY. Exit status: 0 on success, 1 on a gRPC error
(its status and message go to stderr), 2 on bad flags.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf import json_format

from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stratum_jax.client", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="the user message to send")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--health", action="store_true", help="print the server's Health")
    action.add_argument("--metrics", action="store_true", help="print a GetMetrics snapshot")
    action.add_argument("--count-tokens", action="store_true", help="count the prompt's input tokens")
    action.add_argument("--cost", action="store_true", help="estimate the cost of the prompt + --max-tokens")
    action.add_argument("--profile", type=int, metavar="STEPS", help="capture the next STEPS engine steps")
    parser.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--system", default="", help="system prompt")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop sequence (repeatable)")
    parser.add_argument("--model", default="", help="model name the server must be serving")
    parser.add_argument("--timeout", type=float, help="deadline in seconds")
    parser.add_argument("--api-key", default=os.environ.get("STRATUM_API_KEY"), help="default: $STRATUM_API_KEY")
    parser.add_argument("--route", help="x-stratum-route header: default or long-context")
    parser.add_argument("--weight", help="x-stratum-weight header: a number in [0, 1]")
    parser.add_argument("--tls-ca", help="PEM root certificate(s): connect with TLS")
    parser.add_argument("--profile-name", default="", help="sub-directory name of the profile on the server")
    parser.add_argument("--profile-timeout", type=float, default=0.0,
                        help="stop the capture after this many seconds even if fewer steps ran (server default 30)")
    return parser


# Integer flags: the values a request can carry (the server checks its own, tighter limits within these; a
# --max-tokens below 1 is sent, and the server's INVALID_ARGUMENT says what it takes).
_INT_RANGES = (("max_tokens", "--max-tokens", 1, 2**31 - 1), ("top_k", "--top-k", 0, 2**31 - 1),
               ("seed", "--seed", 0, 2**63 - 1), ("profile", "--profile", 1, 2**32 - 1))


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """parser.error for values no request can carry, and a --tls-ca that is no readable PEM certificate."""
    for name, flag, lo, hi in _INT_RANGES:
        value = getattr(args, name)
        if value is not None and (value > hi or (value < lo and name != "max_tokens")):
            parser.error(f"{flag} must be an integer in [{lo}, {hi}], got {value}")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        parser.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if args.tls_ca is not None:
        try:
            with open(args.tls_ca, "rb") as f:
                pem = f.read()
        except OSError as e:
            parser.error(f"--tls-ca {args.tls_ca}: cannot read it ({e.strerror})")
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            parser.error(f"--tls-ca {args.tls_ca}: not a PEM certificate (no '-----BEGIN CERTIFICATE-----' line)")


def _metadata(args) -> list[tuple[str, str]]:
    md = []
    if args.api_key:
        md.append(("x-api-key", args.api_key))
    if args.route:
        md.append(("x-stratum-route", args.route))
    if args.weight:
        md.append(("x-stratum-weight", args.weight))
    return md


def _channel(args) -> grpc.Channel:
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(f.read()))
    return grpc.insecure_channel(args.target)


def _messages_request(args) -> pb.MessagesRequest:
    request = pb.MessagesRequest(model=args.model, system=args.system, max_tokens=args.max_tokens,
                                 messages=[pb.Message(role="user", content=args.prompt)],
                                 stop_sequences=args.stop)
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    return request


def _print_json(message) -> None:
    print(json_format.MessageToJson(message, always_print_fields_with_no_presence=True))


def _generate(stub, args, md) -> None:
    text, stop = [], None
    for event in stub.Messages(_messages_request(args), metadata=md, timeout=args.timeout):
        kind = event.WhichOneof("event")
        if kind == "delta":
            if args.stream:
                print(event.delta.text, end="", flush=True)
            else:
                text.append(event.delta.text)
        elif kind == "stop":
            stop = event.stop
    if args.stream:
        print()
    else:
        print("".join(text))
    if stop is not None:
        print(stop_summary(stop), file=sys.stderr)


def stop_summary(stop: pb.MessageStop) -> str:
    """The line printed after a reply: why it stopped (labelled, so "[stop: max_tokens]" does not read as a
    token count), then usage and timings."""
    t = stop.timings
    return (f"[stop: {pb.StopReason.Name(stop.stop_reason).lower()}] input {stop.usage.input_tokens} tokens "
            f"({stop.usage.cached_input_tokens} cached), output {stop.usage.output_tokens} tokens; "
            f"queue {t.queue_ms:.1f} ms, ttft {t.ttft_ms:.1f} ms, total {t.total_ms:.1f} ms")


def run(args) -> None:
    md = _metadata(args)
    with _channel(args) as channel:
        stub = pb_grpc.StratumStub(channel)
        if args.health:
            _print_json(stub.Health(pb.HealthRequest(), metadata=md, timeout=args.timeout))
        elif args.metrics:
            _print_json(stub.GetMetrics(pb.GetMetricsRequest(), metadata=md, timeout=args.timeout))
        elif args.profile is not None:
            _print_json(stub.Profile(pb.ProfileRequest(num_steps=args.profile, name=args.profile_name,
                                                       timeout_s=args.profile_timeout),
                                     metadata=md, timeout=args.timeout))
        elif args.count_tokens:
            r = _messages_request(args)
            _print_json(stub.CountTokens(pb.CountTokensRequest(model=r.model, system=r.system,
                                                               messages=r.messages), metadata=md,
                                         timeout=args.timeout))
        elif args.cost:
            r = _messages_request(args)
            _print_json(stub.CostEstimate(pb.CostEstimateRequest(model=r.model, system=r.system,
                                                                 messages=r.messages, max_tokens=r.max_tokens),
                                          metadata=md, timeout=args.timeout))
        else:
            _generate(stub, args, md)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    needs_prompt = not (args.health or args.metrics or args.profile is not None)
    if needs_prompt and args.prompt is None:
        parser.error("give a prompt (or one of --health, --metrics, --profile)")
    if not needs_prompt and args.prompt is not None:
        parser.error(f"--health, --metrics and --profile send no prompt: drop {args.prompt!r} or the flag")
    check_args(parser, args)
    try:
        run(args)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
