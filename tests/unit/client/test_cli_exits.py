"""How `llm-mesh` ends when its reader leaves or the user presses Ctrl-C: quietly, with the shell's status."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest

from services import cli
from tests.support.processes import ROOT


def command(raises: BaseException) -> types.ModuleType:
    module = types.ModuleType("fake_command")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        return None

    def run(args: argparse.Namespace) -> int:
        raise raises

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize(("raised", "status"), [(BrokenPipeError(), 141), (KeyboardInterrupt(), 130)])
def test_a_gone_reader_or_ctrl_c_ends_with_the_shells_status_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, raised: BaseException, status: int
) -> None:
    monkeypatch.setitem(sys.modules, "fake_command", command(raised))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "a command that fails"))
    assert cli.main(["fake"]) == status


def test_a_pipe_closed_by_its_reader_prints_no_traceback() -> None:
    """`llm-mesh … | head -1` on a long output: the traceback of the BrokenPipeError went to the terminal."""
    script = (
        "import sys, types\n"
        "from services import cli\n"
        "m = types.ModuleType('talkative')\n"
        "m.add_arguments = lambda parser: None\n"
        "def run(args):\n"
        "    for i in range(200000):\n"
        "        sys.stdout.write(f'line {i}\\n')\n"
        "    return 0\n"
        "m.run = run\n"
        "sys.modules['talkative'] = m\n"
        "cli.COMMANDS['talk'] = ('talkative', '')\n"
        "raise SystemExit(cli.main(['talk']))\n"
    )
    pipeline = f'{sys.executable} -c "$SCRIPT" | head -1'
    done = subprocess.run(
        ["bash", "-c", pipeline], cwd=ROOT, env={"SCRIPT": script, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout == "line 0\n"
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_chat_with_piped_questions_says_a_failed_turn_on_stderr_and_exits_1() -> None:
    """A script piping its questions in saw exit 0, and the error mixed into the answers on stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "chat", "--router", "127.0.0.1:1"],
        cwd=ROOT, input="hi\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "error: UNAVAILABLE" in done.stderr and "error" not in done.stdout.lower(), (
        done.stdout,
        done.stderr,
    )
