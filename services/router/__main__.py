"""`python -m services.router`: the public front door, balancing turns over inference replicas."""

from __future__ import annotations

import os
import sys

from services.router import grpc_io


def main(argv: list[str] | None = None) -> None:
    # Before anything imports grpc: gRPC reads its I/O choice once (see grpc_io).
    try:
        grpc_io.configure(os.environ)
    except ValueError as exc:
        sys.exit(f"python -m services.router: {exc}")
    from services.router.cli import main as serve

    serve(argv)


if __name__ == "__main__":
    main()
