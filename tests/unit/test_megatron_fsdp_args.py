"""--use-megatron-fsdp's flags: Megatron's names and defaults, each sharding strategy's layout
(FSDP2, the distributed optimizer or the grad-buffer wrapper), the dtype flags on FSDP2's
mixed-precision policy, and one-line refusals naming the value and what to use instead."""

import pytest

from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.configs import _ddp_config

BASE = """
--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3
--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data
""".split()
# What Megatron-FSDP's user guide asks a launch script to pass.
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion"]


def _validated(extra, world_size=2):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = world_size
    return validate_args(args)


def _refusal(extra):
    with pytest.raises(ArgumentsError) as err:
        _validated(extra)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_defaults_are_megatrons():
    args = parse_args(argv=BASE)
    assert args.use_megatron_fsdp is False
    assert args.data_parallel_sharding_strategy == "optim_grads_params"
    assert args.outer_dp_sharding_strategy == "no_shard"
    assert args.megatron_fsdp_main_params_dtype == "fp32"
    assert args.megatron_fsdp_main_grads_dtype == "auto"
    assert args.megatron_fsdp_grad_comm_dtype == "auto"


@pytest.mark.parametrize("strategy, fsdp2, reshard, distributed", [
    ("no_shard", False, True, False),
    ("optim", False, True, True),
    ("optim_grads", True, False, False),
    ("optim_grads_params", True, True, False),
])
def test_each_strategy_fills_the_ddp_config(strategy, fsdp2, reshard, distributed):
    ddp = _ddp_config(_validated(MEGATRON_FSDP + ["--data-parallel-sharding-strategy",
                                                  strategy]))
    assert ddp.use_torch_fsdp2 is fsdp2
    assert ddp.use_distributed_optimizer is distributed
    if fsdp2:
        assert ddp.torch_fsdp2_reshard_after_forward is reshard


def test_the_default_strategy_is_fsdp2_resharding_after_forward():
    ddp = _ddp_config(_validated(MEGATRON_FSDP))
    assert ddp.use_torch_fsdp2 and ddp.torch_fsdp2_reshard_after_forward
    assert not ddp.use_distributed_optimizer


@pytest.mark.parametrize("comm, want", [("auto", None), ("fp32", "fp32"), ("bf16", "bf16")])
def test_grad_comm_dtype_becomes_fsdp2_reduce_dtype(comm, want):
    args = _validated(MEGATRON_FSDP + ["--megatron-fsdp-grad-comm-dtype", comm,
                                       "--megatron-fsdp-main-grads-dtype", "fp32"])
    assert _ddp_config(args).torch_fsdp2_reduce_dtype == want


def test_without_megatron_fsdp_the_reduce_dtype_is_fsdp2s_default():
    assert _ddp_config(_validated(["--use-torch-fsdp2", "--bf16"])).torch_fsdp2_reduce_dtype \
        is None


@pytest.mark.parametrize("extra, named", [
    (["--megatron-fsdp-main-params-dtype", "bf16"], "--megatron-fsdp-main-params-dtype bf16"),
    (["--megatron-fsdp-main-params-dtype", "auto"], "--megatron-fsdp-main-params-dtype auto"),
    (["--megatron-fsdp-main-grads-dtype", "bf16"], "--megatron-fsdp-main-grads-dtype bf16"),
    (["--megatron-fsdp-grad-comm-dtype", "fp16"], "--megatron-fsdp-grad-comm-dtype fp16"),
    (["--data-parallel-sharding-strategy", "optim", "--megatron-fsdp-grad-comm-dtype", "bf16"],
     "--megatron-fsdp-grad-comm-dtype bf16"),
    (["--outer-dp-sharding-strategy", "optim"], "--outer-dp-sharding-strategy optim"),
    (["--num-experts", "2", "--no-bias-gelu-fusion", "--expert-tensor-parallel-size", "2"],
     "optim_grads_params"),
    (["--data-parallel-sharding-strategy", "no_shard", "--overlap-param-gather"],
     "--overlap-param-gather"),
])
def test_refusals_name_the_value_in_one_line(extra, named):
    message = _refusal(MEGATRON_FSDP + extra)
    assert named in message
    assert "use " in message or "drop" in message


@pytest.mark.parametrize("extra", [
    ["--data-parallel-sharding-strategy", "optim"],
    ["--megatron-fsdp-grad-comm-dtype", "bf16"],
])
def test_megatron_fsdp_flags_without_it_are_refused(extra):
    assert "needs --use-megatron-fsdp" in _refusal(extra)


def test_strategy_optim_serves_what_fsdp2_refuses():
    """Pipeline parallelism is refused on FSDP2; on the distributed optimizer it runs."""
    args = _validated(MEGATRON_FSDP + ["--data-parallel-sharding-strategy", "optim",
                                       "--pipeline-model-parallel-size", "2"], world_size=4)
    assert args.use_distributed_optimizer and not args.use_torch_fsdp2


def test_distributed_optimizer_instances_become_fsdp2_replicas():
    args = _validated(MEGATRON_FSDP + ["--num-distributed-optimizer-instances", "2"],
                      world_size=4)
    assert parse_args(argv=BASE).num_distributed_optimizer_instances == 1
    assert _ddp_config(args).torch_fsdp2_replicas == 2


@pytest.mark.parametrize("extra, named", [
    (["--num-distributed-optimizer-instances", "3"], "must divide"),
    (["--num-distributed-optimizer-instances", "0"], "must be >= 1"),
    (["--num-distributed-optimizer-instances", "2", "--data-parallel-sharding-strategy",
      "optim"], "optim_grads_params"),
])
def test_distributed_optimizer_instances_refusals(extra, named):
    message = _refusal(MEGATRON_FSDP + extra)
    assert "--num-distributed-optimizer-instances" in message and named in message


def test_distributed_optimizer_instances_without_megatron_fsdp_are_refused():
    message = _refusal(["--num-distributed-optimizer-instances", "2"])
    assert "needs --use-megatron-fsdp" in message


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_fsdp_dtensor_format_is_accepted_when_fsdp2_shards_the_model(strategy):
    args = _validated(MEGATRON_FSDP + ["--data-parallel-sharding-strategy", strategy,
                                       "--ckpt-format", "fsdp_dtensor", "--save", "/tmp/x"])
    assert args.ckpt_format == "fsdp_dtensor" and args.use_torch_fsdp2


@pytest.mark.parametrize("extra", [
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"],
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"],
    []])
@pytest.mark.parametrize("where", [["--save", "/tmp/x"], ["--load", "/tmp/x"]])
def test_fsdp_dtensor_format_without_fsdp2_is_refused_with_what_to_use(extra, where):
    with pytest.raises((ArgumentsError, SystemExit)) as err:
        _validated(extra + ["--no-gradient-accumulation-fusion", "--ckpt-format",
                            "fsdp_dtensor", *where])
    message = str(err.value)
    assert "fsdp_dtensor" in message and "--ckpt-convert-format torch_dist" in message
    assert "\n" not in message


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_validating_twice_gives_the_same_layout(strategy):
    args = _validated(MEGATRON_FSDP + ["--data-parallel-sharding-strategy", strategy])
    once = _ddp_config(args)
    assert _ddp_config(validate_args(args)) == once
