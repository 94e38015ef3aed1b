"""Which id a GPT batch masks as padding (Megatron-Core's choice, --allow-ambiguous-pad-tokens),
and the masking itself against a per-element loop."""

import pytest
import torch

from megatron.data.dataset_utils import (get_ltor_masks_and_position_ids, mask_pad_tokens,
                                         pad_token_id)


class _Tok:
    def __init__(self, pad=None, eod=9, eos=None, specials=None):
        self._ids = {"pad": pad, "eod": eod, "eos": eos}
        if specials is not None:
            self.special_tokens_dict = specials

    def __getattr__(self, name):
        ids = self.__dict__["_ids"]
        if name in ids:
            if ids[name] is None:
                raise NotImplementedError(name)
            return ids[name]
        raise AttributeError(name)


@pytest.mark.parametrize("tok,allow,want", [
    (_Tok(), False, None),                                  # no pad: nothing masked
    (_Tok(pad=3), False, 3),                                # a pad of its own
    (_Tok(pad=9), False, None),                             # pad == eod: ambiguous, dropped
    (_Tok(pad=9), True, 9),                                 # ... kept when the user allows it
    (_Tok(pad=5, eos=5), False, None),                      # pad == eos
    (_Tok(pad=4, specials={"pad_token": 4, "bos_token": 4}), False, None),
    (_Tok(pad=9, specials={"pad_token": 9, "bos_token": 1}), False, 9),  # dict decides
])
def test_pad_token_id(tok, allow, want):
    assert pad_token_id(tok, allow) == want


def test_mask_pad_tokens_against_a_loop():
    torch.manual_seed(0)
    text = torch.randint(0, 6, (3, 9))
    tokens, labels = text[:, :-1].clone(), text[:, 1:].clone()
    _, loss_mask, _ = get_ltor_masks_and_position_ids(tokens, 5, False, False, True)
    want_tokens, want_labels, want_mask = tokens.clone(), labels.clone(), loss_mask.clone()
    for b in range(3):
        for s in range(8):
            if labels[b, s] == 2:
                want_mask[b, s] = 0.0
                want_labels[b, s] = 0
            if tokens[b, s] == 2:
                want_tokens[b, s] = 0
    assert (labels == 2).any() and (tokens == 2).any()
    mask_pad_tokens(tokens, labels, loss_mask, 2)
    assert torch.equal(tokens, want_tokens) and torch.equal(labels, want_labels)
    assert torch.equal(loss_mask, want_mask)
    before = (tokens.clone(), labels.clone(), loss_mask.clone())
    mask_pad_tokens(tokens, labels, loss_mask, None)
    assert all(torch.equal(a, b) for a, b in zip(before, (tokens, labels, loss_mask)))
