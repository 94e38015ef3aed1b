"""The key/value cache of one generation, shared by the attention layers of one pipeline stage.

Generation feeds the model the prompt once and then one new token per step. Each attention
layer keeps the keys and values it has computed so far, so a step only computes those of its new
tokens and attends over the cache. The cache of layer ``n`` (1-based global layer number) is
``key_value_memory_dict[n] = (keys, values)``, each ``[max_sequence_length, max_batch_size,
query groups on this rank, head dim]``, allocated by the layer on its first step. A
multi-latent attention layer with ``--cache-mla-latents`` holds one tensor instead,
``key_value_memory_dict[n] = (latents,)`` ``[max_sequence_length, max_batch_size, kv_lora_rank +
qk_pos_emb_head_dim]``: each token's normalised latent and rotated shared key.
"""

from typing import Dict, Tuple

import torch


class InferenceParams:
    """Where the next step's keys and values go in the cache.

    Args:
        max_batch_size: sequences generated together (the cache's batch dimension).
        max_sequence_length: prompt plus generated tokens (the cache's sequence dimension).

    Attributes:
        sequence_len_offset: tokens already in the cache; this step's tokens take positions
            ``sequence_len_offset ..`` (rotary and learned positions, and the causal mask, use
            it). The generation loop advances it after each step.
        batch_size_offset: first cache row of this step's batch.
        key_value_memory_dict: layer number -> (keys, values), or (latents,) for a
            multi-latent attention layer caching its latents.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(f"InferenceParams needs a positive batch size and length, got "
                             f"{max_batch_size} and {max_sequence_length}")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: Dict[int, Tuple[torch.Tensor, ...]] = {}

    def swap_key_value_dict(self, batch_idx: torch.Tensor) -> None:
        """Reorder every layer's cache along the batch (beam search keeps chosen beams)."""
        for number, held in self.key_value_memory_dict.items():
            self.key_value_memory_dict[number] = tuple(t[:, batch_idx] for t in held)
