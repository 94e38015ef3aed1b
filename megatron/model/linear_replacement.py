"""The ``replace_with_linear`` block of a heterogeneous model (:mod:`megatron.core.
heterogeneous`): one ``[h, h]`` linear layer in place of a layer's attention or MLP.

Split by rows over the tensor-parallel ranks (column-parallel, as Megatron-Core's
``ColumnParallelLinearGathered``), its output gathered back to the full hidden size. Under
sequence parallelism the input is all-gathered along the sequence inside the linear layer, and
after gathering the hidden dimension each rank keeps its own slice of the sequence again.
"""

import torch

from megatron.core import tensor_parallel
from megatron.core.collectives import get_group_size


class LinearReplacement(tensor_parallel.ColumnParallelLinear):
    """``[s, b, h]`` -> ``([s, b, h], None)`` (``[s/tp, b, h]`` under sequence parallelism):
    ``x W^T + b`` with the bias added inside, so the caller's bias-dropout-add gets None."""

    def __init__(self, config, tp_group, sequence_parallel: bool, init_method):
        super().__init__(config.hidden_size, config.hidden_size, init_method=init_method,
                         tp_group=tp_group, bias=config.add_bias_linear, gather_output=False,
                         skip_bias_add=False, sequence_parallel=sequence_parallel,
                         params_dtype=config.params_dtype)

    def forward(self, hidden_states: torch.Tensor, *unused, **unused_kwargs):
        """Attention's call signature is accepted (mask, rotary, cache), and ignored."""
        output, _ = super().forward(hidden_states)                 # [s, b, h/tp]
        if get_group_size(self.tp_group) == 1:
            return output, None
        output = tensor_parallel.gather_from_tensor_model_parallel_region(
            output, self.tp_group)                                 # [s, b, h]
        if self.sequence_parallel:
            output = tensor_parallel.scatter_to_sequence_parallel_region(
                output, self.tp_group)                             # [s/tp, b, h]
        return output, None
