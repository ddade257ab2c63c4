"""`llm-mesh ask "question"`: one turn through the router, streamed to the terminal, then its sources.

An answer that did not end by itself says why on a last line (`[length: 256 tokens]`,
`[cancelled]`, `[degraded: …]`), so a cut answer never passes for a whole one; `--json`
prints one JSON object instead, for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys

from llm_mesh_client import Delta, MeshError
from llm_mesh_client.pb import common_pb2, router_pb2

from services.client.answers import footer, json_answer
from services.client.connection import (
    add_connection_arguments,
    add_turn_arguments,
    describe_error,
    format_citations,
    open_client,
    turn_arguments_problem,
    turn_request,
)
from services.client.constraints import add_constraint_arguments, apply_constraint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    add_turn_arguments(parser)
    add_constraint_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (text, finish_reason, usage, …) at the end"
    )
    parser.add_argument("question", help="what to ask")


def run(args: argparse.Namespace) -> int:
    if not args.question.strip():
        print("error: the question is empty", file=sys.stderr)
        return 2
    if (problem := turn_arguments_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    request = turn_request(args, [common_pb2.ChatMessage(role="user", content=args.question)])
    if (problem := apply_constraint(args, request.sampling)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    client = open_client(args)
    parts: list[str] = []
    try:
        for event in client.chat(request):
            if isinstance(event, Delta):
                parts.append(event.text)
                if not args.json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            else:
                return finish(args, "".join(parts), event.turn)
        return 0
    except MeshError as error:
        print(describe_error(error, args.router), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Leaving the stream cancels the RPC, and the router cancels the generation. With --json
        # stdout is for the JSON answer alone: a script must not read this note as one.
        print("\n[interrupted]", file=sys.stderr if args.json else sys.stdout)
        return 130
    finally:
        client.close()


def finish(args: argparse.Namespace, text: str, end: router_pb2.TurnEnd) -> int:
    failed = end.finish_reason == common_pb2.FINISH_REASON_ERROR
    if args.json:
        print(json.dumps(json_answer(text, end), ensure_ascii=False))
        return 1 if failed else 0
    print()
    if failed:
        print(f"error: {end.error_message}", file=sys.stderr)
        return 1
    if (note := footer(end)) is not None:
        print(note)
    if end.citations:
        print("sources:")
        for line in format_citations(list(end.citations)):
            print(f"  {line}")
    elif args.rag:
        print("sources: none found (ingest documents with `llm-mesh ingest PATH`)")
    return 0
