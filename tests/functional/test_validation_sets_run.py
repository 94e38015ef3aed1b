"""--full-validation and --multiple-validation-sets end to end in pretrain_gpt's pretrain():
each set's logged loss is the loss of a run that validates on that set alone, the names appear
in Megatron's validation lines, a whole pass reads every sample of a set, and two
data-parallel ranks log the losses of one process."""

import contextlib
import io
import re

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks

EVAL_LINE = re.compile(r"^ validation(\S*) loss at (.*?) \| lm loss value: ([-+.\dE]+) \| "
                       r"lm loss PPL: ([-+.\dE]+) \|$")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("valsets_run")
    return {name: write_counting_corpus(str(root / name), num_docs=docs, seed=seed)
            for name, docs, seed in (("train", 200, 0), ("wiki", 24, 1), ("code", 17, 2))}


def _flags(corpora, valid, extra=(), **kw):
    flags = gpt_flags(corpora["train"], 4, **kw)
    i = flags.index("--data-path")
    flags = flags[:i] + flags[i + 2:]
    flags[flags.index("--eval-interval") + 1] = "2"
    return flags + ["--train-data-path", corpora["train"], "--valid-data-path", *valid,
                    *extra]


def _run(argv):
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.training import pretrain

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            state = pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                             pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                             argv=argv)
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()
    return {"stdout": out.getvalue(), "losses": state.train_loss_history,
            "valid": state.final_valid_losses, "per_set": state.valid_losses_per_set,
            "consumed_valid": state.consumed_valid_samples}


def _runs(scenarios):
    return {name: _run(argv) for name, argv in scenarios.items()}


def _eval_lines(stdout):
    return [EVAL_LINE.match(line).groups() for line in stdout.splitlines()
            if EVAL_LINE.match(line)]


@pytest.mark.slow
def test_each_set_is_logged_as_if_validated_alone(corpora):
    full = ["--full-validation"]
    multi = full + ["--multiple-validation-sets", "--validation-set-names", "wiki", "code"]
    scenarios = {
        "multi": _flags(corpora, [corpora["wiki"], corpora["code"]], multi),
        "numbered": _flags(corpora, [corpora["wiki"], corpora["code"]],
                           full + ["--multiple-validation-sets"]),
        "wiki": _flags(corpora, [corpora["wiki"]], full),
        "code": _flags(corpora, [corpora["code"]], full),
        "plain": _flags(corpora, [corpora["wiki"]]),
    }
    runs = run_on_ranks(_runs, 1, scenarios)[0]
    multi_lines = _eval_lines(runs["multi"]["stdout"])
    points = ["iteration 2", "iteration 4", "the end of training for val data"]
    assert [(name, at) for name, at, _, _ in multi_lines if at != "the end of training for "
            "test data"] == [(n, p) for p in points for n in ("-wiki", "-code")]
    for name in ("wiki", "code"):
        alone = [(at, v) for n, at, v, _ in _eval_lines(runs[name]["stdout"]) if n == ""]
        assert alone == [(at, v) for n, at, v, _ in multi_lines if n == f"-{name}"]
        assert runs["multi"]["per_set"][f"validation-{name}"] == runs[name]["valid"]
    numbered = [n for n, at, _, _ in _eval_lines(runs["numbered"]["stdout"])
                if at == "iteration 2"]
    assert numbered == ["-0", "-1"]
    # The training itself is untouched by the flags.
    assert runs["multi"]["losses"] == runs["plain"]["losses"] == runs["wiki"]["losses"]
    # Whole passes: one epoch of each set per evaluation (three evaluations), none of the
    # plain run's --eval-iters counting.
    for name in ("wiki", "code"):
        per_eval = int(re.search(r"validation: (\d+)", runs[name]["stdout"])[1])
        assert runs[name]["consumed_valid"] == 3 * per_eval
        assert per_eval == _one_epoch(corpora[name]) // 2 * 2  # micro batch 2, one rank
    assert runs["plain"]["consumed_valid"] == 3 * 2 * 4      # 3 runs x --eval-iters 2 x 4


def _one_epoch(prefix, seq=16):
    from megatron.data.indexed_dataset import IndexedDataset

    return (int(IndexedDataset(prefix).sequence_lengths.sum()) - 1) // seq


@pytest.mark.slow
def test_two_data_parallel_ranks_log_the_losses_of_one_process(corpora):
    """Blocks of micro batch x DP samples are the same blocks for 1 rank x micro batch 2 and
    2 ranks x micro batch 1, so the full-validation losses agree (float rounding apart)."""
    sets = [corpora["wiki"], corpora["code"]]
    extra = ["--full-validation", "--multiple-validation-sets"]
    one = run_on_ranks(_runs, 1, {"run": _flags(corpora, sets, extra, micro_batch=2,
                                                dropout=0.0)})[0]["run"]
    two = run_on_ranks(_runs, 2, {"run": _flags(corpora, sets, extra, micro_batch=1,
                                                dropout=0.0)})
    last = two[-1]["run"]
    assert last["consumed_valid"] == one["consumed_valid"]
    for name in ("validation-0", "validation-1"):
        assert last["per_set"][name]["lm loss"] == pytest.approx(
            one["per_set"][name]["lm loss"], rel=1e-5)
    printed_one = [float(v) for _, _, v, _ in _eval_lines(one["stdout"])]
    printed_two = [float(v) for _, _, v, _ in _eval_lines(two[0]["run"]["stdout"])]
    assert printed_two == pytest.approx(printed_one, rel=1e-5) and len(printed_one) == 6  # 2 sets x 3 evaluations


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_tensor_and_pipeline_parallel_full_validation_match_one_process(corpora, layout):
    """Tensor-parallel rank 1 receives the step counts by broadcast; the last pipeline stage
    logs; both read the same blocks as one process."""
    sets = [corpora["wiki"], corpora["code"]]
    extra = ["--full-validation", "--multiple-validation-sets"]
    one = run_on_ranks(_runs, 1, {"run": _flags(corpora, sets, extra, dropout=0.0)})[0]["run"]
    two = run_on_ranks(_runs, 2, {"run": _flags(corpora, sets, extra + layout, dropout=0.0)})
    last = two[-1]["run"]
    assert last["consumed_valid"] == one["consumed_valid"] > 0
    for name in ("validation-0", "validation-1"):
        assert last["per_set"][name]["lm loss"] == pytest.approx(
            one["per_set"][name]["lm loss"], rel=1e-5)
