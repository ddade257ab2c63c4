"""`python -m services.session`: the session service on Redis."""

from __future__ import annotations

from services.common.server import run
from services.common.settings import (
    SESSION_PORT,
    EnvArgumentParser,
    add_flags,
    add_server_args,
    from_flags,
    server_options,
)
from services.session.limits import SessionLimits
from services.session.runtime import SessionRuntime
from services.session.store import SessionStore, connect


def main(argv: list[str] | None = None) -> None:
    parser = EnvArgumentParser(prog="python -m services.session", description=__doc__)
    add_server_args(parser, default_port=SESSION_PORT)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis to store sessions in")
    parser.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster"
    )
    parser.add_argument(
        "--redis-timeout-ms", type=int, default=1000, help="bound on one Redis call; beyond it UNAVAILABLE"
    )
    parser.add_argument("--redis-max-connections", type=int, default=64, help="Redis connection pool size")
    parser.add_argument(
        "--redis-ping-interval-ms", type=int, default=500, help="how often health checks Redis"
    )
    add_flags(parser, SessionLimits)
    args = parser.parse_args(argv)
    if args.redis_timeout_ms < 1 or args.redis_ping_interval_ms < 1 or args.redis_max_connections < 1:
        parser.error("--redis-timeout-ms, --redis-ping-interval-ms and --redis-max-connections must be >= 1")
    try:
        limits = from_flags(SessionLimits, args)
    except ValueError as exc:
        parser.error(str(exc))
    timeout_s = args.redis_timeout_ms / 1000
    client = connect(
        args.redis_url,
        cluster=args.redis_cluster,
        timeout_s=timeout_s,
        max_connections=args.redis_max_connections,
    )
    runtime = SessionRuntime(
        SessionStore(client, limits, timeout_s), limits, args.redis_ping_interval_ms / 1000
    )
    run(server_options("session", args, parser), runtime)


if __name__ == "__main__":
    main()
