"""The serving flags (network, security, limits, prices, profiling, stacks and routing), validated once, next
to RuntimeConfig's."""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import pathlib

from serving.auth import load_keys
from serving.cost import Prices
from serving.routing import DEFAULT_ENTROPY_BITS, DEFAULT_ENTROPY_WINDOW, check_regex
from serving.stacks import BASELINE, LONG_CONTEXT, STRATUM, parse_stacks
from stratum_jax.config import PAGE_SIZE_CLASSES

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
    # The stacks (serving/stacks.py) and the split and routing between them (serving/routing.py).
    stacks: tuple[str, ...] = (STRATUM,)     # --stacks stratum[,baseline][,long-context]
    stratum_weight: float = 1.0              # x-stratum-weight of requests that send none
    baseline_kv_pool_tokens: int | None = None      # the baseline's KV pool; None = the Stratum stack's size
    baseline_kv_memory_share: float | None = None   # ... or this share of the device's memory
    long_context_page_size: int = 128
    long_context_max_context: int | None = None     # None = the model's max_position_embeddings
    long_context_kv_pool_tokens: int | None = None  # None = the Stratum stack's pool size
    route_entropy_bits: float = DEFAULT_ENTROPY_BITS
    route_entropy_window: int = DEFAULT_ENTROPY_WINDOW
    route_long_prompt_tokens: int | None = None     # classify by length: prompts of >= this many tokens
    route_regex: str | None = None                  # classify by text: prompts matching this (case-insensitive)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        if isinstance(self.stacks, str):
            object.__setattr__(self, "stacks", parse_stacks(self.stacks))
        else:
            object.__setattr__(self, "stacks", parse_stacks(",".join(self.stacks)))
        need(isinstance(self.stratum_weight, (int, float)) and 0.0 <= self.stratum_weight <= 1.0,
             f"--stratum-weight must be a number in [0, 1], got {self.stratum_weight!r}")
        need(BASELINE in self.stacks or self.stratum_weight == 1.0,
             f"--stratum-weight {self.stratum_weight} sends traffic to the baseline stack, which is not running: "
             "add baseline to --stacks (e.g. --stacks stratum,baseline)")
        need(self.baseline_kv_pool_tokens is None or self.baseline_kv_memory_share is None,
             "--baseline-kv-pool-tokens and --baseline-kv-memory-share both size the baseline's KV pool: give one")
        need(self.baseline_kv_pool_tokens is None or self.baseline_kv_pool_tokens > 0,
             f"--baseline-kv-pool-tokens must be a positive integer, got {self.baseline_kv_pool_tokens!r}")
        need(self.baseline_kv_memory_share is None or 0.0 < self.baseline_kv_memory_share < 1.0,
             f"--baseline-kv-memory-share must lie in (0, 1), got {self.baseline_kv_memory_share!r}")
        need(self.long_context_page_size in PAGE_SIZE_CLASSES,
             f"--long-context-page-size must be one of {PAGE_SIZE_CLASSES}, got {self.long_context_page_size!r}")
        for flag, value in (("--long-context-max-context", self.long_context_max_context),
                            ("--long-context-kv-pool-tokens", self.long_context_kv_pool_tokens),
                            ("--route-long-prompt-tokens", self.route_long_prompt_tokens)):
            need(value is None or (isinstance(value, int) and value > 0),
                 f"{flag} must be a positive integer, got {value!r}")
        need(isinstance(self.route_entropy_bits, (int, float)) and self.route_entropy_bits >= 0,
             f"--route-entropy-bits must be a number >= 0, got {self.route_entropy_bits!r}")
        need(isinstance(self.route_entropy_window, int) and self.route_entropy_window >= 1,
             f"--route-entropy-window must be an integer >= 1, got {self.route_entropy_window!r}")
        check_regex(self.route_regex)
        classifies = self.route_long_prompt_tokens is not None or bool(self.route_regex)
        need(not classifies or LONG_CONTEXT in self.stacks,
             "--route-long-prompt-tokens and --route-regex route to the long-context pool, which is not running: "
             "add long-context to --stacks")

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
        for flag, path, marker in (("--tls-cert", self.tls_cert, "CERTIFICATE-----"),
                                   ("--tls-key", self.tls_key, "PRIVATE KEY-----")):
            if path is not None:
                try:
                    text = pathlib.Path(path).read_bytes().decode("ascii", "replace")
                except OSError as e:
                    raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
                need(marker in text, f"{flag} {path}: not a PEM file with a '-----BEGIN ...{marker}' block")
        if self.keys_file is not None:
            load_keys(self.keys_file)            # a file with no usable key: its ValueError names file and line
        # Fixed ports that would bind the same address twice (jax's profiler binds every interface).
        ports = [(flag, value, host) for flag, value, host in (
            ("--port", self.port, self.host), ("--metrics-port", self.metrics_port, self.metrics_host),
            ("--http-port", self.http_port, self.http_address), ("--profile-port", self.profile_port, "0.0.0.0"))
            if value > 0]
        for i, (flag, value, host) in enumerate(ports):
            for other, other_value, other_host in ports[i + 1:]:
                need(value != other_value or (host != other_host and not {host, other_host} & _WILDCARDS),
                     f"{flag} and {other} are both {value}: give each its own port (or 0 for any free one)")
        for field in dataclasses.fields(self.prices):
            value = getattr(self.prices, field.name)
            need(math.isfinite(value), f"--{field.name.replace('_', '-')} must be a finite number >= 0, got {value!r}")
        for flag, value, stack in (("--baseline-kv-pool-tokens", self.baseline_kv_pool_tokens, BASELINE),
                                   ("--baseline-kv-memory-share", self.baseline_kv_memory_share, BASELINE),
                                   ("--long-context-max-context", self.long_context_max_context, LONG_CONTEXT),
                                   ("--long-context-kv-pool-tokens", self.long_context_kv_pool_tokens, LONG_CONTEXT)):
            need(value is None or stack in self.stacks,
                 f"{flag} sizes the {stack} stack, which is not running: add {stack} to --stacks or drop {flag}")

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

        g = parser.add_argument_group("stacks and routing")
        g.add_argument("--stacks", default=",".join(d.stacks),
                       help="the stacks this server runs, over one copy of the weights: stratum (always), baseline "
                            "(vLLM-like: FCFS, 16-token pages, LRU, bf16 KV, recompute), long-context (a pool with "
                            "larger pages and a higher context cap), e.g. stratum,baseline")
        g.add_argument("--stratum-weight", type=float, default=d.stratum_weight,
                       help="share of requests without x-stratum-weight that go to the Stratum stack, in [0, 1] "
                            "(the rest go to the baseline)")
        g.add_argument("--baseline-kv-pool-tokens", type=int, default=None, metavar="TOKENS",
                       help="the baseline stack's KV pool (default: as large as the Stratum stack's "
                            "--kv-pool-tokens)")
        g.add_argument("--baseline-kv-memory-share", type=float, default=None, metavar="FRACTION",
                       help="size the baseline's KV pool as this share of the device's memory instead")
        g.add_argument("--long-context-page-size", type=int, default=d.long_context_page_size,
                       help=f"the long-context pool's page size, one of {PAGE_SIZE_CLASSES}")
        g.add_argument("--long-context-max-context", type=int, default=None, metavar="TOKENS",
                       help="the long-context pool's context cap (default: the model's max_position_embeddings)")
        g.add_argument("--long-context-kv-pool-tokens", type=int, default=None, metavar="TOKENS",
                       help="the long-context pool's KV pool (default: as large as --kv-pool-tokens)")
        g.add_argument("--route-entropy-bits", type=float, default=d.route_entropy_bits, metavar="BITS",
                       help="classify requests into pools only while the entropy of recent prompt lengths (log2 "
                            "bins, stratum_prompt_length_entropy_bits) is above this")
        g.add_argument("--route-entropy-window", type=int, default=d.route_entropy_window, metavar="REQUESTS",
                       help="recent prompts whose lengths make the entropy")
        g.add_argument("--route-long-prompt-tokens", type=int, default=None, metavar="TOKENS",
                       help="when classifying: prompts of at least this many tokens go to the long-context pool")
        g.add_argument("--route-regex", default=None, metavar="REGEX",
                       help="when classifying: prompts matching this (case-insensitive, e.g. 'contract|agreement|"
                            "nda') go to the long-context pool")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerOptions":
        prices = Prices(args.gpu_usd_per_hour, args.transfer_usd_per_gb, args.hbm_usd_per_gb_hour)
        names = {f.name for f in dataclasses.fields(cls)} - {"prices"}
        return cls(prices=prices, **{k: v for k, v in vars(args).items() if k in names})


_WILDCARDS = {"0.0.0.0", "::", ""}     # hosts that bind every interface


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
