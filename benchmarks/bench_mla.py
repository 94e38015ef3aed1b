"""Multi-latent attention against standard attention on CPU: training step time and the key/value
cache a generation holds per token.

Three GPTs alike in everything but attention (default: 4 layers, hidden 512, 8 heads, rope,
RMSNorm, SwiGLU of FFN 1408, no biases, untied output layer, vocabulary 4096, fp32, dropout 0):

- ``mha``: standard attention, every head its own keys and values (head size hidden / heads);
- ``gqa``: grouped-query attention, ``--num-query-groups`` (default 2) key/value heads;
- ``mla``: multi-latent attention (``--multi-latent-attention``) with DeepSeek-V3's proportions:
  queries through a rank-``--q-lora-rank`` bottleneck, keys and values up-projected from a
  ``--kv-lora-rank`` latent, ``--qk-head-dim`` + ``--qk-pos-emb-head-dim`` channels per query/key
  head and ``--v-head-dim`` per value head.

**Step time**: forward, cross-entropy and backward of one micro-batch (``--batch`` sequences of
``--seq``), the median of ``--iters`` after ``--warmup``; the contenders alternate ``--repeats``
rounds in one process and each keeps its fastest median (on a shared machine the slowest rounds
say more about the neighbours than about the model).

**Key/value cache**: the model runs a ``--seq``-token prompt through
:class:`~megatron.text_generation.inference_params.InferenceParams` as text generation does, and
the bytes of every tensor in its cache are summed and divided by the positions it holds: the
bytes per generated token, all layers. Standard MLA generation caches the *expanded* keys and
values (``heads x (qk_head_dim + qk_pos_emb_head_dim)`` and ``heads x v_head_dim`` per layer);
the row ``mla-latent`` is the same MLA model (same weights) with ``--cache-mla-latents``, whose
cache holds the normalised latent and the shared rotary key (``kv_lora_rank +
qk_pos_emb_head_dim`` per layer). Each measured size must equal the size worked out from the
shapes, and the latent cache's prompt logits must equal the expanded cache's (1e-4 relative,
fp32), or the benchmark stops. ``--cache-mla-latents`` is for generation only, so
``mla-latent`` has no training step time.

Run::

    python benchmarks/bench_mla.py [--layers 4] [--hidden 512] [--heads 8] [--seq 512]
        [--batch 2] [--iters 5] [--warmup 2] [--repeats 2] [--threads 2] [--quick] [--record]

``--quick`` shrinks the model and the runs to seconds (a smoke test, no numbers worth
recording).
"""

import argparse
import os
import statistics
import sys
import time
import types

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.core.config import TransformerConfig  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.text_generation.inference_params import InferenceParams  # noqa: E402
from record import recording  # noqa: E402

CONTENDERS = ("mha", "gqa", "mla")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--q-lora-rank", type=int, default=192)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--qk-head-dim", type=int, default=64)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=32)
    p.add_argument("--v-head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.heads, a.ffn, a.vocab, a.num_query_groups = 2, 64, 4, 128, 256, 2
        a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim = 32, 24, 16, 8
        a.v_head_dim, a.seq, a.batch, a.iters, a.warmup, a.repeats = 16, 32, 2, 2, 1, 1
    if a.hidden % a.heads or a.heads % a.num_query_groups:
        p.error(f"--hidden {a.hidden} must be a multiple of --heads {a.heads}, and --heads a "
                f"multiple of --num-query-groups {a.num_query_groups}")
    return a


def make_config(a, kind: str, **extra) -> TransformerConfig:
    kw = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
              ffn_hidden_size=a.ffn, padded_vocab_size=a.vocab, max_position_embeddings=a.seq,
              seq_length=a.seq, hidden_dropout=0.0, attention_dropout=0.0,
              params_dtype=torch.float32, normalization="RMSNorm", layernorm_epsilon=1e-6,
              swiglu=True, add_bias_linear=False, position_embedding_type="rope",
              untie_embeddings_and_output_weights=True)
    if kind == "gqa":
        kw.update(num_query_groups=a.num_query_groups)
    elif kind == "mla":
        kw.update(multi_latent_attention=True, q_lora_rank=a.q_lora_rank,
                  kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
                  qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
                  qk_layernorm=True)
    kw.update(extra)
    return TransformerConfig(**kw)


def build(a, kind: str, **extra) -> GPTModel:
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
    torch.manual_seed(0)
    return GPTModel(make_config(a, kind, **extra), pstate)


def expected_cache_bytes(a, kind: str, element: int) -> int:
    """Bytes per cached token, all layers, from the shapes."""
    head = a.hidden // a.heads
    per_layer = {"mha": 2 * a.heads * head, "gqa": 2 * a.num_query_groups * head,
                 "mla": a.heads * (a.qk_head_dim + a.qk_pos_emb_head_dim + a.v_head_dim),
                 "mla-latent": a.kv_lora_rank + a.qk_pos_emb_head_dim}[kind]
    return a.layers * per_layer * element


def measure_cache(a, kind: str, model: GPTModel):
    """(Bytes per token the generation cache holds after a ``--seq``-token prompt, the
    prompt's logits)."""
    params = InferenceParams(max_batch_size=1, max_sequence_length=a.seq)
    ids = torch.randint(0, a.vocab, (1, a.seq), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(a.seq).unsqueeze(0)
    with torch.no_grad():
        model.eval()
        logits = model(ids, pos, None, inference_params=params)
        model.train()
    held = sum(t.nbytes for pair in params.key_value_memory_dict.values() for t in pair)
    if len(params.key_value_memory_dict) != a.layers:
        raise RuntimeError(f"{kind}: the cache has {len(params.key_value_memory_dict)} layers, "
                           f"the model {a.layers}")
    per_token = held // a.seq
    element = torch.finfo(torch.float32).bits // 8
    if per_token != expected_cache_bytes(a, kind, element):
        raise RuntimeError(f"{kind}: the cache holds {per_token} bytes per token, the shapes "
                           f"give {expected_cache_bytes(a, kind, element)}")
    return per_token, logits


def step_ms(a, model: GPTModel, batch) -> float:
    """Median milliseconds of forward + loss + backward."""
    ids, pos, labels = batch
    times = []
    for i in range(a.warmup + a.iters):
        start = time.perf_counter()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return statistics.median(times)


def run(a):
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, a.vocab, (a.batch, a.seq), generator=g),
             torch.arange(a.seq).unsqueeze(0).expand(a.batch, a.seq),
             torch.randint(0, a.vocab, (a.batch, a.seq), generator=g))
    models = {kind: build(a, kind) for kind in CONTENDERS}
    best = {kind: float("inf") for kind in CONTENDERS}
    for _ in range(a.repeats):
        for kind, model in models.items():
            best[kind] = min(best[kind], step_ms(a, model, batch))
    rows, logits = [], {}
    for kind, model in models.items():
        attn = sum(p.numel() for n, p in model.named_parameters() if ".self_attention." in n)
        cache, logits[kind] = measure_cache(a, kind, model)
        rows.append((kind, attn, best[kind], cache))
    latent = build(a, "mla", cache_mla_latents=True).eval()
    cache, got = measure_cache(a, "mla-latent", latent)
    torch.testing.assert_close(got, logits["mla"], rtol=1e-4, atol=1e-4)
    rows.append(("mla-latent", rows[-1][1], None, cache))
    return rows


def print_table(a, rows):
    print(f"# {a.layers} layers, hidden {a.hidden}, {a.heads} heads; gqa: {a.num_query_groups} "
          f"key/value heads; mla: q_lora_rank {a.q_lora_rank}, kv_lora_rank {a.kv_lora_rank}, "
          f"qk {a.qk_head_dim}+{a.qk_pos_emb_head_dim}, v {a.v_head_dim}; micro-batch "
          f"{a.batch} x {a.seq} tokens, fp32, {a.threads} threads")
    print("| attention | attention params | fwd+bwd ms | KV cache B/token (held) | vs mha |")
    print("|---|---:|---:|---:|---:|")
    mha_cache = dict((r[0], r[3]) for r in rows)["mha"]
    for kind, params, ms, cache in rows:
        step = "-" if ms is None else f"{ms:.1f}"
        print(f"| {kind} | {params:,} | {step} | {cache:,} | {cache / mha_cache:.2f} |")
    print("# KV cache: what this project's text generation holds per token, all layers; "
          "mla-latent: the mla model with --cache-mla-latents (generation only: no step time)")


def main(argv=None):
    a = parse(argv)
    with recording(a.record, "Multi-latent attention vs standard attention"):
        print_table(a, run(a))


if __name__ == "__main__":
    main()
