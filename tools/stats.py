"""The per-seed statistics every comparison tool reports: mean and sample standard deviation, and the
spread (mean, std, median, min, max) of a figure over seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["mean_std", "spread"]


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
