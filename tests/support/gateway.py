"""The REST gateway sidecar in tests: build it when missing or stale, run it on an ephemeral port."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from services.launcher.process_output import ProcessHandle

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_DIR = ROOT / "deploy" / "gateway"
GATEWAY_BINARY = GATEWAY_DIR / "bin" / "llm-mesh-gateway"


def gateway_build_inputs() -> list[Path]:
    """What the binary is made from: a change to any of them means rebuild."""
    return [
        GATEWAY_DIR / "main.go",
        GATEWAY_DIR / "build.sh",
        *sorted(ROOT.glob("protos/llmmesh/v1/*.proto")),
    ]


def go_environment() -> dict[str, str]:
    """The environment build.sh compiles in: GOPATH mode over the generated code and Debian's sources."""
    gopath = f"{GATEWAY_DIR / 'build' / 'gopath'}:/usr/share/gocode"
    return {**os.environ, "GO111MODULE": "off", "GOPROXY": "off", "GOPATH": gopath, "CGO_ENABLED": "0"}


def ensure_gateway_built(timeout: float = 900.0) -> Path:
    """Run `make gateway` unless the binary is newer than every input; returns the binary.

    `make gateway` installs Debian's Go toolchain with apt when it is missing,
    so a clean clone's `make test` builds the sidecar here.
    """
    if GATEWAY_BINARY.exists():
        built = GATEWAY_BINARY.stat().st_mtime
        if all(p.stat().st_mtime <= built for p in gateway_build_inputs()):
            return GATEWAY_BINARY
    result = subprocess.run(
        ["make", "gateway"], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0 or not GATEWAY_BINARY.exists():
        raise RuntimeError(f"`make gateway` failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return GATEWAY_BINARY


class GatewayProcess(ProcessHandle):
    """``llm-mesh-gateway --listen 127.0.0.1:0 --upstream ROUTER``; the port is read from its first line."""

    def __init__(self, upstream: str, extra_args: list[str] | None = None) -> None:
        self.upstream = upstream
        self.extra_args = extra_args or []
        super().__init__()  # the port comes from its ``llm-mesh gateway listening on`` line

    @property
    def url(self) -> str:
        assert self.port is not None, "not started"
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        cmd = [str(GATEWAY_BINARY), "--listen", "127.0.0.1:0", "--upstream", self.upstream, *self.extra_args]
        self.launch(cmd, "gateway")
        if not self.wait_listening_line(time.monotonic() + timeout, poll_s=0.05):
            self.kill()
            raise RuntimeError("gateway did not start:\n" + self.output())
        return self

    def output(self) -> str:
        return self.out.tail(100)

    def terminate(self) -> None:
        """SIGTERM: the gateway stops accepting and lets in-flight requests finish."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode
