"""Any request to the retriever, the engine or the router → OK or a clear status (matrix row 11).

Hypothesis builds arbitrary, well-typed request messages from the protos. Each
must end in OK or an expected status (INVALID_ARGUMENT naming a field), never
UNKNOWN / INTERNAL / a hang; an invalid Generate must not take an engine slot.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gen.llmmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.reliability.mesh_support import running, sized, synthetic_replica
from tests.reliability.property_support import check_status
from tests.support.processes import ServiceProcess
from tests.support.protofuzz import BOUNDARY_FLOATS, messages

TENANT = (("x-llmmesh-tenant", "acme"),)
EXAMPLES = sized(25, 200)
PROPERTY_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


# --- retriever -----------------------------------------------------------------------------------

RETRIEVER_RPCS = [
    ("Search", retriever_pb2.SearchRequest),
    ("CacheLookup", retriever_pb2.CacheLookupRequest),
    ("CacheStore", retriever_pb2.CacheStoreRequest),
    ("ListDocuments", retriever_pb2.ListDocumentsRequest),
    ("DeleteDocument", retriever_pb2.DeleteDocumentRequest),
]


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[retriever_pb2_grpc.RetrieverStub]:
    data = Path(tmp_path_factory.mktemp("retriever"))
    args = ["--milvus-uri", str(data / "milvus.db"), "--log-level", "WARNING"]
    with (
        running("services.retriever", args) as proc,
        grpc.insecure_channel(proc.address) as channel,
    ):
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        header = retriever_pb2.DocumentHeader(document_id="doc-1", mime_type="text/plain")
        body = b"Rivers carry water to the sea. The Nile is long."
        stub.Ingest(
            iter([retriever_pb2.IngestRequest(header=header), retriever_pb2.IngestRequest(data=body)]),
            metadata=TENANT,
            timeout=120,
        )
        yield stub


@pytest.mark.parametrize(("rpc", "request_cls"), RETRIEVER_RPCS, ids=[r for r, _ in RETRIEVER_RPCS])
def test_any_retriever_request_gets_ok_or_a_clear_status(
    retriever: retriever_pb2_grpc.RetrieverStub, rpc: str, request_cls: Any
) -> None:
    method = getattr(retriever, rpc)

    @PROPERTY_SETTINGS
    @given(request=messages(request_cls.DESCRIPTOR, request_cls), existing=st.booleans())
    def run(request: Any, existing: bool) -> None:
        if existing and hasattr(request, "document_id"):
            request.document_id = "doc-1" if rpc != "DeleteDocument" else "no-such-doc"
        try:
            method(request, metadata=TENANT, timeout=30)
        except grpc.RpcError as err:
            check_status(err.code(), err.details() or "", request_cls.DESCRIPTOR)

    run()


# --- inference engine ----------------------------------------------------------------------------


def finished_generations(metrics_port: int) -> float:
    """llmmesh_inference_requests_total summed over finish reasons: generations the engine ran."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmmesh_inference_requests_total{")
    )


@pytest.fixture(scope="module")
def engine(shared_replica: ServiceProcess) -> ServiceProcess:
    """The session's shared real replica (it has a metrics port: the slot check reads its counters)."""
    return shared_replica


def wait_idle(stub: inference_pb2_grpc.InferenceStub, timeout: float = 5.0) -> inference_pb2.LoadReport:
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
        if load.running == 0 and load.waiting == 0 and load.kv_blocks_used == 0:
            return load
        assert time.monotonic() < deadline, f"engine not idle: {load}"
        time.sleep(0.02)


def test_any_generate_start_gets_ok_or_a_clear_status_and_invalid_ones_take_no_slot(
    engine: ServiceProcess,
) -> None:
    assert engine.metrics_port is not None
    metrics_port = engine.metrics_port
    with grpc.insecure_channel(engine.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @PROPERTY_SETTINGS
        @given(start=messages(inference_pb2.GenerateStart.DESCRIPTOR, inference_pb2.GenerateStart))
        def run(start: Any) -> None:
            wait_idle(stub)
            ran_before = finished_generations(metrics_port)
            call = stub.Generate(iter([inference_pb2.GenerateRequest(start=start)]), timeout=60)
            try:
                # The first answer tells valid from invalid; the client then leaves a valid one.
                next(iter(call), None)
                call.cancel()
            except grpc.RpcError as err:
                code = err.code()
                check_status(code, err.details() or "", inference_pb2.GenerateStart.DESCRIPTOR, {"start"})
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    # Refused before admission: nothing ran, nothing is held.
                    wait_idle(stub, timeout=0.5)
                    assert finished_generations(metrics_port) == ran_before, "an invalid request ran"

        run()


#: Sampling settings aimed at the numerics: boundary floats in every float field.
HOSTILE_SAMPLING = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(1, 6),
    temperature=st.one_of(BOUNDARY_FLOATS, st.sampled_from([0.0, 0.7, 1.0])),
    top_p=st.one_of(BOUNDARY_FLOATS, st.just(1.0)),
    top_k=st.sampled_from([0, 1, 2, 50, 2**31 - 1]),
    repetition_penalty=st.one_of(BOUNDARY_FLOATS, st.sampled_from([1.0, 1.3])),
    presence_penalty=st.one_of(BOUNDARY_FLOATS, st.sampled_from([0.0, -2.0, 2.0])),
    frequency_penalty=st.one_of(BOUNDARY_FLOATS, st.sampled_from([0.0, -2.0, 2.0])),
    # Ids in and past the vocabulary (and negative), biases at and past the bounds.
    logit_bias=st.dictionaries(
        st.one_of(st.integers(0, 49_151), st.integers(-(2**31), 2**31 - 1)),
        st.one_of(BOUNDARY_FLOATS, st.sampled_from([-100.0, 100.0])),
        max_size=3,
    ),
    seed=st.integers(0, 2**64 - 1),
    min_tokens=st.integers(0, 8),
    min_p=st.one_of(BOUNDARY_FLOATS, st.sampled_from([0.0, 0.05, 1.0])),
    # Blank words are refused; the rest (any text, a lone character) run.
    bad_words=st.lists(st.text(max_size=6), max_size=3),
    ignore_eos=st.just(True),
)


def test_any_sampling_settings_get_their_tokens_or_a_clear_status(engine: ServiceProcess) -> None:
    """Contract-valid but numerically hostile settings (1e-40 temperatures, 1.4e-45 penalties, …)
    run to max_tokens or get INVALID_ARGUMENT naming the field; never an engine fault."""
    with grpc.insecure_channel(engine.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @PROPERTY_SETTINGS
        @given(sampling=HOSTILE_SAMPLING)
        def run(sampling: common_pb2.SamplingParams) -> None:
            start = inference_pb2.GenerateStart(prompt="Name a colour.", sampling=sampling)
            tokens = 0
            finished = None
            try:
                for response in stub.Generate(iter([inference_pb2.GenerateRequest(start=start)]), timeout=60):
                    tokens += len(response.chunk.token_ids)
                    if response.HasField("finished"):
                        finished = response.finished
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), sampling)
                check_status(err.code(), err.details() or "", common_pb2.SamplingParams.DESCRIPTOR)
                return
            assert finished is not None and finished.finish_reason == common_pb2.FINISH_REASON_LENGTH, (
                sampling
            )
            assert tokens == sampling.max_tokens

        run()
        wait_idle(stub)


#: Output constraints of any text: most do not compile (INVALID_ARGUMENT naming the field), the
#: rest must run and end by the grammar (STOP) or by max_tokens (LENGTH), never as a fault.
CONSTRAINED_SAMPLING = st.one_of(
    st.builds(common_pb2.SamplingParams, json_schema=st.text(max_size=40)),
    st.builds(common_pb2.SamplingParams, regex=st.text(max_size=20)),
    st.builds(common_pb2.SamplingParams, grammar=st.text(max_size=40)),
    st.builds(
        common_pb2.SamplingParams,
        choice=st.builds(common_pb2.Choices, values=st.lists(st.text(max_size=8), max_size=3)),
    ),
    st.builds(common_pb2.SamplingParams, json_object=st.booleans(), top_logprobs=st.integers(0, 25)),
)


def test_any_output_constraint_runs_or_gets_invalid_argument_naming_it(engine: ServiceProcess) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @PROPERTY_SETTINGS
        @given(sampling=CONSTRAINED_SAMPLING)
        def run(sampling: common_pb2.SamplingParams) -> None:
            sampling.max_tokens = 4
            sampling.temperature = 0.0
            start = inference_pb2.GenerateStart(prompt="Name a colour.", sampling=sampling)
            finished = None
            try:
                for response in stub.Generate(iter([inference_pb2.GenerateRequest(start=start)]), timeout=60):
                    if response.HasField("finished"):
                        finished = response.finished
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details(), sampling)
                check_status(err.code(), err.details() or "", common_pb2.SamplingParams.DESCRIPTOR)
                return
            # A constraint that dead-ends part-way (it needs next a character no token of the
            # vocabulary writes, e.g. U+0016 after "a") is INVALID_ARGUMENT too, above.
            assert finished is not None
            assert finished.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)

        run()
        wait_idle(stub)


# --- router --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router() -> Iterator[router_pb2_grpc.RouterStub]:
    replica = synthetic_replica("--tokens-per-second", "2000")
    proc: ServiceProcess | None = None
    try:
        replica.start(timeout=120)
        proc = ServiceProcess(
            "services.router",
            ["--replicas", replica.address, "--probe-interval-s", "0", "--log-level", "WARNING"],
        ).start(timeout=120)
        with grpc.insecure_channel(proc.address) as channel:
            yield router_pb2_grpc.RouterStub(channel)
    finally:
        for p in [proc, replica]:
            if p is not None:
                p.stop()


def test_any_complete_request_gets_ok_or_a_clear_status(router: router_pb2_grpc.RouterStub) -> None:
    @PROPERTY_SETTINGS
    @given(request=messages(router_pb2.ChatRequest.DESCRIPTOR, router_pb2.ChatRequest))
    def run(request: Any) -> None:
        try:
            router.Complete(request, timeout=30)
        except grpc.RpcError as err:
            check_status(err.code(), err.details() or "", router_pb2.ChatRequest.DESCRIPTOR)

    run()
