"""Small statistics shared by the benchmarks: a mean with its 95% confidence interval over seeds."""

from __future__ import annotations

import statistics

# two-sided 95% Student t quantiles by degrees of freedom (2.0 stands in above 15: within 0.13 of the truth)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
_T95 |= {11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13}


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student t interval) of at least two values, e.g. paired gaps by seed."""
    if len(values) < 2:
        raise ValueError(f"a confidence interval needs at least two values, got {len(values)}")
    half = _T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / len(values) ** 0.5
    return statistics.mean(values), half
