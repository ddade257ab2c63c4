"""`llm-mesh ask "question"`: one turn through the router, streamed to the terminal, then its sources."""

from __future__ import annotations

import argparse
import sys

import grpc

from services.client.connection import (
    add_connection_arguments,
    add_turn_arguments,
    call_metadata,
    describe_error,
    format_citations,
    open_router,
    turn_request,
)
from services.gen.llmmesh.v1 import common_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    add_turn_arguments(parser)
    parser.add_argument("question", help="what to ask")


def run(args: argparse.Namespace) -> int:
    if not args.question.strip():
        print("error: the question is empty", file=sys.stderr)
        return 2
    request = turn_request(args, [common_pb2.ChatMessage(role="user", content=args.question)])
    channel, stub = open_router(args.router)
    try:
        for reply in stub.ChatStream(request, metadata=call_metadata(args.api_key)):
            if reply.HasField("delta"):
                sys.stdout.write(reply.delta.text)
                sys.stdout.flush()
            elif reply.HasField("end"):
                end = reply.end
                print()
                if end.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    print(f"error: {end.error_message}", file=sys.stderr)
                    return 1
                if end.citations:
                    print("sources:")
                    for line in format_citations(list(end.citations)):
                        print(f"  {line}")
                elif args.rag:
                    print("sources: none found (ingest documents with `llm-mesh ingest PATH`)")
                if end.degraded:
                    print(f"note: degraded ({'; '.join(end.degraded_reasons)})", file=sys.stderr)
        return 0
    except grpc.RpcError as error:
        print(describe_error(error, args.router), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Leaving the stream cancels the RPC, and the router cancels the generation.
        print("\n[interrupted]")
        return 130
    finally:
        channel.close()
