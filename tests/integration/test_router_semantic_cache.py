"""The semantic cache through the router never answers another question: scope, verifier, confidence.

A real router over gRPC, a real retriever (Milvus Lite, the packaged embedding
model) holding the semantic cache, and the synthetic token source as the replica:
its answer is a hash of the whole prompt, so a served answer shows which question
it was made for. Two routers share the retriever: ``serving`` serves every
verified hit (no refreshes), ``checking`` refreshes every one (refresh rate 1),
to show an entry learning from a wrong hit. No Redis: no exact cache, so every
hit here is the semantic layer's.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.gen.llmmesh.v1 import common_pb2, retriever_pb2, router_pb2, router_pb2_grpc
from services.router.admission.auth import hash_key
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import router_process, router_stub, synthetic_replica

ACME = (("authorization", "Bearer key-acme"),)
GLOBEX = (("authorization", "Bearer key-globex"),)


@dataclass
class Mesh:
    serving: router_pb2_grpc.RouterStub
    checking: router_pb2_grpc.RouterStub
    serving_process: ServiceProcess
    checking_process: ServiceProcess


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = Path(tmp_path_factory.mktemp("semantic"))
    keys = tmp / "keys.yaml"
    records = [{"id": t, "tenant": t, "sha256": hash_key(f"key-{t}")} for t in ("acme", "globex")]
    keys.write_text(yaml.safe_dump({"keys": records}))
    replica = synthetic_replica()
    retriever = ServiceProcess("services.retriever", ["--milvus-uri", str(tmp / "milvus.db")])
    routers: list[ServiceProcess] = []
    try:
        # All four start at once (each is ready long after it listens): the routers dial lazily.
        replica.start(wait_serving=False)
        retriever.start(timeout=300, wait_serving=False)
        for rate in ("0", "1"):
            flags = [
                "--retriever-addr",
                retriever.address,
                "--api-keys-file",
                str(keys),
                "--metrics-port",
                "0",
            ]
            router = router_process([replica], *flags, "--semantic-cache-refresh-rate", rate)
            routers.append(router.start(wait_serving=False))
        for process in [replica, retriever, *routers]:
            process.wait_serving(300)
        yield Mesh(router_stub(routers[0]), router_stub(routers[1]), routers[0], routers[1])
    finally:
        for p in [*routers, retriever, replica]:
            p.stop()


def ask(
    stub: router_pb2_grpc.RouterStub,
    text: str,
    before: list[tuple[str, str]] | None = None,
    metadata: tuple[tuple[str, str], ...] = ACME,
    rag: bool = False,
    **cache: object,
) -> router_pb2.CompleteResponse:
    messages = [common_pb2.ChatMessage(role=r, content=c) for r, c in before or []]
    messages.append(common_pb2.ChatMessage(role="user", content=text))
    request = router_pb2.ChatRequest(
        messages=messages,
        sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0.0),
        cache=router_pb2.CachePolicy(semantic=True, **cache),  # type: ignore[arg-type]
        rag=router_pb2.RagOptions(enabled=rag, top_k=2),
    )
    response = stub.Complete(request, metadata=metadata, timeout=60)
    assert not response.end.degraded, response.end.degraded_reasons
    return response


def semantic_hit(response: router_pb2.CompleteResponse) -> bool:
    return response.end.cache_layer == router_pb2.CACHE_LAYER_SEMANTIC


def metric(process: ServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def ingest(stub: router_pb2_grpc.RouterStub, text: str) -> None:
    header = retriever_pb2.DocumentHeader(document_id="returns", title="Returns", mime_type="text/plain")
    parts = [retriever_pb2.IngestRequest(header=header), retriever_pb2.IngestRequest(data=text.encode())]
    stub.IngestDocument(iter(parts), metadata=ACME, timeout=120)


def test_a_rephrasing_hits_but_the_same_words_in_another_conversation_or_tenant_never_do(mesh: Mesh) -> None:
    question = "How long does standard shipping take to Portugal?"
    original = ask(mesh.serving, question)
    rephrased = ask(mesh.serving, "how long does standard shipping take to portugal")
    assert semantic_hit(rephrased) and rephrased.text == original.text
    others = {
        "system prompt": ask(mesh.serving, question, [("system", "Answer in French.")]),
        "history": ask(mesh.serving, question, [("user", "I live in Spain."), ("assistant", "Noted.")]),
        "tenant": ask(mesh.serving, question, metadata=GLOBEX),
    }
    for what, response in others.items():
        assert not semantic_hit(response), what
    # The replica answered each its own prompt (the other tenant's prompt is the same one).
    assert others["system prompt"].text != original.text != others["history"].text


def test_a_personal_question_is_answered_from_the_cache_only_for_the_same_user(mesh: Mesh) -> None:
    alices = ask(mesh.serving, "Where is my latest parcel?", user="alice")
    assert semantic_hit(again := ask(mesh.serving, "Where is my latest parcel??", user="alice"))
    assert again.text == alices.text
    assert not semantic_hit(ask(mesh.serving, "Where is my latest parcel??", user="bob"))
    # No user to tell them apart: the semantic cache is skipped, neither read nor filled.
    skipped = "llmmesh_router_semantic_skipped_total" + '{reason="personal_without_user"}'
    before = metric(mesh.serving_process, skipped)
    assert not semantic_hit(ask(mesh.serving, "Where is my latest parcel?"))
    assert metric(mesh.serving_process, skipped) == before + 1
    # The caller may mark a question shared, whatever its pronouns.
    ask(mesh.serving, "What is our refund window?", personal=False)
    assert semantic_hit(ask(mesh.serving, "What is our refund window", personal=False, user="carol"))


def test_a_corpus_update_invalidates_the_answers_built_on_the_old_version(mesh: Mesh) -> None:
    ingest(mesh.serving, "Returns are accepted within 30 days of delivery with the receipt.")
    question = "Within how many days are returns accepted?"
    first = ask(mesh.serving, question, rag=True)
    assert semantic_hit(cached := ask(mesh.serving, "within how many days are returns accepted", rag=True))
    assert cached.text == first.text
    assert not semantic_hit(ask(mesh.serving, "within how many days are returns accepted"))  # no context
    ingest(mesh.serving, "Returns are accepted within 14 days of delivery with the receipt.")
    updated = ask(mesh.serving, "Within how many days are returns accepted??", rag=True)
    assert not semantic_hit(updated) and updated.text != first.text


def test_a_verifier_rejection_falls_through_to_the_replica_and_fills_the_cache_with_its_answer(
    mesh: Mesh,
) -> None:
    rejected = "llmmesh_router_semantic_rejections_total" + '{reason="direction"}'
    before = metric(mesh.serving_process, rejected)
    usd_to_eur = ask(mesh.serving, "How do I convert USD to EUR in the app?")
    eur_to_usd = ask(mesh.serving, "How do I convert EUR to USD in the app?")
    assert not semantic_hit(eur_to_usd) and eur_to_usd.text != usd_to_eur.text
    assert metric(mesh.serving_process, rejected) == before + 1
    again = ask(mesh.serving, "how do I convert EUR to USD in the app")
    assert semantic_hit(again) and again.text == eur_to_usd.text


def test_an_entry_whose_refresh_shows_a_wrong_answer_is_no_longer_served(mesh: Mesh) -> None:
    """The synthetic replica answers each wording differently: a refresh finds the cached answer wrong."""
    refused = "llmmesh_router_semantic_rejections_total" + '{reason="confidence"}'
    differed = "llmmesh_router_semantic_refreshes_total" + '{outcome="differed"}'
    process = mesh.checking_process
    ask(mesh.checking, "Can I pick up an online order in the Lisbon store?")
    before_refused, before_differed = metric(process, refused), metric(process, differed)
    refreshed = ask(mesh.checking, "Can I pick up an online order in the Lisbon store, please?")
    assert not semantic_hit(refreshed)  # answered fresh: a refresh
    assert metric(process, differed) == before_differed + 1
    assert metric(process, refused) == before_refused
    # The same question again (the embedding is case-blind): its entry's confidence now refuses it.
    assert not semantic_hit(ask(mesh.checking, "CAN I PICK UP AN ONLINE ORDER IN THE LISBON STORE?"))
    assert metric(process, refused) == before_refused + 1


def test_a_question_too_long_to_verify_skips_the_semantic_cache(mesh: Mesh) -> None:
    skipped = "llmmesh_router_semantic_skipped_total" + '{reason="too_long"}'
    before = metric(mesh.serving_process, skipped)
    long_question = "Please review this order note: " + "the parcel arrived late and damaged. " * 30
    ask(mesh.serving, long_question)
    assert not semantic_hit(ask(mesh.serving, long_question))  # nothing was stored, nothing found
    assert metric(mesh.serving_process, skipped) == before + 2
