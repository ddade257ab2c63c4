"""A small in-process TCP proxy for fault injection: added latency and blackholes.

`tc netem` is not available here, so tests put this between a client and a
server to slow a replica down or make it stop answering without killing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from services.launcher.readiness import free_port


class FaultProxy:
    """Forwards 127.0.0.1:<port> to an upstream address, with injectable faults.

    - ``delay_s``: added before forwarding each chunk upstream→client (a slow replica).
    - ``blackhole``: accept connections and hold every byte, both ways, until it is lifted, as
      TCP holds a partition's data (its retransmissions deliver it once the path is back): calls
      stall, nothing is answered meanwhile, and nothing is lost. Dropping the bytes instead
      broke the streams themselves (an HTTP/2 peer that missed a header block cannot decode the
      next one): after the "outage" every call on the connection failed INTERNAL for good,
      which no real partition does.
    Runs its own event loop in a daemon thread so sync and async tests can use it.
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.delay_s = 0.0
        self.blackhole = False
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(5)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        try:
            while data := await reader.read(65536):
                while self.blackhole:  # held, not read further: the sender's buffers fill, as in a partition
                    await asyncio.sleep(0.02)
                if delayed and self.delay_s > 0:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        # Cancelled only by stop(): the connection ends quietly (asyncio's stream server logs a
        # connection task that ends in an exception, cancellation included).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pipe(client_r, up_w, False), self._pipe(up_r, client_w, True))

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        # Close the connections it still relays before the loop stops: a task left pending in a
        # stopped loop is reported ("Task was destroyed but it is pending!") when collected.
        closing = asyncio.run_coroutine_threadsafe(self._close_all(), self._loop)
        with contextlib.suppress(Exception):
            closing.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
