"""--dataloader-inter-document-masking: the samples' cu_seqlens (Megatron's rule, by hand), the
batch's mask and position ids against a naive walk over the document and sample indices, the
model's output per document against each document run on its own, and unchanged batches and
samples without the flag."""

import types

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.data.document_masks import document_cu_seqlens, inter_document_masks
from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets
from megatron.model import GPTModel
from megatron.tokenizer.tokenizer import NullTokenizer
from megatron.training import global_vars
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.functional.gpt_runs import VOCAB_SIZE, write_counting_corpus
from tests.unit.test_gpt_model import make_config, single_process_state

SEQ = 16


@pytest.mark.parametrize("parts,seq,want", [
    ([5, 4, 8], 16, [0, 5, 9, 16]),    # the extra (label) token comes off the last part
    ([10, 1], 10, [0, 10]),            # ... which then is empty and dropped
    ([17], 16, [0, 16]),
    ([3, 2], 8, [0, 3, 8]),            # a padded sample: the padding joins the last document
])
def test_cu_seqlens_follow_megatrons_rule(parts, seq, want):
    cu = document_cu_seqlens(parts, seq)
    assert cu.dtype == np.int64 and cu.shape == (seq + 1,)
    assert cu.tolist() == want + [seq] * (seq + 1 - len(want))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    prefix = write_counting_corpus(str(root / "a_document"), num_docs=60, seed=3)

    def build(masking):
        config = GPTDatasetConfig(seq_length=SEQ, split="90,8,2", data_cache_path=str(root / "c"),
                                  inter_document_masking=masking)
        return build_train_valid_test_datasets(config, [prefix], [40, 8, 4])

    return build(True), build(False)


def _naive_documents(ds, i):
    """The position in the document index of each of sample i's seq + 1 tokens, by walking the
    documents from the sample's start one token at a time."""
    built = int(ds.shuffle_idx[i])
    pos, off = (int(x) for x in ds.sample_idx[built])
    lengths = ds.indexed_dataset.sequence_lengths
    out = []
    while len(out) < SEQ + 1:
        if off >= lengths[int(ds.doc_idx[pos])]:
            pos, off = pos + 1, 0
            continue
        out.append(pos)
        off += 1
    return out


def test_masks_and_positions_match_a_walk_over_the_indices(datasets):
    train = datasets[0][0]
    spans = 0
    for i in range(40):
        doc = _naive_documents(train, i)[:SEQ]
        cu = torch.as_tensor(train[i]["cu_seqlens"]).unsqueeze(0)
        mask, positions = inter_document_masks(cu, SEQ)
        for q in range(SEQ):
            assert positions[0, q] == q - doc.index(doc[q])
            for k in range(SEQ):
                assert bool(mask[0, 0, q, k]) == (not (k <= q and doc[k] == doc[q]))
        spans += len(set(doc)) > 1
    assert spans >= 10  # samples that do cross documents were checked


def test_samples_without_the_flag_are_unchanged(datasets):
    with_flag, without = datasets
    for split in range(3):
        for i in range(len(without[split])):
            plain = without[split][i]
            assert list(plain) == ["text"]
            assert plain["text"].tobytes() == with_flag[split][i]["text"].tobytes()


@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_each_document_is_computed_as_if_alone(position):
    torch.manual_seed(0)
    model = GPTModel(make_config(position_embedding_type=position), single_process_state())
    model.eval()
    ids = torch.randint(0, 100, (2, SEQ))
    cu = torch.tensor([[0, 5, 11] + [SEQ] * (SEQ - 2), [0, SEQ] + [SEQ] * (SEQ - 1)])
    mask, positions = inter_document_masks(cu, SEQ)
    with torch.no_grad():
        logits = model(ids, positions, mask)                       # [b, s, v]
        for b in range(2):
            ends = sorted(set(cu[b].tolist()))
            for start, end in zip(ends[:-1], ends[1:]):
                alone = model(ids[b:b + 1, start:end],
                              torch.arange(end - start).unsqueeze(0), None)
                torch.testing.assert_close(logits[b:b + 1, start:end], alone, rtol=0,
                                           atol=1e-12)


FLAGS = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 "
         "--train-iters 1 --tokenizer-type NullTokenizer --vocab-size 129 "
         "--data-path x").split()


def _batch(extra, item):
    args = validate_args(parse_args(argv=FLAGS + extra))
    pstate = types.SimpleNamespace(is_first_stage=lambda: True, is_last_stage=lambda: True,
                                   tp_group=None, tp_ranks=[0], cp_size=1)
    global_vars.set_global_variables(args=args, tokenizer=NullTokenizer(VOCAB_SIZE),
                                     parallel_state=pstate)
    try:
        return pretrain_gpt.get_batch(iter([item]))
    finally:
        global_vars.unset_global_variables()


def test_the_batch_carries_the_document_mask_and_positions(datasets):
    train = datasets[0][0]
    items = [train[0], train[1]]
    item = {k: torch.stack([torch.as_tensor(x[k]) for x in items]) for k in items[0]}
    tokens, labels, loss_mask, mask, positions = _batch(
        ["--dataloader-inter-document-masking"], item)
    want_mask, want_positions = inter_document_masks(item["cu_seqlens"], SEQ)
    assert torch.equal(mask, want_mask) and torch.equal(positions, want_positions)
    assert torch.equal(tokens, item["text"][:, :-1]) and torch.equal(labels, item["text"][:, 1:])
    assert torch.equal(loss_mask, torch.ones(2, SEQ))
    plain = _batch([], {"text": item["text"]})
    assert plain[3] is None and torch.equal(plain[4], torch.arange(SEQ).expand(2, SEQ))


@pytest.mark.parametrize("flag", ["--mock-data", "--fim-data"])
def test_samples_without_documents_are_refused(flag):
    with pytest.raises(ArgumentsError, match=f"{flag} samples have none"):
        validate_args(parse_args(argv=FLAGS + ["--dataloader-inter-document-masking", flag]))


def test_on_documents_ending_in_eod_it_equals_the_eod_reset_flags(datasets):
    # Every document of the counting corpus ends with its end-of-document token, so the document
    # parts are the spans --reset-attention-mask and --reset-position-ids cut at that token.
    train = datasets[0][0]
    for first in range(0, 20, 2):
        items = [train[first], train[first + 1]]
        item = {k: torch.stack([torch.as_tensor(x[k]) for x in items]) for k in items[0]}
        documents = _batch(["--dataloader-inter-document-masking"], item)
        reset = _batch(["--reset-attention-mask", "--reset-position-ids"],
                       {"text": item["text"]})
        for a, b in zip(documents, reset):
            assert torch.equal(a, b)
