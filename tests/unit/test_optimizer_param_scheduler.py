"""Learning-rate and weight-decay schedules against their closed forms.

The closed forms below are written from the schedule definitions (warmup line, cosine and linear
ramps, inverse square root, WSD tails), independently of the scheduler's code paths.
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer.optimizer_param_scheduler import OptimizerParamScheduler

MAX_LR, MIN_LR, INIT_LR = 1e-3, 1e-5, 1e-4
WARMUP, DECAY = 100, 1000


def _optimizer():
    """Two groups: a plain one, and one with lr_mult 0.5 and no weight decay."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a], "lr_mult": 1.0, "wd_mult": 1.0},
                            {"params": [b], "lr_mult": 0.5, "wd_mult": 0.0}], lr=1.0)


def _scheduler(style="cosine", optimizer=None, **overrides):
    kwargs = dict(init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP,
                  lr_decay_steps=DECAY, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                  wd_incr_steps=DECAY, wd_incr_style="constant")
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer or _optimizer(), **kwargs)


def _at(scheduler, n):
    scheduler.num_steps = 0
    scheduler.step(n)
    return scheduler.optimizer.param_groups[0]["lr"]


def _decay_fraction(n):
    return (n - WARMUP) / (DECAY - WARMUP)


CLOSED_FORMS = {
    "linear": lambda n: MIN_LR + (MAX_LR - MIN_LR) * (1 - _decay_fraction(n)),
    "cosine": lambda n: (MIN_LR + (MAX_LR - MIN_LR)
                         * (1 + math.cos(math.pi * _decay_fraction(n))) / 2),
    "constant": lambda n: MAX_LR,
    "inverse-square-root": lambda n: max(MIN_LR, MAX_LR * math.sqrt(WARMUP / n)),
}


@pytest.mark.parametrize("style", sorted(CLOSED_FORMS))
def test_decay_styles_match_closed_forms(style):
    scheduler = _scheduler(style)
    for n in (WARMUP + 1, 250, 500, 777, DECAY - 1, DECAY):
        assert _at(scheduler, n) == pytest.approx(CLOSED_FORMS[style](n), rel=1e-12), n
    # After the decay: min_lr, except constant which never decays.
    for n in (DECAY + 1, 5 * DECAY):
        expected = MAX_LR if style == "constant" else MIN_LR
        assert _at(scheduler, n) == pytest.approx(expected, rel=1e-12), n


@pytest.mark.parametrize("style", sorted(CLOSED_FORMS))
def test_warmup_is_linear_from_init_lr(style):
    scheduler = _scheduler(style)
    for n in (0, 1, 37, 50, WARMUP):
        expected = INIT_LR + (MAX_LR - INIT_LR) * n / WARMUP
        assert _at(scheduler, n) == pytest.approx(expected, rel=1e-12), n
    assert _at(scheduler, WARMUP) == pytest.approx(MAX_LR, rel=1e-12)


def test_cosine_hits_known_points():
    scheduler = _scheduler("cosine")
    assert _at(scheduler, (WARMUP + DECAY) // 2) == pytest.approx((MAX_LR + MIN_LR) / 2)
    assert _at(scheduler, DECAY) == pytest.approx(MIN_LR)


def test_inverse_square_root_floor_and_no_warmup():
    scheduler = _scheduler("inverse-square-root", min_lr=2e-4, lr_decay_steps=10_000)
    assert _at(scheduler, 900) == pytest.approx(MAX_LR / 3)   # sqrt(100 / 900)
    # 1e-3 * sqrt(100 / 3600) = 1.67e-4 is below min_lr: the floor holds inside the decay.
    assert _at(scheduler, 3600) == pytest.approx(2e-4)
    scheduler = _scheduler("inverse-square-root", lr_warmup_steps=0, min_lr=0.0, init_lr=0.0)
    assert _at(scheduler, 0) == pytest.approx(MAX_LR)        # max(n, 1) guards n = 0
    assert _at(scheduler, 400) == pytest.approx(MAX_LR / 20)  # sqrt(1 / 400)


WSD_TAILS = {
    "linear": lambda r: 1 - r,
    "cosine": lambda r: (1 + math.cos(math.pi * r)) / 2,
    "exponential": lambda r: 2 * 0.5 ** r - 1,
    "minus_sqrt": lambda r: 1 - math.sqrt(r),
}


@pytest.mark.parametrize("tail", sorted(WSD_TAILS))
def test_wsd_is_flat_then_decays_with_its_tail(tail):
    wsd = 200
    scheduler = _scheduler("WSD", wsd_decay_steps=wsd, lr_wsd_decay_style=tail)
    for n in (WARMUP + 1, 500, DECAY - wsd):
        assert _at(scheduler, n) == pytest.approx(MAX_LR, rel=1e-12), n
    for n in (DECAY - wsd + 1, 850, 900, DECAY):
        coeff = WSD_TAILS[tail]((n - (DECAY - wsd)) / wsd)
        assert _at(scheduler, n) == pytest.approx(MIN_LR + coeff * (MAX_LR - MIN_LR),
                                                  rel=1e-12, abs=1e-15), n
    assert _at(scheduler, DECAY) == pytest.approx(MIN_LR)
    assert _at(scheduler, DECAY + 1) == MIN_LR


def test_steps_count_samples_and_groups_get_multipliers():
    gbs = 16
    scheduler = _scheduler("linear", start_wd=0.0, end_wd=0.2, wd_incr_style="linear",
                           wd_incr_steps=DECAY)
    for _ in range(20):
        scheduler.step(gbs)
    n = 20 * gbs
    assert scheduler.num_steps == n
    g0, g1 = scheduler.optimizer.param_groups
    assert g0["lr"] == pytest.approx(CLOSED_FORMS["linear"](n), rel=1e-12)
    assert g1["lr"] == pytest.approx(0.5 * CLOSED_FORMS["linear"](n), rel=1e-12)
    assert g0["weight_decay"] == pytest.approx(0.2 * n / DECAY, rel=1e-12)
    assert g1["weight_decay"] == 0.0


def test_group_max_lr_and_min_lr_override_the_defaults():
    optimizer = _optimizer()
    optimizer.param_groups[1].update(max_lr=2e-3, min_lr=0.0, lr_mult=1.0)
    scheduler = _scheduler("linear", optimizer=optimizer)
    scheduler.num_steps = 0
    scheduler.step(550)  # halfway through the decay
    assert optimizer.param_groups[1]["lr"] == pytest.approx(1e-3, rel=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)


@pytest.mark.parametrize("style, coeff", [
    ("linear", lambda r: r),
    ("cosine", lambda r: (1 - math.cos(math.pi * r)) / 2),
])
def test_weight_decay_increment(style, coeff):
    scheduler = _scheduler(start_wd=0.01, end_wd=0.1, wd_incr_steps=400, wd_incr_style=style)
    for n in (0, 100, 200, 333, 400):
        _at(scheduler, n)
        expected = 0.01 + coeff(n / 400) * (0.1 - 0.01)
        assert scheduler.optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected), n
        assert scheduler.optimizer.param_groups[1]["weight_decay"] == 0.0
    _at(scheduler, 401)
    assert scheduler.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_constant_weight_decay():
    scheduler = _scheduler(start_wd=0.05, end_wd=0.05)
    for n in (0, 10, 5000):
        _at(scheduler, n)
        assert scheduler.optimizer.param_groups[0]["weight_decay"] == 0.05


MEGATRON_KEYS = {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                 "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"}


def test_state_round_trip_resumes_the_schedule():
    a = _scheduler("cosine", start_wd=0.0, end_wd=0.1, wd_incr_style="cosine")
    for _ in range(13):
        a.step(32)
    state = a.state_dict()
    assert set(state) == MEGATRON_KEYS
    assert state["num_steps"] == 13 * 32
    b = _scheduler("cosine", start_wd=0.0, end_wd=0.1, wd_incr_style="cosine",
                   use_checkpoint_opt_param_scheduler=False)
    b.load_state_dict(state)
    assert b.num_steps == a.num_steps
    for _ in range(5):
        a.step(32)
        b.step(32)
        for ga, gb in zip(a.optimizer.param_groups, b.optimizer.param_groups):
            assert (ga["lr"], ga["weight_decay"]) == (gb["lr"], gb["weight_decay"])


def test_mismatch_with_checkpoint_names_the_field():
    state = _scheduler("cosine").state_dict()
    strict = _scheduler("linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ConfigError, match=r"learning rate decay style \(--lr-decay-style\) is "
                                          r"'linear' in this run but 'cosine'"):
        strict.load_state_dict(state)
    strict = _scheduler("cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ConfigError, match=r"learning rate \(--lr\) is 0.002 .* 0.001 in the "
                                          r"checkpoint.*--override-opt_param-scheduler"):
        strict.load_state_dict(state)


def test_use_checkpoint_takes_saved_values_and_override_keeps_ours():
    saved = _scheduler("cosine", max_lr=2e-3)
    saved.step(300)
    state = saved.state_dict()
    from_ckpt = _scheduler("linear", use_checkpoint_opt_param_scheduler=True)
    from_ckpt.load_state_dict(state)
    assert (from_ckpt.max_lr, from_ckpt.lr_decay_style) == (2e-3, "cosine")
    assert from_ckpt.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
    ours = _scheduler("linear", use_checkpoint_opt_param_scheduler=False,
                      override_opt_param_scheduler=True)
    ours.load_state_dict(state)
    assert (ours.max_lr, ours.lr_decay_style, ours.num_steps) == (MAX_LR, "linear", 300)
    assert ours.optimizer.param_groups[0]["lr"] == pytest.approx(CLOSED_FORMS["linear"](300))


def test_loads_legacy_key_names():
    legacy = {"start_lr": MAX_LR, "min_lr": MIN_LR, "warmup_steps": WARMUP, "decay_steps": DECAY,
              "decay_style": "linear", "num_iters": 640}
    scheduler = _scheduler("linear", use_checkpoint_opt_param_scheduler=False)
    scheduler.load_state_dict(legacy)
    assert scheduler.num_steps == 640
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(CLOSED_FORMS["linear"](640))


@pytest.mark.parametrize("overrides, match", [
    (dict(min_lr=2e-3), r"--lr \(0.001\) must be >= --min-lr"),
    (dict(init_lr=2e-3), r"--lr-warmup-init"),
    (dict(lr_warmup_steps=DECAY), r"warmup steps \(1000\).*smaller than lr decay steps"),
    (dict(lr_decay_steps=0), r"lr decay steps.*must be > 0"),
    (dict(lr_decay_style="step"), r"--lr-decay-style must be one of"),
    (dict(lr_decay_style="WSD"), r"WSD needs --lr-wsd-decay-iters"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=10, lr_wsd_decay_style="x"),
     r"--lr-wsd-decay-style"),
    (dict(start_wd=0.2, end_wd=0.1), r"--start-weight-decay \(0.2\)"),
    (dict(start_wd=0.0, end_wd=0.1), r"constant needs --start-weight-decay"),
    (dict(override_opt_param_scheduler=True), r"cannot both be set"),
])
def test_rejects_impossible_settings(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _scheduler("cosine", **overrides)
