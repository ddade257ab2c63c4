"""`llm-mesh bench <name>`: dispatch to one benchmark module, imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module exposes add_arguments(parser) and run(args).
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("bench.engine", "the llm-mesh engine vs naive, static and continuous HF generation"),
    "decode-slab": (
        "bench.decode_slab",
        "decode steps over long conversations: the decode slab vs gathering",
    ),
    "router": ("bench.router", "the router's overhead and balancing under load"),
    "retriever": ("bench.retriever", "ingest and search throughput of the retriever"),
    "placement": (
        "bench.placement",
        "prefix-aware placement vs WRT, round robin and group-key hashing over 3 real replicas",
    ),
    "load": ("bench.load", "the whole mesh under many concurrent clients"),
    "http-stack": ("bench.http_stack", "what uvicorn+starlette and aiohttp add per request and SSE event"),
    "openai-front": (
        "bench.openai_front",
        "one short turn through the router's gRPC and its OpenAI HTTP front",
    ),
    "serving": (
        "bench.serving",
        "the OpenAI HTTP front vs transformers serve and llama.cpp's server, same workload",
    ),
    "decode-attention": (
        "bench.decode_attention",
        "one layer's decode attention: the engine's matmuls vs FlexAttention and SDPA",
    ),
    "matmul-ceiling": (
        "bench.matmul_ceiling",
        "fp32 GFLOP/s of the model's own matmul shapes: the ceiling any server meets",
    ),
    "semantic-cache": (
        "bench.semantic_cache",
        "semantic-cache false hits by kind and paraphrase hits: cosine 0.92 vs the verified cache",
    ),
    "embed-coalescing": (
        "bench.embed_coalescing",
        "concurrent query embeds in the retriever: coalesced model calls vs one call per text",
    ),
    "idle-box": (
        "bench.idle_box",
        "what a thread wake-up and a gRPC write cost on this machine after idle gaps",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    listing = "; ".join(f"{name}: {text}" for name, (_, text) in BENCHES.items())
    parser.add_argument("name", choices=sorted(BENCHES), metavar="NAME", help=f"which benchmark ({listing})")
    # Everything after NAME belongs to that benchmark's own parser, built only once it is imported.
    parser.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags (try NAME --help)"
    )


def run(args: argparse.Namespace) -> int:
    module_name = BENCHES[args.name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(
            f"llm-mesh bench {args.name}: not available in this checkout ({module_name} is missing)",
            file=sys.stderr,
        )
        return 2
    if not (hasattr(module, "add_arguments") and hasattr(module, "run")):
        print(
            f"llm-mesh bench {args.name}: {module_name} has no add_arguments/run entry point", file=sys.stderr
        )
        return 2
    parser = argparse.ArgumentParser(prog=f"llm-mesh bench {args.name}", description=BENCHES[args.name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.bench_args)))
