"""`python -m stratum_jax.serve`: the gRPC server (thin: the work is in serving/).

    python -m stratum_jax.serve --model tiny --host 127.0.0.1 --port 50051 --metrics-port 9400

SIGTERM (or Ctrl-C) drains: health turns NOT_SERVING, new requests get UNAVAILABLE, in-flight requests
may finish within --drain-grace-s, and the rest end with UNAVAILABLE. A second signal does not cut the
drain short; it is already bounded.
"""
from __future__ import annotations

import time

_STARTED = time.perf_counter()   # before the heavy imports below (jax, grpc), so that they are timed too

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from serving.options import ServerOptions  # noqa: E402
from serving.server import StratumServer  # noqa: E402
from stratum_jax.compile_watch import enable_persistent_cache  # noqa: E402
from stratum_jax.config import DEFAULT_COMPILATION_CACHE_DIR, RuntimeConfig  # noqa: E402

log = logging.getLogger("stratum_jax.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stratum_jax.serve",
                                     description="Serve a model over gRPC (stratum.v1).")
    RuntimeConfig.add_cli_args(parser)
    parser.set_defaults(compilation_cache_dir=DEFAULT_COMPILATION_CACHE_DIR)
    ServerOptions.add_cli_args(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


async def serve(config: RuntimeConfig, options: ServerOptions) -> int:
    server = StratumServer(config, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(load=False)
    except (OSError, RuntimeError, ValueError) as e:   # a bind failure: gRPC's RuntimeError, HTTP's ValueError,
        o = options                                   # the metrics server's OSError
        log.error("could not open the server's ports (%s). Check --host %s --port %d, --metrics-host %s "
                  "--metrics-port %d and --http-host %s --http-port %d: addresses this machine has and free ports "
                  "(0 picks one; -1 turns metrics or HTTP off)", str(e).rstrip("."), o.host, o.port,
                  o.metrics_host, o.metrics_port, o.http_address, o.http_port)
        await server.drain(grace_s=0)      # closes whatever did open
        return 2
    load = asyncio.create_task(server.load())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        log.error("could not load the model: %s", load.exception())
        await server.drain(grace_s=0)
        return 1
    await stopped
    if not load.done():
        log.info("stopping before the model finished loading")
    await server.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = RuntimeConfig.from_cli_args(args)
        options = ServerOptions.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    if config.num_processes > 1:
        # Every process would need every request (tensor_parallel.py): gRPC reaches only one of them.
        parser.error("--num-processes > 1 is for generate and benchmarks/e2e_decode.py; the server runs on "
                     "one host (use --tensor-parallel N over its GPUs)")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("imports took %.2f s", time.perf_counter() - _STARTED)
    enable_persistent_cache(config.compilation_cache_dir)
    return asyncio.run(serve(config, options))


if __name__ == "__main__":
    sys.exit(main())
