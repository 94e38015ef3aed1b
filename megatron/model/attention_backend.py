"""``--attention-backend``: which body of :class:`~megatron.model.attention.CoreAttention`
computes attention, expressed through the two switches it already reads.

=========  ==========================================================  ====================
backend    body                                                         switches
=========  ==========================================================  ====================
flash      ``torch.nn.functional.scaled_dot_product_attention`` (flash  use_flash_attn
           / memory-efficient kernels on GPU, its flash kernel on CPU)
fused      explicit ``baddbmm`` + scaled masked softmax kernel + ``bmm``  masked_softmax_fusion
           (causal self-attention of 256+ tokens on CPU in float32: in
           blocks of query rows, ``megatron/model/block_causal.py``)
unfused    the same explicit body, plain softmax (same blocks)          neither
local      as unfused (Megatron-Core's own DotProductAttention)         neither
auto       see :func:`auto_backend`
=========  ==========================================================  ====================

All compute the same function within float tolerance. ``flash`` has no softmax-offset term, so
``--softmax-type off-by-one|learnable`` with it is refused; windows (``--window-size``) work
with every backend (``flash`` takes the banded mask as an explicit mask).
"""

from typing import Optional, Tuple

# Shortest sequence from which --attention-backend auto takes scaled_dot_product_attention
# (benchmarks/bench_attention_backends.py, RESULTS.md "Attention backends": on CPU it is the
# fastest path from 256 tokens in fp32 and bf16, by 2-5x at 1024-2048; below, the explicit
# body is as fast or faster).
AUTO_FLASH_MIN_SEQ = 256
# On CPU in float32, up to this many tokens auto keeps the explicit body instead: from 256
# tokens it computes causal attention in blocks of query rows (megatron/model/block_causal.py),
# 1.2-1.5x faster than the flash kernel at 256-512 tokens, 1.04-1.07x at 1024 and 0.91x at
# 2048 (forward + backward, 8 heads of 64, batch 2 and 4, the two alternating; RESULTS.md
# "Attention backends"). Its probabilities also take memory quadratic in the sequence.
AUTO_BLOCKS_MAX_SEQ = 1024

EXPLICIT = ("fused", "unfused", "local")


class AttentionBackendError(ValueError):
    """A backend that cannot run with the other flags; the message is one line."""


def auto_backend(transformer_impl: str, seq_length: int, softmax_type: str,
                 use_flash_attn: bool, masked_softmax_fusion: bool, on_cpu: bool = False,
                 half: bool = False) -> str:
    """The backend ``auto`` picks: the measured rule (``AUTO_FLASH_MIN_SEQ``,
    ``AUTO_BLOCKS_MAX_SEQ``).

    ``flash`` when ``--use-flash-attn`` is given, or when the layers have no softmax offset and
    ``seq_length >= AUTO_FLASH_MIN_SEQ`` (where scaled_dot_product_attention is the faster path
    on GPU, and on CPU in half precision) -- except a float32 run on CPU (``on_cpu`` and not
    ``half``) of at most ``AUTO_BLOCKS_MAX_SEQ`` tokens, whose explicit body runs causal
    attention in blocks and is faster there. Otherwise the explicit body the softmax flags
    select (the fused masked softmax unless ``--no-masked-softmax-fusion``). The same for both
    ``--transformer-impl`` values: they run the same layers here."""
    del transformer_impl
    explicit = "fused" if masked_softmax_fusion else "unfused"
    if use_flash_attn:
        return "flash"
    if softmax_type == "vanilla" and seq_length >= AUTO_FLASH_MIN_SEQ:
        if on_cpu and not half and seq_length <= AUTO_BLOCKS_MAX_SEQ:
            return explicit
        return "flash"
    return explicit


def resolve(backend: str, *, transformer_impl: str = "local", seq_length: int = 0,
            softmax_type: str = "vanilla", use_flash_attn: bool = False,
            masked_softmax_fusion: bool = True, on_cpu: bool = False,
            half: bool = False) -> Tuple[str, bool, bool]:
    """``(chosen backend, use_flash_attn, masked_softmax_fusion)`` for ``--attention-backend
    backend`` and the other flags' values.

    Raises:
        AttentionBackendError: a named backend the other flags contradict
            (``--use-flash-attn`` with an explicit body, ``--no-masked-softmax-fusion`` with
            ``fused``) or cannot run (``flash`` with a softmax offset).
    """
    if backend == "auto":
        backend = auto_backend(transformer_impl, seq_length, softmax_type, use_flash_attn,
                               masked_softmax_fusion, on_cpu, half)
    elif backend == "flash":
        if softmax_type != "vanilla":
            raise AttentionBackendError(
                f"--attention-backend flash cannot add --softmax-type {softmax_type}'s offset "
                "(scaled_dot_product_attention has no such term); use --attention-backend "
                "fused or unfused")
    elif use_flash_attn:
        raise AttentionBackendError(f"--attention-backend {backend} contradicts "
                                    "--use-flash-attn (which selects flash); give one")
    elif backend == "fused" and not masked_softmax_fusion:
        raise AttentionBackendError("--attention-backend fused contradicts "
                                    "--no-masked-softmax-fusion; give one (or use unfused)")
    if backend == "flash":   # the softmax switch stays as given: no flash layer reads it
        return backend, True, masked_softmax_fusion
    return backend, False, backend == "fused"


def backend_name(value) -> Optional[str]:
    """The name of an ``AttnBackend`` member, or of a plain string (None stays None)."""
    return getattr(value, "name", value)
