"""`python -m services.inference`: serve one model over gRPC."""

from __future__ import annotations

import os

from services.common.server import run
from services.common.settings import (
    INFERENCE_PORT,
    EnvArgumentParser,
    add_flags,
    add_server_args,
    from_flags,
    server_options,
)
from services.inference.config import EngineConfig
from services.inference.openmp_policy import default_wait_policy


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="python -m services.inference", description="llm-mesh inference replica")
    add_server_args(parser, default_port=INFERENCE_PORT)
    add_flags(parser, EngineConfig)
    return parser


def main(argv: list[str] | None = None) -> None:
    # Before torch is imported (the runtime imports it): libgomp reads its environment once.
    default_wait_policy(os.environ)
    from services.inference.model_loading import check_model_path
    from services.inference.runtime import InferenceRuntime

    parser = build_parser()
    args = parser.parse_args(argv)
    config = from_flags(EngineConfig, args)
    options = server_options("inference", args, parser)  # the flags first, then the files
    try:
        check_model_path(config.model)  # one line and exit 2, not a traceback from transformers
    except FileNotFoundError as exc:
        parser.error(str(exc))
    run(options, InferenceRuntime(config))


if __name__ == "__main__":
    main()
