"""One real inference replica per test process, shared by every file that needs only "a real replica".

Loading and warming the model takes 20–40 s on the CI's 2 vCPUs; files that each started
their own replica with the same flags paid that once per file. A file that needs other
flags (a KV-block budget, a seat count, a replica it kills or restarts) still starts its
own. `make test` runs whole files per xdist worker, one after another, so a shared replica
serves one file at a time; each file finds it idle and must leave it idle
(``tests/conftest.py`` checks both ends).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from services.gen.llmmesh.v1 import inference_pb2, inference_pb2_grpc
from tests.support.device import replica_device_args
from tests.support.processes import ServiceProcess

#: The flags every sharing file can live with: fp32 on the test device, a metrics port (the
#: gateway's tests read its cancel counter there), everything else the engine's defaults.
SHARED_REPLICA_FLAGS = ("--metrics-port", "0", *replica_device_args())


def shared_replica_process(model_path: Path) -> ServiceProcess:
    return ServiceProcess("services.inference", ["--model", str(model_path), *SHARED_REPLICA_FLAGS])


def load(replica: ServiceProcess) -> inference_pb2.LoadReport:
    with grpc.insecure_channel(replica.address) as channel:
        return inference_pb2_grpc.InferenceStub(channel).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)


def holds_nothing(report: inference_pb2.LoadReport) -> bool:
    """No sequence waiting or running and no KV block held (cached prefix blocks are free to evict)."""
    return report.waiting == 0 and report.running == 0 and report.kv_blocks_used == 0


def wait_idle(replica: ServiceProcess, timeout: float = 30.0) -> inference_pb2.LoadReport:
    """The replica's load once it holds nothing; fails naming what it still held after ``timeout``.

    A cancelled stream frees its slot within a step or two, so this returns at once after a
    file that cleaned up; only a leak (a stream nobody closed) waits out the timeout.
    """
    deadline = time.monotonic() + timeout
    report = load(replica)
    while not holds_nothing(report):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the shared replica still holds work after {timeout:.0f} s (waiting {report.waiting}, "
                f"running {report.running}, KV blocks {report.kv_blocks_used}): a test left a stream open"
            )
        time.sleep(0.05)
        report = load(replica)
    return report
