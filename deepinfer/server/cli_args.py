"""`deepinfer serve` arguments (vLLM's spelling) and the command; the cli module only registers it."""
from __future__ import annotations

import argparse
import os


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    s.add_argument("--model", help="checkpoint directory (default: the embedded tiny model)")
    s.add_argument("--served-model-name", help="model id clients send (default: --model, or deepinfer-tiny-v4)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-seqs", type=int, default=16)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    s.add_argument("--num-blocks", type=int, help="KV blocks (default: sized from --kv-cache-bytes)")
    s.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    s.add_argument("--numerics", choices=("exact", "official"), default="exact")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks (heads, output groups, vocabulary, engram rows)")
    s.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=1,
                   help="routed-expert shards: 1, --tp, or --tp x --dp")
    s.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=1,
                   help="data-parallel attention groups (world size = tp x dp processes; under torchrun "
                        "every rank runs this command and ranks > 0 serve the model only)")
    s.add_argument("--speculative-method", choices=("mtp", "dspark"),
                   help="speculative decoding: draft with the checkpoint's MTP (v4) or DSpark (v41) layers")
    s.add_argument("--num-speculative-tokens", type=int, default=1, help="drafts per step")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one (default: on for one CUDA "
                        "process without speculative decoding)")
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond this get 429")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    s.add_argument("--shutdown-grace", type=float, default=5.0, help="seconds in-flight requests get on SIGTERM")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from deepinfer.server.app import ServerConfig, serve

    logging.basicConfig(level=logging.INFO)
    config = ServerConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        api_key=args.api_key, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        kv_cache_bytes=args.kv_cache_bytes, numerics=args.numerics, seed=args.seed, max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes, shutdown_grace_s=args.shutdown_grace,
        speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        tensor_parallel_size=args.tp, expert_parallel_size=args.ep, data_parallel_size=args.dp,
        async_scheduling=args.async_scheduling)
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun: ranks > 0 hold their model slices, no HTTP
        from deepinfer.engine.distributed_runner import start_parallel_runner
        from deepinfer.config import ModelConfig
        from deepinfer.tiny import default_model_dir

        engine_config = config.engine_config(config.model or str(default_model_dir()))
        start_parallel_runner(engine_config, ModelConfig.from_checkpoint(engine_config.model))  # exits when done
    serve(config)
    return 0
