"""The inference service: one model replica (engine, scheduler, block manager, model runner) behind gRPC."""
