"""--sft positions: every conversation of a pack is computed as if it ran alone.

Megatron's packed SFT samples carry ``cu_seqlens``: attention runs per sequence (THD) and the
rotary angles of each sequence start at 0; learned absolute positions read the sample's
position ids, which restart at 0 for each conversation. The reference here is the plain
(not packed) model run on each conversation's tokens alone, from position 0 with causal
attention, in float64.
"""

import types

import numpy as np
import pytest
import torch

from megatron.data.sft_dataset import pack_conversations, sft_attention_mask
from megatron.model import GPTModel
from megatron.tokenizer.sft_tokenizer import SFTTokenizer
from tests.unit.test_gpt_model import make_config, single_process_state
from tests.unit.test_sft_dataset import CONVERSATION, write_tokenizer

SEQ = 192
VOCAB = 384
PACKS = [  # two packs of a micro-batch, three conversations and two, the last padded
    [CONVERSATION[:3], [CONVERSATION[0]] + CONVERSATION[3:], CONVERSATION[1:3]],
    [CONVERSATION, CONVERSATION[:3]],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return SFTTokenizer(write_tokenizer(tmp_path_factory.mktemp("sft_pos_tok")),
                        "nemotron-h-aligned")


def _batch(tok):
    samples = [pack_conversations(p, tok, SEQ) for p in PACKS]
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def _bounds(segments: torch.Tensor):
    """(start, end) of every conversation of one pack's ``segment_ids`` ``[s]``."""
    cuts = (torch.nonzero(segments[1:] != segments[:-1]).view(-1) + 1).tolist()
    edges = [0] + cuts + [segments.numel()]
    return list(zip(edges[:-1], edges[1:]))


def _model(position_embedding_type, packed: bool, dtype=torch.float64):
    config = make_config(padded_vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ,
                         position_embedding_type=position_embedding_type,
                         rotary_from_position_ids=packed, params_dtype=dtype)
    model = GPTModel(config, single_process_state(), init_seed=3)
    return model.eval()


@pytest.mark.parametrize("kind", ["rope", "yarn", "learned_absolute", "none"])
def test_a_pack_equals_its_conversations_run_alone(tok, kind):
    """Logits and per-token losses of two packs (b = 2) equal, conversation by conversation,
    those of the plain model run on that conversation's tokens alone. The packed and plain
    models hold the same weights (same seed); float64, so only summation order differs."""
    batch = _batch(tok)
    packed, plain = _model(kind, True), _model(kind, False)
    with torch.no_grad():
        logits = packed(batch["tokens"], batch["position_ids"],
                        sft_attention_mask(batch["segment_ids"]))            # [b, s, V]
        losses = packed(batch["tokens"], batch["position_ids"],
                        sft_attention_mask(batch["segment_ids"]), labels=batch["labels"])
    checked = 0
    for b in range(len(PACKS)):
        for start, end in _bounds(batch["segment_ids"][b]):
            ids = batch["tokens"][b:b + 1, start:end]
            pos = torch.arange(end - start)[None]
            with torch.no_grad():
                want = plain(ids, pos, None)[0]
                want_loss = plain(ids, pos, None, labels=batch["labels"][b:b + 1, start:end])[0]
            torch.testing.assert_close(logits[b, start:end], want, rtol=0, atol=1e-12)
            torch.testing.assert_close(losses[b, start:end], want_loss, rtol=0, atol=1e-12)
            checked += 1
    assert checked == 5


def test_a_bf16_pack_gives_its_conversations_alone_bit_for_bit(tok):
    """Rotary is relative, so angles running on through the pack give the same logits only in
    exact arithmetic: in bf16 they differ from the conversation run alone by about one unit in
    the last place (4e-3 here). With the angles restarting, each conversation's rotated queries
    and keys are the alone run's exactly, the masked keys add exact zeros, and every other
    operation works row by row on the CPU: the logits are the same bits."""
    batch = _batch(tok)
    packed, plain = _model("rope", True, torch.bfloat16), _model("rope", False, torch.bfloat16)
    with torch.no_grad():
        logits = packed(batch["tokens"], batch["position_ids"],
                        sft_attention_mask(batch["segment_ids"]))            # [b, s, V]
        for b in range(len(PACKS)):
            for start, end in _bounds(batch["segment_ids"][b]):
                want = plain(batch["tokens"][b:b + 1, start:end],
                             torch.arange(end - start)[None], None)[0]
                assert torch.equal(logits[b, start:end], want), (b, start)


def test_rotary_angles_restart_at_every_conversation(tok):
    """The angles every layer receives for a pack are, conversation by conversation, those of
    positions 0, 1, ... (Megatron's THD rotary); the padding after the last conversation
    continues its positions. Before this, the angles ran 0 .. s-1 through the whole pack:
    equal logits in exact arithmetic (rotary is relative), not the same computation."""
    batch = _batch(tok)
    model = _model("rope", True)
    seen = []
    model.language_model.encoder.register_forward_pre_hook(
        lambda module, args: seen.append(args[2]))
    with torch.no_grad():
        model(batch["tokens"], batch["position_ids"], sft_attention_mask(batch["segment_ids"]))
    rotary = seen[0]                                                         # [s, b, 1, d]
    assert rotary.shape[:3] == (SEQ, len(PACKS), 1)
    table = model.language_model.rotary_pos_emb(SEQ)                         # [s, 1, 1, d]
    for b in range(len(PACKS)):
        bounds = _bounds(batch["segment_ids"][b])
        assert len(bounds) == len(PACKS[b]) and bounds[1][0] > 0
        for start, end in bounds:
            assert torch.equal(rotary[start:end, b], table[:end - start, 0])


def test_without_sft_the_angles_ignore_the_position_ids(tok):
    """Outside --sft the rotary angles are those of 0 .. s-1 whatever the position ids (as in
    Megatron without packed sequences; --reset-position-ids resets learned positions only)."""
    model = _model("rope", False)
    seen = []
    model.language_model.encoder.register_forward_pre_hook(
        lambda module, args: seen.append(args[2]))
    batch = _batch(tok)
    with torch.no_grad():
        model(batch["tokens"], batch["position_ids"], None)
    assert torch.equal(seen[0], model.language_model.rotary_pos_emb(SEQ))


def test_at_positions_gives_the_table_angles_bit_for_bit():
    from megatron.model.rotary_pos_embedding import RotaryEmbedding

    for emb in (RotaryEmbedding(8), RotaryEmbedding(8, 500, True, 2.0, 8.0)):
        table = emb(40)                                                      # [40, 1, 1, 8]
        pos = torch.tensor([[3, 0, 39, 7], [1, 2, 2, 5]])
        got = emb.at_positions(pos)                                          # [4, 2, 1, 8]
        assert torch.equal(got, table[pos.t()].squeeze(3))


@pytest.mark.parametrize("stage", [(True, False), (False, False), (False, True)])
def test_every_pipeline_stage_gets_the_position_ids(tok, stage):
    """With --sft a stage without the embedding still needs the position ids: its layers'
    rotary angles follow them."""
    import pretrain_gpt

    batch = {k: v for k, v in _batch(tok).items()}
    pstate = types.SimpleNamespace(tp_group=None, tp_ranks=[0])
    tokens, labels, loss_mask, mask, pos = pretrain_gpt.get_sft_batch(
        iter([batch]), pstate, stage[0], stage[1], None)
    assert torch.equal(pos, batch["position_ids"])
    assert (tokens is None) == (not stage[0]) and (labels is None) == (not stage[1])
    assert mask is not None and mask.shape == (len(PACKS), 1, SEQ, SEQ)
