"""``--dataloader-inter-document-masking``: attention kept inside each document of a sample.

A GPT sample is cut from consecutive documents (sequences of the indexed dataset). With the flag,
as in Megatron-Core, the dataset also returns ``cu_seqlens``: the cumulative lengths of the
sample's document parts over its ``seq_length`` input tokens (the extra label token taken off the
last part), padded to ``seq_length + 1`` entries with ``seq_length`` so that samples stack. The
batch then gives every token the positions 0, 1, ... of its own document and lets a token attend
only to the earlier tokens of its own document. Megatron runs this as packed ("thd") attention
over the ``cu_seqlens`` segments; here the same restriction is a block-diagonal causal mask
(``[b, 1, s, s]``, True where attention is not allowed), which every attention path takes, so
each document's outputs are those of the document run on its own.
"""

from typing import Sequence, Tuple

import numpy as np
import torch


def document_cu_seqlens(part_lengths: Sequence[int], seq_length: int,
                        extra_token: bool = True) -> np.ndarray:
    """int64 ``[seq_length + 1]``: 0, then the end of each document part among the input tokens,
    then ``seq_length`` repeated.

    Args:
        part_lengths: the tokens each document contributes to the sample, in order (including
            the extra token that only serves as the last label).
        seq_length: ``--seq-length``.
        extra_token: the sample holds ``seq_length + 1`` tokens (the last one a label only).
    """
    lengths = [int(n) for n in part_lengths]
    if extra_token and lengths:
        lengths[-1] -= 1
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = seq_length - sum(lengths)
    if shortfall < 0:
        raise ValueError(f"document parts of {sum(lengths)} tokens exceed --seq-length "
                         f"{seq_length}")
    if shortfall:  # padding belongs to the last document, as Megatron folds it
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = np.full(seq_length + 1, seq_length, dtype=np.int64)
    cu[:len(lengths) + 1] = np.cumsum([0] + lengths)
    return cu


def inter_document_masks(cu_seqlens: torch.Tensor, seq_length: int
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(attention mask ``[b, 1, s, s]`` bool, True = not allowed; position ids ``[b, s]``) of a
    batch of padded ``cu_seqlens`` ``[b, s + 1]``."""
    dev = cu_seqlens.device
    positions = torch.arange(seq_length, device=dev)                    # [s]
    cu = cu_seqlens.long()
    # The document of token t: how many document ends lie at or before t.
    segment = (cu[:, 1:].unsqueeze(1) <= positions.view(1, -1, 1)).sum(-1)  # [b, s]
    starts = torch.gather(cu, 1, segment)                                # [b, s]
    position_ids = positions.unsqueeze(0) - starts                       # [b, s]
    causal = torch.ones((seq_length, seq_length), dtype=torch.bool, device=dev).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)                  # [b, s, s]
    return ~(same & causal).unsqueeze(1), position_ids
