"""Container health check: exit 0 when the service's gRPC health check answers SERVING.

Used by the Dockerfiles' HEALTHCHECK (Kubernetes uses its native gRPC probes instead).
Usage: grpc_health_check.py [HOST:PORT] [SERVICE]
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    address = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    service = argv[2] if len(argv) > 2 else ""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3.0
            )
    except grpc.RpcError as error:
        print(f"{address}: {error.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
