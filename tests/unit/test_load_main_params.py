"""--load-main-params-from-ckpt: where a main param reloads from, and the flag's check."""

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer.optimizer import main_value
from megatron.training.arguments import parse_args
from megatron.training.configs import build_checkpoint_config


def test_main_value_takes_the_checkpoint_tensor_unrounded():
    saved = torch.tensor([1.0 + 2 ** -12, -3.0 + 2 ** -10], dtype=torch.float32)
    param = torch.nn.Parameter(saved.to(torch.bfloat16))
    assert not torch.equal(param.float(), saved)  # bf16 lost the low bits
    assert torch.equal(main_value(param, {id(param): saved}), saved)
    assert torch.equal(main_value(param, None), param.detach())
    assert torch.equal(main_value(param, {}), param.detach())
    with pytest.raises(ValueError, match=r"shape \(3,\), the parameter \(2,\)"):
        main_value(param, {id(param): torch.zeros(3)})


@pytest.mark.parametrize("extra,ok", [([], False), (["--no-load-optim"], True),
                                      (["--finetune"], True)])
def test_needs_the_optimizer_state_left_out(extra, ok):
    args = parse_args(argv=["--load-main-params-from-ckpt", "--load", "x"] + extra)
    if ok:
        assert build_checkpoint_config(args).load_main_params_from_ckpt
    else:
        with pytest.raises(ConfigError, match=r"add --no-load-optim \(or --finetune\)"):
            build_checkpoint_config(args)
