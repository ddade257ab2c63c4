"""The router's public face: the gRPC servicers, the task API, the calls passed through to the retriever."""
