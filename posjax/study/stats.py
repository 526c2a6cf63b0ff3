"""Statistics of the report: mean ± std over seeds, paired comparisons with a t-interval, and
the steps a curve needs to reach a target."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import stats as scipy_stats


def mean_std(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample std (ddof 1; nan for one value) and n of the finite values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if len(v) == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else float("nan"),
            "n": int(len(v))}


def paired(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> dict[str, object]:
    """a − b over the seeds both have: per-seed differences, their mean, the ``level``
    t-interval (mean ± t_{n−1} · s/√n) and n; ``distinguishable`` is False when the interval
    covers 0 (and None when n < 2: no interval)."""
    seeds = sorted(s for s in set(a) & set(b)
                   if a[s] is not None and b[s] is not None
                   and np.isfinite(a[s]) and np.isfinite(b[s]))
    diffs = [float(a[s] - b[s]) for s in seeds]
    n = len(diffs)
    out: dict[str, object] = {"seeds": seeds, "differences": diffs, "n": n,
                              "mean": float(np.mean(diffs)) if n else float("nan"),
                              "low": float("nan"), "high": float("nan"), "distinguishable": None}
    if n >= 2:
        sd = float(np.std(diffs, ddof=1))
        half = float(scipy_stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
        low, high = out["mean"] - half, out["mean"] + half
        out.update(low=low, high=high, distinguishable=not (low <= 0.0 <= high))
    return out


def steps_to_reach(steps: Sequence[float], values: Sequence[float], target: float) -> float | None:
    """The first step at which a decreasing curve reaches ``target`` (linear between its
    points; the first point counts as reached when it is already at or below); None if never."""
    pts = [(float(s), float(v)) for s, v in zip(steps, values) if np.isfinite(v)]
    for i, (s, v) in enumerate(pts):
        if v <= target:
            if i == 0:
                return s
            s0, v0 = pts[i - 1]
            return s0 + (s - s0) * (v0 - target) / (v0 - v) if v0 != v else s
    return None
