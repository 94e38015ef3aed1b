"""torch_dist placement of mixture-of-experts tensors when expert TP differs from TP.

Every rank of a fake layout (the rank lists of :func:`compute_rank_layout`, no processes)
holds its local pieces, cut from whole tensors by the split the experts use under
``--expert-tensor-parallel-size``: an expert's fc1 rows by the expert-TP rank (SwiGLU: rank r
holds ``[gate_r; value_r]``), its fc2 weight's columns, its fc2 bias whole; the router and
the shared experts split by TP as before. The pieces the ranks write must tile each global
tensor exactly once and hold the whole tensors; and a file saved at one layout must give every
rank of any other layout its own pieces back. Every comparison is exact (bytes only move).
"""

import dataclasses
import types
from typing import Dict, List, NamedTuple, Tuple

import pytest
import torch

from megatron.core.parallel_state import compute_rank_layout
from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointReader, ShardWriter,
                                         chunk_layout, extra_state_objects, load_model_state,
                                         model_shards, placements, range_shards,
                                         read_local_rows, write_metadata)
from megatron.model.module import flatten_state_dict
from tests.multiprocess import run_on_ranks

LAYERS, EXPERTS, H, FFN, SHARED_FFN = 2, 4, 4, 8, 8
LAYER = "language_model.encoder.layers.{}."
EXPERT = "mlp.experts.local_experts.{}."
# (world, tp, expert tp, ep, pp): etp below, equal to and above tp; with and without EP and PP.
LAYOUTS = [(1, 1, 1, 1, 1), (2, 2, 1, 2, 1), (2, 2, 1, 1, 1), (2, 1, 2, 1, 1),
           (4, 2, 1, 2, 2), (4, 1, 2, 2, 1), (4, 2, 4, 1, 1), (4, 4, 1, 4, 1)]
IDS = [f"w{w}-tp{t}-etp{e}-ep{p}-pp{s}" for w, t, e, p, s in LAYOUTS]


def _whole(swiglu: bool) -> Dict[str, torch.Tensor]:
    """Whole tensors of the MoE layers, by global layer and (for experts) global expert."""
    gen = torch.Generator().manual_seed(11)
    rows = 2 if swiglu else 1
    whole = {}
    for layer in range(LAYERS):
        prefix = LAYER.format(layer)
        whole[prefix + "input_layernorm.weight"] = torch.randn(H, generator=gen)
        whole[prefix + "mlp.router.weight"] = torch.randn(EXPERTS, H, generator=gen)
        whole[prefix + "mlp.router.bias"] = torch.randn(EXPERTS, generator=gen)
        whole[prefix + "mlp.shared_experts.linear_fc1.weight"] = torch.randn(
            rows * SHARED_FFN, H, generator=gen)
        whole[prefix + "mlp.shared_experts.linear_fc2.weight"] = torch.randn(
            H, SHARED_FFN, generator=gen)
        for expert in range(EXPERTS):
            at = prefix + EXPERT.format(expert)
            whole[at + "linear_fc1.weight"] = torch.randn(rows * FFN, H, generator=gen)
            whole[at + "linear_fc1.bias"] = torch.randn(rows * FFN, generator=gen)
            whole[at + "linear_fc2.weight"] = torch.randn(H, FFN, generator=gen)
            whole[at + "linear_fc2.bias"] = torch.randn(H, generator=gen)
    return whole


def _rows(tensor: torch.Tensor, rank: int, size: int, swiglu: bool) -> torch.Tensor:
    """Rank ``rank``'s rows of a column-parallel weight: contiguous, or with SwiGLU
    ``[gate_r; value_r]`` (stride 2)."""
    if not swiglu:
        return tensor.chunk(size)[rank]
    gate, value = tensor.chunk(2)
    return torch.cat([gate.chunk(size)[rank], value.chunk(size)[rank]])


class Rank(NamedTuple):
    """One rank of a fake layout: its ChunkLayout, its number of layers and of experts."""
    layout: ChunkLayout
    layers: int
    experts: int


def _local(whole: Dict[str, torch.Tensor], rank: Rank) -> dict:
    """The legacy state of one rank: its layers (local numbers), its experts (local numbers),
    each tensor cut by the split it uses."""
    layout = rank.layout
    state = {}
    for local in range(rank.layers):
        src, dst = LAYER.format(layout.layer_offset + local), LAYER.format(local)
        tp, tp_rank, swiglu = layout.tp_size, layout.tp_rank, layout.swiglu
        state[dst + "input_layernorm.weight"] = whole[src + "input_layernorm.weight"]
        state[dst + "mlp.router.weight"] = whole[src + "mlp.router.weight"]
        state[dst + "mlp.router.bias"] = whole[src + "mlp.router.bias"]
        state[dst + "mlp.shared_experts.linear_fc1.weight"] = _rows(
            whole[src + "mlp.shared_experts.linear_fc1.weight"], tp_rank, tp, swiglu)
        state[dst + "mlp.shared_experts.linear_fc2.weight"] = whole[
            src + "mlp.shared_experts.linear_fc2.weight"].chunk(tp, dim=1)[tp_rank]
        etp, etp_rank = layout.expert_tp_size, layout.expert_tp_rank
        for j in range(rank.experts):
            at, to = src + EXPERT.format(layout.expert_offset + j), dst + EXPERT.format(j)
            state[to + "linear_fc1.weight"] = _rows(whole[at + "linear_fc1.weight"], etp_rank,
                                                    etp, swiglu)
            state[to + "linear_fc1.bias"] = _rows(whole[at + "linear_fc1.bias"], etp_rank, etp,
                                                  swiglu)
            state[to + "linear_fc2.weight"] = whole[at + "linear_fc2.weight"].chunk(
                etp, dim=1)[etp_rank]
            state[to + "linear_fc2.bias"] = whole[at + "linear_fc2.bias"]
    return {k: v.clone() for k, v in state.items()}


def _index(groups: List[List[int]], rank: int) -> Tuple[int, int]:
    """``(rank in its group, group size)``."""
    group = next(g for g in groups if rank in g)
    return group.index(rank), len(group)


def _ranks(world, tp, etp, ep, pp, swiglu) -> List[Rank]:
    """Every rank of the layout, from the rank lists alone."""
    rl = compute_rank_layout(world, tp, pp, ep_size=ep, expert_tp_size=etp)
    out = []
    for rank in range(world):
        where = rl.rank_coordinates(rank)
        ep_rank, _ = _index(rl.ep_groups, rank)
        layout = ChunkLayout(
            num_layers=LAYERS, layer_offset=where["pp"] * LAYERS // pp, tp_rank=where["tp"],
            tp_size=tp, dp_rank=where["dp"], swiglu=swiglu, num_experts=EXPERTS,
            expert_offset=ep_rank * EXPERTS // ep,
            expert_dp_rank=_index(rl.expert_dp_groups, rank)[0],
            expert_tp_rank=_index(rl.expert_tp_groups, rank)[0], expert_tp_size=etp)
        out.append(Rank(layout, LAYERS // pp, EXPERTS // ep))
    return out


def _global(whole: Dict[str, torch.Tensor], key_of_inner: str, experts: bool) -> torch.Tensor:
    """The whole tensor Megatron-Core stores: stacked by layer (and by global expert)."""
    if experts:
        return torch.stack([torch.stack([whole[LAYER.format(i) + EXPERT.format(e)
                                               + key_of_inner] for e in range(EXPERTS)])
                            for i in range(LAYERS)])
    return torch.stack([whole[LAYER.format(i) + key_of_inner] for i in range(LAYERS)])


GLOBAL_KEYS = {  # Megatron-Core key -> (legacy inner name, an expert's?)
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",
                                                                   False),
    "decoder.layers.mlp.router.weight": ("mlp.router.weight", False),
    "decoder.layers.mlp.router.bias": ("mlp.router.bias", False),   # with --add-bias-linear
    "decoder.layers.mlp.shared_experts.linear_fc1.weight":
        ("mlp.shared_experts.linear_fc1.weight", False),
    "decoder.layers.mlp.shared_experts.linear_fc2.weight":
        ("mlp.shared_experts.linear_fc2.weight", False),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": ("linear_fc1.weight", True),
    "decoder.layers.mlp.experts.experts.linear_fc1.bias": ("linear_fc1.bias", True),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": ("linear_fc2.weight", True),
    "decoder.layers.mlp.experts.experts.linear_fc2.bias": ("linear_fc2.bias", True),
}


def _save(path: str, whole, world, tp, etp, ep, pp, swiglu) -> DistCheckpointReader:
    """Every rank of the layout writes its pieces (its own data file), then the metadata,
    which refuses chunks that overlap or leave gaps."""
    records = []
    for r, rank in enumerate(_ranks(world, tp, etp, ep, pp, swiglu)):
        writer = ShardWriter(path, r)
        writer.add(model_shards(_local(whole, rank), rank.layout))
        records += writer.close()
    write_metadata(path, records)
    return DistCheckpointReader(path)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("world,tp,etp,ep,pp", LAYOUTS, ids=IDS)
def test_every_element_is_written_by_exactly_one_rank(world, tp, etp, ep, pp, swiglu):
    whole = _whole(swiglu)
    counts = {key: torch.zeros(_global(whole, *inner).shape, dtype=torch.int32)
              for key, inner in GLOBAL_KEYS.items()}
    for rank in _ranks(world, tp, etp, ep, pp, swiglu):
        for name, tensor in _local(whole, rank).items():
            for place in placements(name, tuple(tensor.shape), rank.layout):
                assert place.global_shape == tuple(counts[place.key].shape), name
                if place.written:
                    box = tuple(slice(o, o + s) for o, s in zip(
                        place.global_offset, place.sizes(tuple(tensor.shape))))
                    counts[place.key][box] += 1
    assert {k: int(c.min()) for k, c in counts.items()} == {k: 1 for k in counts}
    assert {k: int(c.max()) for k, c in counts.items()} == {k: 1 for k in counts}


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_saved_at_any_layout_loads_at_any_other(tmp_path, swiglu):
    """Each layout saves (the global tensors are the whole ones); each file then loads at
    every layout, every rank getting exactly its own pieces."""
    whole = _whole(swiglu)
    for s, save_at in enumerate(LAYOUTS):
        reader = _save(str(tmp_path / str(s)), whole, *save_at, swiglu)
        for key, inner in GLOBAL_KEYS.items():
            assert torch.equal(reader.read(key), _global(whole, *inner)), (save_at, key)
        for load_at in LAYOUTS:
            for r, rank in enumerate(_ranks(*load_at, swiglu)):
                want = _local(whole, rank)
                got = flatten_state_dict(load_model_state(reader, want, rank.layout))
                bad = [k for k in want if not torch.equal(want[k], got[k])]
                assert bad == [], (save_at, load_at, r)


def test_swiglu_expert_fc1_follows_the_expert_tp_rank():
    """TP 1, expert TP 2, rank 1: [gate_1; value_1] of ffn 8 sits at rows 4.. and 12..; the
    shared expert (split by TP 1) is whole at row 0."""
    layout = ChunkLayout(num_layers=1, swiglu=True, num_experts=2, expert_tp_rank=1,
                         expert_tp_size=2)
    name = LAYER.format(0) + EXPERT.format(1) + "linear_fc1.weight"
    pieces = placements(name, (8, 4), layout)
    assert [(p.global_offset, p.local_rows) for p in pieces] == [((0, 1, 4, 0), (0, 4)),
                                                                  ((0, 1, 12, 0), (4, 8))]
    assert pieces[0].global_shape == (1, 2, 16, 4)
    shared, = placements(LAYER.format(0) + "mlp.shared_experts.linear_fc2.weight", (4, 8),
                         layout)
    assert (shared.global_shape, shared.global_offset) == ((1, 4, 8), (0, 0, 0))
    bias, = placements(LAYER.format(0) + EXPERT.format(1) + "linear_fc2.bias", (4,), layout)
    assert not bias.written   # expert-TP rank 1 holds a copy; expert-TP rank 0 writes it
    assert dataclasses.replace(layout, expert_tp_rank=0).writes_expert_replicated


def test_layout_defaults_to_tp_and_refuses_a_rank_outside_its_group():
    layout = ChunkLayout(num_layers=1, tp_rank=1, tp_size=2)
    assert (layout.expert_tp_rank, layout.expert_tp_size) == (1, 2)
    with pytest.raises(ValueError, match="expert_tp_rank 2 is outside expert_tp_size 2"):
        ChunkLayout(num_layers=1, expert_tp_rank=2, expert_tp_size=2)


def _optimizer_items(whole, rank: Rank, dp_rank, dp, edp_rank, edp, prefix):
    """What one distributed-optimizer rank writes: of each parameter the flat range its
    (expert-)DP rank owns, cut unevenly as buckets cut them."""
    items = []
    for name, tensor in _local(whole, rank).items():
        index, size = (edp_rank, edp) if ".local_experts." in name else (dp_rank, dp)
        numel = tensor.numel()
        cuts = [0] + [min(numel, numel * k // size + 1) for k in range(1, size)] + [numel]
        start, end = cuts[index], cuts[index + 1]
        items += range_shards(name, tuple(tensor.shape), start, tensor.reshape(-1)[start:end],
                              rank.layout, prefix)
    return items


@pytest.mark.parametrize("world,tp,etp,ep", [(4, 2, 1, 2), (4, 1, 2, 1), (4, 1, 4, 1)],
                         ids=["tp2-etp1-ep2", "tp1-etp2", "tp1-etp4"])
def test_distributed_optimizer_ranges_tile_at_expert_tp(tmp_path, world, tp, etp, ep):
    """The distributed optimizer shards an expert's state over its expert-DP group and a dense
    parameter's over DP; each rank's flat ranges (of its local, expert-TP-cut tensors) tile the
    global tensors once (fc2 bias: expert-TP rank 0 only), and read back at another layout."""
    whole, prefix = _whole(True), "optimizer.state.exp_avg."
    rl = compute_rank_layout(world, tp, 1, ep_size=ep, expert_tp_size=etp)
    records = []
    for r, rank in enumerate(_ranks(world, tp, etp, ep, 1, True)):
        writer = ShardWriter(str(tmp_path), r)
        writer.add(_optimizer_items(whole, rank, *_index(rl.dp_groups, r),
                                    *_index(rl.expert_dp_groups, r), prefix))
        records += writer.close()
    write_metadata(str(tmp_path), records)   # checks the tiling
    reader = DistCheckpointReader(str(tmp_path))
    for key, inner in GLOBAL_KEYS.items():
        assert torch.equal(reader.read(prefix + key), _global(whole, *inner)), key
    for load_at in [(2, 2, 1, 1, 1), (2, 1, 2, 1, 1), (1, 1, 1, 1, 1)]:
        for rank in _ranks(*load_at, True):
            for name, tensor in _local(whole, rank).items():
                rows = (tensor.shape[0] // 3, tensor.shape[0])
                got = read_local_rows(reader, name, tuple(tensor.shape), rows, rank.layout,
                                      prefix)
                assert torch.equal(got, tensor[rows[0]:rows[1]]), (load_at, name)


@pytest.mark.parametrize("world,tp,etp,ep", [(4, 2, 1, 2), (4, 1, 2, 2), (2, 1, 2, 1)],
                         ids=["tp2-etp1-ep2", "tp1-etp2-ep2", "tp1-etp2"])
def test_extra_state_entries_are_written_once(world, tp, etp, ep):
    """The (empty) extra-state entries: each layer's dense modules' and each expert's, once."""
    whole = _whole(False)

    def entries(*at):
        return [item.fqn for rank in _ranks(*at, 1, False) for item in extra_state_objects(
            rank.layout, LAYERS, list(_local(whole, rank)))]

    seen, one = entries(world, tp, etp, ep), entries(1, 1, 1, 1)
    assert len(set(seen)) == len(seen) and sorted(seen) == sorted(one)
    assert any(".experts.experts.linear_fc2._extra_state" in k for k in one)


# -- chunk_layout on a real ParallelState ----------------------------------------------------

def _chunk_layouts_on_ranks(cases):
    from megatron.core import parallel_state

    out = []
    config = types.SimpleNamespace(num_layers=LAYERS, swiglu=True,
                                   first_pipeline_num_layers=None, last_pipeline_num_layers=None)
    for tp, etp, ep, pp in cases:
        pstate = parallel_state.initialize_model_parallel(
            tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        out.append(chunk_layout(config, pstate, num_experts=EXPERTS))
        parallel_state.destroy_model_parallel()
    return out


def test_chunk_layout_reads_the_expert_layout_of_the_parallel_state():
    """What training saves with (chunk_layout of each rank's ParallelState, world 4) is the
    layout the rank lists give."""
    cases = [(2, 1, 2, 2), (1, 2, 2, 1), (2, 4, 1, 1), (4, 1, 4, 1), (2, 2, 2, 1)]
    results = run_on_ranks(_chunk_layouts_on_ranks, 4, cases)
    for c, (tp, etp, ep, pp) in enumerate(cases):
        want = [rank.layout for rank in _ranks(4, tp, etp, ep, pp, True)]
        assert [r[c] for r in results] == want, (tp, etp, ep, pp)
