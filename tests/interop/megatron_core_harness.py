"""Megatron-Core's side of the interoperability tests: run inside a virtual environment that has
the ``megatron-core`` package from PyPI (and not this project), under ``torchrun``, one process
per tensor-parallel rank, on the CPU with gloo.

    torchrun --nproc_per_node TP megatron_core_harness.py load  CKPT_DIR FLAGS_JSON INPUTS OUT
    torchrun --nproc_per_node TP megatron_core_harness.py round CKPT_DIR FLAGS_JSON INPUTS OUT SAVE
    torchrun --nproc_per_node TP megatron_core_harness.py torch CKPT_DIR FLAGS_JSON INPUTS OUT SAVE
    torchrun --nproc_per_node 1  megatron_core_harness.py optim CKPT_DIR FLAGS_JSON INPUTS OUT
    torchrun --nproc_per_node TP megatron_core_harness.py torchload CKPT_DIR FLAGS_JSON INPUTS OUT

``load``: build Megatron-Core's GPT model (local layer spec) for the model that FLAGS_JSON
describes (a fixture's flags.json), load CKPT_DIR with ``megatron.core.dist_checkpointing``,
run the tokens of INPUTS (a reference.pt) and write the logits (padded vocabulary, gathered)
to OUT. ``round``: the same, then save the loaded model with Megatron-Core's own saver into
SAVE/iter_<iteration> with a tracker file, as a Megatron-LM run of that release would.
``torch``: the same, saved as Megatron-LM's ``--ckpt-format torch`` saves a Megatron-Core model:
each rank's ``state_dict_for_save_checkpoint()`` under ``model`` in
SAVE/iter_<iteration>/mp_rank_<tp>/model_optim_rng.pt.
``torchload``: build the model, load CKPT_DIR (an iteration folder of --ckpt-format torch files)
as Megatron-LM loads a Megatron-Core model's torch checkpoint (``load_state_dict`` of the rank's
``model``, strict), and write the logits. ``optim``: load the model and Megatron-Core's Adam (non-distributed) from CKPT_DIR and write the
Adam state it got to OUT.
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist


def _model(flags: dict, tp: int = 0):
    """Megatron-Core's GPT for FLAGS at tensor-parallel size ``tp`` (default: every rank)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=flags["num_layers"], hidden_size=flags["hidden_size"],
        num_attention_heads=flags["num_attention_heads"],
        ffn_hidden_size=flags["ffn_hidden_size"], kv_channels=flags["kv_channels"],
        tensor_model_parallel_size=tp or dist.get_world_size(), use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=flags["layernorm_epsilon"],
        # the tanh GeLU that Megatron's bias-GeLU fusion computes, as the fixtures were run
        bias_activation_fusion=True, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, masked_softmax_fusion=False)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=flags["padded_vocab_size"],
                    max_sequence_length=flags["max_position_embeddings"],
                    share_embeddings_and_output_weights=True, parallel_output=False)


def _args_namespace(flags: dict, tp: int) -> argparse.Namespace:
    """The model flags a Megatron-LM run stores in its checkpoint's ``args``."""
    names = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
             "kv_channels", "seq_length", "max_position_embeddings", "padded_vocab_size",
             "make_vocab_size_divisible_by", "tokenizer_type", "vocab_size",
             "position_embedding_type", "normalization", "num_query_groups",
             "group_query_attention", "add_bias_linear", "add_qkv_bias", "swiglu",
             "untie_embeddings_and_output_weights")
    values = {n: flags[n] for n in names if n in flags}
    values.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                  norm_epsilon=flags["layernorm_epsilon"], ckpt_format="torch_dist")
    return argparse.Namespace(**values)


def _host_only() -> None:
    """Megatron-Core places some buffers on "the current CUDA device" (its attention scratch
    buffer, the optimizer's loss-scale tensor) and waits for the device before its saver copies
    tensors out. On this CPU-only machine all of those are the host."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("tensor", "empty", "zeros", "ones"):
        make = getattr(torch, name)

        def on_host(*args, _make=make, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _make(*args, **kwargs)

        setattr(torch, name, on_host)


def _load_optimizer_state(model, flags: dict, ckpt: str, out: str) -> None:
    """Megatron-Core's Adam over ``model`` (its DDP wrapper, non-distributed), loaded from
    ``ckpt`` with the model; writes ``{"step", "exp_avg": {key: global tensor}, "exp_avg_sq":
    ..., "lr": [per group], "wd": [per group]}`` to OUT, keyed by the checkpoint's tensor
    keys (run at TP 1)."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1,
                        adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0), [ddp])
    model_sharded = model.sharded_state_dict()
    wanted = {"model": model_sharded,
              "optimizer": optimizer.sharded_state_dict(model_sharded, is_loading=True)}
    state = dist_checkpointing.load(wanted, pathlib.Path(ckpt))
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    inner = optimizer.optimizer
    # Each parameter's place in the checkpoint: its sharded tensor's key and offset.
    places = {id(p): model_sharded[n] for n, p in model.named_parameters()}
    found = {"exp_avg": {}, "exp_avg_sq": {}, "step": None,
             "lr": [g["lr"] for g in inner.param_groups],
             "wd": [g["weight_decay"] for g in inner.param_groups]}
    for group in inner.param_groups:
        for param in group["params"]:
            entry, place = inner.state[param], places[id(param)]
            for field in ("exp_avg", "exp_avg_sq"):
                whole = found[field].setdefault(place.key, torch.zeros(place.global_shape))
                lead = (1,) * place.prepend_axis_num
                box = tuple(slice(o, o + n) for o, n in
                            zip(place.global_offset, lead + tuple(param.shape)))
                whole[box] = entry[field].detach().reshape(lead + tuple(param.shape))
            found["step"] = float(entry["step"])
    if dist.get_rank() == 0:  # TP 1: this rank holds every parameter whole
        torch.save(found, out)


def main() -> None:
    mode, ckpt, flags_file, inputs, out = sys.argv[1:6]
    dist.init_process_group("gloo")
    _host_only()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tp, 1)
    # eval mode, dropout 0: no random numbers are drawn, so no CUDA RNG is needed
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with open(flags_file) as f:
        flags = json.load(f)
    model = _model(flags)
    if mode == "optim":
        _load_optimizer_state(model, flags, ckpt, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    if mode == "torchload":
        file = os.path.join(ckpt, f"mp_rank_{dist.get_rank():02d}", "model_optim_rng.pt")
        model.load_state_dict(torch.load(file, weights_only=False)["model"], strict=True)
    else:
        # As Megatron-LM does: the model under "model", the common state merged beside it.
        state = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                        pathlib.Path(ckpt))
        missing, unexpected = model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise SystemExit(f"{ckpt}: missing {missing}, unexpected {unexpected}")
    model.eval()
    ref = torch.load(inputs, weights_only=True)
    with torch.no_grad():
        logits = model(ref["tokens"], ref["position_ids"], ref["attention_mask"])
    if dist.get_rank() == 0:
        torch.save(logits.float(), out)
    if mode == "torch":
        save_root, iteration = sys.argv[6], 10
        folder = os.path.join(save_root, f"iter_{iteration:07d}", f"mp_rank_{dist.get_rank():02d}")
        os.makedirs(folder, exist_ok=True)
        args = _args_namespace(flags, tp)
        args.ckpt_format = "torch"
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": model.state_dict_for_save_checkpoint()},
                   os.path.join(folder, "model_optim_rng.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(save_root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    if mode == "round":
        save_root = sys.argv[6]
        iteration = 10
        iter_dir = os.path.join(save_root, f"iter_{iteration:07d}")
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(),
                                 "args": _args_namespace(flags, tp), "iteration": iteration,
                                 "checkpoint_version": 3.0}, iter_dir)
        if dist.get_rank() == 0:
            with open(os.path.join(save_root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
