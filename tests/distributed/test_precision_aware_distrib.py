"""The distributed optimizer with ``--use-precision-aware-optimizer`` on 2 gloo ranks against one
process stepping :class:`PrecisionAwareAdamW` over the whole model.

Both ranks feed the same batch, so the reduce-scattered average (g/2 + g/2) is exactly the
single-process gradient, and clipping is off (a norm summed per shard would add in another
order). bf16 moments and bf16 main grads are rounded element by element, so every shard must
then follow the single process bit for bit, and the gathered checkpoint state must hold exactly
the single process's moments. (fp16 moments are scaled per tensor, and a shard is its own
tensor, as in Megatron: their values depend on the sharding and are not compared here.)
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.optimizer.precision_aware_adam import PrecisionAwareAdamW
from tests.distributed.test_distrib_optimizer import BUCKET, batch, build_net
from tests.multiprocess import run_on_ranks

STEPS = 4
DTYPES = dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", main_grads_dtype="bf16")
HYPER = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def _loss(model, step):
    x, y = batch(0, step)  # the same batch on every rank
    return torch.nn.functional.mse_loss(model(x), y)


def _single_process():
    net = build_net()
    opt = PrecisionAwareAdamW(
        [{"params": [p for p in net.parameters() if p.dim() > 1], "weight_decay": 0.1},
         {"params": [p for p in net.parameters() if p.dim() == 1], "weight_decay": 0.0}],
        lr=HYPER["lr"], betas=(HYPER["adam_beta1"], HYPER["adam_beta2"]),
        eps=HYPER["adam_eps"], **DTYPES)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(net, step).backward()
        opt.step()
    return net, opt


def _sharded_run():
    dp_group = dist.new_group(list(range(dist.get_world_size())))
    ddp = DistributedDataParallel(build_net(), dp_group=dp_group, bucket_size=BUCKET,
                                  use_distributed_optimizer=True)
    config = OptimizerConfig(clip_grad=0.0, use_distributed_optimizer=True,
                             use_precision_aware_optimizer=True, **HYPER, **DTYPES)
    optimizer = get_megatron_optimizer(config, [ddp], mp_group=None, tp_group=None,
                                       dp_group=dp_group)
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        _loss(ddp, step).backward()
        ddp.finish_grad_sync()
        optimizer.step()
    inner = optimizer.optimizer
    stored = {v.dtype for s in inner.state.values() for k, v in s.items() if k != "step"}
    return {"params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
            "state": optimizer.state_dict(), "stored": stored, "type": type(inner).__name__,
            "order": [[n for n, p in ddp.module.named_parameters() if any(p is q for q in g)]
                      for g in optimizer.model_param_groups]}


@pytest.mark.slow
def test_two_ranks_follow_one_process_bit_for_bit():
    results = run_on_ranks(_sharded_run, 2)
    net, opt = _single_process()
    expected = dict(net.named_parameters())
    for out in results:
        assert out["type"] == "PrecisionAwareAdamW" and out["stored"] == {torch.bfloat16}
        for name, value in out["params"].items():
            assert torch.equal(value, expected[name].detach()), name
    saved = results[0]["state"]["param_state"]
    for g, names in enumerate(results[0]["order"]):
        for i, name in enumerate(names):
            for field in ("exp_avg", "exp_avg_sq"):
                assert saved[g][i][field].dtype == torch.float32
                ref = opt.unscaled_state(expected[name], field).reshape(saved[g][i][field].shape)
                assert torch.equal(saved[g][i][field], ref), (name, field)
