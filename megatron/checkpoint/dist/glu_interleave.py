"""GLU-interleaved MoE fc1 tensors (``--moe-mlp-glu-interleave-size``,
``--moe-shared-expert-glu-interleave-size``) in Megatron-Core's torch_dist layout.

In memory each (expert-)TP rank holds its share of the gate and value rows interleaved in
blocks: ``N`` gate rows, ``N`` value rows, and so on. Megatron-Core saves that local tensor as it
saves a SwiGLU fc1: cut in two halves of rows, the first halves of all ranks stacked, then the
second halves. Of ``R`` rows saved at TP size ``t`` (each rank ``2h`` rows, ``h = R / 2t``),
rank ``s``'s half ``k`` is stored at rows ``k * R / 2 + s * h``. The halves are not the gate and
value halves, so the stored order depends on ``t``; at ``t = 1`` it is the whole interleaved
weight (the ranks' local tensors one after the other, the same at any split). Saves here write
Megatron-Core's order at the saving TP size (the SwiGLU placement of
:func:`~megatron.checkpoint.dist.keys.placements`); :class:`InterleavedView` reads a file of
either maker as that whole interleaved weight, finding ``t`` in the saved args.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint.dist.reader import DistCheckpointError

ROUTED = ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc1.bias")
SHARED = ("mlp.shared_experts.linear_fc1.weight",)


def saved_splits(args) -> Dict[str, int]:
    """The key suffixes of the interleaved tensors a file's saved ``args`` describe, and the
    TP size each was split over when saved (expert-TP for the routed experts)."""
    found: Dict[str, int] = {}
    if args is None:
        return found
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if getattr(args, "moe_mlp_glu_interleave_size", None) is not None:
        etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
        found.update({suffix: etp for suffix in ROUTED})
    if getattr(args, "moe_shared_expert_glu_interleave_size", None) is not None:
        found.update({suffix: tp for suffix in SHARED})
    return found


def stored_runs(rows: int, tp: int) -> List[Tuple[int, int, int]]:
    """``(whole_start, stored_start, length)``: where each run of rows of the whole interleaved
    weight (``rows`` rows) sits in a file saved at TP ``tp``."""
    if rows % (2 * tp):
        raise DistCheckpointError(f"a GLU-interleaved fc1 of {rows} rows cannot have been saved "
                                  f"at TP {tp} (each rank holds two halves of equal rows)")
    half = rows // (2 * tp)
    return [(s * 2 * half + k * half, k * rows // 2 + s * half, half)
            for s in range(tp) for k in range(2)]


class InterleavedView:
    """A reader whose GLU-interleaved fc1 tensors (and their optimizer state) read as the
    whole interleaved weight, whatever TP size saved them; everything else unchanged."""

    def __init__(self, reader, splits: Dict[str, Tuple[int, int]]):
        self._reader = reader
        self._splits = splits   # key -> (row axis, saved TP size)

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def __contains__(self, key: str) -> bool:
        return key in self._reader

    def chunks(self, key: str):
        if key in self._splits:
            shape = self._reader.shape(key)
            return [((0,) * len(shape), tuple(shape))]
        return self._reader.chunks(key)

    def read(self, key: str, offset: Optional[Sequence[int]] = None,
             size: Optional[Sequence[int]] = None, out: Optional[torch.Tensor] = None,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if key not in self._splits:
            return self._reader.read(key, offset, size, out=out, dtype=dtype)
        axis, tp = self._splits[key]
        shape = tuple(self._reader.shape(key))
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        size = tuple(size) if size is not None else tuple(s - o for s, o in zip(shape, offset))
        if out is None:
            out = torch.empty(size, dtype=dtype or self._reader.dtype(key))
        lo, hi = offset[axis], offset[axis] + size[axis]
        for whole, stored, length in stored_runs(shape[axis], tp):
            a, b = max(lo, whole), min(hi, whole + length)
            if a >= b:
                continue
            at = list(offset)
            at[axis] = stored + a - whole
            part = list(size)
            part[axis] = b - a
            self._reader.read(key, at, part, out=out.narrow(axis, a - lo, b - a))
        return out


def open_view(reader, args):
    """``reader`` itself, or an :class:`InterleavedView` of it when its saved ``args`` name
    GLU-interleaved tensors split over more than one rank."""
    splits = {}
    for suffix, tp in saved_splits(args).items():
        if tp <= 1:
            continue
        for key in reader.tensor_keys():
            if key.endswith("." + suffix) or key == suffix:
                axis = len(reader.shape(key)) - (2 if suffix.endswith("weight") else 1)
                splits[key] = (axis, tp)
    return InterleavedView(reader, splits) if splits else reader
