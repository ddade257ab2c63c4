"""`python -m services.retriever`: documents and search on Milvus, plus the semantic cache."""

from __future__ import annotations

import os

from services.common.server import run
from services.common.settings import (
    RETRIEVER_PORT,
    EnvArgumentParser,
    add_flags,
    add_server_args,
    from_flags,
    server_options,
)
from services.retriever.config import RetrieverConfig
from services.retriever.runtime import RetrieverRuntime


def main(argv: list[str] | None = None) -> None:
    # Models are read from local directories only; never let a library reach for the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = EnvArgumentParser(prog="python -m services.retriever", description=__doc__)
    add_server_args(parser, default_port=RETRIEVER_PORT)
    add_flags(parser, RetrieverConfig)
    args = parser.parse_args(argv)
    try:
        # An empty LLMMESH_REDIS_URL (or LLMMESH_MILVUS_TOKEN) means none.
        config = from_flags(
            RetrieverConfig, args, redis_url=args.redis_url or None, milvus_token=args.milvus_token or None
        )
    except ValueError as exc:
        parser.error(str(exc))
    run(server_options("retriever", args, parser), RetrieverRuntime(config))


if __name__ == "__main__":
    main()
