"""DeepSeek sparse attention end to end: a tiny MLA GPT with --experimental-attention-variant dsa
trains (its lm loss falls, the indexer loss is logged), the same seed gives the same losses,
a resumed run continues bit for bit, the checkpoint holds Megatron-Core's indexer keys, and a
TP=2 run with sequence parallelism matches the one-process run."""

import os
import re

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.functional.test_moe_training import _run_logged
from tests.multiprocess import run_on_ranks

DSA = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
       "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4",
       "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "6",
       "--dsa-indexer-loss-coeff", "0.1"]


def _logged(corpus, tmp_path, name, iters, world=1, extra=()):
    """(lm losses, indexer losses) of a run, read from its log line (the last rank logs)."""
    log = str(tmp_path / f"{name}.txt")
    flags = gpt_flags(corpus, iters, tp=world, dropout=0.0, extra=DSA + list(extra))
    run_on_ranks(_run_logged, world, flags, log)
    with open(log if world == 1 else f"{log}.{world - 1}") as f:
        lines = [l for l in f.read().splitlines() if "| lm loss: " in l]
    return ([float(re.search(r"lm loss: (\S+) \|", l).group(1)) for l in lines],
            [float(re.search(r"indexer loss: (\S+) \|", l).group(1)) for l in lines])


@pytest.mark.slow
def test_dsa_gpt_trains_repeats_and_resumes_bit_for_bit(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    save = str(tmp_path / "ckpt")
    lm, indexer = _logged(corpus, tmp_path, "a", 6, extra=[
        "--save", save, "--save-interval", "3",
        "--ckpt-format", "torch"])   # the indexer's keys are read from the one file below
    assert len(lm) == len(indexer) == 6
    assert lm[-1] < lm[0]
    assert all(v > 0 for v in indexer)
    again, again_indexer = _logged(corpus, tmp_path, "b", 6)
    assert (again, again_indexer) == (lm, indexer)
    state = torch.load(os.path.join(save, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"),
                       weights_only=False)["model"]
    keys = [k for k in _flat_keys(state) if ".indexer." in k]
    assert {k.split("indexer.")[1] for k in keys} == {
        "linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias",
        "linear_weights_proj.weight"}
    assert all("self_attention.core_attention.indexer." in k for k in keys)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed, resumed_indexer = _logged(corpus, tmp_path, "c", 6, extra=["--load", save])
    assert resumed == lm[3:] and resumed_indexer == indexer[3:]


def _flat_keys(state, prefix=""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _flat_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


@pytest.mark.slow
def test_dsa_tp2_with_sequence_parallelism_matches_one_process(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    one = _logged(corpus, tmp_path, "one", 3)
    save = str(tmp_path / "dist")
    two = _logged(corpus, tmp_path, "two", 3, world=2,
                  extra=["--sequence-parallel", "--ckpt-format", "torch_dist", "--save", save,
                         "--save-interval", "3"])
    # Printed with 7 significant digits; the head sums run in another order over two ranks.
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-5)
    from megatron.checkpoint.dist import DistCheckpointReader
    from tests.functional.test_convert_dist import _iter_dir
    reader = DistCheckpointReader(_iter_dir(save))
    indexer = "decoder.layers.self_attention.core_attention.indexer."
    assert reader.shape(indexer + "linear_wq_b.weight") == (2, 4 * 8, 12)
    assert reader.shape(indexer + "linear_wk.weight") == (2, 8, 32)
    assert reader.shape(indexer + "k_norm.bias") == (2, 8)
    assert reader.shape(indexer + "linear_weights_proj.weight") == (2, 4, 32)


@pytest.mark.slow
def test_dsa_gpt_forward_backward_runs_in_one_process(tmp_path):
    """A quick default-suite check: two DSA iterations train and log the indexer loss."""
    corpus = write_counting_corpus(str(tmp_path / "count_document"), num_docs=40)
    lm, indexer = _logged(corpus, tmp_path, "quick", 2)
    assert len(lm) == 2 and all(v > 0 for v in indexer)


@pytest.mark.slow
def test_dsa_pp2_matches_one_process(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    one = _logged(corpus, tmp_path, "one", 3)
    two = _logged(corpus, tmp_path, "pp2", 3, world=2,
                  extra=["--pipeline-model-parallel-size", "2",
                         "--tensor-model-parallel-size", "1"])
    # The indexer loss of layer 1 (first stage) reaches the log line of the last stage.
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-5)
