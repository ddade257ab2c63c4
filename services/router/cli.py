"""The router's command line and bootstrap (``python -m services.router`` runs it once the gRPC I/O is chosen)."""

from __future__ import annotations

import dataclasses

from services.common.server import run
from services.common.settings import (
    ROUTER_PORT,
    EnvArgumentParser,
    add_flags,
    add_server_args,
    from_flags,
    server_options,
)
from services.router import grpc_io
from services.router.admission.tls import DialTls
from services.router.api.openai.app import FrontLimits
from services.router.api.openai.listener import HTTP_OFF, HttpSettings
from services.router.placement.outliers import EjectionConfig
from services.router.runtime import RouterRuntime, RouterSettings, static_replicas
from services.router.streams.relay import RelayConfig
from services.router.tasks.settings import TaskSettings, add_task_arguments


def main(argv: list[str] | None = None) -> None:
    parser = EnvArgumentParser(
        prog="python -m services.router",
        description="The public front door, balancing turns over inference replicas.",
        epilog=f"gRPC I/O: {grpc_io.ENV}=poller (default) or eventengine, read at start (see services/router/grpc_io.py).",
    )
    add_server_args(parser, default_port=ROUTER_PORT)
    add = parser.add_argument
    add("--replicas", default="", help="inference replicas, host:port,host:port")
    add_flags(parser, RouterSettings)
    # The relay's and outlier detection's own settings: a few of their fields are flags, defaults theirs.
    for name, kind, default, help_text in (
        (
            "--max-attempts",
            int,
            RelayConfig.max_attempts,
            "replicas tried per turn (retries + failovers + 1)",
        ),
        (
            "--ttft-timeout-s",
            float,
            RelayConfig.ttft_timeout_s,
            "no first token this long: try another replica",
        ),
        ("--stall-timeout-s", float, RelayConfig.stall_timeout_s, "no token this long mid-stream: fail over"),
        (
            "--ejection-failures",
            int,
            EjectionConfig.consecutive_failures,
            "consecutive failures that eject a replica",
        ),
        (
            "--ejection-base-s",
            float,
            EjectionConfig.base_ejection_s,
            "ejection time, times the ejection count",
        ),
    ):
        add(name, type=kind, default=default, help=help_text)
    add(
        "--replica-tls-ca", default=None, help="PEM CA that signed the replicas' certificates (dial with TLS)"
    )
    add("--replica-tls-cert", default=None, help="PEM client certificate shown to replicas (mTLS)")
    add("--replica-tls-key", default=None, help="PEM private key of --replica-tls-cert")
    for peer in ("session", "retriever"):
        add(
            f"--{peer}-tls-ca",
            default=None,
            help=f"PEM CA that signed the {peer}'s certificate (dial with TLS)",
        )
        add(f"--{peer}-tls-cert", default=None, help=f"PEM client certificate shown to the {peer} (mTLS)")
        add(f"--{peer}-tls-key", default=None, help=f"PEM private key of --{peer}-tls-cert")
    add(
        "--http-port",
        type=int,
        default=HttpSettings.port,
        help=f"OpenAI-compatible HTTP port (0 = any free, {HTTP_OFF} = off)",
    )
    add("--no-http", action="store_true", help="no OpenAI-compatible HTTP front (same as --http-port -1)")
    add("--http-host", default=None, help="address of the HTTP front (default: --host)")
    add(
        "--http-max-body-bytes",
        type=int,
        default=FrontLimits.max_body_bytes,
        help="largest HTTP request body",
    )
    add(
        "--http-cors-origin",
        action="append",
        default=[],
        help="a browser origin (https://app.example, or *) whose pages may call the HTTP front; repeatable",
    )
    add(
        "--http-keepalive-s",
        type=float,
        default=FrontLimits.keepalive_s,
        help="SSE keep-alive comment period while waiting",
    )
    add_task_arguments(parser)
    args = parser.parse_args(argv)
    for peer in ("session", "retriever"):
        # Said before the files are read: a peer's TLS without the peer is the first thing wrong.
        given = [getattr(args, f"{peer}_tls_{part}") for part in ("ca", "cert", "key")]
        if any(given) and not getattr(args, f"{peer}_addr"):
            parser.error(f"--{peer}-tls-* without --{peer}-addr: nothing to dial with them")
    # Its own --tls-cert/--tls-key read and checked before anything is built: the gRPC port and the
    # HTTP front serve with them.
    options = server_options("router", args, parser)
    try:
        settings = from_flags(
            RouterSettings,
            args,
            replicas=static_replicas(args.replicas),
            relay=RelayConfig(
                max_attempts=args.max_attempts,
                ttft_timeout_s=args.ttft_timeout_s,
                stall_timeout_s=args.stall_timeout_s,
            ),
            ejection=EjectionConfig(
                consecutive_failures=args.ejection_failures, base_ejection_s=args.ejection_base_s
            ),
            tasks=TaskSettings.from_args(args),
            replica_tls=DialTls.from_files(
                "replica", args.replica_tls_ca, args.replica_tls_cert, args.replica_tls_key
            ),
            session_tls=DialTls.from_files(
                "session", args.session_tls_ca, args.session_tls_cert, args.session_tls_key
            ),
            retriever_tls=DialTls.from_files(
                "retriever", args.retriever_tls_ca, args.retriever_tls_cert, args.retriever_tls_key
            ),
        )
        if not args.no_http and args.http_port != HTTP_OFF:
            settings = dataclasses.replace(
                settings,
                http=HttpSettings(
                    host=args.http_host or args.host,
                    port=args.http_port,
                    limits=FrontLimits(args.http_max_body_bytes, args.http_keepalive_s),
                    grace_s=args.grace_seconds,
                    cors_origins=tuple(args.http_cors_origin),
                    tls_cert=args.tls_cert,
                    tls_key=args.tls_key,
                    tls_client_ca=args.tls_client_ca,
                ),
            )
        runtime = RouterRuntime(settings)
    except ValueError as exc:
        parser.error(str(exc))
    run(options, runtime)
