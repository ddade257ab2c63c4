"""`llm-mesh up` (and `make up`): run the whole mesh locally until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from services.common.model_names import served_model_name
from services.common.redact import masked_url
from services.common.settings import ROUTER_HTTP_PORT, ROUTER_PORT
from services.launcher.children import ChildFailed
from services.launcher.gateway import attach, find_router
from services.launcher.lock import AlreadyRunning, MeshLock, port_in_use
from services.launcher.mesh import DEFAULT_MODEL, GATEWAY_LISTEN, INTERNAL_HOST, ROOT, LocalMesh, MeshConfig
from services.launcher.supervision import RestartPolicy
from services.launcher.supervisor import ChildGaveUp, Supervisor

DEFAULT_ROUTER = f"127.0.0.1:{ROUTER_PORT}"
# Tests and scripts wait for this exact line.
READY_LINE = "llm-mesh is up"


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived: unwind whatever the launcher is doing and stop the mesh."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=int,
        default=MeshConfig.replicas,
        help="inference replicas (ports 50052, 50062, …); default 1",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=MeshConfig.router_port,
        help="router port (0 = every service on a free port)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=ROUTER_HTTP_PORT,
        help=f"the router's OpenAI-compatible HTTP port (default {ROUTER_HTTP_PORT}; -1 = off)",
    )
    parser.add_argument(
        "--host",
        default=MeshConfig.host,
        help="address the router listens on; Redis, session, retriever and the replicas "
        "always listen on 127.0.0.1, reachable only through the router",
    )
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data", help="Redis, Milvus Lite and logs")
    parser.add_argument("--model", type=Path, default=MeshConfig.model, help="model directory for inference")
    parser.add_argument("--device", default=MeshConfig.device, help="inference device: auto, cpu or cuda")
    parser.add_argument(
        "--memory-limit-mib",
        type=int,
        default=None,
        help="memory for the whole mesh; the replicas share what the other services leave "
        "(default: the cgroup's limit, else the machine's RAM)",
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        default=os.environ.get("LLMMESH_API_KEYS_FILE") or None,
        help="API keys for the router (`llm-mesh keys add` writes data/keys.yaml); default: off, "
        "every caller one tenant [env LLMMESH_API_KEYS_FILE]",
    )
    parser.add_argument(
        "--gateway",
        action="store_true",
        help="also start the REST gateway on 127.0.0.1:8080 (if built); with a mesh already running "
        "on --data-dir, attach just the gateway to it (as `llm-mesh gateway`)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=MeshConfig.startup_timeout_s,
        help="seconds for every service to be SERVING",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=MeshConfig.stop_timeout_s,
        help="seconds a service may drain before SIGKILL",
    )


def config_from_args(args: argparse.Namespace) -> MeshConfig:
    return MeshConfig(
        data_dir=args.data_dir.resolve(),
        model=args.model.resolve(),
        replicas=args.replicas,
        host=args.host,
        router_port=args.port,
        http_port=None if args.http_port < 0 else args.http_port,
        # An existing Redis / Milvus wins over the embedded ones, as in every deployment.
        redis_url=os.environ.get("REDIS_URL") or None,
        milvus_uri=os.environ.get("MILVUS_URI") or None,
        gateway=args.gateway,
        api_keys_file=Path(args.api_keys_file).resolve() if args.api_keys_file else None,
        device=args.device,
        memory_limit_mib=args.memory_limit_mib,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
    )


def check_model(model: Path) -> None:
    """``ValueError`` unless ``model`` is one the replicas load: a model directory (with its
    config.json) or a GGUF file. The default one is fetched when missing (``ensure_model``)."""
    if (model / "config.json").exists() or (model.is_file() and model.suffix == ".gguf"):
        return
    if model != DEFAULT_MODEL.resolve():
        raise ValueError(f"--model {model}: neither a model directory (with config.json) nor a .gguf file")


def ensure_model(model: Path) -> None:
    """Fetch the default model on a fresh checkout; any other model must already be there."""
    check_model(model)
    if (model / "config.json").exists() or model.is_file():
        return
    print(f"fetching the default model into {model} (once) …", flush=True)
    subprocess.run(
        [sys.executable, "-m", "services.inference.fetch_model", "--out", str(model)], cwd=ROOT, check=True
    )


def openai_base_url(mesh: LocalMesh) -> str | None:
    """The OpenAI base URL of the router's HTTP front (loopback when it listens on every address)."""
    router = mesh.router
    if router is None or router.http_port is None:
        return None
    host = "127.0.0.1" if router.host in ("0.0.0.0", "::") else router.host
    return f"http://{host}:{router.http_port}/v1"


def ready_block(mesh: LocalMesh, config: MeshConfig) -> str:
    endpoints = mesh.endpoints()
    metrics = mesh.metrics_endpoints()
    router = endpoints["router"]
    lines = [READY_LINE]
    for name, address in endpoints.items():
        extra = f"   metrics http://{metrics[name]}/metrics" if name in metrics else ""
        if name == "gateway":
            extra = f"   REST: curl http://{address}/healthz"
        lines.append(f"  {name:<12} {address}{extra}")
    lines.append(f"  {'redis':<12} {masked_url(mesh.redis_url or '')}" if mesh.redis is None else "")
    if (base := openai_base_url(mesh)) is not None:
        lines.append(f"  {'openai':<12} {base}   (OPENAI_BASE_URL for the OpenAI SDKs)")
    lines.append(f"  {'milvus':<12} {masked_url(config.milvus)}")
    lines.append(f"  {'logs':<12} {config.data_dir / 'logs'}")
    # Name addresses only where they differ from the clients' defaults.
    to_router = "" if router == DEFAULT_ROUTER else f" --router {router}"
    data_dir = "" if config.data_dir == (ROOT / "data").resolve() else f" --data-dir {config.data_dir}"
    # With keys on, every example carries one: a keyless example would only show UNAUTHENTICATED.
    keyed = config.api_keys_file is not None
    grpc_auth = ' -H "authorization: Bearer $LLMMESH_API_KEY"' if keyed else ""
    http_auth = ' -H "authorization: Bearer $LLMMESH_API_KEY"' if keyed else ""
    lines += [
        *(
            [
                f"api keys: on ({config.api_keys_file}); a key: export LLMMESH_API_KEY=$(llm-mesh keys add "
                f"--file {config.api_keys_file} --tenant NAME)  (the clients read it)"
            ]
            if keyed
            else []
        ),
        "try it:",
        f"  grpcurl -plaintext{grpc_auth} -d "
        f'\'{{"messages":[{{"role":"user","content":"What is llm-mesh?"}}],'
        f'"sampling":{{"max_tokens":64}}}}\' {router} llmmesh.v1.Router/Complete',
        *(
            [
                f"  curl {base}/chat/completions -H 'content-type: application/json'{http_auth} "
                f'-d \'{{"model":"{served_model_name(config.model)}",'
                f'"messages":[{{"role":"user","content":"What is llm-mesh?"}}],"max_tokens":64}}\''
            ]
            if base is not None
            else []
        ),
        f"  llm-mesh chat{to_router}",
        f"  llm-mesh ingest{to_router} examples/docs && llm-mesh ask{to_router} --rag 'How do I stop llm-mesh?'",
        f"  llm-mesh status{to_router}{data_dir}",
        f"stop: Ctrl-C here, or kill -TERM {os.getpid()}",
    ]
    return "\n".join(line for line in lines if line)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        check_model(config.model)
        config.memory_plan()  # refuse now, not after Redis and the services have started
    except ValueError as exc:
        print(f"llm-mesh up: {exc}", file=sys.stderr)
        return 2
    lock = MeshLock(config.data_dir)
    try:
        lock.acquire()
    except AlreadyRunning as exc:
        if args.gateway:
            # `up --gateway` on a running mesh adds just the gateway, in front of that mesh's router.
            return attach_gateway(config.data_dir)
        print(str(exc), file=sys.stderr)
        return 1
    try:
        if port_in_use(config.host, config.router_port):
            print(
                f"llm-mesh is already running, or something else listens on {config.host}:{config.router_port}; "
                "stop it first or pass --port",
                file=sys.stderr,
            )
            return 1
        for service, port in config.internal_ports():
            if port_in_use(INTERNAL_HOST, port):
                print(
                    f"something else listens on {INTERNAL_HOST}:{port} (the {service}'s port; another "
                    "mesh?); stop it first, or pass --port 0 to put every service on a free port",
                    file=sys.stderr,
                )
                return 1
        # With --port 0 the HTTP front takes a free port too: 8000 being taken is no reason to stop.
        if config.http_port and port_in_use(config.host, config.port(config.http_port)):
            print(
                f"something else listens on {config.host}:{config.http_port} (the router's OpenAI HTTP port); "
                "stop it first or pass --http-port (-1 = no HTTP front)",
                file=sys.stderr,
            )
            return 1
        ensure_model(config.model)
        return _run_mesh(config, lock)
    finally:
        lock.release()


def attach_gateway(data_dir: Path) -> int:
    router, why = find_router(data_dir)
    if router is None:
        print(f"llm-mesh up --gateway: {why}", file=sys.stderr)
        return 1
    print(f"llm-mesh is already running (router {router}): attaching the gateway to it", flush=True)
    return attach(router, GATEWAY_LISTEN, data_dir)


def record_mesh(lock: MeshLock, mesh: LocalMesh) -> None:
    """What `llm-mesh status` and operators read from the lock file: addresses, metrics, pids."""
    endpoints = mesh.endpoints()
    lock.record(
        router=endpoints["router"], endpoints=endpoints, metrics=mesh.metrics_endpoints(), pids=mesh.pids()
    )


def _run_mesh(config: MeshConfig, lock: MeshLock) -> int:
    mesh = LocalMesh(config, say=lambda line: print(line, flush=True))

    def request_stop(signum: int, frame: FrameType | None) -> None:
        # Later signals only repeat what is already under way.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise StopRequested(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        print(
            f"llm-mesh starting ({config.replicas} inference replica(s), data in {config.data_dir}) …",
            flush=True,
        )
        # A child failing before this point stops `up` (ChildFailed): nothing was ever served.
        mesh.start()
        record_mesh(lock, mesh)
        print(ready_block(mesh, config), flush=True)
        # From here on a child that dies is restarted, and the rest keep serving meanwhile.
        supervisor = Supervisor(
            mesh.started,
            RestartPolicy(),
            say=lambda line: print(line, flush=True),
            ready_timeout_s=config.startup_timeout_s,
            on_ready=lambda child: record_mesh(lock, mesh),  # its metrics port and pid are new
        )
        while True:
            supervisor.step()
            time.sleep(0.5)
    except StopRequested as stop:
        print(f"llm-mesh stopping ({stop}) …", flush=True)
    except (ChildFailed, ChildGaveUp) as exc:
        print(f"llm-mesh: {exc}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        mesh.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("llm-mesh stopped", flush=True)
    return code
