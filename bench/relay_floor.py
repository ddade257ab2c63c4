"""The floor of a Python gRPC relay: ChatStream forwarded to one replica's Generate with no logic at all.

Benchmark reference only, never a serving path. It does what any relay in
grpc-python aio must do for a token stream and nothing else: open a Generate
call, send the start, turn each chunk into a ChatResponse, end with a TurnEnd.
No auth, admission, balancing, retries, watchdog, metrics, interceptors or
replay. ``bench/router.py`` runs it beside the router so the latency the
second gRPC hop costs by itself is measured in the same run as the router's.

    python -m bench.relay_floor --replicas 127.0.0.1:50052,127.0.0.1:50062 --port 0
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from services.router.placement.pool import CHANNEL_OPTIONS

if TYPE_CHECKING:
    from services.gen.llmmesh.v1.inference_pb2_grpc import InferenceAsyncStub


class FloorRelay(router_pb2_grpc.RouterServicer):
    """ChatStream only: replicas in turn, one call per stream, one message out per chunk in."""

    def __init__(self, replicas: list[InferenceAsyncStub]) -> None:
        self.replicas = replicas
        self.turn = 0

    async def ChatStream(
        self, request: router_pb2.ChatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.ChatResponse]:
        start = inference_pb2.GenerateStart(
            request_id=request.request_id, messages=request.messages, sampling=request.sampling
        )
        self.turn += 1
        call = self.replicas[self.turn % len(self.replicas)].Generate()  # type: ignore[call-arg]
        await call.write(inference_pb2.GenerateRequest(start=start))
        seq = 0
        async for response in call:
            seq += 1
            if response.HasField("chunk"):
                chunk = response.chunk
                delta = router_pb2.TokenDelta(text=chunk.text, token_ids=chunk.token_ids, index=chunk.index)
                yield router_pb2.ChatResponse(request_id=request.request_id, seq=seq, delta=delta)
            else:
                done = response.finished
                end = router_pb2.TurnEnd(
                    finish_reason=done.finish_reason, usage=done.usage, timings=done.timings
                )
                yield router_pb2.ChatResponse(request_id=request.request_id, seq=seq, end=end)
                return


async def serve(replicas: list[str], host: str, port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    stubs: list[InferenceAsyncStub] = [
        inference_pb2_grpc.InferenceStub(grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))  # type: ignore[misc]
        for address in replicas
    ]
    server = grpc.aio.server()
    # Only ChatStream is served: the other methods answer UNIMPLEMENTED from the generated base.
    router_pb2_grpc.add_RouterServicer_to_server(FloorRelay(stubs), server)  # type: ignore[abstract]
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    # The same line the services print, so bench.router.Service finds the port.
    print(f"llm-mesh relay-floor listening on {host}:{bound}", flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__)
    parser.add_argument("--replicas", required=True, help="host:port,host:port (taken in turn)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log-level", default="WARNING", help="accepted for bench.router.Service; unused")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()  # as the router runs
    except ImportError:  # pragma: no cover - uvloop is optional
        pass
    asyncio.run(serve(args.replicas.split(","), args.host, args.port))


if __name__ == "__main__":
    main()
