"""--use-torch-fsdp2's flags: Megatron's names and defaults, the config they fill, and one-line
refusals of the combinations FSDP2 does not serve here (each naming the flags)."""

import pytest

from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.configs import _ddp_config

BASE = """
--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16
--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3
--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 128 --mock-data
""".split()


def _validated(extra, world_size=2):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = world_size
    return validate_args(args)


def test_defaults_are_megatrons():
    args = parse_args(argv=BASE)
    assert args.use_torch_fsdp2 is False
    assert args.torch_fsdp2_reshard_after_forward is True
    assert args.use_megatron_fsdp is False


def test_flags_fill_the_ddp_config():
    args = _validated(["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"])
    ddp = _ddp_config(args)
    assert ddp.use_torch_fsdp2 and not ddp.torch_fsdp2_reshard_after_forward
    assert not _ddp_config(_validated([])).use_torch_fsdp2


@pytest.mark.parametrize("extra, named", [
    (["--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--num-experts", "2", "--no-bias-gelu-fusion", "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2"),
])
def test_refused_combinations_name_both_flags(extra, named):
    with pytest.raises(ArgumentsError) as err:
        _validated(["--use-torch-fsdp2"] + extra, world_size=4)
    message = str(err.value)
    assert "--use-torch-fsdp2" in message and named in message and "\n" not in message


@pytest.mark.parametrize("fsdp", [
    ["--use-torch-fsdp2"],
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
])
def test_per_token_loss_is_accepted_and_reaches_the_ddp_config(fsdp):
    """FSDP2 then sums the gradients and divides them by the token count (trained in
    tests/functional/test_fsdp_per_token_loss.py)."""
    ddp = _ddp_config(_validated(fsdp + ["--calculate-per-token-loss"]))
    assert ddp.use_torch_fsdp2 and ddp.calculate_per_token_loss


def test_megatron_fsdp_with_torch_fsdp2_is_refused_in_one_line():
    with pytest.raises(ArgumentsError) as err:
        _validated(["--use-megatron-fsdp", "--use-torch-fsdp2"])
    message = str(err.value)
    assert "--use-megatron-fsdp" in message and "--use-torch-fsdp2" in message
    assert "\n" not in message


@pytest.mark.parametrize("half", ["--bf16", "--fp16"])
def test_half_precision_builds_fp32_weights_under_fsdp2_only(half):
    """FSDP2's shards are the fp32 main weights (bf16 / fp16 is its compute dtype); without
    FSDP2 a half-precision model holds half-precision weights."""
    import torch

    from megatron.training.configs import build_configs
    from megatron.training.training import fsdp2_compute_dtype

    dtype = torch.bfloat16 if half == "--bf16" else torch.float16
    for fsdp, want in ((["--use-torch-fsdp2"], torch.float32), ([], dtype)):
        args = _validated(fsdp + [half])
        args.padded_vocab_size = 128
        configs = build_configs(args)
        assert configs.model.params_dtype == want
        assert configs.model.bf16 == (half == "--bf16") and configs.model.fp16 == (
            half == "--fp16")
        assert fsdp2_compute_dtype(args) == dtype
    assert fsdp2_compute_dtype(_validated(["--use-torch-fsdp2"])) is None


def test_experts_under_hybrid_sharding_are_refused_in_one_line():
    with pytest.raises(ArgumentsError) as err:
        _validated(["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2",
                    "--num-experts", "2", "--no-bias-gelu-fusion"], world_size=4)
    message = str(err.value)
    assert "--num-distributed-optimizer-instances 2" in message and "\n" not in message
    assert "--num-experts" in message


def test_experts_validate_under_fsdp2():
    args = _validated(["--use-torch-fsdp2", "--num-experts", "2", "--no-bias-gelu-fusion",
                       "--expert-model-parallel-size", "2"], world_size=4)
    assert args.use_torch_fsdp2 and args.expert_tensor_parallel_size == 1


def test_meta_device_init_needs_a_fully_sharded_run():
    message = _meta_refusal([])
    assert "--init-model-with-meta-device needs a fully sharded run" in message
    assert "\n" not in message


def test_meta_device_init_refuses_data_parallel_random_init():
    message = _meta_refusal(["--use-torch-fsdp2", "--data-parallel-random-init"])
    assert "--data-parallel-random-init" in message and "\n" not in message


def _meta_refusal(extra):
    with pytest.raises((ArgumentsError, SystemExit)) as err:
        _validated(extra + ["--init-model-with-meta-device"])
    return str(err.value)


def test_meta_device_init_is_accepted_with_fsdp2():
    assert _validated(["--use-torch-fsdp2", "--init-model-with-meta-device"]) \
        .init_model_with_meta_device


def test_overlap_flags_of_megatrons_fsdp_recipes_are_accepted_with_one_note(capsys):
    """FSDP2 always overlaps the reduce-scatter and prefetches the all-gather: the recipes'
    --overlap-grad-reduce / --overlap-param-gather are notes, and the DDP wrapper's switches
    stay off under FSDP2."""
    args = _validated(["--use-torch-fsdp2", "--overlap-grad-reduce", "--overlap-param-gather"])
    assert args.use_torch_fsdp2
    assert not args.overlap_grad_reduce and not args.overlap_param_gather
    notes = [line for line in capsys.readouterr().out.splitlines() if "FSDP2 already" in line]
    assert len(notes) == 1
    assert "--overlap-grad-reduce and --overlap-param-gather" in notes[0]


def test_megatron_fsdp_recipe_flags_validate_on_fsdp2(capsys):
    """Megatron-LM's FSDP recipe line: optim_grads_params with --use-distributed-optimizer and
    both overlap flags runs on FSDP2 (one note for the overlap flags)."""
    args = _validated(["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                       "optim_grads_params", "--use-distributed-optimizer",
                       "--overlap-grad-reduce", "--overlap-param-gather"])
    assert args.use_torch_fsdp2 and not args.use_distributed_optimizer
    assert not args.overlap_grad_reduce and not args.overlap_param_gather
    assert "FSDP2 already overlaps" in capsys.readouterr().out
