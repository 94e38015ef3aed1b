"""Tensor and sequence parallelism: layers, communication, loss, RNG streams, data broadcast."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    ReusableOutputBuffer,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    divide,
    ensure_divisibility,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)
from megatron.core.tensor_parallel.weight_shards import gather_weight_shards
from megatron.core.utils import init_method_normal, scaled_init_method_normal

__all__ = [
    "CheckpointFunction", "all_to_all", "ColumnParallelLinear", "CudaRNGStatesTracker",
    "LinearWithGradAccumulationAndAsyncCommunication", "RNGStatesTracker",
    "ReusableOutputBuffer", "RowParallelLinear",
    "VocabParallelEmbedding", "VocabUtility", "broadcast_data", "checkpoint",
    "copy_tensor_model_parallel_attributes", "copy_to_tensor_model_parallel_region", "divide",
    "ensure_divisibility", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "gather_split_1d_tensor", "get_cuda_rng_tracker",
    "gather_weight_shards", "init_method_normal",
    "linear_with_grad_accumulation_and_async_allreduce",
    "model_parallel_cuda_manual_seed", "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scaled_init_method_normal", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes", "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks", "vocab_parallel_cross_entropy",
]
