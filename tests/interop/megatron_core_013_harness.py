"""Megatron-Core 0.13's side of the pre-0.14 optimizer layout test: its distributed optimizer
reads and writes the ``fully_sharded_model_space`` layout (``--dist-ckpt-save-pre-mcore-014``).
Run like ``megatron_core_harness.py`` (whose model builder it shares), under ``torchrun`` on the
CPU with gloo, with the ``megatron-core==0.13.x`` package first on ``PYTHONPATH``:

    torchrun --nproc_per_node W harness.py load CKPT_DIR FLAGS_JSON TP OUT
    torchrun --nproc_per_node W harness.py save CKPT_DIR FLAGS_JSON TP OUT SAVE_ROOT

``load``: build the model at tensor-parallel size TP (data-parallel size W / TP), wrap it in
Megatron-Core's DDP and distributed optimizer, load model and optimizer from CKPT_DIR with the
optimizer's ``sharded_state_dict`` of sharding type ``fully_sharded_model_space``, and write
what each rank's optimizer holds (see :func:`_held`) to OUT.<rank>, with the keys and flattened
ranges of the sharded tensors it asked for.
``save``: load the model only from CKPT_DIR, give every optimizer state element a value derived
from its weight (``exp_avg = w / 2 + 1/100``, ``exp_avg_sq = w * w``, step 7), and save model
and optimizer in that layout as a Megatron-LM run of that release does, to SAVE_ROOT/
iter_0000010 with a tracker file; OUT.<rank> as for ``load``.
"""

import contextlib
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_core_harness import _args_namespace, _host_only, _model  # noqa: E402

SHARDING = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
FIELDS = ("exp_avg", "exp_avg_sq", "fp32_param")
SAVED_STEP = 7


def _numpy_1_names() -> None:
    """This release declares numpy<2 and calls ``numpy.product``, which numpy 2 removed; it
    was an alias of ``numpy.prod``. The environment shared with the newer release has numpy 2."""
    import numpy

    if not hasattr(numpy, "product"):
        numpy.product = numpy.prod


def _cuda_type_names() -> None:
    """The distributed optimizer of this release sorts parameters by ``Tensor.type()``
    and takes only CUDA type names; on this CPU-only machine the host tensors answer as
    their CUDA counterparts (the data stays on the host)."""
    plain = torch.Tensor.type

    def type_name(self, *args, **kwargs):
        if args or kwargs:
            return plain(self, *args, **kwargs)
        name = plain(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_name


def _step_kept_apart() -> None:
    """With torch's Adam (no TransformerEngine or apex) this release keeps ``step`` in each
    parameter's Adam state, sets it from the param groups on load, and then copies every entry
    of that state from the loaded param state, which has no ``step`` (its loader drops it):
    the copy skips the entry it was never given."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    plain = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        step = state.pop("step", None)
        try:
            plain(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _optimizer(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1,
                        adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
                        use_distributed_optimizer=True), [ddp])
    _allocate_state(_distributed(optimizer).optimizer)
    return ddp, optimizer


def _allocate_state(adam) -> None:
    """Zero moments and step for every main parameter, the state torch's Adam allocates at its
    first step. Without TransformerEngine or apex this release's distributed optimizer reads
    the step from that state before it loads a checkpoint; their fused Adam needs none."""
    for group in adam.param_groups:
        for param in group["params"]:
            adam.state[param] = {"step": torch.tensor(0.0),
                                 "exp_avg": torch.zeros_like(param),
                                 "exp_avg_sq": torch.zeros_like(param)}


def _distributed(optimizer):
    """The one DistributedOptimizer inside get_megatron_optimizer's (chained) result."""
    return getattr(optimizer, "chained_optimizers", [optimizer])[0]


def _held(optimizer, model_sharded, opt_sharded) -> dict:
    """Per state field and checkpoint key, this rank's elements placed in the global tensor
    (NaN where this rank holds nothing), and the sharded tensors' metadata the optimizer gave
    dist_checkpointing: ``{"global": {field: {key: tensor}}, "meta": [(key, global_shape,
    global_offset, axis_fragmentations, flattened (start, stop), replica_id)], "step": [the
    Adam steps held], "lr": [per group]}``."""
    dist_opt = _distributed(optimizer)
    places = {id(t.data): t for t in model_sharded.values() if hasattr(t, "global_shape")}
    found = {"global": {f: {} for f in FIELDS}, "meta": [],
             "step": sorted({float(v["step"]) for v in dist_opt.optimizer.state.values()}),
             "lr": [g["lr"] for g in dist_opt.optimizer.param_groups]}
    for entry in opt_sharded["param_state"].values():
        for field in FIELDS:
            sharded = entry[field]
            found["meta"].append((sharded.key, tuple(sharded.global_shape),
                                  tuple(sharded.global_offset),
                                  tuple(sharded.axis_fragmentations),
                                  (sharded.flattened_range.start, sharded.flattened_range.stop),
                                  tuple(sharded.replica_id)))
    for model_param, (group, order) in dist_opt.model_param_group_index_map.items():
        place = places[id(model_param)]
        tensors = dist_opt._get_main_param_and_optimizer_states(model_param)
        tensors["fp32_param"] = tensors.pop("param")
        lo, hi = _range_of(dist_opt, model_param)
        for field in FIELDS:
            whole = found["global"][field].setdefault(
                place.key, torch.full(tuple(place.global_shape), float("nan")))
            lead = (1,) * place.prepend_axis_num
            box = tuple(slice(o, o + n) for o, n in
                        zip(place.global_offset, lead + tuple(model_param.shape)))
            piece = whole[box].reshape(-1).clone()
            piece[lo:hi] = tensors[field].detach().float().reshape(-1)
            whole[box] = piece.reshape(whole[box].shape)
    return found


def _range_of(dist_opt, model_param):
    """The elements of ``model_param`` (flattened) this rank's optimizer holds."""
    for gbuf_range_maps in dist_opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                if model_param in bucket["param_map"]:
                    rng = bucket["param_map"][model_param]["param"]
                    return rng.start, rng.end
    raise KeyError("parameter not in this rank's ranges")


def _load(model, ckpt: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    _, optimizer = _optimizer(model)
    model_sharded = model.sharded_state_dict()
    opt_sharded = optimizer.sharded_state_dict(model_sharded, is_loading=True, metadata=SHARDING)
    state = dist_checkpointing.load({"model": model_sharded, "optimizer": opt_sharded},
                                    pathlib.Path(ckpt))
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.save(_held(optimizer, model.sharded_state_dict(),
                     optimizer.sharded_state_dict(model.sharded_state_dict(), metadata=SHARDING)),
               f"{out}.{dist.get_rank()}")


def _scheduler(optimizer, iteration: int) -> dict:
    """The learning-rate schedule of the fixture's flags (--lr 3e-4 --min-lr 3e-5 cosine,
    warmup 2 and 100 iterations of 2 samples, weight decay 0.1) after ``iteration``
    iterations, which also sets each param group's lr and weight decay; its state dict."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    batch = 2
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=2 * batch,
        lr_decay_steps=100 * batch, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=100 * batch, wd_incr_style="constant")
    scheduler.step(increment=iteration * batch)
    return scheduler.state_dict()


def _save(model, flags: dict, tp: int, ckpt: str, out: str, save_root: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, pathlib.Path(ckpt))
    model.load_state_dict(state["model"], strict=False)
    _, optimizer = _optimizer(model)
    model_sharded = model.sharded_state_dict()
    dist_opt = _distributed(optimizer)
    with torch.no_grad():
        for model_param in dist_opt.model_param_group_index_map:
            tensors = dist_opt._get_main_param_and_optimizer_states(model_param)
            weight = tensors["param"].detach()
            tensors["exp_avg"].copy_(weight / 2 + 0.01)
            tensors["exp_avg_sq"].copy_(weight * weight)
            tensors["step"].fill_(SAVED_STEP)
    iteration = 10
    iter_dir = os.path.join(save_root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    opt_sharded = optimizer.sharded_state_dict(model_sharded, metadata=SHARDING)
    dist_checkpointing.save({"model": model_sharded, "optimizer": opt_sharded,
                             "opt_param_scheduler": _scheduler(optimizer, iteration),
                             "args": _args_namespace(flags, tp), "iteration": iteration,
                             "checkpoint_version": 3.0}, iter_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(save_root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.save(_held(optimizer, model.sharded_state_dict(), opt_sharded),
               f"{out}.{dist.get_rank()}")


def main() -> None:
    import json

    mode, ckpt, flags_file, tp, out = sys.argv[1:6]
    dist.init_process_group("gloo")
    _host_only()
    _cuda_type_names()
    _numpy_1_names()
    _step_kept_apart()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    tp = int(tp)
    parallel_state.initialize_model_parallel(tp, 1)
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    with open(flags_file) as f:
        flags = json.load(f)
    model = _model(flags, tp)
    if mode == "load":
        _load(model, ckpt, out)
    else:
        _save(model, flags, tp, ckpt, out, sys.argv[6])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
