"""`llm-mesh ingest PATH…`: walks files and folders, streams each document through the router, summarizes.

It is a router client like `ask` and `chat`: the router checks the API key and
the key decides the tenant that owns the documents, so they are the ones that
tenant's `ask --rag`, SearchDocuments and ListDocuments see. The retriever's own
port admits only the router (loopback under `llm-mesh up`, mTLS or a
NetworkPolicy on Kubernetes: docs/retriever.md, "Who may call the retriever").
"""

from __future__ import annotations

import argparse
import os
import random
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
from llm_mesh_client import MeshError, SyncMeshClient, Unavailable
from llm_mesh_client.pb import retriever_pb2
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from services.client.connection import add_connection_arguments, describe_error, open_client
from services.retriever.parsing import DOCX, PDF, mime_type_for

#: Answers that say "not now" rather than "not this": ABORTED (another retriever replica held the
#: document's write lease past the wait limit, or this one lost it) and UNAVAILABLE (the retriever
#: restarting, or its Redis away). A document re-sent after one is never half-written: a write
#: either becomes current whole or not at all, and an identical re-send answers "unchanged".
RETRYABLE = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
#: Answers about the caller or the mesh, not the document: every other document would get the same,
#: so the command stops at the first one (exit 2) instead of "skipping" the whole folder.
FATAL = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
#: How long `ingest` waits for a connection to the router before saying the mesh is not up.
CONNECT_TIMEOUT_S = 3.0
#: Flags of the days `ingest` dialled the retriever itself: refused with the way to do it now.
RETIRED_FLAGS = {
    "--retriever-addr": "ingest goes through the router now: pass --router HOST:PORT (env LLMMESH_ROUTER)",
    "--tenant": "the tenant is the API key's: pass that tenant's --api-key (env LLMMESH_API_KEY)",
}


@dataclass(frozen=True)
class PlannedDocument:
    path: Path
    document_id: str


@dataclass
class IngestReport:
    """What the command did, for the summary and the exit status."""

    ingested: int = 0
    unchanged: int = 0
    chunks: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    #: Attempts sent again after a retryable answer.
    retries: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders to ingest")
    # The key's tenant owns the documents; with keys off, the router's one open tenant does.
    add_connection_arguments(parser)
    for flag in RETIRED_FLAGS:
        # Hidden, and refused in run(): an old script learns what to pass instead of
        # "unrecognized arguments", and never writes where it did not mean to.
        parser.add_argument(flag, dest=retired_dest(flag), default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="metadata for every document"
    )
    parser.add_argument("--id-prefix", default="", help="prepended to every document id")
    parser.add_argument(
        "--charset",
        default=None,
        help="encoding of the text, Markdown and HTML files that have no byte-order mark "
        "(e.g. windows-1252); default UTF-8 (HTML: its <meta charset>)",
    )
    parser.add_argument(
        "--timeout-seconds", type=float, default=300.0, help="limit per attempt at a document"
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=4,
        help="times a document answered ABORTED or UNAVAILABLE is sent again (0 = never)",
    )
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=1.0,
        help="wait before the first retry; doubles for each next one (±20%% jitter)",
    )


def retired_dest(flag: str) -> str:
    return "retired_" + flag.lstrip("-").replace("-", "_")


def plan(paths: list[Path], id_prefix: str = "") -> tuple[list[PlannedDocument], list[tuple[str, str]]]:
    """Documents to send (id = path relative to the folder given) and files skipped, with reasons."""
    planned: list[PlannedDocument] = []
    skipped: list[tuple[str, str]] = []
    for root in paths:
        if root.is_dir():
            files = sorted(
                p
                for p in root.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
            )
            pairs = [(p, p.relative_to(root).as_posix()) for p in files]
        elif root.is_file():
            pairs = [(root, root.name)]
        else:
            skipped.append((str(root), _not_a_document(root)))
            continue
        for path, relative in pairs:
            try:
                relative.encode("utf-8")
            except UnicodeEncodeError:
                # A name in another encoding (decoded by Python with surrogates): a document id must
                # be UTF-8, and sending it crashed the whole run.
                skipped.append((os.fsencode(path).decode("utf-8", "replace"), "file name is not UTF-8"))
                continue
            if mime_type_for(path) is None:
                skipped.append((str(path), f"unsupported type {path.suffix or '(no extension)'}"))
            else:
                planned.append(PlannedDocument(path, id_prefix + relative))
    return planned, skipped


def _not_a_document(path: Path) -> str:
    """Why a path given on the command line is neither a file nor a folder to read."""
    if path.is_symlink() and not path.exists():
        return "broken symbolic link"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file or folder"
    except OSError as exc:  # a folder on the way that cannot be searched, a name too long
        return exc.strerror or type(exc).__name__
    # A FIFO or a device was "no such file or folder", which sent users looking for a typo.
    kind = "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"not a regular file or folder ({kind})"


class UsageError(Exception):
    """A flag the command cannot use: said on stderr, exit 2 (as argparse's own)."""


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata wants KEY=VALUE, got {pair!r}")
        metadata[key] = value
    return metadata


def document_mime_type(path: Path, charset: str | None) -> str:
    """The MIME type sent for ``path``: by its extension, with ``charset`` on the text formats
    (every one but PDF and DOCX, which say their own: JSON's was once dropped)."""
    mime_type = mime_type_for(path) or ""
    return f"{mime_type}; charset={charset}" if charset and mime_type not in ("", PDF, DOCX) else mime_type


def send_document(
    client: SyncMeshClient,
    document: PlannedDocument,
    metadata: dict[str, str],
    timeout_s: float,
    charset: str | None = None,
) -> retriever_pb2.IngestSummary:
    """One attempt: the document streamed from its first byte, through the router."""
    return client.ingest(
        document.path,
        document_id=document.document_id,
        title=document.path.stem,
        mime_type=document_mime_type(document.path, charset),
        metadata=metadata,
        timeout=timeout_s,
    )


def say_retry(console: Console, document: PlannedDocument, exc: MeshError, wait_s: float) -> None:
    console.print(f"[yellow]{document.document_id}: {exc}; retrying in {wait_s:.1f} s")


def backoff_seconds(retry: int, first_s: float, rng: random.Random) -> float:
    """Wait before retry number ``retry`` (0-based): doubling from ``first_s``, ±20 % so that
    several clients refused together do not come back together."""
    return float(first_s * 2**retry * rng.uniform(0.8, 1.2))


def ingest_with_retries(
    send: Callable[[], retriever_pb2.IngestSummary],
    retries: int,
    first_s: float,
    on_retry: Callable[[MeshError, float], None],
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> tuple[retriever_pb2.IngestSummary, int]:
    """``send()`` until it answers, or until a non-retryable error or the last retry raises.
    Returns the summary and how many retries it took."""
    rng = rng or random.Random()
    for retry in range(retries + 1):
        try:
            return send(), retry
        except MeshError as exc:
            if exc.code not in RETRYABLE or retry == retries:
                raise
            wait_s = backoff_seconds(retry, first_s, rng)
            on_retry(exc, wait_s)
            sleep(wait_s)
    raise AssertionError("unreachable: the last attempt returns or raises")


def refuse_retired_flags(args: argparse.Namespace) -> None:
    for flag, instead in RETIRED_FLAGS.items():
        if getattr(args, retired_dest(flag), None) is not None:
            raise UsageError(f"{flag} is gone: {instead}")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        refuse_retired_flags(args)
        if args.retries < 0 or args.retry_seconds < 0:
            raise UsageError("--retries and --retry-seconds must be >= 0")
        metadata = parse_metadata(args.metadata)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    planned, skipped = plan(args.paths, args.id_prefix)
    report = IngestReport(skipped=skipped)
    with open_client(args) as client:
        if planned and not router_reachable(client):
            # Not "retry later": nothing listens there. Retrying each document for ~15 s would
            # only hide the one thing to do.
            print(
                f"error: no router at {args.router} (is the mesh up? start it with `llm-mesh up`)",
                file=sys.stderr,
            )
            return 2
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("ingesting", total=len(planned))
            for document in planned:
                progress.update(task, description=f"ingesting {document.document_id}")
                send = partial(send_document, client, document, metadata, args.timeout_seconds, args.charset)
                try:
                    summary, retries = ingest_with_retries(
                        send, args.retries, args.retry_seconds, partial(say_retry, console, document)
                    )
                except (OSError, ValueError) as exc:
                    # Unreadable, gone since it was listed, or a name the request cannot carry.
                    report.rejected.append((str(document.path), f"{type(exc).__name__}: {exc}"))
                except MeshError as exc:
                    if exc.code in FATAL:
                        # Nothing after this document would fare better; say so once and stop.
                        # Plain print: a rich console wraps at 80 columns when stderr is not a terminal.
                        print(describe_error(exc, args.router), file=sys.stderr)
                        return 2
                    report.rejected.append((str(document.path), str(exc)))
                else:
                    report.retries += retries
                    if summary.unchanged:
                        report.unchanged += 1
                    else:
                        report.ingested += 1
                    report.chunks += summary.chunks
                progress.advance(task)
    print_summary(report)
    return exit_status(report)


def exit_status(report: IngestReport) -> int:
    """0: every file given was ingested (or was already); 1: some file was skipped or refused, each
    with its reason in the summary. (2 is usage, or a router that is not there or refuses the key.)"""
    return 1 if report.rejected or report.skipped else 0


def router_reachable(client: SyncMeshClient, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a connection to the router opens within ``timeout_s``."""
    try:
        client.wait_ready(timeout_s)
    except Unavailable:
        return False
    return True


def print_summary(report: IngestReport) -> None:
    retried = f", {report.retries} retries" if report.retries else ""
    print(
        f"ingested {report.ingested} documents ({report.unchanged} unchanged), {report.chunks} chunks; "
        f"skipped {len(report.skipped) + len(report.rejected)}{retried}"
    )
    for path, reason in report.skipped + report.rejected:
        print(f"  skipped {path}: {reason}")
