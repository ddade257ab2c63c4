"""The one server bootstrap every service uses.

It owns what is the same everywhere: the gRPC server and its options, the error
mapping with its status-code table (wrapped around every handler once, when it
is registered), health and reflection, the Prometheus endpoint, and graceful
shutdown (NOT_SERVING first, then finish in-flight RPCs, then exit). A service
plugs in through a small ``ServiceRuntime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from services.common import errors, tracing
from services.common.grpc_status import status_for
from services.common.handlers import HandlerWrappingServer, MethodWrapper, wrap_handler
from services.common.metrics import REQUEST_SECONDS, REQUESTS
from services.common.settings import ServerOptions
from services.common.tracing_server import ServerTracingInterceptor

log = logging.getLogger("llmmesh.server")


class HealthReporter:
    """Sets the health status of the whole server and each of its services."""

    def __init__(self, servicer: AsyncHealthServicer, names: Sequence[str]) -> None:
        self._servicer = servicer
        self._names = ["", *names]
        self.serving = False
        #: Shutting down: NOT_SERVING for good, whatever a service's own watcher says after.
        self.stopping = False

    async def stop_serving(self) -> None:
        """NOT_SERVING from now on: the server is shutting down. A runtime's watcher (the session
        service's Redis check) that reports SERVING later changes nothing: during the drain window
        the service still takes work, but says it is leaving."""
        self.stopping = True
        await self._set(False)

    async def set_serving(self, serving: bool) -> None:
        if self.stopping:
            return
        await self._set(serving)

    async def _set(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.serving = serving
        for name in self._names:
            await self._servicer.set(name, status)


class ServiceRuntime(Protocol):
    """What a service gives the bootstrap."""

    #: Full proto service names, e.g. ``["llmmesh.v1.Inference"]``.
    service_names: Sequence[str]

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers to the server."""

    async def start(self, health: HealthReporter) -> None:
        """Load what the service needs, then call ``health.set_serving(True)``."""

    async def drain(self) -> None:
        """Stop admitting new work (health is already NOT_SERVING)."""

    async def close(self) -> None:
        """Release resources after the server stopped."""


#: The longest status message sent: room for any error's own words, never for an echoed input.
MAX_STATUS_MESSAGE_CHARS = 1024


def rich_status_trailers(
    code: grpc.StatusCode, message: str, retry_after_s: float | None
) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying a google.rpc.Status with RetryInfo, as clients expect."""
    if retry_after_s is None:
        return ()
    seconds = int(retry_after_s)
    info = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=seconds, nanos=int((retry_after_s - seconds) * 1e9))
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (("grpc-status-details-bin", status.SerializeToString()),)


async def abort_for(exc: BaseException, context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
    """Abort the RPC with the status the error table gives ``exc``."""
    code = status_for(exc)
    message = str(exc) or type(exc).__name__
    trailing: tuple[tuple[str, Any], ...] = ()
    if isinstance(exc, errors.Overloaded):
        trailing = rich_status_trailers(code, message, exc.retry_after_s)
    elif isinstance(exc, errors.Conflict):
        trailing = exc.trailing
    if code == grpc.StatusCode.UNAVAILABLE and not isinstance(exc, errors.MeshError):
        # A Redis, Milvus or socket client's own error: its text names internal addresses
        # ("Error 111 connecting to 10.0.0.5:6379"), which reached every tenant's client and,
        # through the router, its TurnEnd's degraded reasons. The detail is the operators'.
        log.warning("%s: %s: %s", method, type(exc).__name__, exc)
        message = f"{_dependency_of(exc)} is unavailable; try again"
    if code == grpc.StatusCode.INTERNAL:
        # Logged once, here, with its traceback. A bug's own text (a KeyError's key, a path, a
        # value from another request) is the operators', as the HTTP front keeps it: the client
        # sees its type. The mesh's own INTERNAL (RequestFault) says what failed, in its words.
        log.error("%s failed", method, exc_info=exc)
        if isinstance(exc, errors.MeshError):
            message = f"internal error: {type(exc).__name__}: {exc}"
        else:
            message = f"internal error: {type(exc).__name__}"
    if len(message) > MAX_STATUS_MESSAGE_CHARS:
        # A message echoing a huge input would overflow gRPC's metadata limit (8 KiB by default,
        # and escaped): the client would get RESOURCE_EXHAUSTED instead of this status.
        message = message[:MAX_STATUS_MESSAGE_CHARS] + "… (message cut)"
    await context.abort(code, message, trailing_metadata=trailing)


def _dependency_of(exc: BaseException) -> str:
    """What a raw client error is the outage of, in a word a caller can act on."""
    module = type(exc).__module__
    if module.startswith("redis"):
        return "Redis"
    if module.startswith("pymilvus"):
        return "Milvus"
    return "a dependency"


def _code_name(context: grpc.aio.ServicerContext[Any, Any], default: str) -> str:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return default


def peer_names(context: Any) -> set[str]:
    """The names the client's certificate carries: its common name and subject alternative names."""
    auth = context.auth_context()
    return {
        value.decode(errors="replace")
        for key in ("x509_common_name", "x509_subject_alternative_name")
        for value in auth.get(key, ())
    }


def check_peer(context: Any, admitted: frozenset[str]) -> None:
    """``PermissionDenied`` unless the client's certificate names one of ``admitted``. The CA alone
    admitted any certificate it signed: the session and retriever pods' own (issued for client auth
    too, for their probes) could call each other as any tenant."""
    names = peer_names(context)
    if not names & admitted:
        shown = ", ".join(sorted(names))[:200] or "none"
        raise errors.PermissionDenied(
            f"client certificate ({shown}) is not one this service admits (--tls-client-names)"
        )


def error_mapping(service: str, client_names: frozenset[str] = frozenset()) -> MethodWrapper:
    """Wraps a method so its exceptions become the status codes the error table gives, and every
    RPC is counted by outcome. Applied once per method, at registration (``HandlerWrappingServer``).
    ``client_names``: with mTLS, the names a client certificate must carry (empty: any)."""

    def wrap(full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = full_method.rsplit("/", 1)[-1]
        seconds = REQUEST_SECONDS.labels(service, method)
        succeeded = REQUESTS.labels(service, method, "OK")

        def count(code: str, started: float) -> None:
            (succeeded if code == "OK" else REQUESTS.labels(service, method, code)).inc()
            seconds.observe(time.perf_counter() - started)

        @contextlib.asynccontextmanager
        async def counted(context: Any) -> AsyncIterator[None]:
            """One call, unary or streaming: its exception mapped to a status, its outcome counted."""
            started = time.perf_counter()
            code = "OK"
            try:
                if client_names:
                    check_peer(context, client_names)
                yield
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except grpc.aio.AbortError:
                code = _code_name(context, "UNKNOWN")
                raise
            except Exception as exc:  # the table decides; nothing escapes as UNKNOWN
                code = status_for(exc).name
                await abort_for(exc, context, method)
            finally:
                count(code, started)

        async def run_unary(behavior: Any, request: Any, context: Any) -> Any:
            async with counted(context):
                return await behavior(request, context)

        async def run_stream(behavior: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            async with counted(context):
                result = behavior(request, context)
                if inspect.isasyncgen(result):
                    async for item in result:
                        yield item
                else:
                    await result

        return wrap_handler(handler, run_unary, run_stream)

    return wrap


def server_channel_options(options: ServerOptions) -> list[tuple[str, Any]]:
    """gRPC core options: message bounds, keepalive policing, handshake timeout."""
    return [
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.server_handshake_timeout_ms", options.handshake_timeout_ms),
        # Keepalive policing: clients may ping at most every 10 s; abusers get GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.so_reuseport", 0),
        # A client dialling a Service's one address keeps one connection to one pod for good: a
        # bounded age makes it reconnect (and land on any pod) now and then. Calls in flight finish.
        *(
            [("grpc.max_connection_age_ms", int(options.max_connection_age_s * 1000))]
            if options.max_connection_age_s
            else []
        ),
    ]


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    if options.tls_cert is None or options.tls_key is None:
        return None
    with open(options.tls_key, "rb") as f:
        key = f.read()
    with open(options.tls_cert, "rb") as f:
        cert = f.read()
    ca = None
    if options.tls_client_ca:
        with open(options.tls_client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def serve(options: ServerOptions, runtime: ServiceRuntime) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop gracefully."""
    tracing.setup(options.service)
    # Tracing, when it has somewhere to send spans, is the one interceptor: outermost, so a span
    # covers the error mapping too. Without it no interceptor runs per call at all.
    interceptors = [ServerTracingInterceptor(options.service)] if tracing.enabled() else []
    server = HandlerWrappingServer(
        grpc.aio.server(interceptors=interceptors, options=server_channel_options(options)),
        error_mapping(options.service, options.client_names),
    )
    runtime.register(server)
    health_servicer = AsyncHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(runtime.service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    reporter = HealthReporter(health_servicer, names)
    await reporter.set_serving(False)

    address = f"{options.host}:{options.port}"
    creds = server_credentials(options)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    await server.start()
    # Tests and the launcher read this line to learn an ephemeral port.
    print(f"llm-mesh {options.service} listening on {options.host}:{port}", flush=True)
    if options.metrics_port is not None:
        httpd, _ = start_http_server(options.metrics_port, addr=options.host)
        print(f"llm-mesh {options.service} metrics on {options.host}:{httpd.server_port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    start_task = asyncio.create_task(runtime.start(reporter))
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({start_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if start_task in done and start_task.exception() is not None:
        log.error("%s failed to start", options.service, exc_info=start_task.exception())
        await server.stop(0)
        await runtime.close()
        raise SystemExit(1)
    if start_task in done:
        log.info("%s ready on port %d", options.service, port)
        # What startup built (modules, descriptors, the model's Python objects) lives as long as the
        # process: moved out of the cyclic GC's view, a full collection while serving scans only what
        # serving made (a full pass over the router's startup heap took ~13 ms, a p99 spike).
        gc.collect()
        gc.freeze()
    await stop_task

    log.info("%s draining", options.service)
    await reporter.stop_serving()
    if not start_task.done():
        start_task.cancel()
    if options.drain_seconds > 0:
        # Still taking work while it says NOT_SERVING, as --drain-seconds promises: callers that
        # have not seen the health change yet (a router's next poll, a Service's endpoints) are
        # served, not refused. Before 2026-12-07 the runtime drained first, so a replica refused
        # and a router's HTTP front closed its door for the whole window.
        await asyncio.sleep(options.drain_seconds)
    await runtime.drain()
    await server.stop(options.grace_seconds)
    await runtime.close()
    tracing.shutdown()
    log.info("%s stopped", options.service)


def run(options: ServerOptions, runtime: ServiceRuntime) -> None:
    """Entry point for a service's ``__main__``: logging, uvloop, serve."""
    configure_logging(options.log_level)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is optional
        pass
    asyncio.run(serve(options, runtime))
