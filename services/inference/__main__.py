"""`python -m services.inference`: serve one model over gRPC."""

from __future__ import annotations

from services.common.server import run
from services.common.settings import EnvArgumentParser, add_server_args, server_options
from services.inference.config import DEVICES, DTYPES, MODEL_IMPLS, EngineConfig
from services.inference.runtime import InferenceRuntime


def main(argv: list[str] | None = None) -> None:
    parser = EnvArgumentParser(prog="python -m services.inference", description="llm-mesh inference replica")
    add_server_args(parser, default_port=50052)
    parser.add_argument("--model", required=True, help="model directory or .gguf file")
    parser.add_argument("--model-id", default=None, help="name reported to clients (default: from the path)")
    parser.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weights and KV-cache dtype")
    parser.add_argument("--max-queued-requests", type=int, default=256, help="waiting-queue bound")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in the running batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV-cache blocks (default: auto)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the model's)")
    parser.add_argument(
        "--model-impl",
        default="auto",
        choices=MODEL_IMPLS,
        help="native: flat-batch Llama forward; transformers: any causal LM; auto: native when possible",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the transformers forward (slow start)"
    )
    parser.add_argument(
        "--decode-slab-mib",
        type=int,
        default=EngineConfig.decode_slab_mib,
        help="native forward: memory for contiguous decode K/V rows (0 = always gather from the paged cache)",
    )
    parser.add_argument(
        "--memory-limit-mib",
        type=int,
        default=None,
        help="CPU: memory this replica may use; the auto-sized KV cache and decode slab fit in it "
        "(default: the container's cgroup limit, else the machine's RAM)",
    )
    args = parser.parse_args(argv)
    config = EngineConfig(
        model=args.model,
        model_id=args.model_id,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        max_queued_requests=args.max_queued_requests,
        max_model_len=args.max_model_len,
        compile=args.compile,
        model_impl=args.model_impl,
        decode_slab_mib=args.decode_slab_mib,
        memory_limit_mib=args.memory_limit_mib,
    )
    run(server_options("inference", args), InferenceRuntime(config))


if __name__ == "__main__":
    main()
