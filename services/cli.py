"""The `llm-mesh` command: one entry point, one module per subcommand.

Each subcommand lives beside the code it drives and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches,
so services can add commands without touching each other.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("services.launcher.up", "run the whole mesh locally on embedded defaults"),
    "gateway": ("services.launcher.gateway", "attach the REST gateway to the running mesh's router"),
    "chat": ("services.client.chat", "interactive streaming chat through the router"),
    "ask": ("services.client.ask", "ask one question through the router"),
    "status": ("services.client.status", "replicas, health, load and cache hit rate"),
    "ingest": ("services.client.ingest", "ingest files or folders through the router"),
    "keys": ("services.router.admission.keys", "add, list or revoke API keys (data/keys.yaml by default)"),
    "bench": ("bench.cli", "run a benchmark (engine, router, retriever, load)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="llm-mesh", description="llm-mesh: LLM serving over gRPC")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only the chosen subcommand's module is imported: `llm-mesh ask` must not load torch.
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        cmd_parser = sub.add_parser(name, help=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(cmd_parser)
            cmd_parser.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except BrokenPipeError:
        # The reader of our output left (`llm-mesh ask … | head -1`): stop quietly, as Unix tools
        # do, with the shell's status for SIGPIPE. Pointing stdout at /dev/null keeps the
        # interpreter's own flush at exit from raising again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
