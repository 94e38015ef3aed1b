"""Time of one attention forward + backward on CPU for each ``--attention-backend`` path, to
set the rule ``--attention-backend auto`` follows (:mod:`megatron.model.attention_backend`).

The paths are :class:`megatron.model.attention.CoreAttention`'s bodies, built as a model
builds them: ``flash`` (``torch.nn.functional.scaled_dot_product_attention``), ``fused`` (the
scaled masked softmax kernel, ``--masked-softmax-fusion``) and ``unfused`` (the same
explicit body with the plain softmax); the paths alternate within each repeat. In float32 on CPU the explicit bodies run causal
attention of 256 tokens or more in blocks of query rows (``megatron/model/block_causal.py``);
``fused-full`` is the fused body over the whole score matrix, blocks turned off, to show what
the blocks gain. Causal, no dropout, batch 2, 8 heads of 64; fp32 and bf16; the sequence length
varies. Each cell is the median of ``--repeats`` timed runs after
one warm-up, in milliseconds; the fastest path of each row is marked. Results and the rule
drawn from them: ``benchmarks/RESULTS.md``, section "Attention backends".

Run::

    python benchmarks/bench_attention_backends.py [--repeats 5] [--seqs 128 512 2048]
"""

import argparse
import statistics
import time

import torch

from megatron.core.config import TransformerConfig
from megatron.model import block_causal
from megatron.model.attention import CoreAttention

PATHS = {"flash": dict(use_flash_attn=True), "fused": dict(masked_softmax_fusion=True),
         "unfused": dict(masked_softmax_fusion=False),
         "fused-full": dict(masked_softmax_fusion=True)}


def core_attention(path: str, dtype: torch.dtype, heads: int, head_dim: int) -> CoreAttention:
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, padded_vocab_size=128,
                               max_position_embeddings=1, seq_length=1,
                               num_attention_heads=heads, attention_dropout=0.0,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype, **PATHS[path])
    return CoreAttention(config, 1, heads)


def time_paths(seq: int, dtype: torch.dtype, repeats: int, batch: int = 2, heads: int = 8,
               head_dim: int = 64) -> dict:
    """Median ms of each path's forward + backward; the paths alternate (in a rotating order)
    within every repeat, so a slower stretch of the machine falls on all of them."""
    modules = {p: core_attention(p, dtype, heads, head_dim) for p in PATHS}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq, batch, heads, head_dim, generator=gen).to(dtype)
               .requires_grad_() for _ in range(3))
    times = {p: [] for p in PATHS}
    names = list(PATHS)
    min_seq = block_causal.MIN_SEQ
    try:
        for run in range(repeats + 1):
            for path in names[run % len(names):] + names[:run % len(names)]:
                block_causal.MIN_SEQ = 1 << 62 if path == "fused-full" else min_seq
                start = time.perf_counter()
                modules[path](q, k, v, None).float().sum().backward()
                if run:
                    times[path].append((time.perf_counter() - start) * 1e3)
                q.grad = k.grad = v.grad = None
    finally:
        block_causal.MIN_SEQ = min_seq
    return {p: statistics.median(t) for p, t in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| dtype | seq | " + " | ".join(f"{p} (ms)" for p in PATHS) + " | fastest |")
    print("|---|---|" + "---|" * (len(PATHS) + 1))
    for dtype in (torch.float32, torch.bfloat16):
        for seq in args.seqs:
            ms = time_paths(seq, dtype, args.repeats)
            best = min(ms, key=ms.get)
            print(f"| {str(dtype)[6:]} | {seq} | "
                  + " | ".join(f"{ms[p]:.2f}" for p in PATHS) + f" | {best} |", flush=True)


if __name__ == "__main__":
    main()
