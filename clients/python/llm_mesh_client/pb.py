"""The generated protobuf modules, under stable names: ``from llm_mesh_client.pb import router_pb2``."""

from llm_mesh_client._gen.llmmesh.v1 import (
    common_pb2,
    inference_pb2,
    retriever_pb2,
    router_pb2,
    router_pb2_grpc,
)

__all__ = ["common_pb2", "inference_pb2", "retriever_pb2", "router_pb2", "router_pb2_grpc"]
