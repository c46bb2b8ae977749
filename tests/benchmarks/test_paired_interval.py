"""server_overhead.py's interval around the median added time: groups resampled whole."""
from __future__ import annotations

import random
import statistics

from benchmarks.server_overhead import median_interval


def test_the_interval_holds_the_median_and_narrows_with_more_groups() -> None:
    rng = random.Random()

    def draws(shifts: list[float]) -> list[float]:
        return [rng.gauss(3.0, 1.0) + shift for shift in shifts for _ in range(16)]
    few = draws([-2.0, 0.0, 2.0])  # groups far apart: a wide interval
    many = draws([rng.gauss(0, 1.5) for _ in range(64)])
    low, high = median_interval(few, 16)
    assert low <= statistics.median(few) <= high
    low_many, high_many = median_interval(many, 16)
    assert low_many <= statistics.median(many) <= high_many
    assert high_many - low_many < high - low


def test_groups_that_agree_give_no_width() -> None:
    group = [1.0, 2.0, 3.0, 4.0]
    assert median_interval(group * 5, 4) == (2.5, 2.5)


def test_a_group_moves_as_one() -> None:
    """Two groups, each constant: resampling whole groups only ever sees 1, 5 or their mix."""
    low, high = median_interval([1.0] * 8 + [5.0] * 8, 8)
    assert (low, high) == (1.0, 5.0)
