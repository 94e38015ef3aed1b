"""Reading Megatron-LM's ``distrib_optim.pt`` (``--ckpt-format torch`` with the distributed
optimizer).

The files here are built by a naive re-implementation of Megatron-LM's gradient buffer, written
from its documented rules and not from this project's code: parameters in reverse order of the
legacy GPT model's ``named_parameters()`` (listed by hand below), each starting at a multiple of
64 elements of the buffer, a bucket closing once it holds at least the bucket size and its end
padded to a multiple of lcm(DP, 128), each bucket's contents kept up to its last parameter's end
and the buckets concatenated (the legacy layout: one tensor per bucket). Every parameter gets
distinct random values and the gaps a sentinel, so a slice off by one element shows.
"""

import argparse
import math

import pytest
import torch

from megatron.checkpoint.distrib_optim_file import read_param_state
from megatron.checkpoint.layout import CheckpointError
from megatron.model import GPTModel
from tests.unit.test_gpt_model import LAYER_KEYS, make_config, single_process_state

KEYS = ("param", "exp_avg", "exp_avg_sq")
GAP = 7.0  # what the naive writer puts between parameters


def megatron_order(num_layers=2):
    """The legacy GPT model's parameters, in Megatron-LM's module order (tied embeddings)."""
    names = ["language_model.embedding.word_embeddings.weight",
             "language_model.embedding.position_embeddings.weight"]
    for layer in range(num_layers):
        names += [f"language_model.encoder.layers.{layer}.{k}" for k in LAYER_KEYS]
    return names + ["language_model.encoder.final_layernorm.weight",
                    "language_model.encoder.final_layernorm.bias"]


def naive_buckets(numels, bucket_size, dp, align=64, own=()):
    """Megatron's buffer, element by element: ``{name: (bucket, start in bucket)}`` and each
    bucket's unpadded length. Names in ``own`` (a tied embedding, ``shared_embedding``) get a
    bucket to themselves: an open bucket is closed at their aligned start first."""
    where, unpadded = {}, []
    pos = bucket_start = 0
    pad = math.lcm(dp, 128)
    names = list(numels)[::-1]
    for i, name in enumerate(names):
        pos = math.ceil(pos / align) * align
        if name in own and pos > bucket_start:
            unpadded.append(pos - bucket_start)
            pos = bucket_start = math.ceil(pos / pad) * pad
        where[name] = (len(unpadded), pos - bucket_start)
        pos += numels[name]
        if ((bucket_size is not None and pos - bucket_start >= bucket_size) or name in own
                or i == len(names) - 1):
            unpadded.append(pos - bucket_start)
            pos = bucket_start = math.ceil(pos / pad) * pad
    return where, unpadded


def naive_file(values, bucket_size=None, dp=4, align=64, legacy=False, own=()):
    """Megatron-LM's distrib_optim.pt content for ``values[name][key]`` (model order)."""
    where, unpadded = naive_buckets({n: v["param"].numel() for n, v in values.items()},
                                    bucket_size, dp, align, own)
    entry = {}
    for key in KEYS:
        buckets = [torch.full((n,), GAP) for n in unpadded]
        for name, (b, start) in where.items():
            t = values[name][key].reshape(-1)
            buckets[b][start:start + t.numel()] = t
        entry[key] = buckets if legacy else torch.cat(buckets)
    if legacy:
        return {0: {torch.float32: entry}}
    entry["numel_unpadded"] = sum(unpadded)
    return {"buckets_coalesced": True, 0: {(torch.float32, torch.float32): entry}}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPTModel(make_config(params_dtype=torch.float32), single_process_state())


def random_values(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return {name: {"param": torch.randn(shapes[name], generator=g),
                   "exp_avg": torch.randn(shapes[name], generator=g),
                   "exp_avg_sq": torch.rand(shapes[name], generator=g)}
            for name in megatron_order()}


def saved_args(**kw):
    return argparse.Namespace(**{"overlap_grad_reduce": False, "ddp_bucket_size": None,
                                 "data_parallel_size": 4, **kw})


def read_back(path, model, args, legacy=False):
    names = [n for n, _ in model.named_parameters()]
    state = read_param_state(str(path), [model], [list(model.parameters())], args, legacy)
    return dict(zip(names, state[0]))


def assert_all_equal(got, values):
    assert set(got) == set(values)
    for name, entry in values.items():
        for key in KEYS:
            assert torch.equal(got[name][key], entry[key]), (name, key)


def test_model_order_is_megatrons(model):
    assert [n for n, _ in model.named_parameters()] == megatron_order()


@pytest.mark.parametrize("bucket_size,dp", [(None, 1), (None, 4), (3000, 2), (100, 8)])
def test_every_parameter_read_from_its_slice(tmp_path, model, bucket_size, dp):
    values = random_values(model)
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(values, bucket_size, dp), path)
    args = saved_args(overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size,
                      data_parallel_size=dp)
    assert_all_equal(read_back(path, model, args), values)


def test_buckets_must_follow_the_writer(tmp_path, model):
    """Several buckets read as one misplace the parameters after the first bucket."""
    values = random_values(model)
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(values, 100, 2), path)
    with pytest.raises((CheckpointError, AssertionError)):
        assert_all_equal(read_back(path, model, saved_args()), values)


def test_default_bucket_size_and_chained_optimizer_list(tmp_path, model):
    """--overlap-grad-reduce without --ddp-bucket-size: max(4e7, 1e6 x DP), one bucket here;
    Megatron's chained optimizer saves a list of the optimizers' states."""
    values = random_values(model)
    path = tmp_path / "distrib_optim.pt"
    torch.save([naive_file(values, None, 2)], path)
    got = read_back(path, model, saved_args(overlap_grad_reduce=True, data_parallel_size=2))
    assert_all_equal(got, values)


def test_unaligned_older_files(tmp_path, model):
    values = random_values(model)
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(values, align=1), path)
    assert_all_equal(read_back(path, model, saved_args()), values)


def test_legacy_per_bucket_layout_needs_the_flag(tmp_path, model):
    values = random_values(model)
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(values, 100, 2, legacy=True), path)
    args = saved_args(overlap_grad_reduce=True, ddp_bucket_size=100, data_parallel_size=2)
    assert_all_equal(read_back(path, model, args, legacy=True), values)
    with pytest.raises(CheckpointError, match="ckpt-convert-update-legacy-dist-opt-format"):
        read_back(path, model, args)
    current = tmp_path / "current.pt"
    torch.save(naive_file(values), current)
    with pytest.raises(CheckpointError, match="drop --ckpt-convert-update-legacy"):
        read_back(current, model, saved_args(), legacy=True)


def test_truncated_file_is_refused(tmp_path, model):
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(random_values(model)), path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{path}: cannot be read"):
        read_back(path, model, saved_args())


def test_short_tensor_is_refused_naming_it(tmp_path, model):
    state = naive_file(random_values(model))
    entry = state[0][(torch.float32, torch.float32)]
    entry["exp_avg"] = entry["exp_avg"][:-1]
    path = tmp_path / "distrib_optim.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"{path}: buffer 0 .* 'exp_avg' has "
                                              rf"{entry['param'].numel() - 1} elements"):
        read_back(path, model, saved_args())


def test_file_of_another_model_is_refused(tmp_path, model):
    torch.manual_seed(0)
    other = GPTModel(make_config(params_dtype=torch.float32, hidden_size=64),
                     single_process_state())
    path = tmp_path / "distrib_optim.pt"
    torch.save(naive_file(random_values(other)), path)
    with pytest.raises(CheckpointError, match=f"{path}: buffer 0 .* 'param' has"):
        read_back(path, model, saved_args())
    with pytest.raises(CheckpointError, match="not found"):
        read_back(tmp_path / "missing" / "distrib_optim.pt", model, saved_args())
