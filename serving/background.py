"""Runs a StratumServer on a private event loop in a background thread (tests, benchmarks, notebooks).

    with BackgroundServer(RuntimeConfig(model="tiny"), ServerOptions(port=0, metrics_port=0)) as bg:
        channel = grpc.insecure_channel(bg.target)
"""
from __future__ import annotations

import asyncio
import threading

from serving.options import ServerOptions
from serving.server import StratumServer
from stratum_jax.config import RuntimeConfig


class BackgroundServer:
    def __init__(self, config: RuntimeConfig, options: ServerOptions, engine=None,
                 start_timeout_s: float = 600.0) -> None:
        self.server = StratumServer(config, options, engine=engine)
        self._start_timeout_s = start_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stratum-grpc", daemon=True)

    @property
    def target(self) -> str:
        return f"{self.server.options.host}:{self.server.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.server.options.metrics_host}:{self.server.metrics_port}/metrics"

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL (with --http-port), e.g. http://127.0.0.1:8000."""
        return f"http://{self.server.options.http_address}:{self.server.http_port}"

    def start(self, load: bool = True) -> "BackgroundServer":
        """Opens the port; with `load`, also loads and warms the model (else it answers UNAVAILABLE)."""
        self._thread.start()
        self.run(self.server.start(load=load), self._start_timeout_s)
        return self

    def run(self, coro, timeout: float | None = None):
        """Runs a coroutine on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def drain(self, grace_s: float | None = None) -> None:
        self.run(self.server.drain(grace_s))

    def stop(self) -> None:
        if self._thread.is_alive():
            self.drain(grace_s=0.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
