"""Linear layers with weight shards on gloo ranks against the same layers without shards.

World 2 (one weight-shard group of 2, no tensor parallelism) and world 4 (tensor parallel 2 x
2 weight shards, Megatron's rank order: tensor-parallel ranks neighbours, shard peers 2 apart).
The reference is one process: the layers built with no groups from the same seed (their weights
are the full weights) applied, in float64, to every rank's samples. Ranks of a weight-shard
group read different samples, so a shard's gradient must be the sum over the group of the
full-weight gradients, cut to its rows; outputs and input gradients must match rank by rank.
The shards are also written as a ``torch_dist`` checkpoint at their Megatron offsets and read
back in the sharded and in the unsharded layout.
"""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.checkpoint.dist.reader import DistCheckpointReader
from megatron.checkpoint.dist.writer import TensorShard, save_shards
from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import weight_shards as ws
from tests.multiprocess import run_on_ranks

TOL = dict(rtol=0, atol=1e-12)
S, B, H, FFN = 3, 2, 8, 16
INIT = tp.init_method_normal(0.3)


def _groups(tp_size, n_shards):
    """This rank's ((tp group, tp rank), (weight-shard group, its ranks), data index)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_groups = [list(range(s, s + tp_size)) for s in range(0, world, tp_size)]
    shard_groups = ws.weight_shard_ranks(world, tp_size, n_shards)
    mine = {}
    for name, lists in (("tp", tp_groups), ("shard", shard_groups)):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = (group if len(ranks) > 1 else None,
                              ranks.index(rank) if name == "tp" else ranks)
    data_index = rank // tp_size            # the tp ranks of one model copy read the same data
    return mine["tp"], mine["shard"], data_index


def _mlp(tp_group, shard_group, sequence_parallel=False):
    torch.manual_seed(11)
    fc1 = tp.ColumnParallelLinear(H, FFN, init_method=INIT, tp_group=tp_group,
                                  params_dtype=torch.float64, weight_shard_group=shard_group,
                                  sequence_parallel=sequence_parallel)
    fc2 = tp.RowParallelLinear(FFN, H, init_method=INIT, tp_group=tp_group,
                               params_dtype=torch.float64, input_is_parallel=True,
                               weight_shard_group=shard_group, sequence_parallel=sequence_parallel)
    return fc1, fc2


def _forward(fc1, fc2, x):
    h, _ = fc1(x)
    out, _ = fc2(torch.tanh(h))
    return out


def _data(index):
    g = torch.Generator().manual_seed(100 + index)
    return (torch.randn(S, B, H, generator=g, dtype=torch.float64),
            torch.randn(S, B, H, generator=g, dtype=torch.float64))


def _reference(n_data):
    """The unsharded layers, and per data index: output, input grad and every param's grad."""
    fc1, fc2 = _mlp(None, None)
    runs = []
    for i in range(n_data):
        x, dy = _data(i)
        x.requires_grad_(True)
        fc1.zero_grad(), fc2.zero_grad()
        out = _forward(fc1, fc2, x)
        out.backward(dy)
        grads = {n: p.grad.clone() for n, p in (("fc1.weight", fc1.weight),
                                                ("fc1.bias", fc1.bias),
                                                ("fc2.weight", fc2.weight),
                                                ("fc2.bias", fc2.bias))}
        runs.append((out.detach(), x.grad, grads))
    return fc1, fc2, runs


def _expected_piece(full, param, tp_rank, tp_size):
    """Cut ``full`` at the checkpoint box of ``param``: ties the box to the layers' layout."""
    _, offset = ws.checkpoint_box(tuple(param.shape), param.partition_dim, tp_rank, tp_size,
                                  param.weight_shard_rank, param.weight_shards)
    index = tuple(slice(o, o + n) for o, n in zip(offset, param.shape))
    return full[index]


def _check_against_one_process(tp_size, n_shards, ckpt_dir):
    (tp_group, tp_rank), (shard_group, shard_ranks), data_index = _groups(tp_size, n_shards)
    ref1, ref2, runs = _reference(dist.get_world_size() // tp_size)
    fc1, fc2 = _mlp(tp_group, shard_group)
    g = n_shards // tp_size
    assert fc1.weight.shape == (FFN // n_shards, H)
    assert fc2.weight.shape == (H // g, FFN // tp_size)
    for layer, ref in ((fc1, ref1), (fc2, ref2)):
        torch.testing.assert_close(layer.weight.detach(),
                                   _expected_piece(ref.weight.detach(), layer.weight, tp_rank,
                                                   tp_size), **TOL)
    x, dy = _data(data_index)
    x.requires_grad_(True)
    out = _forward(fc1, fc2, x)
    out.backward(dy)
    ref_out, ref_dx, ref_grads = runs[data_index]
    torch.testing.assert_close(out.detach(), ref_out, **TOL)
    torch.testing.assert_close(x.grad, ref_dx, **TOL)
    # Shard peers read different samples: the reduce-scatter sums their weight gradients.
    peers = [r // tp_size for r in shard_ranks]
    for name, layer in (("fc1", fc1), ("fc2", fc2)):
        full = sum(runs[i][2][f"{name}.weight"] for i in peers)
        torch.testing.assert_close(layer.weight.grad,
                                   _expected_piece(full, layer.weight, tp_rank, tp_size), **TOL)
    # biases are not sharded: each rank keeps the gradient of its own samples
    torch.testing.assert_close(fc1.bias.grad, ref_grads["fc1.bias"].chunk(tp_size)[tp_rank],
                               **TOL)
    torch.testing.assert_close(fc2.bias.grad, ref_grads["fc2.bias"], **TOL)
    _save_and_reload(fc1, fc2, ref1, ref2, tp_rank, tp_size, ckpt_dir)
    _load_unsharded_checkpoint(fc1, fc2, tp_rank, tp_size, ckpt_dir + "_full")


def _save_and_reload(fc1, fc2, ref1, ref2, tp_rank, tp_size, ckpt_dir):
    items = []
    for key, layer in (("decoder.layers.0.mlp.linear_fc1.weight", fc1),
                       ("decoder.layers.0.mlp.linear_fc2.weight", fc2)):
        w = layer.weight
        shape, offset = ws.checkpoint_box(tuple(w.shape), w.partition_dim, tp_rank, tp_size,
                                          w.weight_shard_rank, w.weight_shards)
        items.append(TensorShard(key, w.detach(), shape, offset))
    save_shards(ckpt_dir, items)
    reader = DistCheckpointReader(ckpt_dir)
    for item, ref in zip(items, (ref1, ref2)):
        # unsharded layout: the whole weight, as one process without shards holds it
        torch.testing.assert_close(reader.read(item.key), ref.weight.detach(), rtol=0, atol=0)
        # this rank's own shard, back at its offset
        back = reader.read(item.key, item.global_offset, tuple(item.tensor.shape))
        assert torch.equal(back, item.tensor)


def _load_unsharded_checkpoint(fc1, fc2, tp_rank, tp_size, ckpt_dir):
    """A checkpoint of the unsharded layers (written by rank 0 alone) loads into the shards."""
    torch.manual_seed(5)
    other1, other2 = (torch.randn(FFN, H, dtype=torch.float64),
                      torch.randn(H, FFN, dtype=torch.float64))
    keys = ("fc1", "fc2")
    items = ([TensorShard(k, w, tuple(w.shape), (0, 0)) for k, w in zip(keys, (other1, other2))]
             if dist.get_rank() == 0 else [])
    save_shards(ckpt_dir, items)
    reader = DistCheckpointReader(ckpt_dir)
    for key, layer, full in zip(keys, (fc1, fc2), (other1, other2)):
        w = layer.weight
        _, offset = ws.checkpoint_box(tuple(w.shape), w.partition_dim, tp_rank, tp_size,
                                      w.weight_shard_rank, w.weight_shards)
        with torch.no_grad():
            w.copy_(reader.read(key, offset, tuple(w.shape)))
        gathered = ws.gather_weight_shards(w.detach(), layer.weight_shard_group)
        expected = (full.chunk(tp_size, dim=w.partition_dim)[tp_rank] if tp_size > 1 else full)
        assert torch.equal(gathered, expected)


def _body(tp_size, n_shards, ckpt_dir):
    _check_against_one_process(tp_size, n_shards, ckpt_dir)
    return True


@pytest.mark.slow
def test_two_weight_shards_equal_one_process(tmp_path):
    run_on_ranks(_body, 2, 1, 2, str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_tp2_with_two_weight_shards_equals_one_process(tmp_path):
    run_on_ranks(_body, 4, 2, 4, str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_four_weight_shards_without_tp(tmp_path):
    run_on_ranks(_body, 4, 1, 4, str(tmp_path / "ckpt"))


# ---- experts (--expert-tensor-parallel-num-weight-shards) ------------------------------------

E_HIDDEN, E_FFN, NUM_EXPERTS, COUNTS = 8, 8, 2, [3, 2]


def _experts(cls, etp_group, shard_group, swiglu):
    from megatron.model.moe import MoEConfig
    from megatron.model.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=E_HIDDEN, num_attention_heads=2,
                               padded_vocab_size=16, max_position_embeddings=4, seq_length=4,
                               ffn_hidden_size=E_FFN, params_dtype=torch.float64,
                               add_bias_linear=False, swiglu=swiglu,
                               bias_gelu_fusion=False)
    moe = MoEConfig(num_moe_experts=NUM_EXPERTS)
    return cls(config, moe, layer_number=1, expert_tp_group=etp_group,
               weight_shard_group=shard_group)


def _expert_rows(index):
    g = torch.Generator().manual_seed(200 + index)
    n = sum(COUNTS)
    return (torch.randn(n, E_HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(n, E_HIDDEN, generator=g, dtype=torch.float64))


def _run_experts(module, index):
    x, dy = _expert_rows(index)
    x.requires_grad_(True)
    module.zero_grad()
    out = module(x, COUNTS)
    out.backward(dy)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _check_experts(etp_size, n_shards, cls_name, swiglu):
    from megatron.model.moe import experts as experts_module

    cls = getattr(experts_module, cls_name)
    (etp_group, _), (shard_group, shard_ranks), data_index = _groups(etp_size, n_shards)
    reference = _experts(cls, None, None, swiglu)               # one process, no splits
    ref_out, ref_dx, _ = _run_experts(reference, data_index)
    unsharded = _experts(cls, etp_group, None, swiglu)          # the same expert-TP, no shards
    sharded = _experts(cls, etp_group, shard_group, swiglu)
    out, dx, grads = _run_experts(sharded, data_index)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(dx, ref_dx, **TOL)
    peers = [r // etp_size for r in shard_ranks]
    runs = [_run_experts(unsharded, i)[2] for i in peers]
    k, g = shard_ranks.index(dist.get_rank()), len(shard_ranks)
    for name, param in sharded.named_parameters():
        full = sum(run[name] for run in runs)
        assert param.weight_shards == g and param.weight_shard_rank == k
        assert param.shape[0] * g == full.shape[0]
        torch.testing.assert_close(grads[name], full.chunk(g)[k], **TOL)
        torch.testing.assert_close(param.detach(),
                                   dict(unsharded.named_parameters())[name].detach().chunk(g)[k],
                                   rtol=0, atol=0)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", ["SequentialMLP", "GroupedMLP"])
def test_expert_weight_shards_equal_one_process(cls_name):
    run_on_ranks(_check_experts, 2, 1, 2, cls_name, True)


@pytest.mark.slow
def test_expert_tp2_with_weight_shards_equals_one_process():
    run_on_ranks(_check_experts, 4, 2, 4, "GroupedMLP", True)
    run_on_ranks(_check_experts, 4, 2, 4, "SequentialMLP", False)


# ---- resume ---------------------------------------------------------------------------------

def _sgd_steps(fc1, fc2, steps, first):
    losses = []
    for i in range(first, first + steps):
        x, dy = _data(10 * i + dist.get_rank())
        fc1.zero_grad(), fc2.zero_grad()
        out = _forward(fc1, fc2, x)
        loss = (out * dy).sum()
        loss.backward()
        with torch.no_grad():
            for p in (fc1.bias, fc2.bias):   # replicated: summed over the ranks, as DDP would
                dist.all_reduce(p.grad)
            for p in (*fc1.parameters(), *fc2.parameters()):
                p -= 0.05 * p.grad
        losses.append(loss.item())
    return losses


def _resume(ckpt_dir):
    (tp_group, tp_rank), (shard_group, _), _ = _groups(1, 2)
    fc1, fc2 = _mlp(tp_group, shard_group)
    _sgd_steps(fc1, fc2, 2, 0)
    names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    params = (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    items = []
    for name, p in zip(names, params):
        if getattr(p, "weight_shards", 1) > 1:
            shape, offset = ws.checkpoint_box(tuple(p.shape), p.partition_dim, tp_rank, 1,
                                              p.weight_shard_rank, p.weight_shards)
            items.append(TensorShard(name, p.detach().clone(), shape, offset))
        elif dist.get_rank() == 0:          # replicated: one writer
            items.append(TensorShard(name, p.detach().clone(), tuple(p.shape), (0,) * p.dim()))
    save_shards(ckpt_dir, items)
    straight = _sgd_steps(fc1, fc2, 3, 2)
    fc1, fc2 = _mlp(tp_group, shard_group)   # a fresh start, then the checkpoint
    reader = DistCheckpointReader(ckpt_dir)
    for name, p in zip(names, (fc1.weight, fc1.bias, fc2.weight, fc2.bias)):
        offset = (0,) * p.dim()
        if getattr(p, "weight_shards", 1) > 1:
            _, offset = ws.checkpoint_box(tuple(p.shape), p.partition_dim, tp_rank, 1,
                                          p.weight_shard_rank, p.weight_shards)
        with torch.no_grad():
            p.copy_(reader.read(name, offset, tuple(p.shape)))
    assert _sgd_steps(fc1, fc2, 3, 2) == straight
    return straight


@pytest.mark.slow
def test_resume_from_a_sharded_checkpoint_is_bit_exact(tmp_path):
    losses = run_on_ranks(_resume, 2, str(tmp_path / "ckpt"))
    assert losses[0] != losses[1]            # the two ranks trained on different samples


# ---- data parallelism (DistributedDataParallel) ---------------------------------------------

def _ddp_case(overlap):
    from megatron.core.distributed import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = dist.new_group(list(range(world)))
    (_, _), (shard_group, shard_ranks), _ = _groups(1, 2)
    shard_dp = None
    for ranks in ([0, 2], [1, 3]):               # the ranks holding the same rows
        handle = dist.new_group(ranks)
        if rank in ranks:
            shard_dp = handle
    kwargs = dict(dp_group=everyone, overlap_grad_reduce=overlap, bucket_size=40)
    reference = DDP(torch.nn.ModuleList(_mlp(None, None)), **kwargs)
    sharded = DDP(torch.nn.ModuleList(_mlp(None, shard_group)), weight_shard_dp_group=shard_dp,
                  **kwargs)
    assert len(sharded.weight_shard_grad_buffers) == 1
    for model in (reference, sharded):
        model.zero_grad_buffer()
        for micro in range(2):                   # two micro-batches, the first without sync
            x, dy = _data(10 * rank + micro)
            ctx = model.no_sync() if micro == 0 else _NullContext()
            with ctx:
                _forward(*model.module, x).backward(dy)
        model.finish_grad_sync()
    k = shard_ranks.index(rank)
    for ref, mine in zip(reference.module.parameters(), sharded.module.parameters()):
        expected = ref.main_grad.chunk(2)[k] if getattr(mine, "weight_shards", 1) > 1 \
            else ref.main_grad
        torch.testing.assert_close(mine.main_grad, expected, **TOL)
    with torch.no_grad():                        # broadcast keeps each shard's own rows
        for p in sharded.module.parameters():
            p.add_(rank)
    sharded.broadcast_params()
    fresh = torch.nn.ModuleList(_mlp(None, shard_group))
    for p, start in zip(sharded.module.parameters(), fresh.parameters()):
        offset = rank % 2 if getattr(p, "weight_shards", 1) > 1 else 0
        torch.testing.assert_close(p.detach(), start.detach() + offset, **TOL)
    with pytest.raises(ValueError, match="weight_shard_dp_group"):
        DDP(torch.nn.ModuleList(_mlp(None, shard_group)), dp_group=everyone)
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        DDP(torch.nn.ModuleList(_mlp(None, shard_group)), dp_group=everyone,
            weight_shard_dp_group=shard_dp, use_distributed_optimizer=True)
    return True


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_over_weight_shards_equals_plain_data_parallel(overlap):
    run_on_ranks(_ddp_case, 4, overlap)
