import pytest
import torch

from megaloop.alrs import ALRS, ALRSConfig, MultiplierSchedule, read_log


@pytest.mark.parametrize("kwargs, field", [
    (dict(s1=3.0, s2=2.0), "s1"), (dict(s1=0.0), "s1"), (dict(fraction=0.0), "fraction"),
    (dict(fraction=1.5), "fraction"), (dict(interval=0), "interval"),
    (dict(transition=-1), "transition"), (dict(mode="sgd"), "mode"),
    (dict(embedding_head="drop"), "embedding_head"), (dict(eig_method="qr"), "eig_method"),
    (dict(decoder_boost=0.0), "decoder_boost"), (dict(granularity="row"), "granularity"),
    # "" is in every name: every matrix excluded, or every one pinned as embedding/head.
    (dict(exclude=("router", "")), "exclude"), (dict(embedding_head_prefixes=[""]),
                                               "embedding_head_prefixes"),
    # None: before, pin_s2 pinned nothing (embedding and head joined the α range), silently.
    (dict(embedding_head_prefixes=[]), "embedding_head_prefixes"),
    # "" starts every name: before, decoder_boost scaled every LR, embedding and head included.
    (dict(mode="decoder_boost", decoder_prefix=""), "decoder_prefix"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        ALRSConfig(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    # Before: "alrs: ALRS s1 must be <= s2, got s1=6.0 > s2=5.0", unlike every other field's.
    ("alrs.s1=6", "alrs.s1=6.0: must be <= alrs.s2=5.0"),
    ("alrs.mode=sgd", "alrs.mode='sgd': must be one of 'alrs', 'uniform', 'decoder_boost'"),
    ("alrs.exclude=[router, '']", "alrs.exclude=['router', '']: must be free of empty strings (one "
                                  "matches every matrix)"),
])
def test_a_bad_alrs_setting_is_worded_as_every_other_field(override, message):
    from megaloop.config import ConfigError, RunConfig, apply_overrides

    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), [override])
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs, unread", [
    (dict(s2=3.0, decoder_boost=4.0, decoder_prefix="x."), ["decoder_prefix='x.'",
                                                            "decoder_boost=4.0"]),
    (dict(embedding_head="include", embedding_head_prefixes=["x."]),
     ["embedding_head_prefixes=('x.',)"]),
    (dict(mode="uniform", s1=0.5, embedding_head="exclude", interval=7),
     ["s1=0.5", "embedding_head='exclude'"]),
    (dict(mode="decoder_boost", transition=9, decoder_boost=3.0), ["transition=9"]),
    (dict(mode="uniform"), []),
])
def test_options_a_mode_does_not_read_are_listed(kwargs, unread):
    assert ALRSConfig(**kwargs).unread_options() == unread


def test_allocation_steps_of_the_60m_run():
    config = ALRSConfig()
    steps = [s for s in range(1, 3201) if config.allocates_at(s, 3200)]
    assert steps == [1, 100, 200, 300, 400, 500, 600]  # the reference's 7 updates at T = 3200


@pytest.mark.parametrize("kwargs, total, note", [
    # Before: no word. Ramps from 100 (cut at 200) and 200, which moves the multipliers to step 700.
    (dict(transition=500), 1000, "ALRS: alrs.transition=500 is longer than the allocation window "
     "(alrs.fraction x total steps = 200): each ramp but the last is cut short by the next allocation "
     "(every alrs.interval=100 steps), and the last ramp, from step 200, ends at step 700"),
    (dict(transition=950), 1000, "ALRS: alrs.transition=950 is longer than the allocation window "
     "(alrs.fraction x total steps = 200): each ramp but the last is cut short by the next allocation "
     "(every alrs.interval=100 steps), and the last ramp, from step 200, ends at step 1150, after the "
     "run's last step 1000: its targets are never reached"),
    (dict(transition=200, fraction=0.3), 500, "ALRS: alrs.transition=200 is longer than the allocation "
     "window (alrs.fraction x total steps = 150): the last ramp, from step 100, ends at step 300"),
    (dict(transition=200), 1000, None),  # as long as the window: the last ramp ends at 400
    (dict(transition=500, mode="uniform"), 1000, None),  # unread_options names it
])
def test_a_transition_longer_than_the_allocation_window_is_named(kwargs, total, note):
    assert ALRSConfig(**kwargs).transition_note(total) == note
    assert "\n" not in (note or "")


def test_a_run_shorter_than_the_window_still_allocates_at_step_1():
    config = ALRSConfig()  # fraction 0.2: the window 0.2·T holds no step at all when T < 5
    assert [s for s in range(1, 5) if config.allocates_at(s, 4)] == [1]
    assert not ALRSConfig(mode="uniform").allocates_at(1, 4)


def test_first_allocation_holds_at_once_later_ones_ramp():
    sched = MultiplierSchedule({"a": 1.0, "b": 1.0}, transition=50)
    sched.retarget(1, {"a": 4.0, "b": 2.0})  # the reference's first ramp is the LR warmup itself
    assert sched.at(1) == {"a": 4.0, "b": 2.0}
    sched.retarget(100, {"a": 5.0, "b": 1.0})
    assert sched.at(100) == {"a": 4.0, "b": 2.0}
    assert sched.at(125) == {"a": 4.5, "b": 1.5}
    assert sched.at(149)["a"] < 5.0 and sched.at(150) == {"a": 5.0, "b": 1.0}
    sched.retarget(130, {"a": 1.0, "b": 2.0})  # a new target mid-ramp starts from where it is
    assert sched.at(130) == {"a": 4.6, "b": 1.4} and sched.at(180) == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError, match="targets"):
        sched.retarget(200, {"a": 1.0})


def _spread_model(spreads):
    """Linear layers whose weights have eigenvalue spectra λ_j = j^spread (different α each)."""
    model = torch.nn.ModuleDict()
    for i, spread in enumerate(spreads):
        layer = torch.nn.Linear(32, 32, bias=False)
        _set_spectrum(layer.weight, spread, seed=i)
        model[f"l{i}"] = layer
    return model


def _set_spectrum(weight, spread, seed):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=g))
    sigma = torch.arange(1, 33, dtype=torch.float32) ** (spread / 2)
    with torch.no_grad():
        weight.copy_((u * sigma) @ u.T)


def test_schedule_shape_freeze_and_lr_equals_multiplier_times_base_lr(tmp_path):
    model = _spread_model([1.0, 2.0, 4.0])
    total, base = 1000, lambda t: 1e-3 * (1 + t / 1000)
    alrs = ALRS(model, total, ALRSConfig(s1=1.0, s2=5.0, interval=100, fraction=0.2, transition=50),
                log_path=str(tmp_path / "alrs.zarr"))
    history = {}
    for t in range(1, total + 1):
        if t == 150:  # the spectra change: the allocation at 200 must retarget
            _set_spectrum(model["l0"].weight, 4.0, seed=0)
            _set_spectrum(model["l2"].weight, 1.0, seed=2)
        if t == 300:  # after 0.2·T nothing may change any more
            _set_spectrum(model["l1"].weight, 8.0, seed=1)
        history[t] = alrs.step(t, base(t))
    alrs.close()
    l0, l2 = [[history[t][f"l{i}.weight"] for t in range(1, total + 1)] for i in (0, 2)]
    # Steeper spectrum = heavier tail = smaller α = smaller LR.
    assert l0[0] == 5.0 and l2[0] == 1.0  # the first allocation holds from step 1
    changed = [t for t in range(2, total + 1) if history[t] != history[t - 1]]
    assert changed == list(range(201, 251))  # the allocation at 200 ramps over 50 steps, then frozen
    assert l0[250 - 1] == 1.0 and l2[250 - 1] == 5.0 and history[total] == history[250]
    log = read_log(tmp_path / "alrs.zarr")
    assert log.spectra_step.tolist() == [1, 100, 200]  # no spectra after the freeze at 0.2·T
    assert log.lr_step.tolist() == list(range(1, total + 1))
    col = log.lr_groups.index("l2.weight")
    assert log.lr_value[-1, col] == pytest.approx(5.0 * base(total), rel=1e-15)
    assert log.lr_value[-1, log.lr_groups.index("base")] == base(total)
    assert log.allocated.all()


def test_spectra_after_the_freeze_only_when_asked_for(monkeypatch):
    from megaloop.alrs import sharded

    analysed = []
    monkeypatch.setattr(sharded, "spectral_stats",
                        lambda w, name, method: analysed.append(name) or (
                            sharded.SpectralStats(2.0, 1.0, 0.5), torch.ones(2)))
    model = _spread_model([1.0])
    for monitor, expected in ((False, [1, 100]), (True, [1, 100, 200, 300, 400, 500])):
        alrs = ALRS(model, 500, ALRSConfig(monitor_after_freeze=monitor))  # frozen after step 100
        steps = []
        for t in range(1, 501):
            before = len(analysed)
            alrs.step(t)
            if len(analysed) > before:
                steps.append(t)
        assert steps == expected


def test_resume_from_state_dict_is_exact():
    model = _spread_model([1.0, 2.0, 3.0])
    config = ALRSConfig(interval=10, transition=8, fraction=0.5)
    first = ALRS(model, 100, config)
    for t in range(1, 15):
        first.step(t)
    state = first.state_dict()
    second = ALRS(model, 100, config)
    second.load_state_dict(state)
    for t in range(15, 60):
        assert second.step(t) == first.step(t)


def test_a_resume_keeps_the_ramp_in_progress_and_ramps_next_with_the_configured_transition():
    """alrs.transition changed on resume is in effect from the next allocation, as the resume
    logs it. Before: the ramp in progress took the new length at once, its multipliers jumping
    back (and a finished ramp reopened)."""
    saved = MultiplierSchedule({"a": 1.0}, transition=4)
    saved.retarget(1, {"a": 1.0})
    saved.retarget(10, {"a": 3.0})  # a ramp from step 10 to step 14, resumed at step 12
    resumed = MultiplierSchedule({"a": 1.0}, transition=20)
    resumed.load_state_dict(saved.state_dict())
    assert [resumed.at(t)["a"] for t in (12, 13, 14, 30)] == [2.0, 2.5, 3.0, 3.0]
    resumed.retarget(40, {"a": 1.0})  # the next allocation ramps over the new 20 steps
    assert resumed.at(50) == {"a": 2.0}
