"""`llm-mesh ingest`: which files become which document ids, why others are skipped, and which
refusals it sends a document again after."""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import grpc
import pytest
from llm_mesh_client import MeshError

from services import cli
from services.client.ingest import (
    CONNECT_TIMEOUT_S,
    IngestReport,
    UsageError,
    exit_status,
    ingest_with_retries,
    parse_metadata,
    plan,
)
from services.gen.llmmesh.v1 import retriever_pb2 as pb
from services.launcher.readiness import free_port


def test_folders_become_relative_ids_and_unsupported_files_are_skipped_with_a_reason(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "guides").mkdir(parents=True)
    (docs / "guides" / "setup.md").write_text("# Setup")
    (docs / "faq.html").write_text("<p>faq</p>")
    (docs / "logo.png").write_bytes(b"\x89PNG")
    (docs / ".git").mkdir()
    (docs / ".git" / "notes.txt").write_text("hidden")
    single = tmp_path / "single.txt"
    single.write_text("one file")

    planned, skipped = plan([docs, single, tmp_path / "missing"], id_prefix="kb/")

    assert [(p.document_id, p.path.name) for p in planned] == [
        ("kb/faq.html", "faq.html"),
        ("kb/guides/setup.md", "setup.md"),
        ("kb/single.txt", "single.txt"),
    ]
    assert [(Path(path).name, reason) for path, reason in skipped] == [
        ("logo.png", "unsupported type .png"),
        ("missing", "no such file or folder"),
    ]


def test_a_path_that_is_there_but_not_a_file_or_folder_says_what_it_is(tmp_path: Path) -> None:
    # A named pipe was "no such file or folder", which sent users looking for a typo.
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    dangling = tmp_path / "gone.md"
    dangling.symlink_to(tmp_path / "deleted.md")
    _, skipped = plan([fifo, dangling])
    assert [(Path(path).name, reason) for path, reason in skipped] == [
        ("pipe.txt", "not a regular file or folder (a named pipe)"),
        ("gone.md", "broken symbolic link"),
    ]


def test_metadata_pairs_need_a_key_and_an_equals_sign() -> None:
    assert parse_metadata(["team=docs", "note=a=b"]) == {"team": "docs", "note": "a=b"}
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_metadata(["no-equals"])


class Answers:
    """A send() that fails with the given codes in turn, then answers."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.calls = 0

    def __call__(self) -> pb.IngestSummary:
        self.calls += 1
        if self.codes:
            raise MeshError("busy", self.codes.pop(0))
        return pb.IngestSummary(document_id="doc", version=3, chunks=2)


def test_aborted_and_unavailable_are_sent_again_after_doubling_waits() -> None:
    send = Answers(grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    announced: list[tuple[str, float]] = []
    slept: list[float] = []

    summary, retries = ingest_with_retries(
        send,
        retries=4,
        first_s=1.0,
        on_retry=lambda exc, wait_s: announced.append((exc.code.name, wait_s)),
        sleep=slept.append,
        rng=random.Random(7),
    )

    assert (summary.version, retries, send.calls) == (3, 3, 4)
    assert [code for code, _ in announced] == ["ABORTED", "UNAVAILABLE", "ABORTED"]
    assert slept == [wait for _, wait in announced]
    # Doubling from 1 s, each within ±20 %.
    for retry, wait in enumerate(slept):
        assert 0.8 * 2**retry <= wait <= 1.2 * 2**retry
    assert len(set(slept)) == 3


def test_a_document_still_refused_after_the_last_retry_fails_with_the_last_answer() -> None:
    send = Answers(*[grpc.StatusCode.ABORTED] * 3)
    with pytest.raises(MeshError) as caught:
        ingest_with_retries(send, retries=2, first_s=0.5, on_retry=lambda *_: None, sleep=lambda _: None)
    assert caught.value.code == grpc.StatusCode.ABORTED
    assert send.calls == 3


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED],
)
def test_answers_that_would_not_change_are_not_retried(code: grpc.StatusCode) -> None:
    send = Answers(code)
    with pytest.raises(MeshError):
        ingest_with_retries(send, retries=4, first_s=1.0, on_retry=lambda *_: None, sleep=lambda _: None)
    assert send.calls == 1


def test_no_retries_means_one_attempt() -> None:
    send = Answers(grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(MeshError):
        ingest_with_retries(send, retries=0, first_s=1.0, on_retry=lambda *_: None, sleep=lambda _: None)
    assert send.calls == 1


@pytest.mark.parametrize(
    ("flag", "instead"), [("--retriever-addr", "--router HOST:PORT"), ("--tenant", "--api-key")]
)
def test_the_old_direct_to_retriever_flags_say_what_to_pass_instead(
    tmp_path: Path, flag: str, instead: str, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "notes.txt"
    document.write_text("never sent")
    # Refused before any connection (the router address here listens nowhere), as a usage error:
    # exit 2, as the README says (it was 1, by SystemExit's message).
    assert cli.main(["ingest", str(document), "--router", "127.0.0.1:1", flag, "somewhere"]) == 2
    assert re.search(rf"{flag} is gone: .*{instead}", capsys.readouterr().err)


def test_a_bad_metadata_pair_or_retry_count_is_a_usage_error_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "notes.txt"
    document.write_text("never sent")
    for bad in (["--metadata", "no-equals"], ["--retries", "-1"]):
        assert cli.main(["ingest", str(document), "--router", "127.0.0.1:1", *bad]) == 2
        assert capsys.readouterr().err.startswith("error: ")


def test_a_file_name_that_is_not_utf8_is_skipped_with_its_reason_and_the_rest_planned(tmp_path: Path) -> None:
    """A document id must be UTF-8: such a name crashed the whole run with UnicodeEncodeError."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "z.md").write_text("# Z")
    (folder / os.fsdecode(b"caf\xe9.md")).write_bytes(b"# cafe")
    planned, skipped = plan([folder])
    assert [d.document_id for d in planned] == ["z.md"]
    assert [(Path(p).name, reason) for p, reason in skipped] == [("caf\ufffd.md", "file name is not UTF-8")]


def test_with_no_router_listening_ingest_says_the_mesh_is_not_up_and_exits_2_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = tmp_path / "notes.txt"
    document.write_text("never sent")
    started = time.monotonic()
    status = cli.main(["ingest", str(document), "--router", f"127.0.0.1:{free_port()}"])
    assert status == 2
    assert "is the mesh up? start it with `llm-mesh up`" in capsys.readouterr().err
    # No retry-with-backoff of a connection that cannot open (4 retries would be ~15 s).
    assert time.monotonic() - started < CONNECT_TIMEOUT_S + 2


def test_exit_status_is_0_only_when_every_file_given_went_in() -> None:
    assert exit_status(IngestReport(ingested=2, unchanged=1)) == 0
    assert exit_status(IngestReport(ingested=2, skipped=[("a.rst", "unsupported type .rst")])) == 1
    assert exit_status(IngestReport(skipped=[("missing.txt", "no such file or folder")])) == 1
    assert exit_status(IngestReport(ingested=1, rejected=[("b.pdf", "INVALID_ARGUMENT: broken")])) == 1
