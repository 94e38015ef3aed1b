"""The data-parallel wrapper's typed config (Megatron-Core's field names, flags in comments)."""

from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.core.config import ConfigError


@dataclass
class DistributedDataParallelConfig:
    """How :class:`~megatron.core.distributed.DistributedDataParallel` holds and reduces
    gradients."""

    grad_reduce_in_fp32: bool = False          # --accumulate-allreduce-grads-in-fp32
    overlap_grad_reduce: bool = False          # --overlap-grad-reduce
    # --overlap-param-gather: the distributed optimizer's all-gather of updated parameters
    # overlaps the next forward (the optimizer takes it from here).
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False    # --use-distributed-optimizer
    # --ddp-reduce-scatter-with-fp32-accumulation: the distributed optimizer's reduce-scatter
    # is an all-to-all in the buffer's dtype, summed in fp32 by each rank, rounded once.
    reduce_scatter_with_fp32_accumulation: bool = False
    # --ddp-param-name-patterns-for-fp32-local-accumulation: parameters whose name matches
    # (fnmatch, or 'all') accumulate micro-batches in an fp32 main_grad of their own.
    param_name_patterns_for_fp32_local_accumulation: Tuple[str, ...] = ()
    bucket_size: Optional[int] = None          # --ddp-bucket-size, in elements
    # --no-gradient-accumulation-fusion sets False: weight gradients are added into the
    # fp32 main_grad buffer by the fused kernel (Megatron-Core keeps this flag in the
    # model-parallel config; here the wrapper that owns the buffer takes it).
    gradient_accumulation_fusion: bool = False
    # --calculate-per-token-loss: gradients are summed over data-parallel ranks, then divided
    # by the step's token count (Megatron-Core keeps it in the model config).
    calculate_per_token_loss: bool = False
    # --use-torch-fsdp2: shard parameters, gradients and optimizer state over the data-parallel
    # group with PyTorch's FSDP2 instead of this wrapper's grad buffers.
    use_torch_fsdp2: bool = False
    # --torch-fsdp2-no-reshard-after-forward sets False: keep each unit's gathered parameters
    # from its forward to its backward.
    torch_fsdp2_reshard_after_forward: bool = True
    # --megatron-fsdp-grad-comm-dtype on FSDP2: the dtype gradients are reduce-scattered in
    # ("fp32" or "bf16"); None: FSDP2's default for the run (fp32).
    torch_fsdp2_reduce_dtype: Optional[str] = None
    # --num-distributed-optimizer-instances with --use-megatron-fsdp on FSDP2: hybrid sharding,
    # the data-parallel group split into this many replicas, each sharding the model.
    torch_fsdp2_replicas: int = 1

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be >= 1 (elements), got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
        if self.reduce_scatter_with_fp32_accumulation and not self.use_distributed_optimizer:
            raise ConfigError("--ddp-reduce-scatter-with-fp32-accumulation needs "
                              "--use-distributed-optimizer (only its reduction is a "
                              "reduce-scatter)")
