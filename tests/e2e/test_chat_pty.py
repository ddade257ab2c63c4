"""`llm-mesh chat` in a pseudo-terminal: the answer streams in, Ctrl-C interrupts it and the prompt
returns, the chat goes on, Ctrl-D leaves."""

from __future__ import annotations

import sys
import time

from tests.e2e.launched_mesh import ROOT, LaunchedMesh
from tests.e2e.terminal import PseudoTerminal

PROMPT = r"you> "
# Three words of an answer: tokens are arriving one by one, and the answer is far from done
# (--ignore-eos with 200 tokens takes many seconds on a CPU).
STREAMING = r"llm-mesh> \S+\s+\S+\s+\S+"


def test_ctrl_c_interrupts_the_answer_and_the_prompt_returns(mesh: LaunchedMesh) -> None:
    argv = [sys.executable, "-m", "services.cli", "chat", "--router", mesh.router]
    argv += ["--max-tokens", "200", "--ignore-eos", "--temperature", "0"]
    terminal = PseudoTerminal(argv, mesh.env, str(ROOT))
    try:
        terminal.expect(PROMPT, timeout=60)
        for question in ("Tell me a long story about a dragon.", "Now tell me one about a ship."):
            asked = len(terminal.transcript)
            terminal.send(question + "\r")
            streaming = terminal.expect(STREAMING, timeout=180, start=asked)
            terminal.send("\x03")  # Ctrl-C: the terminal turns it into SIGINT
            interrupted = terminal.expect(r"\[interrupted\]", timeout=30, start=streaming.end())
            terminal.expect(PROMPT, timeout=10, start=interrupted.end())
            answer = terminal.transcript[streaming.start() : interrupted.start()]
            # Cut short: 200 tokens would be well over a hundred words.
            assert len(answer.split()) < 100, answer
            # The cancel reached the server: nothing more streams in after the prompt came back.
            settled = len(terminal.transcript)
            time.sleep(1.0)
            terminal.read_available(0.2)
            assert terminal.transcript[settled:].strip() == ""
        assert terminal.running(), "Ctrl-C must not end the chat"
        terminal.send("\x04")  # Ctrl-D at the prompt leaves
        assert terminal.wait_exit(timeout=20) == 0
        assert "Traceback" not in terminal.transcript
    finally:
        terminal.close()
