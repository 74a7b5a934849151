"""Paired differences between two methods scored on the same samples: mean, 95% interval, and a verdict.

Two KV methods run on the same held-out seeds, so their per-sample scores pair up; the difference of the
pairs cancels what varies from sample to sample (an easy edit is easy for every method), which a comparison
of the two means would leave in. The interval is the normal approximation, ``mean +- 1.96 * sd / sqrt(n)``:
where it holds 0, the benchmark cannot tell the two methods apart on these samples ("tie").
"""

from __future__ import annotations

import math
import statistics

#: Two-sided 95% quantile of the standard normal.
Z95 = 1.96


def paired_difference(first: list[float], second: list[float]) -> dict:
    """``first - second`` sample by sample (the same samples, in the same order).

    Returns:
        ``{"mean", "ci95", "n", "verdict"}``: the mean difference, the half-width of its 95% interval (0 for
        one sample), the number of pairs, and ``"ahead"`` / ``"behind"`` (``first`` better / worse: the whole
        interval above / below 0) or ``"tie"``.
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"paired scores need the same non-zero number of samples, got {len(first)} and {len(second)}")
    diffs = [a - b for a, b in zip(first, second)]
    mean = statistics.fmean(diffs)
    half = Z95 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    verdict = "ahead" if mean - half > 0 else "behind" if mean + half < 0 else "tie"
    return {"mean": round(mean, 4), "ci95": round(half, 4), "n": len(diffs), "verdict": verdict}


__all__ = ["Z95", "paired_difference"]
