"""``--dist-ckpt-save-pre-mcore-014``: torch_dist checkpoints in Megatron-Core's layout from
before 0.14, and resuming from them.

The reference reader here follows the older layout's definition on its own, with plain
``torch.distributed.checkpoint`` (no code of this project): the distributed optimizer's state
of a model tensor of global shape ``G`` whose per-rank piece has shape ``g`` is stored under the
same key as today, with shape ``[*(G // g), prod(g)]``: piece ``i`` of the model tensor is row
``i`` of the stored tensor, flattened in row-major order. The common state names the sharding
type ``fully_sharded_model_space`` and has no ``content_metadata``. Megatron-Core 0.16 (the
release the interop tests install) no longer loads flattened optimizer state at all
(``ShardedTensor.flattened_range is not supported``), so it cannot serve as the reference.
"""

import itertools
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load, save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.checkpoint.dist import DistCheckpointError, DistCheckpointReader
from megatron.checkpoint.dist.flattened import open_view
from megatron.training.arguments import parse_args, validate_args
from megatron.training.validation import ArgumentsError
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main as convert_main

N = 3
PRE = "--dist-ckpt-save-pre-mcore-014"
FIELDS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


def _flags(corpus, tp=1, extra=()):
    return gpt_flags(corpus, 2 * N, tp=tp, dropout=0.0, micro_batch=1, global_batch=4,
                     extra=["--ckpt-format", "torch_dist", "--use-distributed-optimizer",
                            *extra])


def _run(corpus, ranks, tp=1, extra=()):
    return run_on_ranks(run_pretrain, ranks, _flags(corpus, tp, extra))[-1]


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _tensors(iter_dir):
    """Every tensor of a torch_dist folder, whole, read with torch's own DCP loader."""
    meta = FileSystemReader(iter_dir).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    load(state, storage_reader=FileSystemReader(iter_dir), no_dist=True)
    return state, meta


def _unflatten(stored, shape):
    """The older layout's definition: row i of ``stored`` is piece i of a tensor of ``shape``."""
    counts = stored.shape[:-1]
    piece = [s // c for s, c in zip(shape, counts)]
    full = torch.empty(shape, dtype=stored.dtype)
    for idx in itertools.product(*map(range, counts)):
        where = tuple(slice(i * p, (i + 1) * p) for i, p in zip(idx, piece))
        full[where] = stored[idx].reshape(piece)
    return full


def _check_against_todays_layout(old_dir, new_dir, tp):
    old, old_meta = _tensors(old_dir)
    new, _ = _tensors(new_dir)
    flat = [k for k in old if k.startswith("optimizer.state.")]
    main = "optimizer.state.fp32_param."   # the older layout always holds the main copy
    assert flat and sorted(k for k in old if not k.startswith(main)) == sorted(new)
    for key in flat:
        model = key.split(".", 3)[3]
        shape = tuple(old[model].shape)
        assert old[key].dim() == len(shape) + 1, (key, old[key].shape, shape)
        want = old[model] if key.startswith(main) else new[key]   # fp32: the weight itself
        assert torch.equal(_unflatten(old[key], shape), want), key
        for chunk in old_meta.state_dict_metadata[key].chunks:   # one DP rank's range each
            assert all(s == 1 for s in chunk.sizes[:-1]), (key, chunk)
        # where Megatron-Core looks for the unflattened shape
        assert old_meta.mcore_data[key] == {"nd_reformulated_orig_global_shape": shape}, key
    assert old_meta.mcore_data["decoder.final_layernorm.weight"] == {}   # a model tensor
    layers, qkv_rows, hidden = old["decoder.layers.self_attention.linear_qkv.weight"].shape
    assert tuple(old["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv."
                     "weight"].shape) == (layers, tp, 1, qkv_rows // tp * hidden)
    for key in new:
        if not key.startswith("optimizer."):
            assert torch.equal(old[key], new[key]), key   # the model is stored as today
    common = DistCheckpointReader(old_dir).common_state()
    assert "content_metadata" not in common
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    groups = common["optimizer"]["optimizer"]["param_groups"]   # the distributed optimizer's
    assert [g["step"] for g in groups] == [float(N)] * 2
    assert "content_metadata" in DistCheckpointReader(new_dir).common_state()


def _save_plain(state, path):
    save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return str(path)


def test_view_reads_a_flattened_state_written_by_torch_itself(tmp_path):
    """A folder written with plain DCP in the older layout (2 layers, TP 2 pieces of rows of
    an [8, 4] weight): any slice reads as the whole tensor's."""
    torch.manual_seed(0)
    whole = torch.randn(2, 8, 4)
    stored = torch.stack([torch.stack([whole[l, :4].reshape(-1), whole[l, 4:].reshape(-1)])
                          for l in range(2)]).unsqueeze(2)          # [2, 2, 1, 16]
    key = "decoder.layers.mlp.linear_fc1.weight"
    path = _save_plain({key: torch.zeros(2, 8, 4), "optimizer.state.exp_avg." + key: stored},
                       tmp_path / "old")
    view = open_view(DistCheckpointReader(path))
    assert view.shape("optimizer.state.exp_avg." + key) == (2, 8, 4)
    assert torch.equal(view.read("optimizer.state.exp_avg." + key), whole)
    part = view.read("optimizer.state.exp_avg." + key, (1, 3, 1), (1, 3, 2))
    assert torch.equal(part, whole[1:2, 3:6, 1:3])
    bad = _save_plain({key: torch.zeros(2, 8, 4),
                       "optimizer.state.exp_avg." + key: torch.zeros(2, 3, 1, 16)},
                      tmp_path / "bad")
    with pytest.raises(DistCheckpointError, match="does not divide"):
        open_view(DistCheckpointReader(bad))


@pytest.mark.slow
def test_pre_014_layout_holds_the_same_state_and_resumes_bit_exact(corpus, tmp_path):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    straight = _run(corpus, 1, extra=["--save", old, "--save-interval", str(N), PRE])
    _run(corpus, 1, extra=["--save", new, "--save-interval", str(N)])
    it = f"iter_{N:07d}"
    _check_against_todays_layout(os.path.join(old, it), os.path.join(new, it), tp=1)
    resumed = _run(corpus, 1, extra=["--load", old, "--ckpt-step", str(N)])
    assert [i for i, _ in resumed["losses"]] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == _losses(straight)[N:]
    # The converter reads the older layout too: converted to today's, it equals today's file.
    converted = str(tmp_path / "converted")
    with open(os.path.join(old, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(N))
    assert convert_main(["--model-type", "GPT", "--load-dir", old, "--save-dir", converted,
                         "--target-ckpt-format", "torch_dist"]) == 0
    got, _ = _tensors(os.path.join(converted, it))
    want, _ = _tensors(os.path.join(new, it))
    moments = [k for k in want if k.startswith("optimizer.state.exp_avg")]
    assert moments
    for key in moments:
        assert torch.equal(got[key], want[key]), key


def test_gathered_optimizer_layout_is_refused():
    with pytest.raises(ArgumentsError, match="dp_zero_gather_scatter"):
        validate_args(parse_args(argv=["--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "16",
                            "--max-position-embeddings", "16", "--micro-batch-size", "1",
                            "--train-iters", "1", "--lr", "1e-3", "--ckpt-format", "torch_dist",
                            "--use-distributed-optimizer", PRE,
                            "--no-ckpt-fully-parallel-save"]))


@pytest.mark.slow
def test_tp2_dp2_pre_014_ranges_and_resume_at_other_layouts(corpus, tmp_path):
    """Each of 2 DP ranks writes its range of each TP piece; the same layout resumes bit for
    bit, TP 1 x DP 1 reads the flattened pieces back into whole tensors."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    straight = _run(corpus, 4, tp=2, extra=["--save", old, "--save-interval", str(N), PRE])
    _run(corpus, 4, tp=2, extra=["--save", new, "--save-interval", str(N)])
    it = f"iter_{N:07d}"
    _check_against_todays_layout(os.path.join(old, it), os.path.join(new, it), tp=2)
    meta = FileSystemReader(os.path.join(old, it)).read_metadata()
    chunks = meta.state_dict_metadata["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1."
                                      "weight"].chunks
    assert len({tuple(c.offsets[:-1]) for c in chunks}) < len(chunks)   # ranges of a piece
    resumed = _run(corpus, 4, tp=2, extra=["--load", old, "--ckpt-step", str(N)])
    assert _losses(resumed) == _losses(straight)[N:]
    other = _run(corpus, 1, extra=["--load", old, "--ckpt-step", str(N)])
    from_new = _run(corpus, 1, extra=["--load", new, "--ckpt-step", str(N)])
    assert _losses(other) == _losses(from_new)
