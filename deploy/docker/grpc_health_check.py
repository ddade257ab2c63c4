"""Container health check: exit 0 when the service's gRPC health check answers SERVING.

Used by the Dockerfiles' HEALTHCHECK, and by the Kubernetes exec probes of services whose port
speaks mutual TLS (the kubelet's own gRPC probes speak plaintext, which such a port refuses).
``--alive`` (a liveness probe): exit 0 when the health service answers at all, NOT_SERVING
included. A session service reports NOT_SERVING while Redis is unreachable, a retriever while
Milvus is: a liveness probe that asked for SERVING restarted every such pod during the store's
outage (and CrashLoopBackOff kept them down after it), though a restart mends nothing there.
Usage: grpc_health_check.py [--alive] [--tls-ca CA --tls-cert CERT --tls-key KEY [--server-name NAME]]
                            [HOST:PORT] [SERVICE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051")
    parser.add_argument("service", nargs="?", default="")
    parser.add_argument("--tls-ca", help="PEM CA that signed the service's certificate (dial with TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate to show (the port requires one)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    # The probe dials 127.0.0.1, but the certificate names the Service: check it against that name.
    parser.add_argument("--server-name", help="name the service's certificate must carry")
    parser.add_argument(
        "--alive", action="store_true", help="succeed on any answer, NOT_SERVING too (liveness)"
    )
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_ca is None and (args.tls_cert or args.server_name):
        parser.error("--tls-cert and --server-name need --tls-ca")
    return args


def channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None:
        return grpc.insecure_channel(args.address)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(args.tls_ca).read_bytes(),
        private_key=Path(args.tls_key).read_bytes() if args.tls_key else None,
        certificate_chain=Path(args.tls_cert).read_bytes() if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, creds, options=options)


def main(argv: list[str]) -> int:
    args = parse(argv[1:])
    try:
        with channel(args) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=3.0
            )
    except grpc.RpcError as error:
        print(f"{args.address}: {error.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except OSError as error:
        print(f"{args.address}: cannot read TLS material: {error}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving or args.alive else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
