"""How the terminal clients reach the router: address, API key, and errors a person can act on."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from llm_mesh_client import MeshError, SyncMeshClient
from llm_mesh_client.pb import common_pb2, router_pb2
from rich.console import Console

from services.common.settings import ROUTER_PORT

DEFAULT_ROUTER = f"127.0.0.1:{ROUTER_PORT}"
#: The terminal clients' temperature unless --temperature: greedy (see add_turn_arguments).
CLI_TEMPERATURE = 0.0


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router",
        default=os.environ.get("LLMMESH_ROUTER", DEFAULT_ROUTER),
        help="router host:port [env LLMMESH_ROUTER]",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLMMESH_API_KEY"),
        help="API key sent as `authorization: Bearer KEY` [env LLMMESH_API_KEY]",
    )
    # A router started with --tls-cert speaks only TLS: without these the CLI could not reach it,
    # and said the mesh was down.
    parser.add_argument(
        "--tls",
        action="store_true",
        default=os.environ.get("LLMMESH_TLS", "") not in ("", "0", "false"),
        help="TLS to the router, trusting the system's roots [env LLMMESH_TLS=1]",
    )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("LLMMESH_TLS_CA"),
        help="PEM CA that signed the router's certificate (implies --tls) [env LLMMESH_TLS_CA]",
    )
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("LLMMESH_TLS_CERT"),
        help="PEM client certificate, for a router that asks for one (mTLS) [env LLMMESH_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("LLMMESH_TLS_KEY"),
        help="PEM private key of --tls-cert [env LLMMESH_TLS_KEY]",
    )


# --rag-mode's words, as retriever.proto's SearchMode numbers.
_RAG_MODES = {"dense": 1, "keyword": 2, "hybrid": 3}


def add_turn_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of one turn, shared by `chat` and `ask`."""
    parser.add_argument("--session", default="", help="session id: the router keeps the history")
    parser.add_argument("--rag", action="store_true", help="answer from the ingested documents")
    parser.add_argument(
        "--rag-min-score",
        type=float,
        default=None,
        help="with --rag: leave out sources less similar than this (cosine; default the router's 0.2)",
    )
    parser.add_argument(
        "--rag-mode",
        choices=sorted(_RAG_MODES),
        default=None,
        help="with --rag: how sources are found (default hybrid)",
    )
    parser.add_argument("--model", default="", help="model name or alias (default: the router's)")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens per answer")
    # Greedy by default: at the engine's 1.0 the small default model's answers read as broken;
    # pass --temperature for sampled answers.
    parser.add_argument(
        "--temperature", type=float, default=CLI_TEMPERATURE, help="0 = greedy (the default here)"
    )
    parser.add_argument(
        "--session-must-exist",
        action="store_true",
        help="with --session: NOT_FOUND for an unknown id instead of starting a new conversation",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens (demos, benchmarks)"
    )


def turn_arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the turn options together (usage, exit 2), or None."""
    if args.session_must_exist and not args.session:
        return "--session-must-exist needs --session ID"
    return None


def sampling_from_args(args: argparse.Namespace) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(ignore_eos=args.ignore_eos)
    if args.max_tokens is not None:
        sampling.max_tokens = args.max_tokens
    if args.temperature is not None:
        sampling.temperature = args.temperature
    return sampling


def rag_options(args: argparse.Namespace) -> router_pb2.RagOptions:
    rag = router_pb2.RagOptions(enabled=args.rag)
    if getattr(args, "rag_min_score", None) is not None:
        rag.min_score = args.rag_min_score
    if getattr(args, "rag_mode", None) is not None:
        rag.mode = _RAG_MODES[args.rag_mode]  # type: ignore[assignment]
    return rag


def turn_request(args: argparse.Namespace, messages: list[common_pb2.ChatMessage]) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=messages,
        model=args.model,
        sampling=sampling_from_args(args),
        session_id=args.session,
        session_must_exist=args.session_must_exist,
        rag=rag_options(args),
    )


#: Width a console takes when its output is not a terminal: wide enough that no table is cut.
PIPED_WIDTH = 10_000


def output_console(stderr: bool = False) -> Console:
    """A rich console for tables: the terminal's width on a terminal; piped, wide enough that a
    table keeps every column at its natural width (rich would otherwise assume 80 columns and
    cut cells to "…" for a script reading it)."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else PIPED_WIDTH)


def channel_security(args: argparse.Namespace) -> bool | grpc.ChannelCredentials | None:
    """The client's ``tls`` for the TLS flags: None (plaintext), True (system roots) or credentials.

    A file that cannot be read, or a certificate without its key, is a usage error (SystemExit 2).
    """
    ca, cert, key = (getattr(args, name, None) for name in ("tls_ca", "tls_cert", "tls_key"))
    if (cert is None) != (key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        raise SystemExit(2)
    if not (getattr(args, "tls", False) or ca or cert):
        return None
    if not (ca or cert):
        return True

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as pem:
                return pem.read()
        except OSError as exc:
            print(f"error: {flag}: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc

    return grpc.ssl_channel_credentials(
        read(ca, "--tls-ca"), read(key, "--tls-key"), read(cert, "--tls-cert")
    )


def open_client(args: argparse.Namespace) -> SyncMeshClient:
    """The client package's blocking client for --router, --api-key and the TLS flags."""
    return SyncMeshClient(args.router, api_key=args.api_key, tls=channel_security(args))


def describe_error(error: grpc.RpcError | MeshError, address: str) -> str:
    """One line for a failed call, with the likely fix when the mesh is simply not running."""
    if isinstance(error, MeshError):
        code: grpc.StatusCode | None = error.code
        details = error.message
    else:
        code = error.code() if isinstance(error, grpc.Call) else None
        details = error.details() if isinstance(error, grpc.Call) else str(error)
    name = code.name if code is not None else "ERROR"
    hint = ""
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = f" (is the mesh up at {address}? start it with `llm-mesh up`"
        if "Socket closed" in details or "handshake" in details.lower() or "ssl" in details.lower():
            hint += "; a router with TLS needs --tls or --tls-ca"
        hint += ")"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = " (pass --api-key or set LLMMESH_API_KEY)"
    return f"error: {name}: {details}{hint}"


def format_citations(citations: list[router_pb2.Citation]) -> list[str]:
    """`[1] title (document id, chunk n, score)` lines, in the order the model saw the chunks."""
    lines = []
    for i, c in enumerate(citations, start=1):
        title = c.title or c.document_id
        lines.append(f"[{i}] {title} ({c.document_id}, chunk {c.position}, score {c.score:.2f})")
    return lines
