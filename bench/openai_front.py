"""One short turn through the router's gRPC ``Complete`` and through its OpenAI HTTP front.

    python -m bench.openai_front                 # 3 rounds of 300 one-token turns per path
    llm-mesh bench openai-front --rounds 5

A synthetic replica (unpaced, one token) behind one router, so what differs
between the rows is the front. Four clients: gRPC's (C core), httpx whole and
streamed (pure Python: its own cost is in its rows), and a raw keep-alive socket
writing the request bytes and reading the JSON answer, which leaves only the
server's side of HTTP. Prints each path's p50 per round.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable

import grpc
import httpx

from bench.router import Service
from bench.serving_peers import router_http_port
from services.gen.llmmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each path runs once per round")
    parser.add_argument("--turns", type=int, default=300, help="turns per path per round")


def _paths(grpc_address: str, http_port: int) -> dict[str, Callable[[], None]]:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(grpc_address))
    turn = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content="hi")],
        model="synthetic",
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0),
    )
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    client = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30)
    sock = socket.create_connection(("127.0.0.1", http_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = sock.makefile("rb")
    payload = json.dumps(body).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )

    def grpc_complete() -> None:
        stub.Complete(turn, timeout=10)

    def httpx_whole() -> None:
        client.post("/v1/chat/completions", json=body).raise_for_status()

    def httpx_stream() -> None:
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            for _ in response.iter_bytes():
                pass

    def raw_socket_whole() -> None:
        sock.sendall(raw)
        length = 0
        while (line := reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reader.read(length)

    return {
        "gRPC Complete": grpc_complete,
        "HTTP whole (httpx)": httpx_whole,
        "HTTP stream (httpx)": httpx_stream,
        "HTTP whole (raw socket)": raw_socket_whole,
    }


def run(args: argparse.Namespace) -> None:
    replica = Service("services.synthetic", ["--model-id", "synthetic"]).start()
    router = Service("services.router", ["--replicas", replica.address, "--http-port", "0"]).start()
    try:
        paths = _paths(router.address, router_http_port(router))
        for call in paths.values():
            for _ in range(50):  # warm-up: connections, caches, the pool's first health check
                call()
        medians: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, call in paths.items():
                seconds = []
                for _ in range(args.turns):
                    started = time.perf_counter()
                    call()
                    seconds.append(time.perf_counter() - started)
                medians[name].append(statistics.median(seconds) * 1000)
        for name, values in medians.items():
            print(f"{name:<24} p50 ms: " + " / ".join(f"{v:.2f}" for v in values))
        print(json.dumps(medians))
    finally:
        for service in (router, replica):
            if service.proc is not None:
                service.proc.terminate()
                service.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
