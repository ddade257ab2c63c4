"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from services.gen.llmmesh.v1 import inference_pb2_grpc
from tests.support.processes import ServiceProcess


@pytest.fixture()
async def stub(replica: ServiceProcess) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    """An Inference stub on the module's ``replica``: its own, configured for its tests, or the
    session's shared one (``shared_replica``, tests/conftest.py) where default flags do."""
    async with grpc.aio.insecure_channel(replica.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)
