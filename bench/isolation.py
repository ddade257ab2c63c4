"""``bench.engine --isolate``: each method's warm-up and round in a fresh process of its own.

Engines built in one process were measured to slow each other: a compiled and an eager
llm-mesh engine in one process ran 2-5 % apart one way, and in fresh processes, alternating,
7 % apart the other (docs/benchmarks.md, the compiled step). Here the parent only plans and
reports: each (round, method) is a child ``python -m bench.engine`` given the same settings,
which builds that one method, warms it up, times one round and hands back its summary and
tokens; the order still rotates round by round, against the machine's drift.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.timings import MethodRun, Summary

#: Settings that describe the parent's run, not the child's one method and round.
_PARENT_ONLY = ("only", "rounds", "json", "isolate", "child_args", "child_out")


def run_isolated(
    args: argparse.Namespace, methods: list[str], console: Any
) -> tuple[list[dict[str, Summary]], dict[str, MethodRun], list[str]]:
    """Per-round summaries, each method's last round, and the notes, measured in child processes."""
    settings = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in _PARENT_ONLY
    }
    per_round: list[dict[str, Summary]] = []
    last_runs: dict[str, MethodRun] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-isolate-") as tmp:
        for index in range(args.rounds):
            order = methods[index % len(methods) :] + methods[: index % len(methods)]
            summaries: dict[str, Summary] = {}
            for method in order:
                console.print(f"round {index + 1}/{args.rounds}: {method} (own process) …")
                child_args = Path(tmp) / f"{index}-{method}.json"
                child_out = Path(tmp) / f"{index}-{method}.pickle"
                child_args.write_text(json.dumps({**settings, "only": method}))
                command = [sys.executable, "-m", "bench.engine", "--child-args", str(child_args)]
                done = subprocess.run([*command, "--child-out", str(child_out)], check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"{method}'s process exited {done.returncode}")
                summary, method_run, child_notes = read_child_result(child_out)
                summaries[method] = summary
                last_runs[method] = method_run
                notes += [n for n in child_notes if n not in notes]
                console.print(f"  {method}: {summary.tok_s:.1f} tok/s")
            per_round.append(summaries)
    return per_round, last_runs, notes


def child_namespace(path: Path, out: Path) -> argparse.Namespace:
    """The settings a child runs with: the parent's, for its one method and one round."""
    settings = json.loads(path.read_text())
    settings["model"] = str(settings["model"])
    return argparse.Namespace(**settings, rounds=1, json=None, isolate=False, child_args=path, child_out=out)


def write_child_result(path: Path, summary: Summary, method_run: MethodRun, notes: list[str]) -> None:
    path.write_bytes(pickle.dumps((summary, method_run, notes)))


def read_child_result(path: Path) -> tuple[Summary, MethodRun, list[str]]:
    # Written a moment ago by this benchmark's own child process, from a private temp folder.
    summary, method_run, notes = pickle.loads(path.read_bytes())
    return summary, method_run, notes
