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
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("sft_pos_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return SFTTokenizer(tok_dir, "nemotron-h-aligned")


def _batch(tok):
    samples = [pack_conversations(p, tok, SEQ) for p in PACKS]
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def _bounds(segments: torch.Tensor):
    """(start, end) of every conversation of one pack's ``segment_ids`` ``[s]``."""
    cuts = (torch.nonzero(segments[1:] != segments[:-1]).view(-1) + 1).tolist()
    edges = [0] + cuts + [segments.numel()]
    return list(zip(edges[:-1], edges[1:]))


# Multi-latent attention rotates only its decoupled position channels (YaRN angles).
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=8, normalization="RMSNorm", add_bias_linear=False)


def _model(position_embedding_type, packed: bool, dtype=torch.float64):
    extra = {}
    if position_embedding_type == "mla":
        position_embedding_type, extra = "yarn", MLA
    config = make_config(padded_vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ,
                         position_embedding_type=position_embedding_type,
                         rotary_from_position_ids=packed, params_dtype=dtype, **extra)
    model = GPTModel(config, single_process_state(), init_seed=3)
    return model.eval()


@pytest.mark.parametrize("kind", ["rope", "yarn", "mla", "learned_absolute", "none"])
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
    pstate = types.SimpleNamespace(tp_group=None, tp_ranks=[0], cp_size=1)
    tokens, labels, loss_mask, mask, pos = pretrain_gpt.get_sft_batch(
        iter([batch]), pstate, stage[0], stage[1], None)
    assert torch.equal(pos, batch["position_ids"])
    assert (tokens is None) == (not stage[0]) and (labels is None) == (not stage[1])
    assert mask is not None and mask.shape == (len(PACKS), 1, SEQ, SEQ)


def test_context_parallel_pads_each_conversation_like_megatron(tok):
    """With cp 2 each conversation is followed by padding up to a multiple of 4 tokens: no
    loss, positions continuing the conversation's, its segment; the conversations' own tokens,
    loss mask and positions are those of the unpadded pack."""
    plain = pack_conversations(PACKS[0], tok, SEQ)
    padded = pack_conversations(PACKS[0], tok, SEQ, pad_multiple=4)
    full = {k: np.concatenate([v, [-1]]) for k, v in padded.items()}      # s + 1 boundaries
    seg_plain, seg_padded = (torch.from_numpy(p["segment_ids"]) for p in (plain, padded))
    b_plain, b_padded = _bounds(seg_plain), _bounds(seg_padded)
    assert len(b_plain) == len(b_padded) == len(PACKS[0])
    for (s0, e0), (s1, e1) in zip(b_plain[:-1], b_padded[:-1]):
        n = e0 - s0
        assert s1 % 4 == 0 and (e1 - s1) % 4 == 0 and 0 <= e1 - s1 - n < 4
        for key in ("tokens", "loss_mask", "position_ids"):
            assert np.array_equal(padded[key][s1:s1 + n - 1], plain[key][s0:s0 + n - 1]), key
        assert padded["position_ids"][s1:e1].tolist() == list(range(e1 - s1))
        assert (full["tokens"][s1 + n:e1] == tok.pad).all()
        assert (padded["loss_mask"][s1 + n - 1:e1 - 1] == 0).all()
    assert int(padded["loss_mask"].sum()) == int(plain["loss_mask"].sum())


def test_the_datasets_of_a_context_parallel_run_pad_for_it(tok, tmp_path):
    import json

    from megatron.data.sft_dataset import build_sft_datasets, split_conversations

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": sum(p, [])}) + "\n" for p in PACKS))
    train, _, _ = build_sft_datasets([str(path)], [2, 0, 0], SEQ, "1", tok,
                                     context_parallel_size=2)
    plain, _, _ = build_sft_datasets([str(path)], [2, 0, 0], SEQ, "1", tok)
    differ = 0
    for i, conversations in enumerate(PACKS):
        want = pack_conversations(split_conversations(sum(conversations, [])), tok, SEQ,
                                  pad_multiple=4)
        assert all(np.array_equal(train[i][k], want[k]) for k in want)
        differ += not np.array_equal(plain[i]["tokens"], want["tokens"])
    assert differ


def _cp_body(tokenizer_dir, comm):
    """On each of two ranks: the pack batch cut by get_sft_batch for this cp rank, through a
    cp-2 model; returns this rank's per-token losses, the one-process ones of its tokens, and
    the largest gap between the cp-summed and the one-process gradients."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core.context_parallel import split_for_cp_rank

    rank = dist.get_rank()
    tok = SFTTokenizer(tokenizer_dir, "nemotron-h-aligned")
    samples = [pack_conversations(p, tok, SEQ, pad_multiple=4) for p in PACKS]
    batch = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
    config = dict(padded_vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ,
                  position_embedding_type="rope", rotary_from_position_ids=True,
                  cp_comm_type=comm)
    whole = GPTModel(make_config(**config), single_process_state(), init_seed=3)
    cp_state = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1,
                                     pp_rank=0, virtual_pp_size=None, virtual_pp_rank=None,
                                     cp_group=dist.group.WORLD, tp_ranks=[rank], cp_size=2,
                                     cp_rank=rank)
    split = GPTModel(make_config(**config), cp_state, init_seed=3)
    mask = batch["loss_mask"]
    want = whole(batch["tokens"], batch["position_ids"], sft_attention_mask(batch["segment_ids"]),
                 labels=batch["labels"])                                    # [b, s]
    ((want * mask).sum() / mask.sum()).backward()
    tokens, labels, loss_mask, attention_mask, pos = pretrain_gpt.get_sft_batch(
        iter([batch]), cp_state, True, True, None)
    got = split(tokens, pos, attention_mask, labels=labels)                 # [b, s/2]
    ((got * loss_mask).sum() / mask.sum()).backward()
    gap = 0.0
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters()):
        grad = b.grad.clone()
        dist.all_reduce(grad)
        gap = max(gap, (grad - a.grad).abs().max().item())
    return (got.detach(), split_for_cp_rank(want.detach(), 1, 2, rank), attention_mask is None,
            gap)


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "a2a", "all_gather"])
def test_context_parallel_2_gives_the_one_process_losses_and_gradients(tok_dir, comm):
    """Two packs of several conversations, padded for cp 2, split over two gloo ranks: each
    rank's per-token losses equal the one-process losses of its tokens, and the gradients
    summed over the ranks equal the one-process ones (float64; blockwise softmax merged by
    log-sum-exp, so rounding only)."""
    from tests.multiprocess import run_on_ranks

    for got, want, no_mask, gap in run_on_ranks(_cp_body, 2, tok_dir, comm):
        assert not no_mask
        assert got.shape == (len(PACKS), SEQ // 2)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert gap < 1e-12, gap


def test_mtp_shifts_stay_inside_each_packed_conversation():
    """--sft with --mtp-num-layers: each depth's tokens, positions, labels and loss mask are
    shifted left inside their own conversation, its last place 0 (Megatron-Core rolls packed
    sequences by their cu_seqlens); a naive loop over the conversations is the reference."""
    from megatron.model.multi_token_prediction import roll_left, sequence_ends
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    values = torch.arange(20).view(2, 10) + 1
    ends = sequence_ends(positions)

    def naive(row, pos):
        out = [0] * len(row)
        for t in range(len(row) - 1):
            out[t] = row[t + 1] if pos[t + 1] != 0 else 0
        return out

    once = roll_left(values, None, ends)
    twice = roll_left(once, None, ends)
    for b in range(2):
        want = naive(values[b].tolist(), positions[b].tolist())
        assert once[b].tolist() == want
        assert twice[b].tolist() == naive(want, positions[b].tolist())
    assert once[0].tolist() == [2, 3, 4, 0, 6, 7, 0, 9, 0, 0]
    assert twice[0].tolist() == [3, 4, 0, 0, 7, 0, 0, 0, 0, 0]
    # Without ends the shift runs on across the conversations.
    assert roll_left(values)[0].tolist()[3] == 5


def test_a_pack_trains_mtp_as_its_conversations_alone(tok):
    """The MTP losses of two packs (b = 2) in training: each depth's masked loss sum and token
    count are those of the conversations run alone, added (float64 weights)."""
    batch = _batch(tok)
    config = dict(padded_vocab_size=VOCAB, max_position_embeddings=SEQ, seq_length=SEQ,
                  position_embedding_type="rope")
    packed = GPTModel(make_config(rotary_from_position_ids=True, **config),
                      single_process_state(), init_seed=3, mtp_num_layers=2).train()
    plain = GPTModel(make_config(**config), single_process_state(), init_seed=3,
                     mtp_num_layers=2).train()
    packed(batch["tokens"], batch["position_ids"], sft_attention_mask(batch["segment_ids"]),
           labels=batch["labels"], loss_mask=batch["loss_mask"])
    got = packed.mtp_tracker.values.clone()
    sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    for b in range(len(PACKS)):
        for start, end in _bounds(batch["segment_ids"][b]):
            mask = batch["loss_mask"][b:b + 1, start:end]
            plain.mtp_tracker.values = None
            plain(batch["tokens"][b:b + 1, start:end], torch.arange(end - start)[None], None,
                  labels=batch["labels"][b:b + 1, start:end], loss_mask=mask)
            for depth in range(2):
                count = mask[0, depth + 1:].double().sum()
                sums[depth] += plain.mtp_tracker.values[depth] * count
                counts[depth] += count
    # The MTP loss sums in fp32 (as the main loss is reduced): 1e-7 relative apart.
    torch.testing.assert_close(got, sums / counts, rtol=1e-6, atol=0)
