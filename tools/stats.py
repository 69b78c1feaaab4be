"""The per-seed statistics every comparison tool reports: mean and sample standard deviation, the spread
(mean, std, median, min, max) of a figure over seeds, and the paired 95 % interval of a gap between two
arms with the count of seeds on each side, and the prediction interval of one more seed's gap."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["mean_std", "paired_interval", "prediction_interval", "spread"]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample std, median, min and max of per-seed values (all nan if one is: some runs lack it)."""
    if any(math.isnan(v) for v in values):
        return dict.fromkeys(('mean', 'std', 'median', 'min', 'max'), math.nan)
    mean, std = mean_std(values)
    return {'mean': mean, 'std': std, 'median': statistics.median(values), 'min': min(values),
            'max': max(values)}


def _t_interval(values: Sequence[float], level: float, scale: float) -> tuple[float, float, float]:
    """(mean, low, high): mean ± t(level, n - 1) · s · scale of per-seed values; nan bounds below two values
    or when one is nan."""
    from scipy.stats import t

    n = len(values)
    if n < 2 or any(math.isnan(v) for v in values):
        return (statistics.fmean(values) if n else math.nan), math.nan, math.nan
    mean, std = mean_std(values)
    half = float(t.ppf(0.5 + level / 2, n - 1)) * std * scale
    return mean, mean - half, mean + half


def paired_interval(gaps: Sequence[float], level: float = 0.95) -> dict[str, float | int]:
    """The t interval of the mean of per-seed paired gaps (arm minus baseline on the same seed), mean ±
    t(level, n - 1) · s / sqrt(n), and how many seeds put the arm ahead, behind or level: {'mean', 'low',
    'high', 'ahead', 'behind', 'level', 'n'}; the bounds are nan below two seeds or when a seed lacks the
    figure."""
    n = len(gaps)
    mean, low, high = _t_interval(gaps, level, 1 / math.sqrt(n) if n else math.nan)
    return {'mean': mean, 'low': low, 'high': high, 'ahead': sum(g > 0 for g in gaps),
            'behind': sum(g < 0 for g in gaps), 'level': sum(g == 0 for g in gaps), 'n': n}


def prediction_interval(gaps: Sequence[float], level: float = 0.95) -> dict[str, float | int]:
    """Where one more seed's gap should land: mean ± t(level, n - 1) · s · sqrt(1 + 1/n) of the per-seed
    gaps (normal, exchangeable seeds), {'mean', 'low', 'high', 'n'}; nan bounds below two seeds or when a seed
    lacks the figure. paired_interval bounds the mean gap, this a single new seed's, which is wider by about
    sqrt(n + 1)."""
    n = len(gaps)
    mean, low, high = _t_interval(gaps, level, math.sqrt(1 + 1 / n) if n else math.nan)
    return {'mean': mean, 'low': low, 'high': high, 'n': n}
