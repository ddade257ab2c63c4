"""uvicorn's httptools protocol, except that a request proposing HTTP/2 (``Upgrade: h2c``) keeps its body.

Java's ``java.net.http.HttpClient`` (the default client of LangChain4j and of Spring's
``RestClient``/``JdkClientHttpRequestFactory``, so of Spring AI) and ``curl --http2``
propose an upgrade to cleartext HTTP/2 on every new ``http://`` connection. A server may
ignore the proposal and answer in HTTP/1.1 (RFC 9110 §7.8); uvicorn means to, but its
httptools parser (llhttp) stops at such a request's headers and treats what follows as
the new protocol's bytes, so the body never reaches the app: every chat completion from
those clients was a 400 "not valid JSON" (uvicorn issue #2722, open).

The fix keeps httptools (half h11's cost per request, ``bench/http_stack.py``) for every
other connection, and hands a connection whose request proposes an upgrade other than
WebSocket to uvicorn's own h11 protocol, which ignores the proposal correctly: the request
is replayed to it without the upgrade headers, followed by the bytes after them, and the
connection stays with h11 for its remaining requests.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import httptools
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("llmmesh.router.openai")

#: Headers that only carry the upgrade proposal: dropped from the replayed request.
_UPGRADE_HEADERS = frozenset({b"upgrade", b"http2-settings"})


class UpgradeTolerantHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that answers an ignored upgrade proposal's request, body and all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: This request proposes an upgrade we do not take: no ASGI cycle is started for it here.
        self._ignored_upgrade = False
        self._received = b""

    def on_headers_complete(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self.parser.should_upgrade() and not self._should_upgrade() and idle:
            # httptools would start the app now with a body it will never parse; h11 serves it
            # instead. (Pipelined behind a response still being written, it is left to uvicorn:
            # two protocols must not write to one connection at once. No client we know does that.)
            self._ignored_upgrade = True
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._ignored_upgrade:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._ignored_upgrade:
            super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        # Kept for the replay: an upgrade's offset counts from the start of the chunk fed.
        self._received = data
        super().data_received(data)

    def _unsupported_upgrade_warning(self) -> None:
        # Called by uvicorn's data_received while it handles HttpParserUpgrade for a proposal it
        # does not take; the exception being handled says where this request's body begins.
        upgrade = sys.exc_info()[1]
        if not self._ignored_upgrade or not isinstance(upgrade, httptools.HttpParserUpgrade):
            super()._unsupported_upgrade_warning()
            return
        self._continue_in_h11(self._received[upgrade.args[0] :])

    def _continue_in_h11(self, rest: bytes) -> None:
        """Replay this request without its upgrade headers to an h11 protocol that takes over the
        connection, then the bytes that followed the headers (the body, and any next request)."""
        head = [b"%s %s HTTP/1.1\r\n" % (self.parser.get_method(), self.url)]
        for name, value in self.headers:
            if name in _UPGRADE_HEADERS:
                continue
            if name == b"connection":
                tokens = [t.strip() for t in value.split(b",")]
                value = b", ".join(
                    t for t in tokens if t and t.lower() not in (b"upgrade", *_UPGRADE_HEADERS)
                )
                if not value:
                    continue
            head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"\r\n")
        log.debug("ignoring an upgrade to %r: the connection goes on in HTTP/1.1 (h11)", self._get_upgrade())
        successor = H11Protocol(self.config, self.server_state, self.app_state, self.loop)
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        self.transport.set_protocol(successor)
        successor.connection_made(self.transport)
        successor.data_received(b"".join(head) + rest)
