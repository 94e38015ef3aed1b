"""DistributedDataParallel and finalize_model_grads on gloo CPU ranks.

Every gradient is checked against plain single-process autograd in float64: the data-parallel
average must equal the gradient of the mean loss over all ranks' data, gradient accumulation must
equal one big batch, and the tensor-parallel / embedding sums must equal the sum of each rank's
local gradient computed here without any communication.
"""

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state as ps
from megatron.core.distributed import (DistributedDataParallel, compute_buffer_layout,
                                       finalize_model_grads)
from tests.multiprocess import run_on_ranks

IN, HIDDEN, OUT = 5, 8, 3
MICRO_BATCH = 4          # samples per rank per micro-batch
NUM_MICRO_BATCHES = 3
DP = 2
SMALL_BUCKET = 20        # elements: cuts the MLP below into 4 buckets


class TinyMLP(nn.Module):
    """Three Linear layers, a LayerNorm, and a frozen Linear that DDP must skip."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, OUT)
        self.frozen = nn.Linear(OUT, OUT)
        self.frozen.requires_grad_(False)

    def forward(self, x):                       # x: [b, IN]
        h = self.norm(torch.tanh(self.fc1(x)))  # [b, HIDDEN]
        h = torch.tanh(self.fc2(h))             # [b, HIDDEN]
        return self.frozen(self.fc3(h))         # [b, OUT]


def build_mlp(dtype=torch.float64) -> TinyMLP:
    torch.manual_seed(0)
    model = TinyMLP()
    with torch.no_grad():  # a LayerNorm at its ones/zeros init would make its gradients special
        model.norm.weight.add_(0.3 * torch.randn(HIDDEN))
        model.norm.bias.add_(0.3 * torch.randn(HIDDEN))
    return model.to(dtype)


def make_batch(rank: int, micro: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    x = torch.randn(MICRO_BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(MICRO_BATCH, OUT, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def mse(out, y):
    return ((out - y) ** 2).mean()


def reference_grads(micro_batches, dtype_of_inputs=torch.float64):
    """fp64 gradient of the mean loss over every rank's and micro-batch's samples, one process.

    ``dtype_of_inputs`` rounds weights and data first (to compare a bf16 run on the same values).
    """
    model = build_mlp(dtype_of_inputs).to(torch.float64)
    batches = [make_batch(r, m, dtype_of_inputs) for r in range(DP) for m in micro_batches]
    x = torch.cat([b[0] for b in batches]).to(torch.float64)  # [DP * k * MICRO_BATCH, IN]
    y = torch.cat([b[1] for b in batches]).to(torch.float64)
    mse(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def main_grads(model: DistributedDataParallel):
    return {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()
            if p.requires_grad}


def all_bucket_flags(model):
    return [b.communication_issued for buf in model.grad_buffers.values() for b in buf.buckets]


def run_step(model, rank, num_micro, dtype=torch.float64, check_overlap=False):
    """One step: accumulate ``num_micro`` micro-batches (all but the last under no_sync)."""
    model.zero_grad_buffer()
    for m in range(num_micro):
        last = m == num_micro - 1
        x, y = make_batch(rank, m, dtype)
        with nullcontext() if last else model.no_sync():
            (mse(model(x), y) / num_micro).backward()
        assert all(p.grad is None for p in model.parameters())
        if check_overlap:  # reductions start from the hooks of the last micro-batch only
            flags = all_bucket_flags(model)
            assert all(flags) if last else not any(flags), (m, flags)
    model.finish_grad_sync()


def _check_layout(model):
    buffer = model.grad_buffers[torch.float64]
    assert buffer.numel % DP == 0 and buffer.numel >= buffer.numel_unpadded
    assert not hasattr(model.module.frozen.weight, "main_grad")
    trainable = [p for p in model.module.parameters() if p.requires_grad]
    assert buffer.params == trainable[::-1]  # reverse parameter order
    base, itemsize = buffer.data.data_ptr(), buffer.data.element_size()
    for p in trainable:  # every main_grad is a view into the one buffer, where the map says
        start, end, _ = buffer.param_index_map[p]
        assert p.main_grad.data_ptr() == base + start * itemsize and end - start == p.numel()


def _ddp_checks():
    state = ps.initialize_model_parallel(1, 1)
    rank, dp_group = state.dp_rank, state.dp_group
    out = {}

    # One micro-batch, one bucket, reduced through finalize_model_grads (pp = 1: no embedding step).
    model = DistributedDataParallel(build_mlp(), dp_group=dp_group)
    _check_layout(model)
    assert len(model.grad_buffers[torch.float64].buckets) == 1
    x, y = make_batch(rank, 0)
    mse(model(x), y).backward()
    assert all(p.grad is None for p in model.parameters())
    finalize_model_grads([model], tp_group=state.tp_group, embedding_group=state.embedding_group)
    out["single"] = main_grads(model)

    model.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in model.module.parameters() if p.requires_grad)
    assert not model.grad_buffers[torch.float64].data.any()

    run_step(model, rank, NUM_MICRO_BATCHES)
    out["accum"] = main_grads(model)

    # Overlap with several buckets: the first bucket (fc3's grads) must already be in flight
    # when fc1's gradient, among the last of backward, arrives.
    overlap = DistributedDataParallel(build_mlp(), dp_group=dp_group, overlap_grad_reduce=True,
                                      bucket_size=SMALL_BUCKET)
    buckets = overlap.grad_buffers[torch.float64].buckets
    assert len(buckets) == 4
    seen = []
    overlap.module.fc1.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(buckets[0].communication_issued))
    run_step(overlap, rank, NUM_MICRO_BATCHES, check_overlap=True)
    assert seen == [False] * (NUM_MICRO_BATCHES - 1) + [True], seen
    out["overlap"] = main_grads(overlap)

    # A second backward in the last micro-batch would add into a bucket being reduced.
    overlap.zero_grad_buffer()
    mse(overlap(x), y).backward()
    with pytest.raises(RuntimeError, match="arrived after its bucket's all-reduce"):
        mse(overlap(x), y).backward()
    overlap.finish_grad_sync()

    # bf16 parameters, fp32 gradient buffer, several buckets.
    bf16 = DistributedDataParallel(build_mlp(torch.bfloat16), dp_group=dp_group,
                                   accumulate_allreduce_grads_in_fp32=True,
                                   bucket_size=SMALL_BUCKET)
    assert list(bf16.grad_buffers) == [torch.float32]
    run_step(bf16, rank, NUM_MICRO_BATCHES, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    out["bf16"] = main_grads(bf16)

    # broadcast_params: rank 1 starts from different weights and must end with rank 0's.
    fresh = DistributedDataParallel(build_mlp(), dp_group=dp_group)
    with torch.no_grad():
        for p in fresh.module.parameters():
            p.add_(float(rank))
    fresh.broadcast_params()
    out["broadcast"] = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}

    # State dicts are the wrapped module's, keys unchanged.
    assert list(model.state_dict()) == list(model.module.state_dict())
    assert list(model.state_dict_for_save_checkpoint()) == list(model.module.state_dict())
    model.load_state_dict(fresh.state_dict())
    assert torch.equal(model.module.fc2.weight, fresh.module.fc2.weight)
    return out


def test_ddp_matches_single_process_gradients():
    results = run_on_ranks(_ddp_checks, DP)
    ref_single = reference_grads([0])
    ref_accum = reference_grads(range(NUM_MICRO_BATCHES))
    ref_bf16 = reference_grads(range(NUM_MICRO_BATCHES), torch.bfloat16)
    initial = dict(build_mlp().named_parameters())
    for rank, out in enumerate(results):
        for name in ref_single:
            # fp64: only the summation order differs from the reference.
            torch.testing.assert_close(out["single"][name], ref_single[name], rtol=1e-10,
                                       atol=1e-13, msg=f"rank {rank} {name} single")
            torch.testing.assert_close(out["accum"][name], ref_accum[name], rtol=1e-10,
                                       atol=1e-13, msg=f"rank {rank} {name} accumulated")
            # Same local sums, exact halving, and a two-term sum: bucketing cannot change a bit.
            assert torch.equal(out["overlap"][name], out["accum"][name]), (rank, name)
            assert torch.equal(out["accum"][name], results[0]["accum"][name]), (rank, name)

            # bf16 keeps 8 significant bits (unit roundoff 2**-9 ~ 0.2%). The reference uses the
            # same bf16-rounded weights and data, so only rounding inside forward and backward
            # differs: each gradient comes out of about six rounded bf16 results (matmul, tanh,
            # LayerNorm, loss), i.e. ~1.2% of the tensor's scale at worst, while fp32
            # accumulation and reduction add ~1e-7. Observed: <= 0.7%. Bound: 2% of the largest
            # entry per tensor (a missing 1/dp would double every value).
            got = out["bf16"][name]
            assert got.dtype == torch.float32
            scale = ref_bf16[name].abs().max().item()
            torch.testing.assert_close(got.double(), ref_bf16[name], rtol=0, atol=0.02 * scale,
                                       msg=f"rank {rank} {name} bf16")
        # Accumulation happened in fp32: sums of bf16 grads are not all bf16 values.
        flat = torch.cat([g.reshape(-1) for g in out["bf16"].values()])
        assert not torch.equal(flat, flat.bfloat16().float())
        for name, value in out["broadcast"].items():
            assert torch.equal(value, initial[name].detach()), (rank, name)


# finalize_model_grads on 4 ranks: tp = 2, pp = 2 (dp = 1).
#   tp groups [0, 1] [2, 3]; embedding groups (first + last stage) [0, 2] [1, 3].
VOCAB, H, BATCH = 6, 4, 3
TP_GROUPS = [[0, 1], [2, 3]]
EMBEDDING_GROUPS = [[0, 2], [1, 3]]


class StageChunk(nn.Module):
    """One pipeline stage's chunk: tied embedding weight, sequence-parallel LayerNorm, Linear."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(1)
        self.word_embeddings = nn.Parameter(torch.randn(VOCAB, H, dtype=torch.float64))
        self.norm = nn.LayerNorm(H, dtype=torch.float64)
        self.proj = nn.Linear(H, H, dtype=torch.float64)
        for p in self.norm.parameters():
            p.sequence_parallel = True
        self.share_embeddings_and_output_weights = tied

    def shared_embedding_or_output_weight(self):
        return self.word_embeddings

    def forward(self, x):                           # x: [b, VOCAB]
        h = self.proj(self.norm(x @ self.word_embeddings))  # [b, H]
        return h @ self.word_embeddings.t()         # [b, VOCAB]


def stage_batch(rank: int):
    return torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(rank),
                       dtype=torch.float64)


def stage_loss(chunk, rank):
    return chunk(stage_batch(rank)).pow(2).mean()


def _finalize_checks():
    state = ps.initialize_model_parallel(2, 2)
    rank = dist.get_rank()
    out = {}
    for tied in (True, False):
        chunk = DistributedDataParallel(StageChunk(tied), dp_group=state.dp_group)
        stage_loss(chunk, rank).backward()
        finalize_model_grads(
            [chunk], tp_group=state.tp_group, embedding_group=state.embedding_group,
            is_first_stage=state.is_first_stage(), is_last_stage=state.is_last_stage(),
            pp_size=state.pp_size, sequence_parallel=tied)
        out[tied] = main_grads(chunk)
    return out


def local_stage_grads(rank: int, tied: bool):
    chunk = StageChunk(tied)
    stage_loss(chunk, rank).backward()
    return {n: p.grad for n, p in chunk.named_parameters()}


def _partner(groups, rank):
    return next(r for g in groups for r in g if rank in g and r != rank)


def test_finalize_model_grads_sums_sequence_parallel_and_embedding_grads():
    results = run_on_ranks(_finalize_checks, 4)
    for tied in (True, False):
        local = [local_stage_grads(r, tied) for r in range(4)]
        for rank, out in enumerate(results):
            expected = dict(local[rank])
            if tied:  # sequence parallelism on and embeddings tied in this round
                tp_peer, emb_peer = _partner(TP_GROUPS, rank), _partner(EMBEDDING_GROUPS, rank)
                for name in ("norm.weight", "norm.bias"):
                    expected[name] = local[rank][name] + local[tp_peer][name]
                expected["word_embeddings"] = (local[rank]["word_embeddings"]
                                               + local[emb_peer]["word_embeddings"])
            for name, value in expected.items():
                torch.testing.assert_close(out[tied][name], value, rtol=1e-12, atol=1e-14,
                                           msg=f"rank {rank} tied={tied} {name}")


def _no_tp_group_check():
    """Sequence-parallel grads with tp_group=None (no tensor parallelism) on 2 data-parallel
    ranks: only the data-parallel average happens, no tensor-parallel sum (over the whole job,
    which is what a None group means to torch.distributed)."""
    dist.barrier()
    norm = nn.LayerNorm(3)
    norm.weight.sequence_parallel = True
    model = DistributedDataParallel(norm, dp_group=dist.group.WORLD)
    for p in model.module.parameters():
        p.main_grad.fill_(float(dist.get_rank() + 1))
    finalize_model_grads([model], tp_group=None, sequence_parallel=True)
    return model.module.weight.main_grad.clone()


def test_finalize_without_a_tp_group_reduces_nothing():
    results = run_on_ranks(_no_tp_group_check, 2)
    for rank, grad in enumerate(results):
        assert torch.equal(grad, torch.full((3,), 1.5)), (rank, grad)   # mean of 1 and 2


def test_buffer_layout_cuts_buckets_without_splitting_params():
    layout = compute_buffer_layout([6, 4, 8, 3], bucket_size=10, dp_size=2)
    assert layout.param_ranges == [(0, 6), (6, 10), (10, 18), (18, 21)]
    assert layout.bucket_ranges == [(0, 10), (10, 22)]
    assert layout.bucket_params == [[0, 1], [2, 3]]
    assert (layout.numel, layout.numel_unpadded) == (22, 21)

    one = compute_buffer_layout([6, 4, 8, 3], bucket_size=None, dp_size=4)
    assert one.bucket_ranges == [(0, 24)] and one.bucket_params == [[0, 1, 2, 3]]

    # Distributed-optimizer layout: every bucket a multiple of dp, params shifted past padding.
    padded = compute_buffer_layout([5, 4, 3], bucket_size=4, dp_size=4, pad_buckets=True)
    assert padded.bucket_ranges == [(0, 8), (8, 12), (12, 16)]
    assert padded.param_ranges == [(0, 5), (8, 12), (12, 15)]

    with pytest.raises(ValueError, match=r"--ddp-bucket-size.*got 0"):
        compute_buffer_layout([3], bucket_size=0, dp_size=1)
