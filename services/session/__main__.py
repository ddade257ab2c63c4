"""`python -m services.session`: the session service on Redis."""

from __future__ import annotations

from services.common.server import run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.session.limits import DEFAULT_TTL_SECONDS, SessionLimits
from services.session.runtime import SessionRuntime
from services.session.store import SessionStore, connect


def main(argv: list[str] | None = None) -> None:
    parser = EnvArgumentParser(prog="python -m services.session", description=__doc__)
    add_server_args(parser, default_port=50054)
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
    parser.add_argument(
        "--default-ttl-seconds",
        type=int,
        default=DEFAULT_TTL_SECONDS,
        help="sliding TTL when a call asks none",
    )
    parser.add_argument(
        "--max-ttl-seconds", type=int, default=SessionLimits.max_ttl_seconds, help="largest TTL"
    )
    parser.add_argument(
        "--max-turns-per-session",
        type=int,
        default=SessionLimits.max_turns_per_session,
        help="turns per session",
    )
    parser.add_argument(
        "--max-turn-bytes", type=int, default=SessionLimits.max_turn_bytes, help="UTF-8 bytes per turn"
    )
    parser.add_argument(
        "--max-sessions-per-owner",
        type=int,
        default=SessionLimits.max_sessions_per_owner,
        help="live sessions per owner",
    )
    args = parser.parse_args(argv)
    if args.redis_timeout_ms < 1 or args.redis_ping_interval_ms < 1 or args.redis_max_connections < 1:
        parser.error("--redis-timeout-ms, --redis-ping-interval-ms and --redis-max-connections must be >= 1")
    try:
        limits = SessionLimits(
            default_ttl_seconds=args.default_ttl_seconds,
            max_ttl_seconds=args.max_ttl_seconds,
            max_turns_per_session=args.max_turns_per_session,
            max_turn_bytes=args.max_turn_bytes,
            max_sessions_per_owner=args.max_sessions_per_owner,
        )
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
    run(server_options("session", args), runtime)


if __name__ == "__main__":
    main()
