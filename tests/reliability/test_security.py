"""Security through the router (reliability matrix row 12).

API keys decide who calls; the tenant comes from the key, never from the
client's own ``x-llmmesh-*`` metadata; one tenant cannot reach another's
session, document or task; a key bursting 10× its quota is limited while
other keys keep full success and their latency; a keepalive ping flood gets
GOAWAY. Replicas are synthetic token sources (fake, no model).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from services.gen.llmmesh.v1 import retriever_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import KeyLimits
from services.router.admission.keys import add_key, revoke_key
from tests.reliability.mesh_support import Mesh, chat, synthetic_replica
from tests.support.processes import ServiceProcess
from tests.support.redis import RedisServer

QUOTA_RPS = 4.0  # the bursting key's requests per second (and burst)


class Door:
    """A router with API keys, Redis, session service, retriever and a synthetic replica."""

    def __init__(self, mesh: Mesh, keys: dict[str, str], keys_file: Path) -> None:
        self.mesh = mesh
        self.keys = keys
        self.keys_file = keys_file
        self.channel = grpc.insecure_channel(mesh.router.address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def auth(self, name: str, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[name]}"), *extra)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    tmp = Path(tmp_path_factory.mktemp("security"))
    keys_file = tmp / "keys.yaml"
    quota = KeyLimits(requests_per_second=QUOTA_RPS, burst=int(QUOTA_RPS))
    keys = {
        "acme": add_key(keys_file, "acme", "acme-main")[0],
        "globex": add_key(keys_file, "globex", "globex-main")[0],
        "bursty": add_key(keys_file, "initech", "initech-bursty", quota)[0],
        "steady": add_key(keys_file, "initech", "initech-steady", quota)[0],
        "old": add_key(keys_file, "acme", "acme-old")[0],
    }
    m = Mesh()
    try:
        m.redis = RedisServer(tmp / "redis").start()
        m.session = ServiceProcess("services.session", ["--redis-url", m.redis.url, "--log-level", "WARNING"])
        m.session.start(timeout=120)
        retriever = ServiceProcess(
            "services.retriever", ["--milvus-uri", str(tmp / "milvus.db"), "--log-level", "WARNING"]
        )
        m.others.append(retriever)
        retriever.start(timeout=300)
        m.replicas = [synthetic_replica()]
        m.replicas[0].start(timeout=120)
        m.start_router("--api-keys-file", str(keys_file), "--retriever-addr", retriever.address)
        d = Door(m, keys, keys_file)
        yield d
        d.channel.close()
    finally:
        m.stop()


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer llmk_made-up"),), (("authorization", "Basic YWRtaW46YWRtaW4="),)],
    ids=["missing", "wrong", "not-bearer"],
)
def test_missing_or_wrong_key_is_unauthenticated_on_every_rpc(
    door: Door, metadata: tuple[tuple[str, str], ...]
) -> None:
    calls = [
        lambda: door.stub.Complete(chat("hi"), metadata=metadata, timeout=10),
        lambda: list(door.stub.ChatStream(chat("hi"), metadata=metadata, timeout=10)),
        lambda: door.stub.SubmitTask(
            router_pb2.SubmitTaskRequest(request=chat("hi")), metadata=metadata, timeout=10
        ),
        lambda: door.stub.ListReplicas(router_pb2.ListReplicasRequest(), metadata=metadata, timeout=10),
        lambda: door.stub.SearchDocuments(
            retriever_pb2.SearchRequest(query="x"), metadata=metadata, timeout=10
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()


def test_revoked_key_is_unauthenticated(door: Door) -> None:
    assert door.stub.Complete(chat("still valid"), metadata=door.auth("old"), timeout=10).token_ids
    revoke_key(door.keys_file, "acme-old")
    deadline = time.monotonic() + 10
    while True:
        try:
            door.stub.Complete(chat("after revoke"), metadata=door.auth("old"), timeout=10)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() < deadline, "revoked key still accepted 10 s after the file changed"
        time.sleep(0.2)


def smuggle(tenant: str) -> tuple[tuple[str, str], ...]:
    """Internal metadata a client has no business sending."""
    return (("x-llmmesh-tenant", tenant), ("x-llmmesh-user", f"{tenant}-admin"))


def test_another_tenants_session_is_out_of_reach_even_with_smuggled_metadata(door: Door) -> None:
    """Session ids are each tenant's own (docs/session.md, Tenants): acme's turns under globex's id
    go to acme's own session and never into globex's. Until 2026-12-07 they were PERMISSION_DENIED,
    which told acme the id was in use."""
    first = door.stub.Complete(chat("my secret is 42", 4, session_id="globex-private-session"),
                               metadata=door.auth("globex"), timeout=10)  # fmt: skip
    assert first.end.session_version == 1
    for turn, metadata in enumerate((door.auth("acme"), door.auth("acme", *smuggle("globex"))), 1):
        theirs = door.stub.Complete(chat("what is the secret?", 4, session_id="globex-private-session"),
                                    metadata=metadata, timeout=10)  # fmt: skip
        assert theirs.end.session_version == turn  # acme's own session: new, then one turn on
    again = door.stub.Complete(chat("still mine?", 4, session_id="globex-private-session"),
                               metadata=door.auth("globex"), timeout=10)  # fmt: skip
    assert again.end.session_version == 2, "acme's turns reached globex's session"


def test_another_tenants_task_is_permission_denied_even_with_smuggled_metadata(door: Door) -> None:
    task = door.stub.SubmitTask(
        router_pb2.SubmitTaskRequest(request=chat("private job", 4)), metadata=door.auth("globex"), timeout=10
    )
    rpcs = [
        (door.stub.GetTask, router_pb2.GetTaskRequest(task_id=task.task_id)),
        (door.stub.CancelTask, router_pb2.CancelTaskRequest(task_id=task.task_id)),
    ]
    for metadata in (door.auth("acme"), door.auth("acme", *smuggle("globex"))):
        for rpc, request in rpcs:
            with pytest.raises(grpc.RpcError) as denied:
                rpc(request, metadata=metadata, timeout=10)  # type: ignore[operator]
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, denied.value.details()


def test_another_tenants_document_is_out_of_reach_even_with_smuggled_metadata(door: Door) -> None:
    header = retriever_pb2.DocumentHeader(document_id="globex-plan", mime_type="text/plain")
    body = b"The globex launch code word is heliotrope. It is confidential."
    requests = [retriever_pb2.IngestRequest(header=header), retriever_pb2.IngestRequest(data=body)]
    assert door.stub.IngestDocument(iter(requests), metadata=door.auth("globex"), timeout=120).chunks >= 1
    for metadata in (door.auth("acme"), door.auth("acme", *smuggle("globex"))):
        found = door.stub.SearchDocuments(
            retriever_pb2.SearchRequest(query="launch code word heliotrope"), metadata=metadata, timeout=60
        )
        assert all(c.document_id != "globex-plan" for c in found.chunks), "search crossed tenants"
        listed = door.stub.ListDocuments(retriever_pb2.ListDocumentsRequest(), metadata=metadata, timeout=30)
        assert all(d.document_id != "globex-plan" for d in listed.documents)
        with pytest.raises(grpc.RpcError) as denied:
            door.stub.DeleteDocument(
                retriever_pb2.DeleteDocumentRequest(document_id="globex-plan"), metadata=metadata, timeout=30
            )
        # NOT_FOUND as well as PERMISSION_DENIED keeps the tenant out; the retriever does not
        # even say the document exists (docs/reliability.md, row 12).
        assert denied.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND)
    mine = door.stub.ListDocuments(
        retriever_pb2.ListDocumentsRequest(), metadata=door.auth("globex"), timeout=30
    )
    assert "globex-plan" in {d.document_id for d in mine.documents}, "the other tenant's delete went through"


def timed_complete(door: Door, name: str, i: int) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        door.stub.Complete(chat(f"{name} {i}", 2), metadata=door.auth(name), timeout=10)
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
    return code, time.perf_counter() - started


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[int(0.99 * (len(ordered) - 1))]


@dataclass
class BurstRound:
    """One measurement: the steady key's calls in quiet windows and in burst windows, interleaved."""

    quiet: list[tuple[str, float]]
    loud: list[tuple[str, float]]
    burst_codes: list[str]
    burst_seconds: float
    burst_windows: int

    @property
    def latencies(self) -> tuple[float, float]:
        return p99([t for _, t in self.quiet]), p99([t for _, t in self.loud])

    def latency_kept(self) -> bool:
        # p99 within 2x the quiet one (a 20 ms floor: a dozen samples on a shared machine).
        quiet, loud = self.latencies
        return loud <= max(2 * quiet, quiet + 0.02)


def burst_round(door: Door, offset: int, windows: int = 3, window_s: float = 1.0) -> BurstRound:
    """The steady key calls every 0.3 s (under its quota) throughout; the bursting key sends 10x
    its quota in every other window. Quiet and loud samples alternate within seconds, so both
    see the same background load: on a 2-core CI machine another worker's tests swing latencies
    over a few seconds more than a burst could, and a quiet baseline taken first compared that
    drift, not the burst."""
    spacing = 0.3
    total = 2 * windows * window_s

    def loud_at(t: float) -> bool:
        return int(t // window_s) % 2 == 1

    def steady(started: float) -> list[tuple[float, str, float]]:
        out = []
        i = 0
        while (sent := time.perf_counter() - started) < total:
            code, latency = timed_complete(door, "steady", offset + i)
            out.append((sent, code, latency))
            i += 1
            time.sleep(spacing)
        return out

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        started = time.perf_counter()
        measuring = pool.submit(steady, started)
        bursting = []
        for i in range(int(10 * QUOTA_RPS * total)):
            at = i / (10 * QUOTA_RPS)
            if not loud_at(at):
                continue
            time.sleep(max(0.0, started + at - time.perf_counter()))
            bursting.append(pool.submit(timed_complete, door, "bursty", offset + i))
        samples = measuring.result()
        burst_codes = [f.result()[0] for f in bursting]
    return BurstRound(
        quiet=[(code, t) for sent, code, t in samples if not loud_at(sent)],
        loud=[(code, t) for sent, code, t in samples if loud_at(sent)],
        burst_codes=burst_codes,
        burst_seconds=windows * window_s,
        burst_windows=windows,
    )


def test_a_key_bursting_ten_times_its_quota_is_limited_while_another_keeps_full_success(door: Door) -> None:
    # Up to three rounds: a burst that slows the other key does so in every round, while a
    # scheduling hiccup on the loaded machine lands in one round's loud windows at most now and
    # then. Every round must show the limit and the other key's full success.
    rounds: list[BurstRound] = []
    for attempt in range(3):
        r = burst_round(door, offset=1000 * attempt)
        rounds.append(r)
        assert [code for code, _ in r.quiet] == ["OK"] * len(r.quiet)
        assert set(r.burst_codes) <= {"OK", "RESOURCE_EXHAUSTED"}, set(r.burst_codes)
        # About the burst allowance (refilled in each quiet window) + rate x time get through;
        # the rest (of 10x the rate) is refused.
        allowed = QUOTA_RPS * (r.burst_seconds + 1) + QUOTA_RPS * r.burst_windows
        assert r.burst_codes.count("OK") <= allowed, (r.burst_codes.count("OK"), len(r.burst_codes))
        assert [code for code, _ in r.loud] == ["OK"] * len(r.loud), "the other key lost requests"
        quiet, loud = r.latencies
        print(f"row 12: steady key p99 {quiet * 1000:.1f} ms quiet, {loud * 1000:.1f} ms during a 10x burst")
        if r.latency_kept():
            return
    pytest.fail(f"the steady key's p99 more than doubled in every round: {[r.latencies for r in rounds]}")


def test_keepalive_ping_flood_gets_goaway(door: Door) -> None:
    """Raw HTTP/2 PINGs with no call open: past the ping policy's strikes the server says GOAWAY."""
    port = door.mesh.router.port
    assert port is not None
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    goaway: h2.events.ConnectionTerminated | None = None
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 10
        sent = 0
        while goaway is None and time.monotonic() < deadline:
            if sent < 50:
                conn.ping(sent.to_bytes(8, "big"))
                sent += 1
                sock.sendall(conn.data_to_send())
            sock.settimeout(0.05)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = event
            sock.sendall(conn.data_to_send())
    assert goaway is not None, f"no GOAWAY after {sent} pings"
    assert goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert b"too_many_pings" in (goaway.additional_data or b"")
    # The router still serves everyone else.
    assert door.stub.Complete(chat("after the flood", 2), metadata=door.auth("acme"), timeout=10).token_ids
