"""`llm-mesh chat`: an interactive conversation over the router's bidirectional Chat stream.

Tokens are printed as they arrive. Ctrl-C during an answer sends a cancel on
the same stream and returns to the prompt; Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from llm_mesh_client import Conversation, Delta, MeshError, StreamEnded, SyncMeshClient
from llm_mesh_client.pb import common_pb2, router_pb2

from services.client.answers import footer
from services.client.connection import (
    add_connection_arguments,
    add_turn_arguments,
    describe_error,
    format_citations,
    open_client,
    turn_arguments_problem,
    turn_request,
)

PROMPT = "you> "
ANSWER_PREFIX = "llm-mesh> "
INTERRUPTED = "[interrupted]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    add_turn_arguments(parser)


class ChatTerminal:
    """The read–send–stream loop. Without --session the client keeps the history and sends it whole."""

    def __init__(self, args: argparse.Namespace, client: SyncMeshClient) -> None:
        self.args = args
        self.client = client
        self.history: list[common_pb2.ChatMessage] = []
        self.stream: Conversation | None = None
        # A turn failed: the exit status says so (1) for a script that pipes its questions in.
        self.failed = False

    def loop(self) -> int:
        session = f", session {self.args.session}" if self.args.session else ""
        print(f"llm-mesh chat via {self.args.router}{session}. Ctrl-C interrupts an answer, Ctrl-D quits.")
        try:
            while True:
                try:
                    line = input(PROMPT)
                except EOFError:
                    print()
                    return 1 if self.failed else 0
                except KeyboardInterrupt:
                    # At the prompt Ctrl-C just clears the line, as in a shell.
                    print()
                    continue
                if line.strip():
                    self.turn(line)
        finally:
            if self.stream is not None:
                self.stream.close()

    def turn(self, text: str) -> None:
        user = common_pb2.ChatMessage(role="user", content=text)
        messages = [user] if self.args.session else [*self.history, user]
        if self.stream is None:
            self.stream = self.client.conversation()
        self.stream.send(turn_request(self.args, messages))
        answer = self.stream_answer(self.stream)
        if answer is not None:
            self.history += [user, common_pb2.ChatMessage(role="assistant", content=answer)]

    def stream_answer(self, stream: Conversation) -> str | None:
        """Print the answer as it streams; the text the model produced, or None if the stream broke."""
        parts: list[str] = []
        cancelled = False
        sys.stdout.write(ANSWER_PREFIX)
        sys.stdout.flush()
        while True:
            try:
                event = stream.next_event()
                if isinstance(event, Delta):
                    parts.append(event.text)
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                else:
                    self.finish_turn(event.turn, cancelled)
                    return "".join(parts)
            except KeyboardInterrupt:
                if not cancelled:
                    # The router ends the turn with CANCELLED; the conversation stays open.
                    cancelled = True
                    stream.cancel()
                    continue
                # A second Ctrl-C does not wait for the router: drop this stream, keep the chat.
                self.reset_stream()
                print(f" {INTERRUPTED}")
                return "".join(parts)
            except StreamEnded:
                print()
                print(
                    "error: the router closed the conversation; the next message opens a new one",
                    file=sys.stderr,
                )
                self.failed = True
                self.reset_stream()
                return None
            except MeshError as error:
                print()
                print(describe_error(error, self.args.router), file=sys.stderr)
                self.failed = True
                self.reset_stream()
                return None

    def finish_turn(self, end: router_pb2.TurnEnd, cancelled: bool) -> None:
        if cancelled or end.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
            print(f" {INTERRUPTED}")
            return
        print()
        if end.finish_reason == common_pb2.FINISH_REASON_ERROR:
            print(f"error: {end.error_message}", file=sys.stderr)
            self.failed = True
        elif (note := footer(end)) is not None:
            print(note)
        for line in format_citations(list(end.citations)):
            print(f"  {line}")

    def reset_stream(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.close()
        self.stream = None


def run(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    # Ctrl-C is how an answer is interrupted, even when a parent started us with SIGINT
    # ignored (a shell's `cmd &`, nohup): Python would then inherit SIG_IGN.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if (problem := turn_arguments_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with open_client(args) as client:
        return ChatTerminal(args, client).loop()
