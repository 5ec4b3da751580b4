"""Judging host speed checks against the host's usual speed (pure)."""

from __future__ import annotations

import pytest

from sailor.profiler.cpu_host.speed import SpeedCheck, drift, mean_check, nominal, same_speed


def _check(alone: tuple[float, ...], together: tuple[float, ...], at: float = 0.0) -> SpeedCheck:
    return SpeedCheck(at_s=at, alone_s=alone, together_s=together)


def test_the_usual_speed_is_the_fastest_seen_per_core_and_mode() -> None:
    checks = [
        _check((7e-3, 14e-3), (7.2e-3, 15e-3), at=1.0),  # core 1 shared with another tenant
        _check((7.5e-3, 7e-3), (14e-3, 7.1e-3), at=2.0),  # core 0 slowed while both compute
    ]
    usual = nominal(checks)
    assert usual.alone_s == (7e-3, 7e-3) and usual.together_s == (7.2e-3, 7.1e-3)
    assert usual.at_s == 2.0
    assert checks[0].slowest_ratio(usual) == pytest.approx(15 / 7.1)
    assert not same_speed(checks[0], usual) and not same_speed(checks[1], usual)
    assert same_speed(_check((7.7e-3, 7.5e-3), (8e-3, 8.2e-3)), usual, tolerance=0.2)


def test_two_checks_agree_when_no_time_moved_by_more_than_the_tolerance() -> None:
    slow = _check((14e-3, 14e-3), (15e-3, 15e-3))
    also_slow = _check((15e-3, 13e-3), (14e-3, 16e-3))
    fast = _check((7e-3, 7e-3), (7e-3, 7e-3))
    # a host slowed down steadily is the same host for a comparison: only a change matters
    assert same_speed(slow, also_slow) and not same_speed(slow, fast)
    assert drift(slow, fast) == pytest.approx(drift(fast, slow))
    assert drift(slow, fast) == pytest.approx(15 / 7 - 1)
    both = mean_check([slow, fast])
    assert both.alone_s == pytest.approx((10.5e-3, 10.5e-3))
    assert both.together_s == pytest.approx((11e-3, 11e-3))


def test_bad_checks_name_the_values() -> None:
    with pytest.raises(ValueError, match="one time per core"):
        _check((1.0,), (1.0, 2.0))
    with pytest.raises(ValueError, match="must be > 0"):
        _check((0.0,), (1.0,))
    with pytest.raises(ValueError, match="at least one"):
        nominal([])
    with pytest.raises(ValueError, match="same cores"):
        nominal([_check((1.0,), (1.0,)), _check((1.0, 1.0), (1.0, 1.0))])
    with pytest.raises(ValueError, match="tolerance"):
        same_speed(_check((1.0,), (1.0,)), _check((1.0,), (1.0,)), tolerance=-1)
    with pytest.raises(ValueError, match="at least one"):
        mean_check([])
    with pytest.raises(ValueError, match="cores"):
        _check((1.0,), (1.0,)).slowest_ratio(_check((1.0, 1.0), (1.0, 1.0)))
