"""Command-line settings with `LLMMESH_*` environment defaults.

Every flag `--foo-bar` of every service defaults to the environment variable
`LLMMESH_FOO_BAR` when set, so a container can be configured by environment
alone while a person can still override anything on the command line.

A settings dataclass declares each of its flags once, on the field (``flag()``):
the default and the help text live there, ``add_flags`` makes the argparse
flags from them and ``from_flags`` builds the dataclass from the parsed flags,
so a default can never differ between the command line and code that builds
the settings directly (tests, the launcher).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, TypeVar

from services.common.tls_files import check_server_files

T = TypeVar("T")

#: The ports each service listens on by default (DESIGN.md); `llm-mesh up` uses the same.
ROUTER_PORT = 50051
#: The router's OpenAI-compatible HTTP front: where OpenAI SDKs and tools expect a local server.
ROUTER_HTTP_PORT = 8000
INFERENCE_PORT = 50052
RETRIEVER_PORT = 50053
SESSION_PORT = 50054

_FLAG = "llmmesh.flag"


def env_name(flag: str) -> str:
    return "LLMMESH_" + flag.lstrip("-").replace("-", "_").upper()


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose defaults come from `LLMMESH_*` variables."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        long_flags = [a for a in args if isinstance(a, str) and a.startswith("--")]
        if long_flags and kwargs.get("action") != "help":
            var = env_name(long_flags[0])
            raw = os.environ.get(var)
            if raw is not None:
                # Set by the environment, a required flag (the replica's --model) is given: a
                # container configured by environment alone must start.
                kwargs["required"] = False
                action = kwargs.get("action")
                if action == "store_true":
                    kwargs["default"] = raw.lower() in ("1", "true", "yes", "on")
                elif action == "append":  # a repeatable flag: comma-separated values
                    kwargs["default"] = [v.strip() for v in raw.split(",") if v.strip()]
                elif "type" in kwargs and callable(kwargs["type"]):
                    kwargs["default"] = kwargs["type"](raw)
                else:
                    kwargs["default"] = raw
            help_text = kwargs.get("help") or ""
            if help_text != argparse.SUPPRESS:
                kwargs["help"] = f"{help_text} [env {var}]".strip()
        return super().add_argument(*args, **kwargs)


@dataclass(frozen=True)
class _Flag:
    help: str
    #: None: ``--`` and the field's name with dashes.
    name: str | None
    #: More ``add_argument`` keywords (``choices``; ``type`` where the default is None).
    options: Mapping[str, Any]


def flag(default: Any = MISSING, *, help: str, name: str | None = None, **options: Any) -> Any:
    """A settings field that is also a command-line flag; no default: the flag is required.

    ``type`` comes from an int or float default, a bool default makes a ``store_true`` switch.
    """
    metadata = {_FLAG: _Flag(help, name, options)}
    if default is MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def _flag_fields(settings: type) -> list[tuple[Field[Any], _Flag, str]]:
    """(field, its flag, the flag's name) for each ``flag()`` field of the dataclass ``settings``."""
    found = []
    for f in fields(settings):
        spec = f.metadata.get(_FLAG)
        if spec is not None:
            found.append((f, spec, spec.name or "--" + f.name.replace("_", "-")))
    return found


def add_flags(parser: argparse.ArgumentParser, settings: type, **defaults: Any) -> None:
    """One flag per ``flag()`` field of ``settings``; ``defaults`` replace fields' defaults (a service's port)."""
    for f, spec, name in _flag_fields(settings):
        default = defaults.get(f.name, f.default)
        kwargs: dict[str, Any] = {"help": spec.help, **spec.options}
        if default is MISSING:
            kwargs["required"] = True
        elif isinstance(default, bool):
            kwargs.update(action="store_true", default=default)
        else:
            kwargs["default"] = default
            if isinstance(default, int | float) and "type" not in kwargs:
                kwargs["type"] = type(default)
        parser.add_argument(name, **kwargs)


def from_flags(settings: type[T], args: argparse.Namespace, **values: Any) -> T:
    """``settings`` from the parsed flags of its ``flag()`` fields; ``values`` give (or replace) fields."""
    kwargs = {
        f.name: getattr(args, spec.options.get("dest") or name.lstrip("-").replace("-", "_"))
        for f, spec, name in _flag_fields(settings)
    }
    return settings(**{**kwargs, **values})


@dataclass(frozen=True)
class ServerOptions:
    """What the shared bootstrap needs to serve one service (the flags every service takes)."""

    service: str
    host: str = flag("127.0.0.1", help="address to listen on")
    # Each service's flag defaults to its own port (add_server_args).
    port: int = flag(0, help="gRPC port (0 = any free)")
    metrics_port: int | None = flag(None, type=int, help="Prometheus HTTP port (0 = any free; unset = off)")
    grace_seconds: float = flag(30.0, help="how long in-flight RPCs may run on shutdown")
    drain_seconds: float = flag(
        0.0, help="how long to report NOT_SERVING before refusing new RPCs on shutdown"
    )
    max_message_bytes: int = flag(4 * 1024 * 1024, help="largest gRPC message accepted")
    handshake_timeout_ms: int = flag(10_000, help="drop connections that do not finish the handshake")
    tls_cert: str | None = flag(None, help="PEM server certificate (enables TLS)")
    tls_key: str | None = flag(None, help="PEM private key of --tls-cert")
    tls_client_ca: str | None = flag(None, help="PEM CA for client certificates (enables mTLS)")
    tls_client_names: str = flag(
        "",
        help="with --tls-client-ca: names a client certificate must carry (CN or DNS SAN), comma-separated;"
        " empty = any the CA signed",
    )
    max_connection_age_s: float = flag(
        0.0,
        help="close each client connection after this long (GOAWAY; calls on it finish) so clients"
        " behind one Service address spread over its pods; 0 = never",
    )
    log_level: str = flag("INFO", help="logging level")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace and drain seconds must be >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not (self.tls_cert and self.tls_key):
            # Without a certificate the service served plaintext, checking no client at all.
            raise ValueError(
                "--tls-client-ca needs --tls-cert and --tls-key: without them the service would serve "
                "plaintext and check no client certificate"
            )
        if self.client_names and not self.tls_client_ca:
            raise ValueError(
                "--tls-client-names needs --tls-client-ca: without it no client shows a certificate"
            )
        if self.max_connection_age_s < 0:
            raise ValueError("--max-connection-age-s must be >= 0")

    @property
    def client_names(self) -> frozenset[str]:
        """``--tls-client-names`` as a set (empty: any certificate the client CA signed)."""
        return frozenset(n.strip() for n in self.tls_client_names.split(",") if n.strip())


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags every service takes."""
    add_flags(parser, ServerOptions, port=default_port)


def server_options(
    service: str, args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> ServerOptions:
    """The server flags as options; with ``parser``, a bad combination is its usage error (one
    line naming the flags, exit 2), not a traceback.

    The TLS files are read and checked here too (a swapped, mismatched or non-PEM certificate or
    key was a traceback at the bind, "Failed to bind to address"); ``ServerOptions`` itself only
    checks the flags, so code and tests can build it without files."""
    try:
        options = from_flags(ServerOptions, args, service=service)
        check_server_files(options.tls_cert, options.tls_key, options.tls_client_ca)
        return options
    except ValueError as exc:
        if parser is None:
            raise
        parser.error(str(exc))
