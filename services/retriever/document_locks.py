"""Who may write a document: one ingest or delete at a time per (tenant, document).

Inside one process a lock per document does it. Several retriever replicas over one
Milvus server need a lock they all see: Milvus has no compare-and-set, so two
replicas ingesting one document at once (a client's retry landing on another pod,
say) would both write version v+1's chunks and leave a mix of the two. With
``--redis-url`` every write also holds a Redis lease on the document: a random token
set with NX and an expiry, renewed while the write runs, released only by its holder
(redis-py's ``Lock``, which does each of those in one Lua step). A writer that lost
its lease (Redis restarted empty, or the process stalled past the lease) stops
before making its version current: its chunks stay invisible, and the next ingest
of the document deletes them.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import redis
from redis.exceptions import LockError, LockNotOwnedError

from services.common.errors import Conflict, DependencyUnavailable
from services.retriever.filters import digest

log = logging.getLogger("llmmesh.retriever.locks")

DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_WAIT_SECONDS = 60.0


class WriteLease(Protocol):
    def check(self) -> None:
        """Raise unless this writer still holds the document (call right before making a version current)."""


class DocumentLocks(Protocol):
    def hold(self, tenant: str, document_id: str) -> AbstractContextManager[WriteLease]:
        """Held for the whole write; raises Conflict or DependencyUnavailable when it cannot be had."""
        ...


class _HeldInProcess:
    def check(self) -> None:
        return None  # nobody else can take a lock this process holds


class LocalLocks:
    """One writer per document within this process: enough when one replica writes the corpus."""

    def __init__(self) -> None:
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()

    @contextmanager
    def hold(self, tenant: str, document_id: str) -> Iterator[WriteLease]:
        with self._guard:
            lock = self._locks[digest(tenant, document_id)]
        with lock:
            yield _HeldInProcess()


class _RedisLease:
    """A held Redis lock, renewed by a thread until released."""

    def __init__(self, lock: redis.lock.Lock, document_id: str, lease_s: float) -> None:
        self._lock = lock
        self._document_id = document_id
        self._lost = threading.Event()
        self._done = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew, args=(lease_s / 3,), name="llmmesh-doc-lease", daemon=True
        )
        self._renewer.start()

    def _renew(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            try:
                self._lock.reacquire()
            except LockNotOwnedError:
                log.warning("lost the write lease on document %r", self._document_id)
                self._lost.set()
                return
            except redis.RedisError as exc:  # transient: check() decides before the flip
                log.warning("could not renew the write lease on %r: %s", self._document_id, exc)

    def check(self) -> None:
        try:
            owned = not self._lost.is_set() and self._lock.owned()
        except redis.RedisError as exc:
            raise DependencyUnavailable(
                f"document locks (Redis) unreachable before committing {self._document_id!r}: {exc}"
            ) from exc
        if not owned:
            raise Conflict(
                f"lost the write lease on document {self._document_id!r} (Redis restarted or this "
                "replica stalled past the lease); the new version was not made current: retry"
            )

    def release(self) -> None:
        self._done.set()
        self._renewer.join()
        try:
            self._lock.release()
        except (LockError, redis.RedisError) as exc:  # expired or Redis gone: nothing to give back
            log.info("write lease on %r not released: %s", self._document_id, exc)


class RedisLocks:
    """Per-document write leases in Redis, shared by every retriever replica of one corpus."""

    def __init__(
        self,
        client: redis.Redis,
        lease_s: float = DEFAULT_LEASE_SECONDS,
        wait_s: float = DEFAULT_WAIT_SECONDS,
    ) -> None:
        if lease_s <= 0 or wait_s < 0:
            raise ValueError(f"lease must be > 0 and wait >= 0, got {lease_s} and {wait_s}")
        self._client = client
        self._lease_s = lease_s
        self._wait_s = wait_s
        # Writers in this process queue here, not by polling Redis.
        self._local = LocalLocks()

    @staticmethod
    def key(tenant: str, document_id: str) -> str:
        return f"llm:retriever:write:{{{digest(tenant, document_id)}}}"

    @contextmanager
    def hold(self, tenant: str, document_id: str) -> Iterator[WriteLease]:
        with self._local.hold(tenant, document_id):
            lock = self._client.lock(
                self.key(tenant, document_id),
                timeout=self._lease_s,
                blocking_timeout=self._wait_s,
                thread_local=False,  # the renewing thread acts for the writer
            )
            try:
                acquired = lock.acquire()
            except redis.RedisError as exc:
                raise DependencyUnavailable(
                    f"document locks (Redis) unreachable; not writing {document_id!r}: {exc}"
                ) from exc
            if not acquired:
                raise Conflict(
                    f"document {document_id!r} is being written by another retriever replica "
                    f"(waited {self._wait_s:g}s); retry"
                )
            lease = _RedisLease(lock, document_id, self._lease_s)
            try:
                yield lease
            finally:
                lease.release()
