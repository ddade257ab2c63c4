"""Calls the router forwards to the retriever, and the status a client sees when one fails.

Every code the retriever answers with reaches the client unchanged, with the
retriever's own message (docs/router.md, "Downstream statuses"): the router adds
no status of its own to a forwarded call.

A client stream (IngestDocument) is pumped into the downstream call here rather
than handed to gRPC as an iterator. When the retriever ends such a call early
(it rejects the upload after its first message, or once it is too large), a
message the router is still sending fails, and grpc-python then records the
call's status as INTERNAL "Internal error from Core" — over the retriever's real
status if that had already arrived. gRPC's own iterator consumer cannot avoid
that; the pump below can. It is cancelled from the call's done callback, which
runs synchronously the moment the call has a status: a write then pending (or
whose failure is queued) resumes with CancelledError instead of its failure, so
grpc-python never records the INTERNAL over it. A write that failed before the
status arrived records INTERNAL first, and the real status, still to come from
the call's receive side, replaces it before ``await call`` returns. (grpcio
1.85; tests/integration/test_router_downstream_status.py checks it 200 times.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

import grpc

from services.common import errors
from services.common.grpc_status import domain_code

Request = TypeVar("Request")
Response = TypeVar("Response")


class DownstreamStatus(errors.MeshError):
    """A status from the retriever, passed on to the client as it is."""

    def __init__(self, exc: grpc.aio.AioRpcError) -> None:
        super().__init__(exc.details() or exc.code().name)
        self.code = domain_code(exc.code())


@contextlib.contextmanager
def passed_on() -> Iterator[None]:
    """Turns a failed downstream call into the same status for our client."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise DownstreamStatus(exc) from None


async def forward_stream(
    call: grpc.aio.StreamUnaryCall[Request, Response], requests: AsyncIterator[Request]
) -> Response:
    """Sends the client's ``requests`` into ``call`` (started without a request iterator) and
    returns its response; the downstream ending early stops the reading and is the answer."""
    pump = asyncio.create_task(_pump(call, requests))

    def stop_pump(_: object) -> None:
        # Runs synchronously, the moment the call gets its first status: see the module docstring.
        pump.cancel()

    call.add_done_callback(stop_pump)
    try:
        with passed_on():
            return await call
    except asyncio.CancelledError:
        # The pump cancels the call when the client's stream fails: that failure is the answer.
        if pump.done() and not pump.cancelled() and (failure := pump.exception()) is not None:
            raise failure from None
        raise
    finally:
        call.cancel()  # no-op once it ended
        pump.cancel()
        await asyncio.wait({pump})  # never raises the pump's error a second time
        if not pump.cancelled():
            pump.exception()  # retrieved: asyncio would log it as never retrieved


async def _pump(call: grpc.aio.StreamUnaryCall[Any, Any], requests: AsyncIterator[Any]) -> None:
    try:
        async for request in requests:
            if call.done() or not await _sent(call.write(request)):
                return  # the downstream call ended: stop reading the client
    except asyncio.CancelledError:
        raise
    except Exception:
        call.cancel()  # reading the client failed: nothing more will come
        raise
    await _sent(call.done_writing())


async def _sent(step: Awaitable[None]) -> bool:
    """Whether a write (or the half-close) went out; when not, the call is over or ending and
    its status, not this write's error, is the answer."""
    try:
        await step
    except asyncio.CancelledError:
        raise
    except Exception:  # AioRpcError, InvalidStateError, or cygrpc's own errors for a finished call
        return False
    return True
