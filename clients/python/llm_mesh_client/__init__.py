"""llm-mesh-client: an async-first, typed Python client for the llm-mesh router.

    async with MeshClient("127.0.0.1:50051") as mesh:
        async for event in mesh.chat("What is a mesh?", max_tokens=64):
            ...

The generated messages are importable as ``llm_mesh_client.pb.router_pb2`` etc.
"""

from llm_mesh_client.client import ChatTurn, MeshClient
from llm_mesh_client.conversation import Conversation
from llm_mesh_client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    StreamEnded,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from llm_mesh_client.events import ChatEvent, Completion, Delta, End
from llm_mesh_client.sync import SyncMeshClient

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "ChatEvent",
    "ChatTurn",
    "Completion",
    "Conversation",
    "DeadlineExceeded",
    "Delta",
    "End",
    "FailedPrecondition",
    "InvalidArgument",
    "MeshClient",
    "MeshError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "StreamEnded",
    "SyncMeshClient",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
]
