"""The --save-*-interval dumps: Megatron's file names, which rank writes, what the hooks keep
(against naive formulas), and the flags' checks."""

import os
from types import SimpleNamespace

import pytest
import torch

from megatron.training import dumps
from megatron.training.arguments import ArgumentsError, validate_args
from tests.unit.test_arguments import BASE, _args


def _pstate(tp_rank=0, pp_rank=0, pp_size=1, dp_cp_rank=0):
    return SimpleNamespace(tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pp_size,
                           dp_cp_rank=dp_cp_rank)


@pytest.mark.parametrize("kwargs,name", [
    ({}, "mp_rank_00.pth"),
    ({"tp_rank": 1, "pp_rank": 2, "pp_size": 4}, "mp_rank_01_002.pth"),
])
def test_dump_path_is_megatrons(tmp_path, kwargs, name):
    path = dumps.dump_path(str(tmp_path), "wgrads", 100, _pstate(**kwargs))
    assert path == os.path.join(str(tmp_path), "wgrads", "iter_0000100", name)


def test_only_data_parallel_rank_zero_writes_and_the_file_loads_weights_only(tmp_path):
    state = {"model_chunk0": {"w": torch.arange(6.0).reshape(2, 3), "flag": True}}
    dumps.save_dump(str(tmp_path), "params", 3, state, _pstate(dp_cp_rank=1))
    assert not os.path.exists(tmp_path / "params")
    dumps.save_dump(str(tmp_path), "params", 3, state, _pstate())
    loaded = torch.load(tmp_path / "params" / "iter_0000003" / "mp_rank_00.pth",
                        weights_only=True)
    assert torch.equal(loaded["model_chunk0"]["w"], state["model_chunk0"]["w"])
    assert loaded["model_chunk0"]["flag"] is True
    assert os.listdir(tmp_path / "params" / "iter_0000003") == ["mp_rank_00.pth"]


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.up = torch.nn.Linear(4, 6)
        self.down = torch.nn.Linear(6, 3)

    def forward(self, tokens):
        return self.down(torch.tanh(self.up(self.embed(tokens))))


def test_recorders_keep_the_last_micro_batch_against_naive_formulas():
    model = _Tiny()
    acts, grads = dumps.ActivationRecorder([model]), dumps.DataGradRecorder([model])
    batches = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    for tokens in batches:
        model(tokens).square().sum().backward()
    acts.remove()
    grads.remove()
    model(batches[0]).sum().backward()             # after remove(): nothing more is kept
    a, g = acts.state["model_chunk0"], grads.state["model_chunk0"]
    assert torch.equal(a["embed/input0"], batches[1])
    w_up, b_up = model.up.weight.double(), model.up.bias.double()
    w_down, b_down = model.down.weight.double(), model.down.bias.double()
    x = model.embed.weight.double()[batches[1]]
    torch.testing.assert_close(a["embed/output0"].double(), x)
    h = torch.tanh(x @ w_up.T + b_up)
    y = h @ w_down.T + b_down
    torch.testing.assert_close(a["down/input0"].double(), h)
    torch.testing.assert_close(a["down/output0"].double(), y)
    dy = 2 * y                                                  # d(sum y^2)/dy
    torch.testing.assert_close(g["down/output0"].double(), dy)
    torch.testing.assert_close(g["down/input0"].double(), dy @ w_down)
    dz = (dy @ w_down) * (1 - h ** 2)
    torch.testing.assert_close(g["up/input0"].double(), dz @ w_up)
    assert "embed/input0" not in g                               # not a linear layer


class _Experts(torch.nn.Module):
    def forward(self, rows, counts):
        return rows


def test_tokens_per_expert_lines(tmp_path):
    layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for layer in layers:
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = _Experts()
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = layers
    recorder = dumps.TokensPerExpertRecorder([model])
    for counts in ([3, 1], [0, 4]):
        for layer in reversed(layers):
            layer.mlp.experts(torch.zeros(4, 2), counts)
    recorder.remove()
    recorder.append_to(str(tmp_path), 7, rank=5)
    text = (tmp_path / "tokens_per_expert" / "rank5.jsonl").read_text()
    assert text == ('{"iter": 7, "block": "decoder", "layer": 0, "tpe": [[3, 1], [0, 4]]}\n'
                    '{"iter": 7, "block": "decoder", "layer": 1, "tpe": [[3, 1], [0, 4]]}\n')


def test_due_counts_iterations_from_one():
    assert [i for i in range(1, 10) if dumps.due(3, i)] == [3, 6, 9]
    assert not dumps.due(None, 3)


@pytest.mark.parametrize("extra,world,pattern", [
    (["--save-params-interval", "2"], 1,
     "--save-params-interval writes into the --save folder; give --save"),
    (["--save-dgrads-interval", "0", "--save", "/tmp/never-written"], 1,
     "--save-dgrads-interval must be >= 1, got 0"),
    (["--save-wgrads-interval", "1", "--save", "/tmp/never-written",
      "--use-distributed-optimizer"], 2,
     "--save-wgrads-interval with --use-distributed-optimizer: each data-parallel rank"),
])
def test_flag_checks(extra, world, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        validate_args(_args(BASE + extra, world_size=world))
