"""The router's gRPC I/O choice: the poller by default, EventEngine on request, an operator's setting kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.router import grpc_io


def test_the_poller_is_the_default() -> None:
    env: dict[str, str] = {}
    assert grpc_io.configure(env) == "poller"
    assert env["GRPC_EXPERIMENTS"] == grpc_io.POLLER_EXPERIMENTS


def test_eventengine_leaves_grpc_as_it_is() -> None:
    env = {grpc_io.ENV: "eventengine"}
    assert grpc_io.configure(env) == "eventengine"
    assert "GRPC_EXPERIMENTS" not in env


def test_an_operators_own_experiments_are_kept() -> None:
    env = {"GRPC_EXPERIMENTS": "some_experiment"}
    grpc_io.configure(env)
    assert env["GRPC_EXPERIMENTS"] == "some_experiment"


def test_a_wrong_choice_is_refused_at_start_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="poller, eventengine"):
        grpc_io.configure({grpc_io.ENV: "threads"})
    run = subprocess.run(
        [sys.executable, "-m", "services.router", "--port", "0"],
        env={grpc_io.ENV: "threads", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "LLMMESH_ROUTER_GRPC_IO must be one of poller, eventengine" in run.stderr
