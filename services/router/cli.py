"""The router's command line and bootstrap (``python -m services.router`` runs it once the gRPC I/O is chosen)."""

from __future__ import annotations

import dataclasses

from services.common.server import run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.router import grpc_io
from services.router.admission.tls import DialTls
from services.router.api.openai.app import FrontLimits
from services.router.api.openai.listener import HTTP_OFF, HttpSettings
from services.router.placement.outliers import EjectionConfig
from services.router.placement.policies import POLICY_NAMES
from services.router.runtime import RouterRuntime, RouterSettings, static_replicas
from services.router.streams.relay import RelayConfig
from services.router.tasks.settings import TaskSettings, add_task_arguments


def main(argv: list[str] | None = None) -> None:
    parser = EnvArgumentParser(
        prog="python -m services.router",
        description="The public front door, balancing turns over inference replicas.",
        epilog=f"gRPC I/O: {grpc_io.ENV}=poller (default) or eventengine, read at start (see services/router/grpc_io.py).",
    )
    add_server_args(parser, default_port=50051)
    add = parser.add_argument
    add("--replicas", default="", help="inference replicas, host:port,host:port")
    add("--replicas-dns", default=None, help="NAME:PORT resolved periodically (headless Service)")
    add("--replicas-file", default=None, help="file of host:port lines, re-read when it changes")
    add("--session-addr", default=None, help="session service host:port")
    add("--retriever-addr", default=None, help="retriever service host:port")
    add("--redis-url", default=None, help="Redis for pins, rate limits, caches, tasks and Resume")
    add("--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster")
    add("--api-keys-file", default=None, help="API keys (hashed); unset = open, one tenant")
    add("--policy", default="auto", choices=POLICY_NAMES, help="balancing policy")
    add("--epsilon", type=float, default=0.25, help="bounded-load slack for affinity")
    add("--max-in-flight", type=int, default=2048, help="turns in flight before shedding load")
    add("--max-attempts", type=int, default=3, help="replicas tried per turn (retries + failovers + 1)")
    add("--ttft-timeout-s", type=float, default=60.0, help="no first token this long: try another replica")
    add("--stall-timeout-s", type=float, default=15.0, help="no token this long mid-stream: fail over")
    add("--ejection-failures", type=int, default=3, help="consecutive failures that eject a replica")
    add("--ejection-base-s", type=float, default=30.0, help="ejection time, times the ejection count")
    add("--model-aliases", default="", help="alias=model pairs, e.g. fast=M1,quality=M2")
    add("--model-fallbacks", default="", help="model:fallback pairs, tried in order, e.g. M1:M2")
    add("--canary", default="", help="MODEL=NEW:SHARE, e.g. m=m-v2:0.1")
    add("--default-model", default=None, help="model for requests that name none")
    add("--health-interval-s", type=float, default=1.0, help="active health and load polling period")
    add("--probe-interval-s", type=float, default=30.0, help="one-token generation probe period (0 = off)")
    add("--cache-ttl-seconds", type=int, default=3600, help="exact-cache entry lifetime")
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
        default=8000,
        help=f"OpenAI-compatible HTTP port (0 = any free, {HTTP_OFF} = off)",
    )
    add("--no-http", action="store_true", help="no OpenAI-compatible HTTP front (same as --http-port -1)")
    add("--http-host", default=None, help="address of the HTTP front (default: --host)")
    add("--http-max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest HTTP request body")
    add("--http-keepalive-s", type=float, default=10.0, help="SSE keep-alive comment period while waiting")
    add_task_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = RouterSettings(
            replicas=static_replicas(args.replicas),
            replicas_dns=args.replicas_dns,
            replicas_file=args.replicas_file,
            session_addr=args.session_addr,
            retriever_addr=args.retriever_addr,
            redis_url=args.redis_url,
            redis_cluster=args.redis_cluster,
            api_keys_file=args.api_keys_file,
            policy=args.policy,
            epsilon=args.epsilon,
            max_in_flight=args.max_in_flight,
            relay=RelayConfig(
                max_attempts=args.max_attempts,
                ttft_timeout_s=args.ttft_timeout_s,
                stall_timeout_s=args.stall_timeout_s,
            ),
            ejection=EjectionConfig(
                consecutive_failures=args.ejection_failures, base_ejection_s=args.ejection_base_s
            ),
            model_aliases=args.model_aliases,
            model_fallbacks=args.model_fallbacks,
            canary=args.canary,
            default_model=args.default_model,
            health_interval_s=args.health_interval_s,
            probe_interval_s=args.probe_interval_s,
            cache_ttl_seconds=args.cache_ttl_seconds,
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
                ),
            )
        runtime = RouterRuntime(settings)
    except ValueError as exc:
        parser.error(str(exc))
    run(server_options("router", args), runtime)
