"""The gateway's Go side: gofmt, `go vet` and its unit tests (main_test.go), against the generated code."""

from __future__ import annotations

import subprocess

from tests.support.gateway import GATEWAY_DIR, ensure_gateway_built, go_environment

GO_SOURCES = ["main.go", "main_test.go"]


def go(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["go", *args],
        cwd=GATEWAY_DIR,
        env=go_environment(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_go_sources_are_gofmt_clean_and_vet_clean() -> None:
    ensure_gateway_built()  # writes the generated packages main.go imports
    unformatted = subprocess.run(
        ["gofmt", "-l", *GO_SOURCES], cwd=GATEWAY_DIR, capture_output=True, text=True, check=True
    ).stdout.split()
    vet = go("vet", ".")

    assert unformatted == [], f"run gofmt -w on {unformatted}"
    assert vet.returncode == 0, vet.stderr


def test_go_unit_tests_pass() -> None:
    ensure_gateway_built()
    result = go("test", "-count=1", ".")

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
