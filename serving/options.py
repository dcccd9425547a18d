"""The serving flags (network, security, limits, prices, profiling), validated once, next to RuntimeConfig's."""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import pathlib

from serving.cost import Prices

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"              # loopback by default: exposing the server is an explicit choice
    port: int = 50051                    # 0 = any free port (the bound port is logged)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9400             # Prometheus /metrics; 0 = any free port, -1 = off
    http_host: str | None = None         # the OpenAI-compatible HTTP endpoint's address; None = `host`
    http_port: int = -1                  # its port; 0 = any free port (logged), -1 = off
    profile_port: int = -1               # jax.profiler.start_server; -1 = off
    profile_dir: str = "profiles"        # Profile RPC traces go in sub-directories of this
    keys_file: str | None = None         # API keys, one a line; None = no authentication
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES   # largest request gRPC accepts
    drain_grace_s: float = 30.0          # how long in-flight requests may run after SIGTERM
    prices: Prices = dataclasses.field(default_factory=Prices)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        need(-1 <= self.metrics_port <= 65535, f"--metrics-port must be in [-1, 65535], got {self.metrics_port}")
        need(-1 <= self.http_port <= 65535, f"--http-port must be in [-1, 65535] (-1 = off), got {self.http_port}")
        need(-1 <= self.profile_port <= 65535 and self.profile_port != 0,
             f"--profile-port must be a port in [1, 65535] (or -1 = off), got {self.profile_port}")
        need(self.max_message_bytes >= 1024, f"--max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        need(self.drain_grace_s >= 0, f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        need((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key go together: give both")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--keys-file", self.keys_file)):
            need(path is None or pathlib.Path(path).is_file(), f"{flag} {path}: no such file")

    @property
    def is_loopback(self) -> bool:
        """Whether every port this server opens for requests (gRPC, and HTTP when on) is on loopback."""
        hosts = [self.host] + ([self.http_address] if self.http_port >= 0 else [])
        return all(_is_loopback(h) for h in hosts)

    @property
    def http_address(self) -> str:
        return self.host if self.http_host is None else self.http_host

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerOptions()
        g = parser.add_argument_group("serving")
        g.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
        g.add_argument("--port", type=int, default=d.port, help="gRPC port; 0 = any free port")
        g.add_argument("--metrics-host", default=d.metrics_host)
        g.add_argument("--metrics-port", type=int, default=d.metrics_port,
                       help="Prometheus port; 0 = any free port, -1 = off")
        g.add_argument("--http-port", type=int, default=d.http_port,
                       help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                            "/v1/models, /health, /metrics) on this port; 0 = any free port, -1 = off (default)")
        g.add_argument("--http-host", default=d.http_host, help="address of the HTTP API (default: --host)")
        g.add_argument("--profile-port", type=int, default=d.profile_port,
                       help="start jax.profiler.start_server on this port (-1 = off); jax binds it on "
                            "every interface, so keep it behind a firewall")
        g.add_argument("--profile-dir", default=d.profile_dir, help="where Profile RPC traces are written")
        g.add_argument("--keys-file", default=d.keys_file,
                       help="API keys, one per line; requires x-api-key (gRPC) or Authorization: Bearer (HTTP)")
        g.add_argument("--tls-cert", default=d.tls_cert, help="PEM certificate chain (with --tls-key)")
        g.add_argument("--tls-key", default=d.tls_key, help="PEM private key (with --tls-cert)")
        g.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                       help="largest request message accepted (RESOURCE_EXHAUSTED above it)")
        g.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s,
                       help="on SIGTERM, how long in-flight requests may still run")
        p = Prices()
        g.add_argument("--gpu-usd-per-hour", type=float, default=p.gpu_usd_per_hour, help="cost model: GPU price")
        g.add_argument("--transfer-usd-per-gb", type=float, default=p.transfer_usd_per_gb,
                       help="cost model: network transfer price")
        g.add_argument("--hbm-usd-per-gb-hour", type=float, default=p.hbm_usd_per_gb_hour,
                       help="cost model: price of holding 1 GB of HBM for an hour")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerOptions":
        prices = Prices(args.gpu_usd_per_hour, args.transfer_usd_per_gb, args.hbm_usd_per_gb_hour)
        names = {f.name for f in dataclasses.fields(cls)} - {"prices"}
        return cls(prices=prices, **{k: v for k, v in vars(args).items() if k in names})


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
