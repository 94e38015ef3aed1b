"""Loss scalers against a hand-worked table of Megatron's dynamic rule."""

import pytest
import torch

from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

# initial 16, min 2, window 3, hysteresis 2. Each row: event, then the expected
# (scale, growth_tracker, hysteresis_tracker) after it. Worked out by hand from the rule:
# inf -> growth 0, hysteresis - 1, back off (floor min) once hysteresis <= 0;
# ok  -> growth + 1; at the window: scale x2, growth 0, hysteresis restored.
HAND_TABLE = [
    ("inf", 16.0, 0, 1),   # first overflow is absorbed by hysteresis
    ("ok", 16.0, 1, 1),    # clean steps do not restore hysteresis
    ("inf", 8.0, 0, 0),    # hysteresis exhausted -> back off
    ("inf", 4.0, 0, -1),   # every further overflow backs off
    ("inf", 2.0, 0, -2),   # reaches the floor exactly
    ("inf", 2.0, 0, -3),   # 1.0 would be below min_scale 2
    ("ok", 2.0, 1, -3),
    ("ok", 2.0, 2, -3),
    ("ok", 4.0, 0, 2),     # window of 3 clean steps -> grow, hysteresis restored
    ("ok", 4.0, 1, 2),
    ("ok", 4.0, 2, 2),
    ("inf", 4.0, 0, 1),    # overflow resets the growth counter, absorbed by hysteresis
    ("ok", 4.0, 1, 1),
    ("ok", 4.0, 2, 1),
    ("ok", 8.0, 0, 2),
]


def _trackers(scaler):
    state = scaler.state_dict()
    return float(state["scale"].item()), state["growth_tracker"], state["hysteresis_tracker"]


def test_dynamic_scaler_follows_hand_table():
    scaler = DynamicGradScaler(initial_scale=16.0, min_scale=2.0, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=3, hysteresis=2)
    assert _trackers(scaler) == (16.0, 0, 2)
    for step, (event, scale, growth, hysteresis) in enumerate(HAND_TABLE):
        scaler.update(event == "inf")
        assert _trackers(scaler) == (scale, growth, hysteresis), f"after step {step} ({event})"
        assert scaler.inv_scale.item() == 1.0 / scale
        assert scaler.scale.dtype == torch.float32 and scaler.scale.shape == (1,)


def test_dynamic_scaler_megatron_defaults_back_off_on_second_overflow():
    # --initial-loss-scale 2**32, --hysteresis 2: the second consecutive overflow halves it.
    scaler = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0)
    scaler.update(True)
    assert scaler.scale.item() == 2.0 ** 32
    scaler.update(True)
    assert scaler.scale.item() == 2.0 ** 31
    for _ in range(999):
        scaler.update(False)
    assert scaler.scale.item() == 2.0 ** 31
    scaler.update(False)
    assert scaler.scale.item() == 2.0 ** 32


def test_dynamic_scaler_state_round_trip_continues_identically():
    a = DynamicGradScaler(initial_scale=64.0, min_scale=1.0, growth_interval=2, hysteresis=3)
    for event in (True, False, True, True):
        a.update(event)
    b = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=2, hysteresis=3)
    b.load_state_dict(a.state_dict())
    assert _trackers(a) == _trackers(b) == (32.0, 0, 0)
    for event in (False, True, False, False, False, True):
        a.update(event)
        b.update(event)
        assert _trackers(a) == _trackers(b)


def test_dynamic_scaler_load_rejects_incomplete_state():
    scaler = DynamicGradScaler(initial_scale=8.0, min_scale=1.0)
    with pytest.raises(KeyError, match="hysteresis_tracker"):
        scaler.load_state_dict({"scale": torch.tensor([4.0]), "growth_tracker": 0})


def test_constant_scaler_never_changes():
    scaler = ConstantGradScaler(128.0)
    for event in (True, True, True, False):
        scaler.update(event)
    assert scaler.scale.item() == 128.0
    assert scaler.inv_scale.item() == 1.0 / 128.0
    assert scaler.state_dict() == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_scale=0.0, min_scale=1.0), "loss scale must be > 0"),
    (dict(initial_scale=4.0, min_scale=8.0), "min_scale"),
    (dict(initial_scale=4.0, min_scale=1.0, hysteresis=0), "hysteresis"),
    (dict(initial_scale=4.0, min_scale=1.0, backoff_factor=1.5), "backoff_factor"),
])
def test_dynamic_scaler_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicGradScaler(**kwargs)
