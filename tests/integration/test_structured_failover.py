"""kill -9 of the replica in the middle of a JSON answer: the router resumes it on the other
replica with the same constraint, and the client gets exactly the uninterrupted constrained
tokens, whose text validates against the schema. A constraint that dead-ends is the client's
error, passed on, not a replica's failure."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import grpc
import jsonschema
import pytest

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, router_pb2
from tests.support.processes import ServiceProcess
from tests.support.router_mesh import read_turn, router_process, router_stub, serving_replica, user_turn

pytestmark = pytest.mark.timeout(300)

#: Long enough a JSON answer that the kill lands inside it.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 4, "maxLength": 16},
        "story": {"type": "string", "minLength": 80, "maxLength": 120},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}
BYPASS = router_pb2.CachePolicy(mode=router_pb2.CACHE_MODE_BYPASS)


def test_kill_9_mid_json_resumes_the_grammar_token_for_token(model_path: Path) -> None:
    replicas = [
        ServiceProcess(
            "services.inference", ["--model", str(model_path), "--device", "cpu", "--dtype", "float32"]
        )
        for _ in range(2)
    ]
    router: ServiceProcess | None = None
    try:
        for r in replicas:
            r.start(wait_serving=False)
        for r in replicas:
            r.wait_serving(240)
        router = router_process(replicas).start()
        stub = router_stub(router)
        request = user_turn("Tell me a very short story as JSON.", 96, cache=BYPASS)
        request.sampling.json_schema = json.dumps(SCHEMA)
        start = inference_pb2.GenerateStart(messages=request.messages, sampling=request.sampling)
        with grpc.insecure_channel(replicas[0].address) as channel:
            direct = list(
                inference_pb2_grpc.InferenceStub(channel).Generate(
                    iter([inference_pb2.GenerateRequest(start=start)]), timeout=120
                )
            )
        reference = [t for r in direct if r.HasField("chunk") for t in r.chunk.token_ids]
        assert direct[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert len(reference) > 30

        # A constraint that dead-ends part-way is the client's: passed on as INVALID_ARGUMENT
        # naming it, never failed over, never counted against a replica (three in a row would
        # eject one if they were).
        dead_end = user_turn("Pick one.", 8, cache=BYPASS)
        dead_end.sampling.choice.values.append("a\x16")
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.ChatStream(dead_end, timeout=60))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (caught.value.details() or "").startswith("choice: "), caught.value.details()
        listed = stub.ListReplicas(router_pb2.ListReplicasRequest())
        assert [r.ejection_count for r in listed.replicas] == [0, 0]

        stream = stub.ChatStream(request, timeout=120)
        messages = [next(stream) for _ in range(4)]
        victim = serving_replica(stub)
        assert victim is not None
        killer = threading.Thread(target=next(r for r in replicas if r.address == victim).kill)
        killer.start()
        messages += list(stream)
        killer.join()
        answer = read_turn(messages)
        assert answer.end.failovers == 1, "the kill came after the answer"
        assert answer.end.replica != victim
        assert answer.token_ids == reference
        assert answer.end.finish_reason == common_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(answer.text), SCHEMA)
    finally:
        for p in [router, *replicas]:
            if p is not None:
                p.stop()
