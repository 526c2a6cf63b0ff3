"""Statistics of the report: mean ± std over seeds, paired comparisons with a t-interval and
one-sided p-values, the equivalence test (TOST), the t-interval of a mean (the convergence
ratio), Holm's correction across claims, and the steps a curve needs to reach a target."""
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
        out.update(mean_interval(diffs, level))
        out["distinguishable"] = not (out["low"] <= 0.0 <= out["high"])
    else:
        out["why"] = f"n = {n}: no interval"
    return out


def mean_interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """The mean of ``values`` with its ``level`` t-interval (mean ± t_{n−1} · s/√n), the
    standard error and n; n < 2: no interval (low/high nan)."""
    v = np.asarray(values, np.float64)
    n = len(v)
    mean = float(v.mean()) if n else float("nan")
    if n < 2:
        return {"mean": mean, "low": float("nan"), "high": float("nan"), "se": float("nan"),
                "n": n}
    se = float(v.std(ddof=1)) / math.sqrt(n)
    half = float(scipy_stats.t.ppf(0.5 + level / 2, n - 1)) * se
    return {"mean": mean, "low": mean - half, "high": mean + half, "se": se, "n": n}


def one_sided_p(mean: float, se: float, n: int, above: float = 0.0) -> float:
    """p of the one-sided t-test of H0: true mean <= ``above`` (small: the mean is above)."""
    if n < 2 or not np.isfinite(se):
        return float("nan")
    if se == 0.0:
        return 0.0 if mean > above else 1.0
    return float(scipy_stats.t.sf((mean - above) / se, n - 1))


def tost(mean: float, se: float, n: int, margin: float) -> float:
    """p of the equivalence test (two one-sided t-tests) of |true mean| < ``margin``: the
    larger of the p-values of H0: mean <= −margin and H0: mean >= +margin."""
    return max(one_sided_p(mean, se, n, -margin), one_sided_p(-mean, se, n, -margin))


def holm(p_values: dict[str, float], alpha: float = 0.05) -> dict[str, dict[str, float]]:
    """Holm's step-down correction: ``{key: {p, p_adjusted, rejected}}`` (nan p-values take no
    part and are never rejected)."""
    finite = sorted((p, k) for k, p in p_values.items() if np.isfinite(p))
    m = len(finite)
    out = {k: {"p": p, "p_adjusted": float("nan"), "rejected": False}
           for k, p in p_values.items()}
    running = 0.0
    for i, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (m - i) * p))
        out[k]["p_adjusted"] = running
        out[k]["rejected"] = running <= alpha
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
