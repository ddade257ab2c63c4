"""`llm-mesh ask --json-schema FILE | --regex RE | --choice A --choice B`: the answer's output constraint."""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_mesh_client.pb import common_pb2


def add_constraint_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", metavar="FILE", help="answer JSON valid against the JSON Schema in FILE"
    )
    group.add_argument("--regex", help="answer text that matches this regular expression, whole")
    group.add_argument(
        "--choice", action="append", metavar="TEXT", help="answer exactly one of these (repeat the flag)"
    )


def apply_constraint(args: argparse.Namespace, sampling: common_pb2.SamplingParams) -> str | None:
    """Set the constraint the flags ask for on ``sampling``; the problem (usage, exit 2) or None.
    Whether the schema or regex compiles is the replica's answer (INVALID_ARGUMENT naming it)."""
    if args.json_schema is not None:
        try:
            sampling.json_schema = Path(args.json_schema).read_text(encoding="utf-8")
        except OSError as exc:
            return f"--json-schema: cannot read {args.json_schema}: {exc.strerror}"
        except UnicodeDecodeError:
            return f"--json-schema: {args.json_schema} is not UTF-8 text (a JSON schema is)"
    elif args.regex is not None:
        sampling.regex = args.regex
    elif args.choice:
        sampling.choice.values.extend(args.choice)
    return None
