"""What an HTTP stack adds per request and per streamed event: uvicorn+starlette (what the router's
OpenAI front runs) against aiohttp, both in one process, under uvloop.

    python -m bench.http_stack                  # 2,000 small JSON requests, 20 streams of 1,000 events
    llm-mesh bench http-stack --events 500

The client is a raw asyncio socket (the same for both, and cheap), so the
difference between the two rows is the servers'. Each event is a real chat
chunk's size (~230 bytes); each request reuses one keep-alive connection. The
stream runs through the front's own ``SseResponse`` (a disconnect listener per
stream included), not a bare StreamingResponse.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import socket
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Stop = Callable[[], Awaitable[None]]
CHUNK = (
    b'id: chatcmpl-0123456789abcdef0123456789abcdef-17\ndata: {"id":"chatcmpl-0123456789abcdef0123456789abcdef",'
    b'"object":"chat.completion.chunk","created":1796157994,"model":"SmolLM2-135M-Instruct",'
    b'"choices":[{"index":0,"delta":{"content":" nice"},"logprobs":null,"finish_reason":null}]}\n\n'
)
ANSWER = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llm-mesh"}]})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="small JSON requests per stack")
    parser.add_argument("--streams", type=int, default=20, help="SSE streams per stack")
    parser.add_argument("--events", type=int, default=1000, help="events per stream")


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _uvicorn(events: int, http: str) -> tuple[int, Stop]:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from services.router.api.openai.listener import _EmbeddedServer
    from services.router.api.openai.streaming import SseResponse

    async def body(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield CHUNK

    async def stream(request: Request) -> Any:
        async def nothing() -> None:
            return None

        return SseResponse(body(int(request.query_params.get("n", events))), nothing)

    async def small(request: Request) -> Response:
        return Response(ANSWER, media_type="application/json")

    app = Starlette(
        routes=[Route("/stream", stream, methods=["GET"]), Route("/small", small, methods=["GET"])]
    )
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, http=http)
    server = _EmbeddedServer(config)
    sock = _free_socket()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)

    async def stop() -> None:
        server.should_exit = True
        await task

    return sock.getsockname()[1], stop


async def _aiohttp(events: int, http: str = "") -> tuple[int, Stop]:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(int(request.query.get("n", events))):
            await response.write(CHUNK)
        await response.write_eof()
        return response

    async def small(request: web.Request) -> web.Response:
        return web.Response(text=ANSWER, content_type="application/json")

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/small", small)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = _free_socket()
    site = web.SockSite(runner, sock)
    await site.start()
    return sock.getsockname()[1], runner.cleanup


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response's body: Content-Length or chunked (the two the servers send)."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers = head.lower()
    if b"content-length:" in headers:
        length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0])
        return await reader.readexactly(length)
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return bytes(body)
        body += chunk[:-2]


async def _measure(port: int, requests: int, streams: int, events: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ask = b"GET /small HTTP/1.1\r\nhost: bench\r\n\r\n"
    for _ in range(50):  # warm-up
        writer.write(ask)
        await _read_response(reader)
    started = time.perf_counter()
    for _ in range(requests):
        writer.write(ask)
        await _read_response(reader)
    per_request = (time.perf_counter() - started) / requests
    # A one-event stream, whole: what opening and closing a stream costs (the disconnect listener too).
    started = time.perf_counter()
    for _ in range(requests // 4):
        writer.write(b"GET /stream?n=1 HTTP/1.1\r\nhost: bench\r\n\r\n")
        await _read_response(reader)
    per_short_stream = (time.perf_counter() - started) / (requests // 4)
    per_event = []
    for _ in range(streams):
        started = time.perf_counter()
        writer.write(b"GET /stream HTTP/1.1\r\nhost: bench\r\n\r\n")
        body = await _read_response(reader)
        assert body.count(b"\n\n") == events, "lost events"
        per_event.append((time.perf_counter() - started) / events)
    writer.close()
    return {
        "request_us": per_request * 1e6,
        "short_stream_us": per_short_stream * 1e6,
        "event_us": statistics.median(per_event) * 1e6,
    }


async def _run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results = {}
    stacks: dict[str, tuple[Callable[[int, str], Awaitable[tuple[int, Stop]]], str]] = {
        "uvicorn(h11)+starlette": (_uvicorn, "h11"),
        "aiohttp": (_aiohttp, ""),
    }
    if importlib.util.find_spec("httptools") is not None:
        stacks["uvicorn(httptools)+starlette"] = (_uvicorn, "httptools")
    for name, (start, http) in stacks.items():
        port, stop = await start(args.events, http)
        try:
            results[name] = await _measure(port, args.requests, args.streams, args.events)
        finally:
            await stop()
    return results


def run(args: argparse.Namespace) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    results = asyncio.run(_run(args))
    print(f"{'stack':<30} {'small request':>14} {'1-event stream':>15} {'per SSE event':>14}")
    for name, r in results.items():
        print(
            f"{name:<30} {r['request_us']:>11.0f} µs {r['short_stream_us']:>12.0f} µs {r['event_us']:>11.1f} µs"
        )
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
