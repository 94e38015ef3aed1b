"""pretrain_gpt end to end with ``--qk-clip`` and ``--log-max-attention-logit``.

- logging alone changes no loss, and each iteration's line carries ``max attention logit``;
- the clip (a threshold under the logits these tiny models reach) changes the losses from the
  second step on (it scales weights after the first) and two runs with one seed agree exactly;
- tensor parallelism (standard attention with grouped queries, and multi-latent attention)
  and pipeline parallelism give the one-process losses and logged maxima: each rank clips its
  own heads and layers, and the logged value is the whole model's;
- the distributed optimizer clips its main-weight shards as the replicated one clips whole
  weights;
- a run resumed from a checkpoint continues bit for bit (the clip keeps no state across steps).

Dropout is off so that runs under different layouts see the same numbers; tensor-parallel runs
agree to float tolerance (1e-5, as the other parity runs), others exactly.
"""

import re

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_mla_run import MLA
from tests.multiprocess import run_on_ranks

GQA = ["--group-query-attention", "--num-query-groups", "2"]
# The largest logit of these runs starts near 0.06: 0.03 clips from the first step.
CLIP = ["--qk-clip", "--qk-clip-threshold", "0.03", "--qk-clip-alpha", "0.4"]
LOGGED = re.compile(r"\| max attention logit: ([-\d.]+) \|")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, ranks, iters, extra, capfd=None, tp=1):
    argv = gpt_flags(corpus, iters, tp=tp, dropout=0.0, extra=list(extra))
    out = run_on_ranks(run_pretrain, ranks, argv)[-1]
    losses = [loss for _, loss in out["losses"]]
    if capfd is None:
        return losses, None
    logged = [float(v) for v in LOGGED.findall(capfd.readouterr().out)]
    return losses, logged


@pytest.mark.slow
def test_logging_changes_nothing_and_the_clip_changes_losses_from_the_second_step(corpus,
                                                                                   capfd):
    plain, none = _run(corpus, 1, 4, GQA, capfd)
    assert none == []
    logged_only, logged = _run(corpus, 1, 4, GQA + ["--log-max-attention-logit"], capfd)
    assert logged_only == plain
    assert len(logged) == 4 and all(0 < v < 1 for v in logged), logged
    clipped, clip_logged = _run(corpus, 1, 4, GQA + CLIP, capfd)
    assert clipped[0] == plain[0] and clipped[1:] != plain[1:]
    assert clip_logged[0] == logged[0]          # the first step's forward ran before any clip
    again, again_logged = _run(corpus, 1, 4, GQA + CLIP, capfd)
    assert again == clipped and again_logged == clip_logged


@pytest.mark.slow
@pytest.mark.parametrize("model,tp,pp", [(GQA, 2, 1), (MLA, 2, 1), (GQA, 1, 2)],
                         ids=["gqa-tp2", "mla-tp2", "gqa-pp2"])
def test_model_parallel_clip_equals_one_process(corpus, capfd, model, tp, pp):
    flags = model + CLIP + ["--log-max-attention-logit"]
    one, one_logged = _run(corpus, 1, 4, flags, capfd)
    two, two_logged = _run(corpus, 2, 4, flags + ["--pipeline-model-parallel-size", str(pp)],
                           capfd, tp=tp)
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-5)
    assert len(two_logged) == len(one_logged) == 4
    torch.testing.assert_close(torch.tensor(two_logged), torch.tensor(one_logged), rtol=1e-3,
                               atol=1e-3)   # the log line shows three decimals
    plain, _ = _run(corpus, 1, 4, model)
    assert one[1:] != plain[1:]


@pytest.mark.slow
def test_distributed_optimizer_clips_like_the_replicated_one(corpus):
    flags = GQA + CLIP + ["--clip-grad", "0"]
    replicated, _ = _run(corpus, 2, 4, flags)
    sharded, _ = _run(corpus, 2, 4, flags + ["--use-distributed-optimizer"])
    assert sharded == replicated
    # The gather of the clipped weights then waits for the next forward.
    overlapped, _ = _run(corpus, 2, 4, flags + ["--use-distributed-optimizer",
                                                "--overlap-grad-reduce",
                                                "--overlap-param-gather"])
    assert overlapped == replicated
    bf16, _ = _run(corpus, 2, 4, flags + ["--bf16"])
    bf16_sharded, _ = _run(corpus, 2, 4, flags + ["--bf16", "--use-distributed-optimizer"])
    assert bf16_sharded == bf16


@pytest.mark.slow
def test_resumed_clip_run_continues_bit_for_bit(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    straight, _ = _run(corpus, 1, 6, GQA + CLIP + ["--save", save, "--save-interval", "3"])
    resumed, _ = _run(corpus, 1, 6, GQA + CLIP + ["--load", save, "--ckpt-step", "3"])
    assert resumed == straight[3:]
