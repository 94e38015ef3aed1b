"""--grad-reduce-in-bf16 and the two grad-buffer refinements: what validation derives from them,
what the data-parallel config carries, and the combinations refused in one line."""

import pytest

from megatron.core.config import ConfigError
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.tokenizer import build_tokenizer
from megatron.training.arguments import ArgumentsError, build_configs, parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 2 "
        "--train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 64").split()
PATTERNS = "--ddp-param-name-patterns-for-fp32-local-accumulation"
FP32_RS = "--ddp-reduce-scatter-with-fp32-accumulation"


def _validated(extra, world_size=2):
    args = parse_args(argv=BASE + extra.split())
    args.world_size = world_size
    args = validate_args(args)
    build_tokenizer(args)          # pads the vocabulary, which build_configs reads
    return args


def test_defaults_keep_fp32_buffers_with_bf16_and_param_dtype_without():
    args = _validated("--bf16")
    assert args.accumulate_allreduce_grads_in_fp32 and not args.grad_reduce_in_bf16
    assert args.ddp_param_name_patterns_for_fp32_local_accumulation == []
    ddp = build_configs(args).ddp
    assert ddp.grad_reduce_in_fp32 and not ddp.reduce_scatter_with_fp32_accumulation
    assert ddp.param_name_patterns_for_fp32_local_accumulation == ()
    assert not _validated("").accumulate_allreduce_grads_in_fp32


def test_grad_reduce_in_bf16_turns_fp32_buffers_off_as_megatron_does(capsys):
    assert not _validated("--bf16 --grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32
    args = _validated("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32")
    assert not args.accumulate_allreduce_grads_in_fp32
    assert "--grad-reduce-in-bf16 overrides" in capsys.readouterr().out


def test_the_refinements_reach_the_data_parallel_config():
    args = _validated(f"--bf16 --grad-reduce-in-bf16 --use-distributed-optimizer {FP32_RS} "
                      f"{PATTERNS} *norm* all")
    ddp = build_configs(args).ddp
    assert not ddp.grad_reduce_in_fp32 and ddp.reduce_scatter_with_fp32_accumulation
    assert ddp.param_name_patterns_for_fp32_local_accumulation == ("*norm*", "all")
    # fp16 buffers (no --accumulate-allreduce-grads-in-fp32) take the patterns too.
    assert _validated(f"--fp16 {PATTERNS} *norm*").ddp_param_name_patterns_for_fp32_local_accumulation


MEGATRON_FSDP = "--use-megatron-fsdp --no-gradient-accumulation-fusion"


@pytest.mark.parametrize("extra, same_as", [
    ("--use-torch-fsdp2", None),
    (MEGATRON_FSDP, f"{MEGATRON_FSDP} --megatron-fsdp-grad-comm-dtype bf16"),
    (f"{MEGATRON_FSDP} --megatron-fsdp-grad-comm-dtype fp32",
     f"{MEGATRON_FSDP} --megatron-fsdp-grad-comm-dtype fp32"),
])
def test_under_fsdp2_grad_reduce_in_bf16_reduce_scatters_in_bf16(extra, same_as):
    """As in Megatron (its FSDP paths reduce in the bf16 parameters' dtype once
    --grad-reduce-in-bf16 clears grad_reduce_in_fp32): FSDP2's reduce dtype becomes bf16, the
    same run as --megatron-fsdp-grad-comm-dtype bf16; an explicit comm dtype still decides."""
    ddp = build_configs(_validated(f"--bf16 --grad-reduce-in-bf16 {extra}")).ddp
    assert ddp.use_torch_fsdp2
    want = "bf16" if same_as is None else build_configs(
        _validated(f"--bf16 {same_as}")).ddp.torch_fsdp2_reduce_dtype
    assert ddp.torch_fsdp2_reduce_dtype == want
    assert build_configs(_validated(f"--bf16 {extra}")).ddp.torch_fsdp2_reduce_dtype != "bf16"


@pytest.mark.parametrize("extra, flag", [
    ("--grad-reduce-in-bf16", "--grad-reduce-in-bf16 needs --bf16"),
    ("--fp16 --grad-reduce-in-bf16", "--grad-reduce-in-bf16 needs --bf16"),
    (f"--bf16 --grad-reduce-in-bf16 {FP32_RS}", f"{FP32_RS} needs --use-distributed-optimizer"),
    (f"--bf16 {PATTERNS} *norm*", f"{PATTERNS}: the gradient buffers are already fp32"),
    (f"{PATTERNS} *norm*", f"{PATTERNS}: the gradient buffers are already fp32"),
    (f"--fp16 --accumulate-allreduce-grads-in-fp32 {PATTERNS} all",
     f"{PATTERNS}: the gradient buffers are already fp32"),
    (f"--bf16 --use-torch-fsdp2 {FP32_RS}",
     f"{FP32_RS} is built for the grad-buffer wrapper, not with FSDP2"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(extra, flag):
    with pytest.raises(ArgumentsError) as err:
        _validated(extra)
    message = str(err.value)
    assert message.startswith(flag) and "\n" not in message, message


def test_config_refuses_an_fp32_reduce_scatter_without_one():
    with pytest.raises(ConfigError, match="needs --use-distributed-optimizer"):
        DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True)
    assert DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True,
                                         use_distributed_optimizer=True).bucket_size is None
