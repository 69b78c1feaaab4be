"""tools.stats: the per-seed figures the comparison tools report."""

from __future__ import annotations

import math
import statistics

from tools.stats import mean_std, paired_interval, prediction_interval, spread


def test_mean_and_sample_std_over_seeds_and_one_seed_has_no_std():
    mean, std = mean_std([60.0, 62.0, 67.0])
    assert mean == 63.0 and math.isclose(std, statistics.stdev([60.0, 62.0, 67.0]))
    assert math.isclose(std, math.sqrt(((3 ** 2) + 1 + 4 ** 2) / 2))  # n - 1 in the denominator
    one = mean_std([5.0])
    assert one[0] == 5.0 and math.isnan(one[1])


def test_spread_gives_median_and_range_and_is_nan_when_a_seed_lacks_the_figure():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"mean": 4.0, "std": statistics.stdev([3.0, 1.0, 2.0, 10.0]),
                                             "median": 2.5, "min": 1.0, "max": 10.0}
    assert all(math.isnan(v) for v in spread([1.0, math.nan]).values())


def test_paired_interval_is_the_t_interval_with_the_sign_count():
    gaps = [1.0, 3.0, -0.5, 2.5, 4.0]
    got = paired_interval(gaps)
    half = 2.7764451051977987 * statistics.stdev(gaps) / math.sqrt(5)  # t(0.975, 4), from tables
    assert math.isclose(got["mean"], 2.0) and math.isclose(got["low"], 2.0 - half)
    assert math.isclose(got["high"], 2.0 + half)
    assert (got["ahead"], got["behind"], got["level"], got["n"]) == (4, 1, 0, 5)
    one = paired_interval([2.0])
    assert one["mean"] == 2.0 and math.isnan(one["low"]) and one["ahead"] == 1
    assert math.isnan(paired_interval([1.0, math.nan])["high"])


def test_prediction_interval_is_the_t_interval_of_one_new_seed_and_covers_it_at_its_level():
    from scipy import stats

    gaps = [1.0, 3.0, -0.5, 2.5, 4.0]
    got = prediction_interval(gaps)
    half = 2.7764451051977987 * statistics.stdev(gaps) * math.sqrt(1 + 1 / 5)  # t(0.975, 4), from tables
    assert math.isclose(got["low"], 2.0 - half) and math.isclose(got["high"], 2.0 + half) and got["n"] == 5
    low, high = stats.t.interval(0.95, 4, loc=2.0, scale=statistics.stdev(gaps) * math.sqrt(1.2))
    assert math.isclose(got["low"], low) and math.isclose(got["high"], high)
    assert math.isnan(prediction_interval([1.0])["low"])
    assert math.isnan(prediction_interval([1.0, math.nan])["high"])
    # normal seeds: a new seed lands inside the interval of seven others 95 % of the time
    import numpy as np

    draws = np.random.default_rng(0).normal(size=(4000, 8))
    inside = 0
    for row in draws:
        p = prediction_interval(row[:7].tolist())
        inside += p["low"] <= row[7] <= p["high"]
    assert abs(inside / 4000 - 0.95) < 0.015
