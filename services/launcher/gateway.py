"""`llm-mesh gateway` (and `llm-mesh up --gateway` while a mesh runs): the REST sidecar attached to a
running mesh's router, until Ctrl-C, which stops the gateway and nothing else.

The router's address comes from the running launcher's lock file (``DATA/llm-mesh.lock``), or from
``--router`` for a router that no `llm-mesh up` here started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from services.launcher.children import ChildFailed, ChildProcess
from services.launcher.lock import running_mesh
from services.launcher.mesh import GATEWAY_BINARY, GATEWAY_LISTEN, ROOT

READY_LINE = "llm-mesh gateway is up"
#: How long the gateway may take to listen (it only dials the router lazily).
START_TIMEOUT_S = 30.0
#: The gateway's own drain on SIGTERM (its --shutdown-grace default), and what it is given in
#: all before SIGKILL: 10 s cut the answers it was still streaming at Ctrl-C short.
SHUTDOWN_GRACE_S = 30.0
STOP_TIMEOUT_S = SHUTDOWN_GRACE_S + 5.0


class GatewayStop(Exception):
    """SIGINT or SIGTERM: stop the gateway."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir", type=Path, default=ROOT / "data", help="the running `llm-mesh up`'s data directory"
    )
    parser.add_argument(
        "--router", default=None, help="router host:port (default: the running mesh's, from its lock file)"
    )
    parser.add_argument(
        "--listen", default=GATEWAY_LISTEN, help=f"REST address (default {GATEWAY_LISTEN}; port 0 = any free)"
    )


def find_router(data_dir: Path) -> tuple[str | None, str]:
    """The running mesh's router address, or None and why not."""
    owner = running_mesh(data_dir)
    if owner is None:
        return (
            None,
            f"no llm-mesh is running with data in {data_dir} (start one with `llm-mesh up`, or pass --router)",
        )
    router = owner.get("router")
    if not isinstance(router, str) or router == "starting":
        return (
            None,
            f"the mesh (pid {owner.get('pid', '?')}) is still starting: try again once it says it is up",
        )
    return router, ""


def run(args: argparse.Namespace) -> int:
    router = args.router
    if router is None:
        router, why = find_router(args.data_dir.resolve())
        if router is None:
            print(f"llm-mesh gateway: {why}", file=sys.stderr)
            return 1
    return attach(router, args.listen, args.data_dir.resolve())


def attach(router: str, listen: str, data_dir: Path) -> int:
    """Run the gateway in front of ``router`` until a signal; its exit status otherwise."""
    if not os.access(GATEWAY_BINARY, os.X_OK):
        print(
            f"llm-mesh gateway: not built ({GATEWAY_BINARY} missing): run `make gateway` first",
            file=sys.stderr,
        )
        return 1
    log = data_dir / "logs" / "gateway-attached.log"
    child = ChildProcess(
        "gateway",
        [
            str(GATEWAY_BINARY),
            "--listen",
            listen,
            "--upstream",
            router,
            "--shutdown-grace",
            f"{SHUTDOWN_GRACE_S:g}s",
        ],
        log,
        dict(os.environ),
    )

    def request_stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise GatewayStop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Its own session (ChildProcess): Ctrl-C reaches this command, which decides the shutdown.
        child.start()
        child.wait_listening(time.monotonic() + START_TIMEOUT_S)
        address = child.address
        print(READY_LINE, flush=True)
        print(f"  gateway      http://{address}  → router {router}", flush=True)
        print(f"  try it:      curl http://{address}/healthz", flush=True)
        print(f"  log          {log}", flush=True)
        print("stop: Ctrl-C here (the mesh keeps running)", flush=True)
        while child.alive():
            time.sleep(0.2)
        print(f"llm-mesh gateway: the gateway exited (code {child.returncode}); see {log}", file=sys.stderr)
        return 1
    except GatewayStop as stop:
        print(f"llm-mesh gateway stopping ({stop}) …", flush=True)
        return 0
    except ChildFailed as exc:
        print(f"llm-mesh gateway: {exc}", file=sys.stderr)
        return 1
    finally:
        child.terminate()
        child.wait_exit(STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("llm-mesh gateway stopped", flush=True)
