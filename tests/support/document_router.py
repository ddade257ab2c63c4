"""A router in front of a retriever, for tests that ingest the way a user does: `llm-mesh ingest` via the router."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.router.admission.keys import add_key
from tests.support.processes import ROOT, ServiceProcess


@dataclass
class DocumentRouter:
    """The router process and one API key per tenant (none: the router is open, one tenant)."""

    process: ServiceProcess
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.process.address

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[tenant]}"),)

    def ingest_command(self, *args: str, tenant: str | None = None) -> list[str]:
        """`llm-mesh ingest ARGS… --router ADDRESS [--api-key KEY]` as a subprocess argv."""
        key = ["--api-key", self.keys[tenant]] if tenant is not None else []
        return [sys.executable, "-m", "services.cli", "ingest", *args, "--router", self.address, *key]

    def ingest(
        self, *args: str, tenant: str | None = None, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.ingest_command(*args, tenant=tenant),
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip


@contextlib.contextmanager
def document_router(
    retriever_address: str, keys_dir: Path, tenants: Sequence[str] = (), router_args: Sequence[str] = ()
) -> Iterator[DocumentRouter]:
    """A router (API keys on when ``tenants`` are given) whose documents live in the retriever at
    ``retriever_address``; a synthetic replica behind it, since a router needs one to serve."""
    keys: dict[str, str] = {}
    args = ["--retriever-addr", retriever_address, "--probe-interval-s", "0", "--log-level", "WARNING"]
    if tenants:
        keys_file = keys_dir / "keys.yaml"
        keys = {tenant: add_key(keys_file, tenant, f"{tenant}-ingest")[0] for tenant in tenants}
        args += ["--api-keys-file", str(keys_file)]
    replica = ServiceProcess("services.synthetic", ["--log-level", "WARNING"])
    router: ServiceProcess | None = None
    try:
        replica.start(timeout=120)
        router = ServiceProcess("services.router", ["--replicas", replica.address, *args, *router_args])
        router.start(timeout=120)
        yield DocumentRouter(router, keys)
    finally:
        if router is not None:
            router.stop()
        replica.stop()
