"""Megatron-Core's own distributed optimizer reads the ``distrib_optim.pt`` this project writes
(``--ckpt-format torch --use-distributed-optimizer``).

A run here saves at data-parallel size 2. Megatron-Core's ``DistributedOptimizer`` (the
``megatron-core`` package from PyPI, on the CPU with gloo; see
``megatron_core_distrib_optim_harness.py``) is built over a module with the legacy GPT's
parameters in Megatron-LM's module order and loads the file with its ``load_parameter_state``, at
data-parallel sizes 1 and 2, for an fp32 model and a bf16 one (its buffers keyed by (bf16, fp32)).
What its ranks then hold, put together, must be the saved weights (the fp32 main parameters are
the weights, bit for bit, rounded to bf16 for the bf16 model) and the Adam moments of the same
run made with the replicated optimizer: a parameter read from another offset of Megatron-Core's
buffers would hold another parameter's numbers.
"""

import os
import pathlib
import subprocess

import pytest
import torch

from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_distrib_optim_save import (MOMENT_RTOL, N, _flags, _load, _model_tree,
                                                      _rank_dir, corpus)  # noqa: F401
from tests.interop.test_megatron_core import _env, mcore_python  # noqa: F401
from tests.multiprocess import run_on_ranks
from tests.unit.test_distrib_optim_file import megatron_order

pytestmark = pytest.mark.slow

HARNESS = pathlib.Path(__file__).with_name("megatron_core_distrib_optim_harness.py")


def _megatron_core_view(python, distrib_optim: str, spec: str, out: pathlib.Path, dp: int):
    """Run the harness at ``dp`` ranks from a folder outside the checkout; the ranks' views
    put together: ``{name: {field: tensor}}``, with the number of ranks holding each element."""
    torchrun = pathlib.Path(python).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(dp), str(HARNESS),
           distrib_optim, spec, str(out)]
    result = subprocess.run(cmd, cwd=out.parent, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    views = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(dp)]
    merged = {}
    for name in views[0]:
        merged[name] = {}
        for field in views[0][name]:
            held = torch.stack([v[name][field] for v in views])
            count = (~held.isnan()).sum(dim=0)
            merged[name][field] = (held.nan_to_num(0.0).sum(dim=0), count)
    return merged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_cores_distributed_optimizer_loads_our_file(mcore_python, corpus, tmp_path,
                                                             dtype):
    save, replicated = str(tmp_path / "distributed"), str(tmp_path / "replicated")
    bf16 = ["--bf16"] if dtype == "bfloat16" else []
    run_on_ranks(run_pretrain, 2, _flags(corpus, bf16 + ["--save", save, "--save-interval",
                                                         str(N)]))
    run_on_ranks(run_pretrain, 2, _flags(corpus, bf16 + ["--save", replicated, "--save-interval",
                                                         str(N)], distributed=False))
    state = _load(os.path.join(_rank_dir(save), "model_optim_rng.pt"))
    tree, args = _model_tree(state), state["args"]
    names = megatron_order(args.num_layers)
    assert sorted(names) == sorted(tree)
    spec = tmp_path / "spec.pt"
    assert all(tree[n].dtype == getattr(torch, dtype) for n in names)
    torch.save({"params": [(n, tuple(tree[n].shape)) for n in names], "dtype": dtype,
                "num_layers": args.num_layers, "hidden_size": args.hidden_size,
                "num_attention_heads": args.num_attention_heads}, spec)

    # The replicated run's moments, by name (its param groups list the parameters by index,
    # matrices in the decayed group, biases and norms in the other, each in model order).
    opt = _load(os.path.join(_rank_dir(replicated), "model_optim_rng.pt"))["optimizer"]
    inner = opt.get("optimizer", opt)
    moments = {}
    for group in inner["param_groups"]:
        decayed = float(group["wd_mult"]) > 0
        group_names = [n for n in names
                       if (not n.endswith(".bias") and "layernorm" not in n) == decayed]
        for name, index in zip(group_names, group["params"]):
            moments[name] = inner["state"][index]
    assert sorted(moments) == sorted(names)

    distrib_optim = os.path.join(_rank_dir(save), "distrib_optim.pt")
    for dp in (1, 2):
        out_dir = tmp_path / f"mcore_dp{dp}"
        out_dir.mkdir()
        view = _megatron_core_view(mcore_python, distrib_optim, str(spec), out_dir / "held.pt",
                                   dp)
        assert sorted(view) == sorted(names)
        for name in names:
            for field, (value, count) in view[name].items():
                assert bool((count == 1).all()), (dp, name, field, "held by one rank each")
            param, _ = view[name]["param"]
            assert torch.equal(param.to(tree[name].dtype), tree[name]), (dp, name)
            for field in ("exp_avg", "exp_avg_sq"):
                want, (got, _) = moments[name][field], view[name][field]
                scale = want.abs().max()
                assert scale > 0 and (got - want).abs().max() <= MOMENT_RTOL * scale, (
                    dp, name, field)
