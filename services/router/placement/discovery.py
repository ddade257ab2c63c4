"""Where replicas come from: a static list, a DNS name re-resolved periodically, a watched file.

The pool is the union (a Kubernetes headless Service is the DNS case).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from pathlib import Path

from services.router.placement.pool import ReplicaPool

log = logging.getLogger("llmmesh.router.pool")


def parse_address(raw: str) -> str:
    """Validate ``host:port``; raises ValueError naming the flag's format."""
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"replica address {raw!r}: expected host:port")
    return f"{host}:{int(port)}"


def parse_address_list(text: str) -> list[str]:
    """Addresses separated by commas, whitespace or newlines; ``#`` starts a comment."""
    out: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        out.extend(parse_address(part) for part in line.replace(",", " ").split())
    return out


class ReplicaDiscovery:
    """Keeps the pool equal to static ∪ DNS ∪ file addresses."""

    def __init__(
        self,
        pool: ReplicaPool,
        static: Iterable[str] = (),
        dns: str | None = None,
        file: str | None = None,
        dns_interval_s: float = 10.0,
        file_interval_s: float = 1.0,
    ) -> None:
        self.pool = pool
        self.static = [parse_address(a) for a in static]
        if dns is not None:
            parse_address(dns)  # NAME:PORT, checked at start
        self.dns = dns
        self.file = Path(file) if file else None
        self.dns_interval_s = dns_interval_s
        self.file_interval_s = file_interval_s
        self._dns_addresses: set[str] = set()
        self._file_addresses: set[str] = set()
        # The file's (mtime ns, inode, size) as last read, and that of an empty read not yet taken.
        self._file_mtime: tuple[int, int, int] | None = None
        self._empty_version: tuple[int, int, int] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _apply(self) -> None:
        self.pool.set_addresses({*self.static, *self._dns_addresses, *self._file_addresses})

    async def resolve_dns(self) -> None:
        assert self.dns is not None
        name, _, port = self.dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            # Keep the last answer: a DNS hiccup must not empty the pool.
            log.warning("resolving %s failed: %s", self.dns, exc)
            return
        found = set()
        for family, *_, sockaddr in infos:
            host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
            found.add(f"{host}:{port}")
        self._dns_addresses = found

    def read_file(self) -> bool:
        """Re-read the replicas file if it changed; True when it did."""
        assert self.file is not None
        try:
            st = self.file.stat()
        except FileNotFoundError:
            log.warning(
                "--replicas-file %s is missing; keeping %d replicas", self.file, len(self._file_addresses)
            )
            return False
        # Nanoseconds, inode and size: a rewrite within one coarse mtime tick (or a replacement
        # by rename) is still seen, as the keys file's reload does.
        version = (st.st_mtime_ns, st.st_ino, st.st_size)
        if version == self._file_mtime:
            return False
        try:
            addresses = set(parse_address_list(self.file.read_text()))
        except ValueError as exc:
            self._file_mtime = version
            log.error("--replicas-file %s: %s; keeping the previous list", self.file, exc)
            return False
        if not addresses and self._file_addresses and version != self._empty_version:
            # Read while it was being rewritten in place (truncated, not yet written): taken
            # only if it is still empty at the next read, never on one glimpse.
            self._empty_version = version
            log.warning(
                "--replicas-file %s is empty; keeping %d replicas unless it stays so",
                self.file,
                len(self._file_addresses),
            )
            return False
        self._file_mtime = version
        self._file_addresses = addresses
        return True

    async def start(self) -> None:
        if self.dns:
            await self.resolve_dns()
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="router-dns"))
        if self.file:
            self.read_file()
            self._tasks.append(asyncio.create_task(self._file_loop(), name="router-replicas-file"))
        self._apply()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.dns_interval_s)
            before = set(self._dns_addresses)
            await self.resolve_dns()
            if self._dns_addresses != before:
                self._apply()

    async def _file_loop(self) -> None:
        while True:
            await asyncio.sleep(self.file_interval_s)
            if self.read_file():
                self._apply()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
