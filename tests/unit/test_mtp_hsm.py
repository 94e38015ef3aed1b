"""Hidden-state mixing of multi-token prediction (``--mtp-hsm``) in one process, against
references written here with plain loops:

* the mixing picks, place by place, the state its index names, and the newest state where
  the index names it or an all-zero older state;
* a 3-depth MTP block feeds depth K the per-place pick among the main model's state shifted
  K places, depth J's output shifted K - 1 - J places (zeros past the end) and depth K - 1's
  output, with the picks the block drew; depth 0 takes the main model's state unmixed;
* the picks come from the tracker stream ``'mtp-hsm-rng'`` seeded with the default seed
  + 2**40 + dp rank, not from the default stream; eval mode neither mixes nor draws;
* the stream is recreated from its seed when loaded states lack it;
* ``--mtp-hsm`` needs ``--mtp-num-layers >= 2``.
"""

import pytest
import torch

from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                  model_parallel_cuda_manual_seed)
from megatron.model import GPTModel, mtp_hsm
from megatron.training.arguments import ArgumentsError
from tests.unit.test_gpt_model import BATCH, SEQ, make_batch, make_config, single_process_state
from tests.unit.test_mtp_options import _validate

SEED = 1234


@pytest.fixture(autouse=True)
def _fresh_streams():
    """Seeded streams as training has them; forgotten afterwards (they are per process)."""
    outside = torch.get_rng_state()
    model_parallel_cuda_manual_seed(SEED, 0)
    yield
    get_cuda_rng_tracker().reset()
    torch.set_rng_state(outside)


def _naive_mix(older, newest, picks):
    out = torch.empty_like(newest)
    n = older.size(0)
    for i in range(newest.size(0)):
        for b in range(newest.size(1)):
            k = int(picks[i, b])
            if k == n or bool((older[k, i, b] == 0).all()):
                out[i, b] = newest[i, b]
            else:
                out[i, b] = older[k, i, b]
    return out


def test_mixing_picks_each_places_state_as_a_loop_does():
    gen = torch.Generator().manual_seed(0)
    older = torch.randn(3, 7, 2, 5, generator=gen, dtype=torch.float64)
    older[1, 6] = 0                                  # a place a shift emptied
    older[2, 3, 1] = 0
    newest = torch.randn(7, 2, 5, generator=gen, dtype=torch.float64)
    picks = torch.randint(4, (7, 2), generator=gen)
    picks[6] = 1
    picks[3, 1] = 2
    got = mtp_hsm.mix_hidden_states(older, newest, picks)
    assert torch.equal(got, _naive_mix(older, newest, picks))
    assert torch.equal(got[6], newest[6]) and torch.equal(got[3, 1], newest[3, 1])
    # every source appears, so the comparison is not vacuous
    assert set(picks.flatten().tolist()) == {0, 1, 2, 3}


def _model(depths=3, hsm=True, detach=False):
    torch.manual_seed(0)
    return GPTModel(make_config(position_embedding_type="rope"), single_process_state(),
                    mtp_num_layers=depths, mtp_loss_scaling_factor=0.3, mtp_hsm=hsm,
                    mtp_detach_heads=detach).train()


def _shift(state, places):
    """``state [s, b, h]`` shifted left ``places`` along the sequence, zeros past the end."""
    out = torch.zeros_like(state)
    if places < state.size(0):
        out[:state.size(0) - places] = state[places:]
    return out


def _record_picks(monkeypatch):
    drawn = []
    original = mtp_hsm.draw_picks

    def recording(*args, **kwargs):
        picks = original(*args, **kwargs)
        drawn.append(picks)
        return picks
    monkeypatch.setattr(mtp_hsm, "draw_picks", recording)
    return drawn


def _block_inputs(model, monkeypatch):
    """The block's outputs, each layer's hidden-state input, and the picks drawn."""
    drawn = _record_picks(monkeypatch)
    inputs = []
    for layer in model.mtp.layers:
        layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach()))
    ids, pos, _ = make_batch()
    lm = model.language_model
    hidden = lm(ids, pos, None).detach()                                    # [s, b, h]
    rotary = lm.rotary_angles(SEQ, pos, None, hidden.device)
    outputs = model.mtp(ids, pos, hidden, None, rotary, model._mtp_embedding)
    return hidden, [o.detach() for o in outputs], inputs, drawn


def test_each_depth_takes_its_pick_among_the_shifted_history(monkeypatch):
    model = _model(depths=3)
    hidden, outputs, inputs, drawn = _block_inputs(model, monkeypatch)
    assert [p.shape for p in drawn] == [(SEQ, BATCH)] * 2
    assert drawn[0].max() == 1 and drawn[1].max() == 2 and drawn[1].min() == 0
    assert torch.equal(inputs[0], hidden)
    # depth 1: the main state shifted once, or depth 0's output
    want1 = _naive_mix(_shift(hidden, 1)[None], outputs[0], drawn[0])
    # depth 2: the main state shifted twice, depth 0's output shifted once, depth 1's output
    want2 = _naive_mix(torch.stack([_shift(hidden, 2), _shift(outputs[0], 1)]), outputs[1],
                       drawn[1])
    assert torch.equal(inputs[1], want1)
    assert torch.equal(inputs[2], want2)
    # the last places of the shifted states are empty: the newest state is taken there
    assert torch.equal(inputs[2][-1], outputs[1][-1])
    assert not torch.equal(inputs[2], outputs[1])


def test_without_the_flag_each_depth_takes_the_previous_output(monkeypatch):
    model = _model(depths=3, hsm=False)
    hidden, outputs, inputs, drawn = _block_inputs(model, monkeypatch)
    assert drawn == []
    assert torch.equal(inputs[1], outputs[0]) and torch.equal(inputs[2], outputs[1])


def test_picks_come_from_their_own_stream_seeded_per_replica():
    tracker = get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    seed = mtp_hsm.hsm_seed(dp_rank=3)
    assert seed == SEED + 2 ** 40 + 3
    picks = mtp_hsm.draw_picks(4, 5, 2, 2, 1, seed, torch.device("cpu"))   # owner 1 of 2
    assert mtp_hsm.HSM_RNG_TRACKER_NAME in tracker.get_states()
    want = torch.randint(4, (10, 2), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(picks, want[5:])
    assert torch.equal(torch.get_rng_state(), default_before)             # default untouched
    again = mtp_hsm.draw_picks(4, 5, 2, 2, 1, seed, torch.device("cpu"))
    assert not torch.equal(again, picks)                                   # the stream moves on


def test_the_stream_is_recreated_when_loaded_states_lack_it():
    tracker = get_cuda_rng_tracker()
    seed = mtp_hsm.hsm_seed(0)
    without = tracker.get_states()
    first = mtp_hsm.draw_picks(3, 6, 1, 1, 0, seed, torch.device("cpu"))
    tracker.set_states(without)            # a checkpoint saved before the stream existed
    assert torch.equal(mtp_hsm.draw_picks(3, 6, 1, 1, 0, seed, torch.device("cpu")), first)
    with pytest.raises(ValueError, match="already used"):
        tracker.add("another", seed)


def test_eval_mode_neither_mixes_nor_draws(monkeypatch):
    mixed, plain = _model(depths=3), _model(depths=3, hsm=False)
    plain.load_state_dict(mixed.state_dict())
    for m in (mixed, plain):
        m.eval()
    stream_before = get_cuda_rng_tracker().get_states()[mtp_hsm.HSM_RNG_TRACKER_NAME]
    _, outputs, inputs, drawn = _block_inputs(mixed, monkeypatch)
    _, plain_outputs, _, _ = _block_inputs(plain, monkeypatch)
    assert drawn == []
    assert all(torch.equal(a, b) for a, b in zip(outputs, plain_outputs))
    assert torch.equal(get_cuda_rng_tracker().get_states()[mtp_hsm.HSM_RNG_TRACKER_NAME],
                       stream_before)
    ids, pos, labels = make_batch()
    with torch.no_grad():
        assert torch.equal(mixed(ids, pos, None, labels=labels),
                           plain(ids, pos, None, labels=labels))


def test_training_loss_moves_with_the_flag_and_gradients_reach_the_picked_states():
    ids, pos, labels = make_batch()
    mixed, plain = _model(depths=2), _model(depths=2, hsm=False)
    plain.load_state_dict(mixed.state_dict())
    with_flag = mixed(ids, pos, None, labels=labels)
    with_flag.mean().backward()
    plain(ids, pos, None, labels=labels).mean().backward()
    logged, plain_logged = mixed.mtp_tracker.report(), plain.mtp_tracker.report()
    assert logged["mtp_1 loss"] == plain_logged["mtp_1 loss"]             # depth 0 is unmixed
    assert logged["mtp_2 loss"] != plain_logged["mtp_2 loss"]
    assert all(p.grad is not None for p in mixed.parameters())


def test_one_depth_is_refused():
    with pytest.raises(ValueError, match="--mtp-hsm needs --mtp-num-layers >= 2, got 1"):
        _model(depths=1)
    with pytest.raises(ArgumentsError, match="--mtp-hsm needs --mtp-num-layers >= 2, got 1"):
        _validate(["--mtp-hsm", "--mtp-num-layers", "1"])
    with pytest.raises(ArgumentsError, match="--mtp-hsm needs --mtp-num-layers$"):
        _validate(["--mtp-hsm"])
    assert _validate(["--mtp-hsm", "--mtp-num-layers", "2"]).mtp_hsm is True
