"""What a training process imports: a plain run (no FSDP, no torch_dist folder, no compile)
leaves ``torch._dynamo``, DTensor and ``torch.distributed.checkpoint`` unimported, which saves
each rank about 2.5 s of CPU at start (measured by tests of nothing but sys.modules, not time);
and the optimizers' base class keeps torch.compile's wrappers once dynamo is imported."""

import os
import pathlib
import subprocess
import sys

import torch

from megatron.optimizer import torch_base
from megatron.optimizer.fused_adam import FusedAdamW

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "sympy")

_RUN = """
import runpy, sys
sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
try:
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
finally:
    print("HEAVY", sorted(m for m in {heavy!r} if m in sys.modules))
"""


def _run(*flags):
    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 "
             "--train-iters 2 --log-interval 1 --eval-interval 2 --eval-iters 1 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 128 --device cpu").split() + list(flags)
    out = subprocess.run([sys.executable, "-c", _RUN.format(heavy=HEAVY), *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "iteration        2/       2" in out.stdout
    return out.stdout.split("HEAVY ")[-1].strip()


def test_a_plain_training_run_leaves_dynamo_dtensor_and_dcp_unimported():
    assert _run() == "[]"


def test_a_torch_dist_save_imports_what_it_needs(tmp_path):
    # The torch_dist writer builds torch.distributed.checkpoint's metadata: imported then.
    loaded = _run("--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--ckpt-format",
                  "torch_dist")
    assert "'torch.distributed.checkpoint'" in loaded


def test_base_methods_are_torchs_own_wrapped_or_not():
    for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad"):
        wrapped = getattr(torch.optim.Optimizer, name)
        assert getattr(wrapped, "__wrapped__", None) is not None, name  # torch still wraps it
        method = torch_base._method(name)
        if "torch._dynamo" in sys.modules:
            assert method is wrapped
        else:
            assert method is wrapped.__wrapped__


def test_once_dynamo_is_imported_the_wrappers_are_called(monkeypatch):
    import torch._dynamo  # noqa: F401  (what a compiling run has done)

    calls = []
    real = torch.optim.Optimizer.add_param_group

    def spy(self, group):
        calls.append(len(group["params"]))
        return real(self, group)

    monkeypatch.setattr(torch.optim.Optimizer, "add_param_group", spy)
    FusedAdamW([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))])
    assert calls == [2]


def test_optimizer_state_round_trips_through_the_unwrapped_methods():
    """The base class's methods give torch.optim.AdamW's state_dict layout and load it back."""
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = FusedAdamW(params, lr=0.1, weight_decay=0.01)
    ref = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=0.1,
                            weight_decay=0.01)
    for step in range(2):
        for a, b in zip(params, ref.param_groups[0]["params"]):
            a.grad = torch.full_like(a, 0.5 + step)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    mine, theirs = opt.state_dict(), ref.state_dict()
    assert mine["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    for index in theirs["state"]:
        for key, value in theirs["state"][index].items():
            torch.testing.assert_close(mine["state"][index][key], value, rtol=1e-6, atol=1e-7)
    again = FusedAdamW([p.detach().clone().requires_grad_() for p in params], lr=0.1,
                       weight_decay=0.01)
    again.load_state_dict(mine)
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], mine["state"][0]["exp_avg"])
    opt.zero_grad()
    assert all(p.grad is None for p in params)
