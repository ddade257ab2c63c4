"""Request builders shared by the async client and its sync wrapper (no I/O here)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import grpc

from llm_mesh_client._gen.llmmesh.v1 import common_pb2, retriever_pb2, router_pb2

#: One message as (role, content), e.g. ("system", "Answer in French.").
MessageLike = common_pb2.ChatMessage | tuple[str, str]
#: What a turn is asked with: a user message, a list of messages, or a whole ChatRequest.
Prompt = str | Sequence[MessageLike] | router_pb2.ChatRequest
#: Bytes per IngestRequest data piece (the router caps one message at a few MiB).
PIECE_BYTES = 256 * 1024


def channel_credentials(tls: bool | grpc.ChannelCredentials | None) -> grpc.ChannelCredentials | None:
    """None/False: plaintext; True: TLS with the system's roots; or credentials as given."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    return tls


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The router reads the key as `authorization: Bearer KEY`."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def chat_request(
    prompt: Prompt,
    *,
    model: str = "",
    session_id: str = "",
    session_must_exist: bool = False,
    max_tokens: int | None = None,
    temperature: float | None = None,
    rag: bool = False,
    request_id: str = "",
    ignore_eos: bool = False,
) -> router_pb2.ChatRequest:
    """A ChatRequest; a ChatRequest given as the prompt is used as is (keyword options then apply
    only where they are set)."""
    if isinstance(prompt, router_pb2.ChatRequest):
        request = router_pb2.ChatRequest()
        request.CopyFrom(prompt)
    else:
        request = router_pb2.ChatRequest(messages=list(_messages(prompt)))
    if model:
        request.model = model
    if session_id:
        request.session_id = session_id
    if session_must_exist:
        request.session_must_exist = True
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    if temperature is not None:
        request.sampling.temperature = temperature
    if ignore_eos:
        request.sampling.ignore_eos = True
    if rag:
        request.rag.enabled = True
    if request_id:
        request.request_id = request_id
    return request


def _messages(prompt: str | Sequence[MessageLike]) -> Iterator[common_pb2.ChatMessage]:
    if isinstance(prompt, str):
        yield common_pb2.ChatMessage(role="user", content=prompt)
        return
    for message in prompt:
        if isinstance(message, common_pb2.ChatMessage):
            yield message
        else:
            role, content = message
            yield common_pb2.ChatMessage(role=role, content=content)


@dataclass(frozen=True)
class DocumentSource:
    """What `ingest()` sends: a header and the bytes (read in pieces from a path)."""

    header: retriever_pb2.DocumentHeader
    path: Path | None = None
    data: bytes = b""

    def pieces(self) -> Iterator[retriever_pb2.IngestRequest]:
        """The header, then the data in pieces (a path is opened when the iteration starts)."""
        with self.open() as pieces:
            yield from pieces

    def open(self) -> DocumentPieces:
        """The requests to send, with a path's file opened now: an unreadable file raises its
        OSError here, before any call starts."""
        return DocumentPieces(self)


class DocumentPieces:
    """The IngestRequests of one document: a gRPC call's request iterator. gRPC swallows what
    a request iterator raises (the call just fails: CANCELLED, or UNKNOWN "Exception iterating
    requests!"), so an error reading the file is kept in ``error`` for the caller to raise instead.
    A context manager: leaving it closes the file."""

    def __init__(self, source: DocumentSource) -> None:
        self.source = source
        self.error: Exception | None = None
        self._file: BinaryIO | None = source.path.open("rb") if source.path is not None else None
        self._requests = self._generate()

    def __enter__(self) -> DocumentPieces:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __iter__(self) -> DocumentPieces:
        return self

    def __next__(self) -> retriever_pb2.IngestRequest:
        return next(self._requests)

    def _generate(self) -> Iterator[retriever_pb2.IngestRequest]:
        try:
            yield retriever_pb2.IngestRequest(header=self.source.header)
            if self._file is None:
                data = self.source.data
                for start in range(0, len(data), PIECE_BYTES):
                    yield retriever_pb2.IngestRequest(data=data[start : start + PIECE_BYTES])
                return
            while piece := self._file.read(PIECE_BYTES):
                yield retriever_pb2.IngestRequest(data=piece)
        except Exception as error:
            if isinstance(error, OSError) and error.filename is None and self.source.path is not None:
                error.filename = str(self.source.path)  # name the file, as open() would have
            self.error = error
            raise


def document_source(
    source: str | Path | bytes,
    *,
    document_id: str | None = None,
    title: str | None = None,
    mime_type: str = "",
    metadata: dict[str, str] | None = None,
    filename: str = "",
) -> DocumentSource:
    """A path (id: its file name, type: from its extension) or bytes (pass ``document_id``, and
    ``mime_type`` or a ``filename`` whose extension names the type). The retriever decides the
    type from ``source`` when ``mime_type`` is empty."""
    if isinstance(source, bytes | bytearray):
        if not document_id:
            raise ValueError("ingest(bytes) needs document_id")
        if not mime_type and not filename:
            raise ValueError("ingest(bytes) needs mime_type or a filename with an extension")
        header = retriever_pb2.DocumentHeader(
            document_id=document_id,
            title=title if title is not None else Path(filename).stem,
            mime_type=mime_type,
            metadata=metadata or {},
            source=filename,
        )
        return DocumentSource(header, data=bytes(source))
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"ingest: no such file: {path}")
    header = retriever_pb2.DocumentHeader(
        document_id=document_id or path.name,
        title=title if title is not None else path.stem,
        mime_type=mime_type,
        metadata=metadata or {},
        source=filename or str(path),
    )
    return DocumentSource(header, path=path)
