"""Run state lives in the TrainState, not in the parsed flags; checkpoints keep Megatron's keys.

A short single-rank run saves, a second one resumes from it and a third starts from its weights
with --pretrained-checkpoint. After each, the flags (``global_vars.get_args()``) are exactly as
they were when the model was built: loading, training, evaluating and saving wrote nothing into
them. The checkpoint holds the iteration at its top level and the consumed samples inside its
``args`` namespace, where Megatron-LM reads them.
"""

import argparse
import copy
import dataclasses

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks

GBS = 4
EVAL_ITERS = 2
# Run state that earlier versions kept in args; none of it may appear there.
RUN_STATE = {"iteration", "consumed_train_samples", "consumed_valid_samples", "exit_requested",
             "train_loss_history", "loss_spike_history", "do_train", "do_valid", "do_test",
             "final_valid_losses", "final_test_losses"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra):
    return gpt_flags(corpus, iters, global_batch=GBS,
                     extra=["--eval-interval", "2", "--eval-iters", str(EVAL_ITERS), *extra])


def _run_checked(argv):
    """pretrain() with the flags recorded when the model is built; returns the train state, the
    flags then and the flags after the run."""
    import pretrain_gpt
    from megatron.training import global_vars
    from megatron.training import training
    from megatron.core import parallel_state

    real_setup = training.setup_model_and_optimizer
    seen = {}

    def setup(model_provider, args, pstate, **kwargs):
        seen["at_setup"] = dict(vars(args))
        return real_setup(model_provider, args, pstate, **kwargs)

    training.setup_model_and_optimizer = setup
    try:
        state = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                  pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                                  argv=argv)
        # The result-validation machine (on by default) holds process groups: not data.
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                  if f.name != "rerun"}
        return {"state": copy.deepcopy(fields), "at_setup": seen["at_setup"],
                "after": dict(vars(global_vars.get_args()))}
    finally:
        training.setup_model_and_optimizer = real_setup
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _runs(corpus, root):
    from megatron.training import checkpointing

    save, fresh = f"{root}/save", f"{root}/fresh"
    out = {"first": _run_checked(_flags(corpus, 6, ["--save", save, "--save-interval", "2",
                                                    "--exit-interval", "4",
                                                    "--ckpt-format", "torch"]))}   # read below
    state = checkpointing.load_state_file(checkpointing.checkpoint_file(save, 4, 0, 0, 1))
    out["file"] = {"keys": sorted(state), "iteration": state["iteration"],
                   "args": vars(state["args"])}
    out["resumed"] = _run_checked(_flags(corpus, 6, ["--load", save]))
    out["pretrained"] = _run_checked(_flags(corpus, 2, ["--load", fresh,
                                                        "--pretrained-checkpoint", save]))
    return out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    return run_on_ranks(_runs, 1, corpus, str(tmp_path_factory.mktemp("ckpt")))[0]


@pytest.mark.parametrize("name", ["first", "resumed", "pretrained"])
def test_flags_are_untouched_by_the_run(runs, name):
    run = runs[name]
    assert not RUN_STATE & set(run["after"]), RUN_STATE & set(run["after"])
    assert run["after"] == run["at_setup"]


def test_train_state_counts_the_run(runs):
    first, resumed, pretrained = (runs[n]["state"] for n in ("first", "resumed", "pretrained"))
    # Stopped by --exit-interval at 4 (evaluations at 2 and 4), then resumed to 6.
    assert (first["iteration"], first["exit_requested"]) == (4, True)
    assert first["consumed_train_samples"] == 4 * GBS
    assert first["consumed_valid_samples"] == 2 * EVAL_ITERS * GBS
    assert [i for i, _ in first["train_loss_history"]] == [1, 2, 3, 4]
    assert first["final_valid_losses"] is None
    assert (resumed["iteration"], resumed["exit_requested"]) == (6, False)
    assert resumed["consumed_train_samples"] == 6 * GBS
    # One more evaluation at 6, then the end-of-training ones on the validation and the test
    # data (every evaluation counts in the consumed validation samples).
    assert resumed["consumed_valid_samples"] == (2 + 1 + 2) * EVAL_ITERS * GBS
    assert [i for i, _ in resumed["train_loss_history"]] == [5, 6]
    assert set(resumed["final_valid_losses"]) == {"lm loss"}
    # --pretrained-checkpoint starts from its weights only, at iteration 0.
    assert pretrained["iteration"] == 2 and pretrained["consumed_train_samples"] == 2 * GBS


def test_checkpoint_keeps_megatron_keys(runs):
    saved = runs["file"]
    assert {"args", "checkpoint_version", "iteration", "model", "optimizer",
            "opt_param_scheduler", "rng_state"} <= set(saved["keys"])
    assert saved["iteration"] == 4
    assert saved["args"]["consumed_train_samples"] == 4 * GBS
    assert saved["args"]["consumed_valid_samples"] == 2 * EVAL_ITERS * GBS
    assert saved["args"]["global_batch_size"] == GBS and saved["args"]["save_interval"] == 2
    assert not {"exit_requested", "train_loss_history", "do_train"} & set(saved["args"])


def test_checkpoint_args_take_config_and_position_without_changing_flags():
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.checkpointing import checkpoint_args
    from megatron.training.train_state import TrainState

    args = validate_args(parse_args(argv="--num-layers 2 --hidden-size 16 --num-attention-heads 2 "
                                    "--seq-length 8 --max-position-embeddings 8 "
                                    "--micro-batch-size 1 --save a".split()))
    args.padded_vocab_size = 128
    before = dict(vars(args))
    ckpt = dataclasses.replace(build_configs(args).checkpoint, save="b", ckpt_format="torch_dist")
    state = TrainState(iteration=3, consumed_train_samples=12, consumed_valid_samples=4,
                       loss_spike_history=[2.5])
    saved = checkpoint_args(args, ckpt, state)
    assert isinstance(saved, argparse.Namespace)
    assert (saved.save, saved.ckpt_format) == ("b", "torch_dist")
    assert (saved.consumed_train_samples, saved.consumed_valid_samples) == (12, 4)
    assert saved.loss_spike_history == [2.5] and saved.loss_spike_history is not \
        state.loss_spike_history
    assert not hasattr(saved, "iteration")  # the top-level key, not a flag
    assert vars(args) == before
