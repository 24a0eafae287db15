"""Statistics for benchmarks/: speed ratios of interleaved pairs and the learning comparison.

Speed: `ratio_summary(tamer_seconds, trl_seconds, target)` reduces the pairs of one setting to
the median ratio and its range; the target counts as met only when every pair is under it.

Learning (`learning_summary(rows, ...)`, one row per seed with both trainers' held-out curves
`[step, train seconds, accuracy]`): the analysis is fixed before any seed runs:

* primary endpoint: each run's mean held-out accuracy over its evaluations in the second half
  of training (steps >= total/2), compared per seed (tamer - TRL) with a paired t-test and an
  equivalence test (TOST) at +-`margin` (default 1 point: 0.01): equivalent when the 90%
  confidence interval of the mean difference lies inside (-margin, +margin);
* the same for the final evaluation;
* steps-to-target and seconds-to-target for a fixed `target` accuracy: medians, how many
  seeds each trainer reaches it first, and an exact two-sided sign test;
* the whole curve, against steps and against training seconds: the mean difference at every
  evaluation point (seconds: on a common grid, each run's accuracy being its last evaluation
  so far), with p-values adjusted for all points at once by a sign-flip permutation test of
  the maximum |t| (Westfall-Young), and the paired t-test of the area under the curve.

Plain Python and numpy; Student's t from the regularized incomplete beta function.
"""

from __future__ import annotations

import math
import statistics

import numpy as np


# ---------------------------------------------------------------------------- distributions
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection; |t| < 1e3)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided sign test: P(a Binomial(n, 1/2) at least as far from n/2 as k)."""
    if n == 0:
        return 1.0
    probs = [math.comb(n, i) / 2.0 ** n for i in range(n + 1)]
    return min(1.0, sum(p for p in probs if p <= probs[k] * (1 + 1e-12)))


# ---------------------------------------------------------------------------- speed
def ratio_summary(tamer_seconds: list[float], trl_seconds: list[float], target: float | None) -> dict:
    """Per-pair ratios tamer / TRL: median, min, max; `target_met` only if the whole range is under `target`."""
    ratios = [a / b for a, b in zip(tamer_seconds, trl_seconds)]
    out = {"ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
           "ratio_max": round(max(ratios), 3), "ratios": [round(r, 3) for r in ratios], "target": target}
    out["target_met"] = None if target is None else max(ratios) <= target
    return out


# ---------------------------------------------------------------------------- paired comparisons
def paired(diffs: list[float], margin: float | None = None, alpha: float = 0.05) -> dict:
    """Mean paired difference, its standard error, a two-sided t-test and, with `margin`, TOST.

    TOST: p = max of the two one-sided p-values (H0: mean <= -margin, H0: mean >= +margin);
    equivalent when p < alpha, i.e. when the (1 - 2 alpha) interval lies inside (-margin, margin).
    """
    n = len(diffs)
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else float("nan")
    se = sd / math.sqrt(n) if n > 1 else float("nan")
    df = n - 1
    out = {"n": n, "mean_diff": mean, "sd": sd, "se": se}
    if n < 2:
        return out
    if se == 0:
        t, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / se
        p = 2 * (1 - t_cdf(abs(t), df))
    half = t_ppf(1 - alpha, df) * se
    out.update({"t": t, "p_two_sided": p, "ci90": [mean - half, mean + half] if alpha == 0.05 else None,
                "above": sum(d > 0 for d in diffs), "below": sum(d < 0 for d in diffs),
                "ties": sum(d == 0 for d in diffs)})
    if margin is not None:
        if se == 0:
            p_tost = 0.0 if abs(mean) < margin else 1.0
        else:
            p_tost = max(1 - t_cdf((mean + margin) / se, df), t_cdf((mean - margin) / se, df))
        out.update({"margin": margin, "p_tost": p_tost, "equivalent": p_tost < alpha,
                    "interval": [mean - half, mean + half], "interval_level": 1 - 2 * alpha})
    return out


def max_t_permutation(diffs: np.ndarray, flips: int = 20000, seed: int = 0) -> dict:
    """Per-point paired t and p-values adjusted over all points (sign flips of whole seeds, max |t|).

    `diffs` (seeds, points): tamer - TRL at each point of the curve. Flipping the sign of a
    seed's whole row keeps the dependence between points; the adjusted p of a point is the
    fraction of flips whose largest |t| over all points reaches that point's |t|.
    """
    diffs = np.asarray(diffs, dtype=float)
    n = diffs.shape[0]

    def tstats(d: np.ndarray) -> np.ndarray:  # (..., seeds, points) -> (..., points)
        sd = d.std(axis=-2, ddof=1)
        mean = d.mean(axis=-2)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = mean / (sd / math.sqrt(n))
        return np.where(sd > 0, t, 0.0)

    observed = tstats(diffs)
    rng = np.random.default_rng(seed)
    exceed = np.zeros(diffs.shape[1])
    for start in range(0, flips, 1000):
        signs = rng.choice([-1.0, 1.0], size=(min(1000, flips - start), n, 1))
        peak = np.abs(tstats(signs * diffs[None])).max(axis=-1)  # (flips,)
        exceed += (peak[:, None] >= np.abs(observed)[None, :] - 1e-12).sum(0)
    adjusted = (exceed + 1) / (flips + 1)
    return {"mean_diff": diffs.mean(0).tolist(), "t": observed.tolist(), "p_adjusted": adjusted.tolist(),
            "p_global": float(adjusted.min()), "flips": flips}


# ---------------------------------------------------------------------------- learning curves
def first_reach(curve: list, target: float, index: int) -> float | None:
    """curve[index] (0: step, 1: seconds) of the first evaluation at or above `target`, else None."""
    return next((point[index] for point in curve if point[2] >= target), None)


def accuracy_at(curve: list, seconds: float) -> float:
    """The accuracy of the last evaluation at or before `seconds` of training."""
    return max((p for p in curve if p[1] <= seconds), key=lambda p: p[1])[2]


def _reach(rows: list[dict], target: float, index: int, horizon: float) -> dict:
    """Steps (index 0) or seconds (1) to `target`; runs that never reach it count as `horizon` (censored)."""
    pairs = [(first_reach(r["tamer_curve"], target, index), first_reach(r["trl_curve"], target, index)) for r in rows]
    filled = [(horizon if a is None else a, horizon if b is None else b) for a, b in pairs]
    tamer_first = sum(a < b for a, b in filled)
    trl_first = sum(b < a for a, b in filled)
    return {"tamer": [a for a, _ in pairs], "trl": [b for _, b in pairs],
            "tamer_median": statistics.median(a for a, _ in filled),
            "trl_median": statistics.median(b for _, b in filled),
            "tamer_never": sum(a is None for a, _ in pairs), "trl_never": sum(b is None for _, b in pairs),
            "tamer_first": tamer_first, "trl_first": trl_first, "ties": len(pairs) - tamer_first - trl_first,
            "sign_test_p": binom_two_sided(tamer_first, tamer_first + trl_first), "censored_at": horizon}


def plateau(curve: list, total_steps: int) -> float:
    """Mean accuracy of the evaluations at steps >= total_steps / 2."""
    return statistics.fmean(p[2] for p in curve if p[0] >= total_steps / 2)


def learning_summary(rows: list[dict], *, seeds: list[int], target: float, margin: float = 0.01,
                     grid_points: int = 40, flips: int = 20000) -> dict:
    """The pre-registered comparison over `rows` (one per seed); refuses to conclude on missing seeds."""
    done = sorted(r["seed"] for r in rows)
    missing = sorted(set(seeds) - set(done))
    out: dict = {"seeds_planned": len(seeds), "seeds_done": len(done), "missing_seeds": missing,
                 "complete": not missing, "target_accuracy": target, "margin": margin}
    rows = sorted((r for r in rows if r["seed"] in set(seeds)), key=lambda r: r["seed"])
    if len(rows) < 2:
        return out
    total = rows[0]["steps"]
    out["plateau"] = paired([plateau(r["tamer_curve"], total) - plateau(r["trl_curve"], total) for r in rows], margin)
    out["final"] = paired([r["tamer_curve"][-1][2] - r["trl_curve"][-1][2] for r in rows], margin)
    out["steps_to_target"] = _reach(rows, target, 0, horizon=total + rows[0]["eval_every"])
    horizon = max(max(r["tamer_curve"][-1][1], r["trl_curve"][-1][1]) for r in rows) * 1.01
    out["seconds_to_target"] = _reach(rows, target, 1, horizon=horizon)
    steps = [p[0] for p in rows[0]["tamer_curve"]]
    by_step = np.array([[a[2] - b[2] for a, b in zip(r["tamer_curve"], r["trl_curve"])] for r in rows])
    out["curve_by_step"] = {"steps": steps, **max_t_permutation(by_step, flips)}
    out["auc_by_step"] = paired(by_step.mean(1).tolist(), margin)
    # Seconds: a grid up to the shorter run's end in every seed (both curves defined there).
    end = min(min(r["tamer_curve"][-1][1], r["trl_curve"][-1][1]) for r in rows)
    grid = [end * i / grid_points for i in range(grid_points + 1)]
    by_time = np.array([[accuracy_at(r["tamer_curve"], t) - accuracy_at(r["trl_curve"], t) for t in grid]
                        for r in rows])
    out["curve_by_seconds"] = {"seconds": [round(t, 3) for t in grid], **max_t_permutation(by_time, flips)}
    out["auc_by_seconds"] = paired(by_time.mean(1).tolist(), margin)
    return out
