"""--full-validation, --multiple-validation-sets, --validation-set-names: the flag checks, the
GPT validation data they build, and evaluation's whole pass over a set, each against a naive
reference (one epoch counted from the token counts, a set built alone, an fp64 loop over every
sample)."""

import contextlib
import types

import numpy as np
import pytest
import torch

from megatron.data import gpt_dataset
from megatron.data.dataset_utils import DataError
from megatron.data.samplers import build_pretraining_data_loader, cyclic_iter
from megatron.training import arguments, training
from megatron.training import log as training_log
from megatron.training import validation_sets
from megatron.training.train_state import TrainState
from tests.functional.gpt_runs import write_counting_corpus

SEQ = 16


# -- flags -----------------------------------------------------------------------------------

def _validated(extra):
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 129 "
            "--device cpu").split()
    args = arguments.parse_args(argv=base + extra)
    arguments.validate_args(args)
    return args


VALID_AB = ["--train-data-path", "t", "--valid-data-path", "a", "b"]


@pytest.mark.parametrize("extra, words", [
    (VALID_AB + ["--full-validation", "--multiple-validation-sets",
                 "--validation-set-names", "x", "y", "z"],
     ["--validation-set-names", "3 name(s)", "2 validation set(s)"]),
    (VALID_AB + ["--full-validation", "--validation-set-names", "x", "y"],
     ["--validation-set-names x y needs --multiple-validation-sets"]),
    (VALID_AB + ["--multiple-validation-sets"],
     ["--multiple-validation-sets needs --full-validation"]),
    (["--train-data-path", "t", "--valid-data-path", "1", "a", "1", "b", "--full-validation",
      "--multiple-validation-sets"], ["without weights", "['1', '1']"]),
    (VALID_AB + ["--full-validation", "--multiple-validation-sets",
                 "--validation-set-names", "x", "x"], ["each set needs its own name"]),
    (["--mock-data", "--full-validation"], ["--full-validation", "--mock-data"]),
])
def test_bad_combinations_are_refused_in_one_line(extra, words):
    with pytest.raises(arguments.ArgumentsError) as err:
        _validated(extra)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_good_combinations_parse_with_megatron_names():
    args = _validated(VALID_AB + ["--full-validation", "--multiple-validation-sets",
                                  "--validation-set-names", "wiki", "code"])
    assert (args.full_validation, args.multiple_validation_sets,
            args.validation_set_names) == (True, True, ["wiki", "code"])
    assert validation_sets.set_suffixes(2, True, args.validation_set_names) == ["-wiki", "-code"]
    assert validation_sets.set_suffixes(2, True) == ["-0", "-1"]
    assert validation_sets.set_suffixes(1, False) == [""]
    plain = _validated([])
    assert (plain.full_validation, plain.multiple_validation_sets,
            plain.validation_set_names) == (False, False, None)


def test_bert_refuses_full_validation():
    args = types.SimpleNamespace(
        tokenizer_type="BertWordPieceLowerCase", position_embedding_type="learned_absolute",
        use_rotary_position_embeddings=False, add_position_embedding=True,
        untie_embeddings_and_output_weights=False, mock_data=False, context_parallel_size=1,
        calculate_per_token_loss=False, full_validation=True, multiple_validation_sets=False,
        enable_mhc_connections=False, use_mup=False, save=None, ckpt_format="torch_dist")
    with pytest.raises(arguments.ArgumentsError, match="GPT datasets only"):
        arguments.validate_bert_args(args)


# -- names in the log --------------------------------------------------------------------------

def test_eval_line_and_scalars_carry_the_set_name():
    """Megatron's line: `` validation{suffix} loss at {prefix} | lm loss value: ... |``, and
    the scalar ``lm loss validation{suffix}``."""
    line = training_log.format_eval_line("iteration 5", {"lm loss": 2.5}, "-wiki").split("\n")
    assert line[1] == (" validation-wiki loss at iteration 5 | lm loss value: 2.500000E+00 | "
                       "lm loss PPL: 1.218249E+01 |")
    assert line[0] == line[2] == "-" * len(line[1])
    plain = training_log.format_eval_line("iteration 5", {"lm loss": 2.5}).split("\n")[1]
    assert plain.startswith(" validation loss at iteration 5 |")

    written = []
    writer = types.SimpleNamespace(add_scalar=lambda *a: written.append(a))
    args = types.SimpleNamespace(log_validation_ppl_to_tensorboard=False)
    state = TrainState(iteration=7, consumed_train_samples=28)
    training_log.write_eval_scalars(writer, args, state, {"lm loss": 2.5}, "-0")
    assert written == [("lm loss validation-0", 2.5, 7), ("lm loss validation-0 vs samples",
                                                          2.5, 28)]


# -- the data ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("valsets")
    return (write_counting_corpus(str(root / "a"), num_docs=30, seed=1),
            write_counting_corpus(str(root / "b"), num_docs=20, seed=2))


def _config(tmp_path):
    return gpt_dataset.GPTDatasetConfig(seq_length=SEQ, split="80,20,0",
                                        data_cache_path=str(tmp_path))


def _tokens(prefix, documents):
    from megatron.data.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(prefix)
    return int(sum(indexed.sequence_lengths[documents]))


def _samples(dataset):
    return [np.asarray(dataset[i]["text"]).tolist() for i in range(len(dataset))]


def test_full_validation_builds_exactly_one_epoch(corpora, tmp_path):
    """A None valid count gives the split's one epoch: (T - 1) // S samples for T tokens, each
    document's tokens read once."""
    a, _ = corpora
    _, valid, _ = gpt_dataset.build_train_valid_test_datasets(_config(tmp_path), [a],
                                                              [8, None, 0])
    valid_docs = np.arange(24, 30)  # 80,20,0 of 30 documents: 24 train, 6 valid
    tokens = _tokens(a, valid_docs)
    assert len(valid) == (tokens - 1) // SEQ
    # Each sample holds S + 1 tokens, consecutive samples overlapping by one.
    assert sum(len(s) - 1 for s in _samples(valid)) == len(valid) * SEQ <= tokens - 1


def test_full_validation_refuses_a_weighted_blend_and_mock_data(corpora, tmp_path):
    a, b = corpora
    with pytest.raises(DataError, match="weighted blend"):
        gpt_dataset.build_train_valid_test_datasets(_config(tmp_path), ["1", a, "1", b],
                                                    [8, None, 0])
    mock = gpt_dataset.GPTDatasetConfig(seq_length=SEQ, mock=True, vocab_size=50)
    with pytest.raises(DataError, match="--mock-data"):
        gpt_dataset.build_train_valid_test_datasets(mock, None, [8, None, 0])


def test_each_validation_set_is_the_prefix_built_alone(corpora, tmp_path):
    a, b = corpora
    config = _config(tmp_path)
    train, valid, _ = gpt_dataset.build_train_valid_test_datasets(
        config, None, [8, None, 0], train_data_path=[a], valid_data_path=[a, b],
        multiple_validation_sets=True)
    assert len(train) >= 8 and isinstance(valid, list) and len(valid) == 2
    for prefix, got in zip((a, b), valid):
        _, alone, _ = gpt_dataset.build_train_valid_test_datasets(
            config, None, [8, None, 0], train_data_path=[a], valid_data_path=[prefix])
        assert _samples(got) == _samples(alone)
        assert len(alone) == (_tokens(prefix, np.arange(len(_doc_count(prefix)))) - 1) // SEQ
    with pytest.raises(DataError, match="without weights"):
        gpt_dataset.build_train_valid_test_datasets(
            config, None, [8, None, 0], train_data_path=[a], valid_data_path=["1", a, "1", b],
            multiple_validation_sets=True)


def _doc_count(prefix):
    from megatron.data.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix).sequence_lengths


# -- one evaluation pass -----------------------------------------------------------------------

class _Recorded(torch.utils.data.Dataset):
    """``n`` samples of 3 values; remembers which indices were read."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 3, generator=g)
        self.y = torch.randn(n, generator=g)
        self.read = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.read.append(int(i))
        return {"x": self.x[i], "y": self.y[i]}


class _Model(torch.nn.Linear):
    def __init__(self):
        super().__init__(3, 1)
        self.no_sync = contextlib.nullcontext


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["x"]).squeeze(-1)

    def loss_func(output):
        loss = ((output - batch["y"]) ** 2).mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


@pytest.mark.parametrize("n, micro, batch", [(23, 2, 6), (24, 1, 4), (7, 3, 3)])
def test_full_pass_reads_every_sample_once_and_averages_like_a_naive_loop(n, micro, batch):
    """One evaluation reads the N // mbs whole micro batches (the short tail is left out, as
    Megatron's sampler drops it), each sample once, the last step shorter; the loss is the fp64
    mean over those samples; a second evaluation reads the same samples again."""
    data = _Recorded(n)
    model = [_Model()]
    loader = build_pretraining_data_loader(data, 0, micro, 0, 1, "single", num_workers=0)
    iterator = iter(cyclic_iter(loader))
    blocks = validation_sets.count_blocks([data], micro, 1, [""])[0]
    args = types.SimpleNamespace(eval_global_batch_size=batch, eval_micro_batch_size=micro,
                                 micro_batch_size=micro, calculate_per_token_loss=False,
                                 empty_unused_memory_level=0, hybrid_context_parallel=False)
    pstate = types.SimpleNamespace(pp_size=1, virtual_pp_size=None, dp_size=1,
                                   dp_cp_group=None)
    calculator = types.SimpleNamespace(current_running_global_batch_size=batch)
    state = TrainState()
    read = (n // micro) * micro
    with torch.no_grad():
        w = model[0].weight.double()
        b = model[0].bias.double()
        naive = ((data.x[:read].double() @ w.T).squeeze(-1) + b - data.y[:read].double()) ** 2
    for _ in range(2):
        data.read.clear()
        losses = training.evaluate(_forward_step, iterator, model, args, pstate, calculator,
                                   eval_iters=99, train_state=state, full_pass_blocks=blocks)
        assert sorted(data.read) == list(range(read))
        assert losses["lm loss"] == pytest.approx(naive.mean().item(), rel=1e-6)
    assert state.consumed_valid_samples == 2 * read
    steps = validation_sets.full_pass_steps(blocks, batch // micro)
    assert sum(steps) == n // micro and all(s == batch // micro for s in steps[:-1])


def test_full_pass_steps_and_too_small_sets():
    assert validation_sets.full_pass_steps(11, 3) == [3, 3, 3, 2]
    assert validation_sets.full_pass_steps(9, 3) == [3, 3, 3]
    assert validation_sets.full_pass_steps(2, 4) == [2]
    with pytest.raises(DataError, match="validation-code.*3 samples.*\\(2\\) x data-parallel "
                                        "size \\(2\\)"):
        validation_sets.count_blocks([list(range(3))], 2, 2, ["-code"])
    assert validation_sets.count_blocks([None, list(range(9))], 2, 2, ["", ""]) == [0, 2]
    with pytest.raises(DataError, match="returned 1 validation set"):
        validation_sets.as_set_list(["one"], 2)


def test_virtual_pipeline_needs_whole_interleaved_steps():
    chunk = validation_sets.ValidationSets(["-0", "-1"], ["it0", "it1"], [8, 6])
    merged = validation_sets.merge_chunks([chunk, chunk], pp_size=2)
    assert merged.iterators == [["it0", "it0"], ["it1", "it1"]] and merged.blocks == [8, 6]
    with pytest.raises(DataError, match="'validation-1' makes 6 micro-batches.*\\(4\\)"):
        validation_sets.merge_chunks([chunk, chunk], pp_size=4)
