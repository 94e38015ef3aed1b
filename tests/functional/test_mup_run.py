"""pretrain_gpt end to end with ``--use-mup``.

* Width multiplier 1, both multipliers 1 and ``--mup-attn-scale-power 0.5``: the losses are the
  standard run's, bit for bit (the same weights, the same groups, the same attention scale).
* At width multiplier 2 with every multiplier set, tensor parallelism 2 (and pipeline
  or context parallelism 2) gives the one-process losses: TP sums the row-parallel outputs and the
  vocab-parallel loss in another order (fp32, measured 4e-8 relative); 1e-5 leaves room for
  that, far below a multiplier applied twice or not at all on one rank (percents).
* The distributed optimizer (DP 2) gives the replicated optimizer's losses, and a run resumed
  from a checkpoint continues bit for bit: the scaled lr and eps of each group come back with
  it (a resume that loses the optimizer state is checked to differ); --use-checkpoint-args
  takes the muP flags from it.
"""

import pytest

from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
# A wide init, so that the attention scores are far from zero and their scale shows in the
# loss (at 0.02 a wrong scale on one path moved the losses by 1e-7 only).
MUP = ["--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "2.0",
       "--mup-base-head-dim", "4", "--mup-attn-scale-power", "1.0", "--init-method-std", "0.5"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _losses(corpus, ranks, extra, tp=1):
    argv = gpt_flags(corpus, 2 * N, tp=tp, dropout=0.0, lr=2e-3, extra=list(extra))
    return [loss for _, loss in run_on_ranks(run_pretrain, ranks, argv)[-1]["losses"]]


@pytest.mark.slow
def test_width_one_mup_run_is_the_plain_run_bit_for_bit(corpus):
    plain = _losses(corpus, 1, [])
    assert _losses(corpus, 1, ["--use-mup", "--mup-attn-scale-power", "0.5"]) == plain
    # The default muP attention (1 / head_dim) is another run.
    assert _losses(corpus, 1, ["--use-mup"]) != plain


@pytest.mark.slow
def test_mup_run_with_tp2_pp2_or_cp2_matches_one_process(corpus):
    """PP 2 also checks the last stage's copy of the tied table: it must be grouped as the
    first stage's embedding (vector-like), or the two copies would step apart."""
    one = _losses(corpus, 1, MUP)
    assert one != _losses(corpus, 1, [])
    assert _losses(corpus, 2, MUP, tp=2) == pytest.approx(one, rel=1e-5)
    pp = _losses(corpus, 2, MUP + ["--pipeline-model-parallel-size", "2"])
    assert pp == pytest.approx(one, rel=1e-5)
    # Context parallelism runs the attention scale through its own ring.
    cp = _losses(corpus, 2, MUP + ["--context-parallel-size", "2"])
    assert cp == pytest.approx(one, rel=1e-5)


@pytest.mark.slow
def test_mup_distributed_optimizer_matches_and_resumes_bit_for_bit(corpus, tmp_path):
    # No clipping: its coefficient, a norm summed in another order over the shards, would
    # differ in the last bit between the two optimizers.
    replicated = _losses(corpus, 2, MUP + ["--clip-grad", "0"])
    save = str(tmp_path / "ckpt")
    dist_flags = MUP + ["--clip-grad", "0", "--use-distributed-optimizer"]
    straight = _losses(corpus, 2, dist_flags + ["--save", save, "--save-interval", str(N)])
    assert straight == replicated
    load = ["--load", save, "--ckpt-step", str(N)]
    assert _losses(corpus, 2, dist_flags + load) == straight[N:]
    assert _losses(corpus, 2, dist_flags + load + ["--no-load-optim"])[1:] != straight[N + 1:]
    # --use-checkpoint-args takes the muP flags: the weights mean nothing without them.
    args = parse_args(argv=["--load", save, "--use-checkpoint-args"])
    checkpointing.load_args_from_checkpoint(args)
    assert (args.use_mup, args.mup_base_hidden_size, args.mup_embedding_mult,
            args.mup_base_head_dim, args.mup_attn_scale_power) == (True, 16, 2.0, 4, 1.0)


@pytest.mark.slow
def test_mup_decoupled_lr_bf16_replicated_optimizer_resumes_from_torch_dist(corpus, tmp_path):
    """The default --ckpt-format torch_dist holds every param group of the run: muP's scaled-lr
    and scaled-eps groups and --decoupled-lr's own group, each parameter's state found under
    its name through the fp32 main copies of the bf16 wrapper. The resumed run continues bit
    for bit; the checkpoint records one group per (wd_mult, lr_mult, decoupled, muP factors)
    with its eps."""
    from megatron.checkpoint.dist.reader import DistCheckpointReader
    flags = MUP + ["--bf16", "--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-4"]
    save = str(tmp_path / "ckpt")
    straight = _losses(corpus, 1, flags + ["--save", save, "--save-interval", str(N)])
    load = ["--load", save, "--ckpt-step", str(N)]
    assert _losses(corpus, 1, flags + load) == straight[N:]
    assert _losses(corpus, 1, flags + load + ["--no-load-optim"])[1:] != straight[N + 1:]
    reader = DistCheckpointReader(str(tmp_path / "ckpt" / f"iter_{N:07d}"))
    groups = reader.common_state()["optimizer"]["param_groups"]
    eps = {(g["wd_mult"], g["is_decoupled_lr"], g.get("mup_lr_factor", 1.0)): g["eps"]
           for g in groups}
    assert len(eps) == len(groups) >= 4
    assert sorted(set(eps.values())) == pytest.approx([1e-8 / 2, 1e-8])
