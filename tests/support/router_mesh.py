"""Helpers for router tests: start replicas and routers as processes, build turns, read answers."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from services.gen.llmmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, router_pb2, router_pb2_grpc
from services.synthetic.tokens import prompt_key, synthetic_token
from tests.support.processes import ServiceProcess


def synthetic_replica(*args: str) -> ServiceProcess:
    """A synthetic token source (load-testing fake replica) as a process."""
    return ServiceProcess("services.synthetic", ["--model-id", "synthetic", *args])


def router_process(replicas: Iterable[ServiceProcess], *args: str) -> ServiceProcess:
    addresses = ",".join(r.address for r in replicas)
    return ServiceProcess("services.router", ["--replicas", addresses, "--health-interval-s", "0.2", *args])


def user_turn(
    text: str,
    max_tokens: int = 8,
    session_id: str = "",
    temperature: float = 0.0,
    ignore_eos: bool = False,
    **fields: object,
) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
        ),
        session_id=session_id,
        **fields,  # type: ignore[arg-type]
    )


@dataclass
class Answer:
    """One turn as the client saw it."""

    messages: list[router_pb2.ChatResponse]

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages if m.HasField("delta") for t in m.delta.token_ids]

    @property
    def text(self) -> str:
        return "".join(m.delta.text for m in self.messages if m.HasField("delta"))

    @property
    def end(self) -> router_pb2.TurnEnd:
        assert self.messages and self.messages[-1].HasField("end"), "turn did not end"
        return self.messages[-1].end


def read_turn(stream: Iterable[router_pb2.ChatResponse]) -> Answer:
    return Answer(list(stream))


def expected_synthetic_ids(request: router_pb2.ChatRequest) -> list[int]:
    """What the synthetic token source answers to ``request`` (no history, no RAG)."""
    start = inference_pb2.GenerateStart(messages=request.messages, sampling=request.sampling)
    key = prompt_key(start)
    return [synthetic_token(key, i) for i in range(request.sampling.max_tokens)]


def router_stub(process: ServiceProcess) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(process.address))


def running_sequences(replica: ServiceProcess) -> int:
    with grpc.insecure_channel(replica.address) as channel:
        load = inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)
        return int(load.running + load.waiting)


def wait_until_idle(replicas: Sequence[ServiceProcess], timeout: float = 5.0) -> float:
    """Seconds until every replica reports nothing running or waiting; raises on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if all(running_sequences(r) == 0 for r in replicas):
            return time.monotonic() - started
        time.sleep(0.05)
    raise TimeoutError(f"replicas still busy after {timeout}s")


def serving_replica(router: router_pb2_grpc.RouterStub) -> str | None:
    """The address with a stream open, by the router's own ListReplicas."""
    pool = router.ListReplicas(router_pb2.ListReplicasRequest(), timeout=5)
    busy = [r.address for r in pool.replicas if r.in_flight > 0]
    return busy[0] if len(busy) == 1 else None
