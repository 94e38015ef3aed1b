"""Serve a trained GPT over HTTP: Megatron's ``PUT /api`` text generation server.

Run it with the model's training flags and ``--load``, on as many ranks as the checkpoint's
tensor x pipeline split (``torchrun`` for more than one)::

    torchrun --nproc_per_node 2 tools/run_text_generation_server.py \\
        <the training flags> --tensor-model-parallel-size 2 --load CHECKPOINT_DIR --port 5000

then ``curl -X PUT http://localhost:5000/api -H 'Content-Type: application/json'
-d '{"prompts": ["Hello"], "tokens_to_generate": 32}'`` or
``python tools/text_generation_cli.py localhost:5000``. Rank 0 answers HTTP; the other ranks run
each generation with it (see ``megatron/text_generation/server.py`` for the request and
response). It listens on 127.0.0.1 unless ``--host`` says otherwise: there is no authentication.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.text_generation.api import DEFAULT_MAX_TOKENS_TO_OOM  # noqa: E402
from megatron.text_generation.server import (  # noqa: E402
    DEFAULT_HOST,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
)


def add_text_generate_args(parser):
    """The server's own flags, added to the training flags."""
    g = parser.add_argument_group(title="text generation server")
    g.add_argument("--port", type=int, default=5000, help="HTTP port of rank 0 (default 5000)")
    g.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address rank 0 listens on (default {DEFAULT_HOST}: this machine only; "
                        f"0.0.0.0 is every interface, and the server has no authentication)")
    g.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help=f"seconds a request (headers and body) may take to arrive, and an idle "
                        f"connection may stay open (default {DEFAULT_READ_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"connections served at once; more are answered 503 at once (default "
                        f"{DEFAULT_MAX_CONNECTIONS})")
    g.add_argument("--max-tokens-to-oom", type=int, default=DEFAULT_MAX_TOKENS_TO_OOM,
                   help="refuse requests of more tokens (prompts x (longest prompt + "
                        "tokens_to_generate)) than this")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="recompute the whole prefix at every step instead of keeping keys and "
                        "values (slower; for checking)")
    # Megatron's server script accepts these; sampling settings come with each request here.
    g.add_argument("--temperature", type=float, default=1.0, help="ignored: per request")
    g.add_argument("--top_p", type=float, default=0.0, help="ignored: per request")
    g.add_argument("--top_k", type=int, default=0, help="ignored: per request")
    g.add_argument("--out-seq-length", type=int, default=1024, help="ignored: per request")
    return parser


def _check_args(args) -> None:
    from megatron.training.arguments import ArgumentsError

    if args.load is None:
        raise ArgumentsError("--load is required: the checkpoint to serve")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ArgumentsError("--num-layers-per-virtual-pipeline-stage: text generation runs "
                             "without virtual pipeline stages; drop the flag (the checkpoint "
                             "must then be saved without them)")
    if not 0 < args.port < 65536:
        raise ArgumentsError(f"--port must be between 1 and 65535, got {args.port}")
    if not 0 < args.read_timeout < float("inf"):
        raise ArgumentsError(f"--read-timeout must be a positive number of seconds, got "
                             f"{args.read_timeout}")
    if args.max_connections < 1:
        raise ArgumentsError(f"--max-connections must be at least 1, got {args.max_connections}")
    if args.max_tokens_to_oom < 1:
        raise ArgumentsError(f"--max-tokens-to-oom must be positive, got "
                             f"{args.max_tokens_to_oom}")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    import pretrain_gpt
    from megatron.core import device
    from megatron.inference import initialize_for_inference, load_model_for_inference
    from megatron.text_generation.server import GenerationService, MegatronServer

    args, pstate, tokenizer = initialize_for_inference(add_text_generate_args, argv)
    _check_args(args)
    if args.sequence_parallel and args.rank == 0:
        print("NOTE: --sequence-parallel is turned off for generation (the weights are the "
              "same)", flush=True)
    # Steps of one token cannot be split over the sequence; the model is built without it.
    args.sequence_parallel = False
    chunks, _ = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
    service = GenerationService(chunks[0], pstate, tokenizer, device.current_device(),
                                args.max_position_embeddings, args.max_tokens_to_oom,
                                use_kv_cache=not args.no_kv_cache)
    if args.rank != 0:
        service.worker_loop()
        return
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    # Heartbeats keep the waiting ranks' broadcast well inside the process group's timeout.
    heartbeat_s = min(60.0, args.distributed_timeout_minutes * 60 / 4)
    try:
        MegatronServer(service, heartbeat_s, args.read_timeout,
                       args.max_connections).run(args.host, args.port)
    except KeyboardInterrupt:
        print("server stopped", flush=True)
    except OSError as err:
        from megatron.training.arguments import ArgumentsError

        raise ArgumentsError(err.strerror or str(err)) from None


if __name__ == "__main__":
    from megatron.errors import exit_on_user_error

    with exit_on_user_error():
        main()
