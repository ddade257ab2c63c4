"""Command-line settings with `LLMMESH_*` environment defaults.

Every flag `--foo-bar` of every service defaults to the environment variable
`LLMMESH_FOO_BAR` when set, so a container can be configured by environment
alone while a person can still override anything on the command line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any


def env_name(flag: str) -> str:
    return "LLMMESH_" + flag.lstrip("-").replace("-", "_").upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose defaults come from `LLMMESH_*` variables."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        long_flags = [a for a in args if isinstance(a, str) and a.startswith("--")]
        if long_flags:
            var = env_name(long_flags[0])
            raw = os.environ.get(var)
            if raw is not None:
                action = kwargs.get("action")
                if action == "store_true":
                    kwargs["default"] = raw.lower() in ("1", "true", "yes", "on")
                elif "type" in kwargs and callable(kwargs["type"]):
                    kwargs["default"] = kwargs["type"](raw)
                else:
                    kwargs["default"] = raw
            help_text = kwargs.get("help") or ""
            if help_text != argparse.SUPPRESS:
                kwargs["help"] = f"{help_text} [env {var}]".strip()
        return super().add_argument(*args, **kwargs)


@dataclass(frozen=True)
class ServerOptions:
    """What the shared bootstrap needs to serve one service."""

    service: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    grace_seconds: float = 30.0
    drain_seconds: float = 0.0
    max_message_bytes: int = 4 * 1024 * 1024
    handshake_timeout_ms: int = 10_000
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace and drain seconds must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags every service takes."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port (0 = any free)")
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus HTTP port (0 = any free; unset = off)"
    )
    parser.add_argument(
        "--grace-seconds", type=float, default=30.0, help="how long in-flight RPCs may run on shutdown"
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        help="how long to report NOT_SERVING before refusing new RPCs on shutdown",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=4 * 1024 * 1024, help="largest gRPC message accepted"
    )
    parser.add_argument(
        "--handshake-timeout-ms",
        type=int,
        default=10_000,
        help="drop connections that do not finish the handshake",
    )
    parser.add_argument("--tls-cert", default=None, help="PEM server certificate (enables TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None, help="PEM CA for client certificates (enables mTLS)")
    parser.add_argument("--log-level", default="INFO", help="logging level")


def server_options(service: str, args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        service=service,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grace_seconds=args.grace_seconds,
        drain_seconds=args.drain_seconds,
        max_message_bytes=args.max_message_bytes,
        handshake_timeout_ms=args.handshake_timeout_ms,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        log_level=args.log_level,
    )
