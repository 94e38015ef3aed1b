"""--dump-param-to-param-group-map: which optimizer parameter group each parameter is in.

Megatron writes, with ``torch.distributed.checkpoint.save`` (every rank, one checkpoint folder),
a flat state dict ``{global parameter name: parameter group index}``. Names are those of
Megatron's wrapped model chunks, with layers and experts numbered over the whole model:
``module.`` (the data-parallel wrapper), ``module.`` again under --fp16 / --bf16 (its
mixed-precision wrapper), then the Megatron-Core name, e.g.
``module.decoder.layers.5.self_attention.linear_qkv.weight``. Group indices are global too:
the distinct group settings of all ranks, in order of rank, then of the rank's own groups, so
one index means the same settings on every rank.
"""

import re
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from megatron.checkpoint import torch_dist
from megatron.checkpoint.dist import keys
from megatron.optimizer.builder import get_param_groups

_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_LOCAL_NAME = re.compile(r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.+)")


def global_param_name(local_name: str, layout: keys.ChunkLayout, prefix: str) -> str:
    """Megatron's global name of the chunk parameter ``local_name`` (a legacy dotted name,
    layers numbered within the chunk); a name with no Megatron-Core key keeps its own."""
    match = _LOCAL_NAME.fullmatch(local_name)
    if match:
        layer = layout.layer_offset + int(match.group(1))
        expert = _EXPERT.fullmatch(match.group(2))
        if expert:
            number = layout.expert_offset + int(expert.group(1))
            return f"{prefix}decoder.layers.{layer}.mlp.experts.local_experts.{number}." \
                   f"{expert.group(2)}"
    try:
        key, _ = keys.mcore_key(local_name, layout.mla)
    except keys.KeyMappingError:
        return prefix + local_name
    if match:
        key = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
    return prefix + key


def _group_settings(group: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in group.items() if k != "params"))


def global_group_indices(groups: List[dict]) -> List[int]:
    """Each local group's index among the distinct settings of all ranks' groups."""
    mine = [_group_settings(g) for g in groups]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    order: Dict[tuple, int] = {}
    for rank_groups in everyone:
        for settings in rank_groups:
            order.setdefault(settings, len(order))
    return [order[s] for s in mine]


def param_to_param_group(model_chunks: Sequence[torch.nn.Module], optimizer_config, pstate,
                         mixed_precision: bool) -> Dict[str, int]:
    """``{global name: group index}`` of this rank's trainable parameters (collective)."""
    groups = get_param_groups(model_chunks, optimizer_config)
    indices = global_group_indices(groups)
    group_of = {id(p): i for g, i in zip(groups, indices) for p in g["params"]}
    layouts = torch_dist._layouts(model_chunks, torch_dist._model_config(model_chunks), pstate)
    prefix = "module.module." if mixed_precision else "module."
    mapping = {}
    for chunk, layout in zip(model_chunks, layouts):
        for name, param in chunk.named_parameters():
            if id(param) in group_of:
                local = name
                while local.startswith("module."):  # the wrappers' own prefixes
                    local = local[len("module."):]
                mapping[global_param_name(local, layout, prefix)] = group_of[id(param)]
    return mapping


def dump_param_to_param_group_map(args, model_chunks, optimizer_config, pstate) -> None:
    """Write the map to --dump-param-to-param-group-map (a checkpoint folder) when given."""
    path = args.dump_param_to_param_group_map
    if path is None:
        return
    mapping = param_to_param_group(model_chunks, optimizer_config, pstate,
                                   bool(args.fp16 or args.bf16))
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict=mapping, checkpoint_id=path)


def read_param_to_param_group_map(path: str) -> Dict[str, int]:
    """The map a run (this project's or Megatron's) wrote to ``path``."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return dict(_load_state_dict_from_keys(checkpoint_id=path))
