"""--load-main-params-from-ckpt: a bf16 run that loads an fp32 run's checkpoint without its
optimizer state takes the fp32 main parameters from the checkpoint's own values (both formats,
both optimizers), where by default they are the model's bf16-rounded copies. Reference: the
fp32 tensors in the torch-format file, read directly."""

import os

import pytest
import torch

from megatron.checkpoint.layout import load_state_file
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned runs


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An fp32 run's checkpoint at iteration 2 in the torch format, and the same converted to
    torch_dist (an exact copy of the values); the saved fp32 tensors by checkpoint name."""
    root = tmp_path_factory.mktemp("main_params")
    corpus = write_counting_corpus(str(root / "corpus" / "count_document"))
    torch_dir, dist_dir = str(root / "torch"), str(root / "dist")
    run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=["--save", torch_dir,
                                                              "--ckpt-format", "torch"]))
    run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=[
        "--load", torch_dir, "--ckpt-convert-format", "torch_dist",
        "--ckpt-convert-save", dist_dir]))
    state = load_state_file(os.path.join(torch_dir, "iter_0000002", "mp_rank_00",
                                         "model_optim_rng.pt"))
    tensors = {k: v for k, v in flatten_state_dict(state["model"]).items()
               if isinstance(v, torch.Tensor) and v.dtype == torch.float32}
    assert os.path.isdir(os.path.join(dist_dir, "iter_0000002"))
    return {"torch": torch_dir, "torch_dist": dist_dir,
            "corpus": corpus, "tensors": tensors}


def _main_params_after_load(flags):
    """Build the model and optimizer as pretrain does, load, return {name: (model param as
    fp32, main param)} for every half-precision parameter."""
    import pretrain_gpt
    from megatron.training import checkpointing, global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.tokenizer import build_tokenizer
    from megatron.training.training import setup_model_and_optimizer

    args = validate_args(parse_args(argv=flags))
    pstate = initialize_megatron(args)
    tokenizer = build_tokenizer(args)  # pads the vocabulary the model config needs
    configs = build_configs(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer, parallel_state=pstate)
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args,
                                                            pstate, configs=configs)
    checkpointing.load_checkpoint(model, optimizer, scheduler, args, pstate,
                                  config=configs.checkpoint)
    names = {id(p): n for n, p in flatten_state_dict(
        model[0].state_dict_for_save_checkpoint(keep_vars=True)).items()
        if isinstance(p, torch.nn.Parameter)}
    out = {}
    if hasattr(optimizer, "_shards"):  # distributed optimizer: one flat slice per piece
        for piece, main in optimizer._shards():
            p = piece.model_param
            if p.dtype == torch.float32:
                continue
            full = out.setdefault(names[id(p)], (p.detach().float(),
                                                 torch.full((p.numel(),), float("nan"))))[1]
            full[piece.param_start:piece.param_end] = main.detach()
        out = {n: (m, full.view(m.shape)) for n, (m, full) in out.items()}
    else:
        for model_group, main_group in zip(optimizer.float16_groups,
                                           optimizer.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                out[names[id(p)]] = (p.detach().float(), main.detach().clone())
    global_vars.unset_global_variables()
    return out


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("dist_opt", [False, True])
def test_main_params_are_the_checkpoints_fp32_values(saved, fmt, dist_opt):
    base = gpt_flags(saved["corpus"], 4, extra=[
        "--bf16", "--load", saved[fmt], "--no-load-optim"]
        + (["--use-distributed-optimizer"] if dist_opt else []))
    flagged = run_on_ranks(_main_params_after_load, 1, base + ["--load-main-params-from-ckpt"])[0]
    plain = run_on_ranks(_main_params_after_load, 1, base)[0]
    ref = saved["tensors"]
    assert flagged.keys() == plain.keys() and len(flagged) > 5
    rounded_somewhere = False
    for name, (model_value, main) in flagged.items():
        want = ref[name]
        assert torch.equal(model_value, want.to(torch.bfloat16).float()), name  # model: bf16
        assert torch.equal(main, want), name                    # main: the checkpoint's fp32
        plain_main = plain[name][1]
        assert torch.equal(plain_main, want.to(torch.bfloat16).float()), name
        rounded_somewhere |= not torch.equal(plain_main, want)
    assert rounded_somewhere  # the default really differs, so the comparison bites

