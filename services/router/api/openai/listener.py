"""The HTTP listener: uvicorn serving the OpenAI front inside the router's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from starlette.middleware.cors import CORSMiddleware

from services.common.settings import ROUTER_HTTP_PORT
from services.router.api.openai.app import FrontLimits, OpenAiFront
from services.router.api.openai.http_protocol import UpgradeTolerantHttpToolsProtocol

log = logging.getLogger("llmmesh.router.openai")
#: --http-port that turns the listener off.
HTTP_OFF = -1


@dataclass(frozen=True)
class HttpSettings:
    """Where and how the OpenAI front listens."""

    host: str = "127.0.0.1"
    #: 0 = any free port (printed on the ``http on`` line).
    port: int = ROUTER_HTTP_PORT
    limits: FrontLimits = field(default_factory=FrontLimits)
    #: Seconds a shutdown waits for open responses (streams included) before cutting them.
    grace_s: float = 30.0
    #: Browser origins (``https://app.example``, or ``*``) whose pages may call the front
    #: directly; none by default, as a browser then refuses a page on another origin.
    cors_origins: tuple[str, ...] = ()
    #: The router's own --tls-cert / --tls-key / --tls-client-ca: with them the front is HTTPS
    #: (and asks for a client certificate signed by the CA), as the gRPC port is. Without this,
    #: a router whose gRPC port took TLS served the same API keys over plaintext HTTP.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--http-port must be in 0..65535 (or {HTTP_OFF} for off), got {self.port}")
        for origin in self.cors_origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(
                    f"--http-cors-origin must be * or scheme://host[:port] with no path, got {origin!r}"
                )


def _is_origin(text: str) -> bool:
    """``scheme://host[:port]`` and nothing more: what a browser sends as ``Origin``."""
    parts = urlsplit(text)
    return (
        parts.scheme in ("http", "https")
        and bool(parts.netloc)
        and text == f"{parts.scheme}://{parts.netloc}"
    )


def with_cors(app: Any, origins: tuple[str, ...]) -> Any:
    """``app`` answering browsers' CORS preflights for ``origins`` (Starlette's middleware)."""
    if not origins:
        return app
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST"],
        # Authorization, Content-Type, the SDKs' X-Stainless-* and ours (x-request-id, Last-Event-ID).
        allow_headers=["*"],
        # What a page's script may read from an answer: its id and when to retry.
        expose_headers=["x-request-id", "Retry-After", "x-should-retry"],
        max_age=600,
    )


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the router's bootstrap owns SIGTERM and drains both fronts."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpListener:
    """Binds first (so an ephemeral port is known at once), then serves until ``stop``."""

    def __init__(self, front: OpenAiFront, settings: HttpSettings) -> None:
        self.settings = settings
        self.front = front
        config = uvicorn.Config(
            with_cors(front.app(), settings.cors_origins),
            # httptools (a dependency): half h11's cost per request (bench/http_stack.py); the
            # subclass keeps the body of a request that proposes h2c, as Java's HttpClient does.
            http=UpgradeTolerantHttpToolsProtocol,
            lifespan="off",
            log_config=None,  # keep the router's logging as configured
            access_log=False,
            timeout_graceful_shutdown=math.ceil(settings.grace_s),
            # Clients reuse connections (the OpenAI SDK pools them); an idle one is closed after this.
            timeout_keep_alive=30,
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
            ssl_ca_certs=settings.tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    async def start(self, service: str = "router") -> None:
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.port))
        sock.set_inheritable(False)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="openai-http")
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # it failed to start: say why
        # Tests and the launcher read this line (like the gRPC one) to learn the port.
        scheme = " (https: TLS)" if s.tls_cert else ""
        print(f"llm-mesh {service} http on {s.host}:{self.port}{scheme}", flush=True)

    def begin_shutdown(self) -> None:
        """Stop accepting connections; open responses finish within the grace period."""
        self._server.should_exit = True

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._task is not None:
            await self._task
            self._task = None
        await self.front.close()  # resumable turns left running by clients that went away
