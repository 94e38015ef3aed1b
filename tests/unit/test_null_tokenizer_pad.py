"""--null-tokenizer-pad-id: the NullTokenizer's pad id reaches the GPT batch, whose loss mask and
ids are checked against a per-element loop; the default (-1) leaves every batch unchanged."""

import types

import pytest
import torch

import pretrain_gpt
from megatron.tokenizer.tokenizer import build_tokenizer
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args

FLAGS = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 12 "
         "--max-position-embeddings 12 --micro-batch-size 2 --global-batch-size 2 "
         "--train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 50 "
         "--null-tokenizer-eod-id 49").split()


def _single_process():
    return types.SimpleNamespace(is_first_stage=lambda: True, is_last_stage=lambda: True,
                                 tp_group=None, tp_ranks=[0], cp_size=1)


def _batch(extra, text):
    args = validate_args(parse_args(argv=FLAGS + extra))
    tokenizer = build_tokenizer(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer,
                                     parallel_state=_single_process())
    try:
        return pretrain_gpt.get_batch(iter([{"text": text.clone()}]))
    finally:
        global_vars.unset_global_variables()


def _text():
    torch.manual_seed(0)
    text = torch.randint(0, 8, (2, 13))
    text[0, 5] = 49  # an end of document
    return text


def test_pad_id_masks_labels_and_zeroes_ids_like_a_loop():
    text = _text()
    tokens, labels, loss_mask, _, _ = _batch(["--null-tokenizer-pad-id", "3"], text)
    assert (text[:, 1:] == 3).any() and (text[:, :-1] == 3).any()
    for b in range(2):
        for t in range(12):
            token, label = int(text[b, t]), int(text[b, t + 1])
            assert tokens[b, t] == (0 if token == 3 else token)
            assert labels[b, t] == (0 if label == 3 else label)
            assert loss_mask[b, t] == (0.0 if label == 3 else 1.0)


def test_default_pad_id_changes_nothing():
    text = _text()
    tokens, labels, loss_mask, _, _ = _batch([], text)
    assert torch.equal(tokens, text[:, :-1]) and torch.equal(labels, text[:, 1:])
    assert torch.equal(loss_mask, torch.ones(2, 12))
    assert build_tokenizer(validate_args(parse_args(argv=FLAGS))).pad == -1


@pytest.mark.parametrize("allow", [False, True])
def test_pad_id_equal_to_the_end_of_document_masks_only_when_allowed(allow):
    # Megatron-Core's datasets drop a pad id that is also the eod, unless allowed explicitly.
    text = _text()
    extra = ["--null-tokenizer-pad-id", "49"] + (["--allow-ambiguous-pad-tokens"] if allow else [])
    _, labels, loss_mask, _, _ = _batch(extra, text)
    masked = text[:, 1:] == 49
    assert masked.any()
    assert torch.equal(loss_mask == 0, masked if allow else torch.zeros_like(masked))
