"""The study report, built only from ``results/`` (so grids run on several machines merge by
copying their ``results/`` folders together): ``report.md``, ``report.json`` and PNGs.

Claims come from ``study.json``'s ``claims`` (the study config's ``study.claims``), each
decided from the numbers by one rule (``CLAIM_RULES``), never written by hand.
"""
from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Any

import numpy as np

from posjax.study import cost as cost_lib
from posjax.study import stats
from posjax.study import analysis
from posjax.study.analysis import HEAD_RULE

VERDICTS = ("reproduced", "contradicted", "effect smaller than the paper's (excluded)",
            "not shown", "undecidable at this scale")
ALPHA = 0.05   # family-wise, Holm across the claims that can be decided
CLAIM_RULES = {
    "paired": ("one-sided paired t-test of (a − b) over seeds in the claimed direction, Holm-"
               "adjusted across claims: p ≤ 0.05 reproduced; the 95% interval entirely on the "
               "other side: contradicted; else not shown"),
    "same": ("equivalence test (TOST) of |a − b| < the margin written in the config before the "
             "run, Holm-adjusted: p ≤ 0.05 reproduced; the 95% interval entirely outside "
             "±margin: contradicted; else undecidable at this scale (interval wider than the "
             "margin)"),
    "convergence": ("per seed, the steps a needs to reach b's final held-out loss of that seed "
                    "over the steps b needs; one-sided t-test of mean ratio < `at_most`, Holm-"
                    "adjusted: reproduced; the 95% interval of the mean ratio above `at_most` "
                    "but below 1: effect smaller than the paper's (excluded); at or above 1: "
                    "contradicted; else not shown"),
    "gate": ("an MLM claim is decided only when both entries end below the bigram baseline of "
             "the held-out targets, an accuracy claim only when both are above chance, a GLUE "
             "claim only when GLUE ran: else undecidable at this scale"),
}


def load_results(root: pathlib.Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(manifest, one record per manifest cell: its results JSON, else status 'not run')."""
    rdir = root / "results"
    manifest = json.loads((rdir / "study.json").read_text())
    records = []
    for c in manifest["cells"]:
        path = rdir / f"{c['cell']}.json"
        if path.is_file():
            records.append(json.loads(path.read_text()))
        else:
            records.append({**c, "status": "pending" if c.get("pending") else "not run",
                            "error": c.get("pending", "")})
    return manifest, records


def read_curve(path: pathlib.Path) -> dict[str, np.ndarray]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    keys = rows[0].keys() if rows else []
    return {k: np.array([float(r[k]) if r[k] != "" else np.nan for r in rows]) for k in keys}


def metric(record: dict[str, Any], path: str) -> float | None:
    """A number from a record by dotted path; ``glue_mean`` = mean GLUE ``score``."""
    if path == "glue_mean":
        scores = [v.get("score") for v in record.get("glue", {}).values()]
        return float(np.mean(scores)) if scores else None
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) else None


def by_name(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["name"], []).append(r)
    return out


def ok(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "ok"]


def seeds_of(records: list[dict[str, Any]], path: str) -> dict[int, float]:
    return {r["seed"]: v for r in ok(records) if (v := metric(r, path)) is not None}


def fmt(s: dict[str, float], digits: int = 4) -> str:
    if not s["n"]:
        return "—"
    std = "" if not np.isfinite(s["std"]) else f" ± {s['std']:.{digits}f}"
    return f"{s['mean']:.{digits}f}{std} (n={s['n']})"


def convergence(root: pathlib.Path, groups: dict[str, list[dict[str, Any]]], base: str
                ) -> dict[str, Any]:
    """Per seed s: the steps each entry needs to reach the baseline's final held-out loss of
    seed s, over the steps the baseline itself needs to reach it (its last evaluation, unless
    its curve dipped below earlier); steps interpolated between evaluations. Per entry: those
    steps and ratios per seed, and the mean ratio over the seeds the two share (None unless the
    entry reached the target in every one of them)."""
    def read(record: dict[str, Any]) -> dict[str, list[float]] | None:
        path = root / "results" / f"{record['cell']}_curve.csv"
        c = read_curve(path) if path.is_file() else {}
        return c if len(c.get("eval_loss", ())) else None

    curves = {r["cell"]: read(r) for records in groups.values() for r in ok(records)}
    targets = {}   # seed -> (the baseline's final loss, the steps it needs to reach it)
    for r in ok(groups.get(base, [])):
        final, c = metric(r, "final.loss"), curves[r["cell"]]
        if final is not None and c is not None:
            targets[r["seed"]] = (final, stats.steps_to_reach(c["step"], c["eval_loss"], final))
    if not targets:
        return {}
    out: dict[str, Any] = {}
    for name, records in groups.items():
        steps, ratios = {}, {}
        for r in ok(records):
            c = curves[r["cell"]]
            if r["seed"] not in targets or c is None:
                continue
            target, base_steps = targets[r["seed"]]
            steps[r["seed"]] = stats.steps_to_reach(c["step"], c["eval_loss"], target)
            if steps[r["seed"]] is not None and base_steps:
                ratios[r["seed"]] = steps[r["seed"]] / base_steps
        reached = [x for x in steps.values() if x is not None]
        out[name] = {"steps": steps, "ratios": ratios,
                     "mean_steps": float(np.mean(reached)) if reached else None,
                     "reached": f"{len(reached)}/{len(steps)}",
                     "ratio": (float(np.mean(list(ratios.values())))
                               if steps and len(ratios) == len(steps) else None)}
    return out


def gate(claim: dict[str, Any], groups: dict[str, list[dict[str, Any]]],
         context: dict[str, Any]) -> str:
    """Why ``claim`` cannot be decided at this scale ('' when it can; ``CLAIM_RULES['gate']``)."""
    if claim.get("rule") == "convergence":
        metrics = ["final.loss"]
    else:
        metrics = [claim["metric"], claim.get("metric_b", claim["metric"])]
    for name, path in zip((claim["a"], claim["b"]), metrics * (2 // len(metrics))):
        if path == "glue_mean" and not context.get("glue_tasks"):
            return "GLUE is off at this scale (no fine-tuning ran)"
        values = list(seeds_of(groups.get(name, []), path).values())
        if not values:
            continue
        mean = float(np.mean(values))
        bigram = context.get("baselines", {}).get("bigram")
        if "loss" in path and bigram is not None and not mean < bigram:
            return (f"{name} ends at {mean:.3f} nats, not below the bigram baseline "
                    f"({bigram:.3f})")
        chance = context.get("chance")
        if "accuracy" in path and chance is not None and mean <= chance + CHANCE_MARGIN:
            return f"{name} is at chance ({mean:.3f} vs {chance:.3f})"
    return ""


CHANCE_MARGIN = 0.02   # an accuracy within 2 points of chance counts as chance


def measure(claim: dict[str, Any], groups: dict[str, list[dict[str, Any]]],
            conv: dict[str, Any]) -> dict[str, Any]:
    """The claim's effect: the paired (or ratio) mean, its 95% interval, n, and the p-value of
    its rule before correction (nan where it cannot be computed)."""
    kind = claim.get("rule", "paired")
    a, b = claim["a"], claim["b"]
    if kind == "convergence":
        ratios = conv.get(a, {}).get("ratios", {})
        steps = conv.get(a, {}).get("steps", {})
        m = stats.mean_interval(list(ratios.values()))
        missing = [s for s, v in steps.items() if v is None]
        p = stats.one_sided_p(-m["mean"], m["se"], m["n"], -claim.get("at_most", 0.5))
        return {**m, "p": p, "never_reached": missing, "per_seed": ratios}
    metric_b = claim.get("metric_b", claim["metric"])
    d = stats.paired(seeds_of(groups.get(a, []), claim["metric"]),
                     seeds_of(groups.get(b, []), metric_b))
    if kind == "same":
        p = (stats.tost(d["mean"], d["se"], d["n"], claim["margin"]) if d["n"] >= 2
             else float("nan"))
    else:
        sign = -1.0 if claim.get("better", "higher") == "lower" else 1.0
        p = stats.one_sided_p(sign * d["mean"], d.get("se", float("nan")), d["n"])
    return {**d, "p": p}


def decide_all(claims: list[dict[str, Any]], groups: dict[str, list[dict[str, Any]]],
               conv: dict[str, Any], context: dict[str, Any]) -> list[dict[str, Any]]:
    """Every claim measured, gated, Holm-corrected across the decidable ones and decided."""
    out = []
    for claim in claims:
        kind = claim.get("rule", "paired")
        row = {**claim, "rule_text": CLAIM_RULES[kind]}
        missing = [n for n in (claim["a"], claim["b"]) if not ok(groups.get(n, []))]
        row["undecidable"] = gate(claim, groups, context)
        if missing:
            row["undecidable"] = f"no finished cells of {', '.join(missing)}"
        row["effect"] = measure(claim, groups, conv)
        out.append(row)
    family = {str(i): r["effect"]["p"] for i, r in enumerate(out) if not r["undecidable"]}
    adjusted = stats.holm(family, ALPHA)
    for i, row in enumerate(out):
        row["holm"] = adjusted.get(str(i), {"p": row["effect"]["p"],
                                            "p_adjusted": float("nan"), "rejected": False})
        row["verdict"] = verdict(row)
        row["measured"] = _measured(row)
    return out


def verdict(row: dict[str, Any]) -> str:
    """One claim's outcome from its effect and Holm-adjusted p (``CLAIM_RULES``)."""
    if row["undecidable"]:
        return "undecidable at this scale"
    e, kind = row["effect"], row.get("rule", "paired")
    if row["holm"]["rejected"]:
        return "reproduced"
    if e["n"] < 2 or not np.isfinite(e["low"]):
        return "not shown"
    if kind == "same":
        m = row["margin"]
        if e["low"] > m or e["high"] < -m:
            return "contradicted"
        return "undecidable at this scale"
    if kind == "convergence":
        if e["low"] >= 1.0:
            return "contradicted"
        if e["low"] > row.get("at_most", 0.5) and e["high"] < 1.0:
            return "effect smaller than the paper's (excluded)"
        return "not shown"
    sign = -1.0 if row.get("better", "higher") == "lower" else 1.0
    if max(sign * e["low"], sign * e["high"]) < 0:
        return "contradicted"
    return "not shown"


def decide(claim: dict[str, Any], groups: dict[str, list[dict[str, Any]]],
           conv: dict[str, Any], context: dict[str, Any] | None = None) -> dict[str, Any]:
    """One claim decided on its own (a family of one: no correction)."""
    return decide_all([claim], groups, conv, context or {})[0]


def _measured(row: dict[str, Any]) -> str:
    e = row["effect"]
    if row.get("rule") == "convergence":
        what = f"steps ratio {row['a']} / {row['b']}"
        if e.get("never_reached"):
            what += f" ({row['a']} never reached the target in seeds {e['never_reached']})"
    else:
        what = row["metric"] + (f" vs {row['metric_b']}" if row.get("metric_b") else "")
        what += f": {row['a']} − {row['b']}"
    if e["n"] < 2:
        return f"{what} = {e['mean']:+.4f} (n = {e['n']}: no interval)"
    margin = f", margin ±{row['margin']:g}" if row.get("rule") == "same" else ""
    return (f"{what} = {e['mean']:+.4f} [{e['low']:+.4f}, {e['high']:+.4f}] "
            f"(n={e['n']}{margin})")


def best_rate(scores: dict[float, float | None], better: str) -> float | None:
    """The rate with the best finite sweep score (``better``: 'lower' or 'higher'); None when
    no score is finite."""
    finite = {r: v for r, v in scores.items() if v is not None and np.isfinite(v)}
    if not finite:
        return None
    return (min if better == "lower" else max)(finite, key=finite.get)


def select(records: list[dict[str, Any]], sweep: dict[str, Any] | None
           ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[float, dict[str, Any]]],
                      dict[str, float]]:
    """(groups, sweeps, rates): per entry the records its statistics use (the seeds 2.. run at
    its chosen rate, and the sweep cell at that rate as seed 1), its sweep cells by rate, and
    the chosen rate (the rate its later seeds ran at, else the sweep's best so far)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    sweeps: dict[str, dict[float, dict[str, Any]]] = {}
    for r in records:
        if r.get("sweep"):
            sweeps.setdefault(r["name"], {})[float(r["learning_rate"])] = r
        else:
            groups.setdefault(r["name"], []).append(r)
    rates: dict[str, float] = {}
    for name, by_rate in sweeps.items():
        ran = [r.get("learning_rate") for r in ok(groups.get(name, []))]
        scores = {rate: metric(r, sweep["metric"]) for rate, r in by_rate.items()
                  if r.get("status") == "ok"} if sweep else {}
        if ran and ran[0] is not None:
            rates[name] = float(ran[0])
        elif (best := best_rate(scores, sweep["better"]) if sweep else None) is not None:
            rates[name] = best
        if name in rates and rates[name] in by_rate:
            groups[name] = [by_rate[rates[name]]] + groups.get(name, [])
        groups.setdefault(name, [])
    return groups, sweeps, rates


# ----------------------------------------------------------------------------- plots


def entry_styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """A colour, marker and line style per entry, every entry distinguishable from every
    other (20 colours; marker and dash cycle on their own periods)."""
    from posjax.plots import pyplot

    colours = pyplot().get_cmap("tab20").colors
    markers = "os^Dv<>pXh*"
    dashes = ["-", "--", "-.", ":"]
    return {n: {"color": colours[(2 * i) % 20 + (i // 10) % 2], "marker": markers[i % 11],
                "linestyle": dashes[i % 4]} for i, n in enumerate(names)}


def plot_curves(curves_of: dict[str, list[dict[str, np.ndarray]]], out: pathlib.Path,
                keys: tuple[str, ...], title: str = "") -> pathlib.Path | None:
    """Curves of every entry: mean over seeds and a min–max band; each entry its own colour,
    marker and line style; the legend outside the axes."""
    from posjax.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys) + 2.5, 4), squeeze=False)
    styles = entry_styles(list(curves_of))
    drawn = False
    for name, curves in curves_of.items():
        for ax, key in zip(axes[0], keys):
            series = [(c["step"][np.isfinite(c.get(key, np.array([np.nan])))],
                       c[key][np.isfinite(c[key])]) for c in curves if key in c]
            series = [x for x in series if len(x[0])]
            if not series:
                continue
            steps = series[0][0]
            same = [v for st, v in series if len(st) == len(steps) and np.all(st == steps)]
            stack = np.stack(same)
            style = styles[name]
            ax.plot(steps, stack.mean(0), markersize=4, markevery=max(1, len(steps) // 8),
                    label=f"{name} (n={len(same)})", **style)
            ax.fill_between(steps, stack.min(0), stack.max(0), alpha=0.12, color=style["color"])
            ax.set_xlabel("step")
            ax.set_ylabel(key.removeprefix("eval_").replace("_", " "))
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (5.5 * len(keys) + 2.5), 1))
    save_figure(fig, out)
    return out


def plot_terms(terms: dict[str, np.ndarray], out: pathlib.Path) -> pathlib.Path:
    from posjax.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(terms), figsize=(3.2 * len(terms), 3.2))
    for ax, (name, m) in zip(np.atleast_1d(axes), terms.items()):
        im = ax.imshow(m, cmap="viridis")
        ax.set_title(name)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("BERT-A layer 1: correlation terms (TUPE Fig. 2)")
    fig.tight_layout()
    save_figure(fig, out)
    return out


def plot_heads(maps: np.ndarray, labels: list[str], title: str, out: pathlib.Path) -> pathlib.Path:
    from posjax.plots import pyplot, save_figure

    plt = pyplot()
    cols = min(len(maps), 4)
    rows = math.ceil(len(maps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(maps):
            ax.imshow(maps[i], cmap="viridis")
            ax.set_title(f"head {i}: {labels[i]}", fontsize=9)
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, out)
    return out


def plot_similarity(sim: np.ndarray, out: pathlib.Path) -> pathlib.Path:
    from posjax.plots import pyplot, save_figure

    plt = pyplot()
    gh, gw = sim.shape[:2]
    fig, axes = plt.subplots(gh, gw, figsize=(gw, gh))
    for i in range(gh):
        for j in range(gw):
            ax = axes[i][j]
            ax.imshow(sim[i, j], vmin=-1, vmax=1, cmap="viridis")
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("cosine similarity of learned position embeddings (ViT Fig. 7)")
    save_figure(fig, out)
    return out


# ----------------------------------------------------------------------------- report


def _cost(root: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per entry cost, how it was measured) from ``results/cost.json`` (empty if missing)."""
    path = cost_lib.cost_file(root)
    if not path.is_file():
        return {}, {}
    measured = json.loads(path.read_text())
    entries = measured.pop("entries")
    return entries, measured


def _cost_lines(rep: dict[str, Any], base: str) -> list[str]:
    lines = ["", f"## Cost (ratios to {base}, measured side by side in one process)", ""]
    how = rep.get("cost_measurement")
    if not how:
        return lines + ["Not measured yet: `python -m posjax.study --config ... --workdir ... "
                        "--cost` (the grid measures it once after its cells)."]
    lines += ["| entry | step time (ms) | time ratio (min–max over rounds) | peak step memory "
              "(MiB) | memory ratio | params |", "|---|---|---|---|---|---|"]
    for name, c in rep["cost"].items():
        if "error" in c:
            lines.append(f"| {name} | failed: {c['error'][:120]} | | | | |")
            continue
        lines.append(f"| {name} | {1e3 * c['step_time_s']:.1f} | {c['time_ratio']:.2f} "
                     f"({c['time_ratio_min']:.2f}–{c['time_ratio_max']:.2f}) | "
                     f"{c['peak_bytes'] / 2**20:.1f} | {c['memory_ratio']:.2f} | "
                     f"{c['params']:,} |")
    load = ", ".join(f"{x:.2f}" for x in how["load_average_before"])
    load_after = ", ".join(f"{x:.2f}" for x in how["load_average_after"])
    return lines + ["", f"Each entry's own train step (forward, backward, optimizer update) at "
                    f"the study's batch, {how['rounds']} rounds × {how['steps_per_round']} "
                    f"steps, entries in a rotated order each round; the ratio is the median "
                    f"over rounds of entry / {base} in the same round. CPU: {how['cpu']} "
                    f"({how['cpus']} cores); load average {load} before, {load_after} after. "
                    "Peak step memory: XLA's sizes of that compiled step (temporaries + "
                    "arguments: the train state and the batch)."]


def build(root: pathlib.Path) -> dict[str, Any]:
    """Write report.md, report.json and the PNGs into ``root``; return the report dict."""
    root = pathlib.Path(root)
    manifest, records = load_results(root)
    order = [e["name"] for e in manifest["entries"]]
    groups, sweeps, rates = select(records, manifest.get("sweep"))
    groups = {n: groups[n] for n in sorted(groups, key=lambda n: order.index(n)
                                           if n in order else len(order))}
    base, floor = manifest["baseline"], manifest.get("floor", "")
    kind = manifest["kind"]
    primary = (("held_out.1.loss", "held_out.1.accuracy") if kind == "text"
               and manifest.get("sweep") else ("final.loss", "final.accuracy") if kind == "text"
               else ("final.accuracy", "final.loss"))
    rep: dict[str, Any] = {"kind": kind, "baseline": base, "floor": floor, "primary": primary,
                           "cells": [], "table": {}, "paired": {}, "cost": {}, "figures": []}
    for r in records:
        rep["cells"].append({k: r.get(k) for k in ("cell", "name", "seed", "scheme", "status",
                                                   "error", "stage_errors", "learning_rate")})
    rep["baselines"] = _baselines(root)
    context = {"baselines": rep["baselines"] or {}, "glue_tasks": manifest.get("glue_tasks", [
        "unknown"]), "chance": manifest.get("chance")}
    for name, rs in groups.items():
        row = {m: stats.mean_std(list(seeds_of(rs, m).values())) for m in primary}
        row["status"] = {st: sum(r["status"] == st for r in rs)
                         for st in ("ok", "failed", "not run", "pending")}
        rep["table"][name] = row
        rep["paired"][name] = {}
        for other in (base, floor):
            if other and other != name and other in groups:
                rep["paired"][name][other] = {
                    m: stats.paired(seeds_of(rs, m), seeds_of(groups[other], m))
                    for m in primary}
    rep["floor_verdicts"] = _floor_verdicts(rep, primary[0], floor,
                                            better="lower" if "loss" in primary[0] else "higher")
    if manifest.get("sweep"):
        rep["sweep"] = _sweep_table(sweeps, rates, manifest["sweep"])
    rep["movement"] = _movement(groups)
    rep["cost"], rep["cost_measurement"] = _cost(root)
    rep["time"] = _times({**groups, **{f"{n} (sweep)": list(v.values())
                                       for n, v in sweeps.items()}})
    if kind == "text":
        rep["convergence"] = convergence(root, groups, base)
        rep["glue"] = _glue(groups)
        rep["extrapolation"] = _nested(groups, "held_out", "loss")
        rep["synthetic"] = {t: _nested(groups, f"synthetic.{t}", "accuracy")
                            for t in _keys(groups, "synthetic")}
    else:
        rep["transfer"] = _transfer(groups)
    rep["claims"] = decide_all(list(manifest.get("claims", [])), groups,
                               rep.get("convergence", {}), context)
    _figures(root, groups, rep, kind)
    (root / "report.json").write_text(json.dumps(rep, indent=1, default=_plain))
    (root / "report.md").write_text(markdown(manifest, rep))
    return rep


def _baselines(root: pathlib.Path) -> dict[str, Any] | None:
    path = root / "results" / "baselines.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _floor_verdicts(rep: dict[str, Any], m: str, floor: str, better: str) -> dict[str, Any]:
    """Per entry: does it help beyond the floor (NoPE)? One-sided paired tests of entry −
    floor in the better direction, Holm-adjusted across the entries."""
    if not floor:
        return {}
    sign = -1.0 if better == "lower" else 1.0
    tests = {}
    for name, others in rep["paired"].items():
        d = others.get(floor, {}).get(m)
        if d is not None:
            tests[name] = stats.one_sided_p(sign * d["mean"], d.get("se", float("nan")), d["n"])
    adjusted = stats.holm(tests, ALPHA)
    out = {}
    for name, a in adjusted.items():
        d = rep["paired"][name][floor][m]
        worse = d["n"] >= 2 and (d["low"] > 0 if sign < 0 else d["high"] < 0)
        out[name] = {**a, "verdict": (
            f"undecidable: {d['n']} paired seed{'s' * (d['n'] != 1)} (a test needs 2)"
            if d["n"] < 2 else "helps beyond NoPE" if a["rejected"] else
            "worse than NoPE" if worse else "not shown beyond NoPE")}
    return out


def _sweep_table(sweeps: dict[str, dict[float, dict[str, Any]]], rates: dict[str, float],
                 sweep: dict[str, Any]) -> dict[str, Any]:
    grid = sorted(float(r) for r in sweep["learning_rates"])
    out = {}
    for name, by_rate in sweeps.items():
        values = {}
        for rate in grid:
            r = by_rate.get(rate)
            values[f"{rate:g}"] = (None if r is None else metric(r, sweep["metric"])
                                   if r.get("status") == "ok" else "failed")
        chosen = rates.get(name)
        edge = chosen is not None and chosen in (grid[0], grid[-1])
        out[name] = {"values": values, "chosen": chosen, "at_edge": edge}
    return {"metric": sweep["metric"], "rates": [f"{r:g}" for r in grid], "entries": out}


def _movement(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per entry and positional parameter group (the path without its layer): the median over
    seeds and layers of the relative change and the largest absolute change."""
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        acc: dict[str, dict[str, list[float]]] = {}
        for r in ok(rs):
            for path, v in (r.get("position_movement") or {}).items():
                parts = [q.strip("[]'") for q in path.replace(".value", "").split("][")]
                group = "/".join(q for q in parts if not q.startswith("layer_")
                                 and q not in ("encoder", "params"))
                slot = acc.setdefault(group, {"relative": [], "max_abs_change": []})
                slot["relative"].append(v["relative"])
                slot["max_abs_change"].append(v["max_abs_change"])
        if acc:
            out[name] = {g: {"relative": _nanmedian(v["relative"]),
                             "max_abs_change": float(np.max(v["max_abs_change"]))}
                         for g, v in acc.items()}
    return out


def _nanmedian(xs: list[float]) -> float | None:
    finite = [x for x in xs if x is not None and np.isfinite(x)]
    return float(np.median(finite)) if finite else None


def _plain(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return str(x)


def _keys(groups: dict[str, list[dict[str, Any]]], field: str) -> list[str]:
    return sorted({k for rs in groups.values() for r in ok(rs) for k in r.get(field, {})})


def _times(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Where the grid's time went, as run (machine load included): per entry the median over
    its finished cells of the wall time, the training part (main run and its evals) and each
    follow-up stage; and the sum of all cells' wall times."""
    def median(xs: list[float]) -> float | None:
        return float(np.median(xs)) if xs else None

    entries: dict[str, Any] = {}
    total = 0.0
    for name, rs in groups.items():
        done = [r for r in ok(rs) if _number(r.get("wall_s"))]
        total += sum(r["wall_s"] for r in done)
        stages = sorted({k for r in done for k in r.get("stage_s", {})})
        entries[name] = {"cells": len(done),
                         "wall_s": median([r["wall_s"] for r in done]),
                         "train_s": median([r["train_s"] for r in done if "train_s" in r]),
                         "stage_s": {k: median([r["stage_s"][k] for r in done
                                                if k in r.get("stage_s", {})]) for k in stages}}
    return {"sum_wall_s": total, "entries": entries}


def _glue(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    tasks = _keys(groups, "glue")
    return {name: {t: stats.mean_std(list(seeds_of(rs, f"glue.{t}.score").values()))
                   for t in tasks} for name, rs in groups.items()}


def _nested(groups: dict[str, list[dict[str, Any]]], field: str, key: str) -> dict[str, Any]:
    """{entry: {factor: mean_std of key, or the reason}} of per-length results."""
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        entry: dict[str, Any] = {}
        for r in ok(rs):
            node: Any = r
            for part in field.split("."):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            for f, v in (node or {}).items():
                if "reason" in v:
                    entry[f] = {"reason": v["reason"], "length": v["length"]}
                elif key in v:
                    entry.setdefault(f, {"values": [], "length": v["length"],
                                         "extended": bool(v.get("extended"))})
                    entry[f].setdefault("values", []).append(v[key])
        for f, v in entry.items():
            if "values" in v:
                v.update(stats.mean_std(v.pop("values")))
        if entry:
            out[name] = entry
    return out


def _transfer(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rs in groups.items():
        entry: dict[str, Any] = {}
        for r in ok(rs):
            for size, methods in r.get("transfer", {}).items():
                for method, v in methods.items():
                    entry.setdefault(f"{size}px {method}", []).append(v.get("accuracy"))
        if entry:
            out[name] = {k: stats.mean_std(v) for k, v in entry.items()}
    return out


def read_analysis(root: pathlib.Path, cell: str) -> dict[str, np.ndarray] | None:
    """``results/<cell>_analysis.json`` (or the .npz of earlier versions) as arrays."""
    path = root / "results" / f"{cell}_analysis.json"
    if path.is_file():
        return {k: np.asarray(v) for k, v in json.loads(path.read_text()).items()}
    path = path.with_suffix(".npz")
    if path.is_file():
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    return None


def _figures(root: pathlib.Path, groups: dict[str, list[dict[str, Any]]], rep: dict[str, Any],
             kind: str) -> None:
    def curves(suffix: str) -> dict[str, list[dict[str, np.ndarray]]]:
        out: dict[str, list[dict[str, np.ndarray]]] = {}
        for name, rs in groups.items():
            for r in ok(rs):
                path = root / "results" / f"{r['cell']}{suffix}_curve.csv"
                if path.is_file():
                    out.setdefault(name, []).append(read_curve(path))
        return out

    keys = ("eval_loss", "eval_accuracy")
    if (p := plot_curves(curves(""), root / "curves.png", keys,
                         "held-out curves (mean over seeds, min–max band)")) is not None:
        rep["figures"].append(p.name)
    for task in rep.get("synthetic", {}):
        if (p := plot_curves(curves(f"+synth_{task}"), root / f"synthetic_{task}.png",
                             ("train_loss", "eval_accuracy"),
                             f"synthetic task {task}: learning curves")) is not None:
            rep["figures"].append(p.name)
    for rs in groups.values():
        for r in ok(rs):
            data = read_analysis(root, r["cell"])
            if data is None:
                continue
            terms = {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith("bert_terms/")}
            if terms:
                rep["figures"].append(plot_terms(terms, root / f"tupe_terms_{r['name']}.png").name)
            if "tupe_maps" in data:
                labels = [str(x) for x in data["tupe_labels"]]
                rep.setdefault("head_labels", {})[r["name"]] = labels
                rep["figures"].append(plot_heads(
                    data["tupe_maps"], labels, f"{r['name']}: positional attention per head "
                    f"(rule: {HEAD_RULE})", root / f"tupe_heads_{r['name']}.png").name)
            if "vit_similarity" in data:
                rep.setdefault("layout", {}).setdefault(r["name"], {})[r["cell"]] = \
                    analysis.layout_scores(data["vit_similarity"])
                if r["seed"] == min(x["seed"] for x in ok(rs)):   # one map per entry
                    rep["figures"].append(plot_similarity(
                        data["vit_similarity"],
                        root / f"position_similarity_{r['name']}.png").name)


def _interval(p: dict[str, Any]) -> str:
    if p["n"] < 2:
        return f"{p['mean']:+.4f} (n = {p['n']}: no interval)"
    return f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]"


def markdown(manifest: dict[str, Any], rep: dict[str, Any]) -> str:
    base, floor, m = rep["baseline"], rep.get("floor"), rep["primary"][0]
    lines = [f"# {manifest.get('title') or manifest['kind'] + ' study'}", "",
             f"Baseline: `{base}`" + (f"; floor: `{floor}` (no positions)" if floor else "")
             + ". Built from `results/` only. Mean ± sample std over seeds (n = finished "
             "seeds); intervals are 95% paired t-intervals over seeds.", ""]
    b = rep.get("baselines")
    if b:
        lines += ["## Baselines of the held-out targets", "",
                  f"The same {b['num_predictions']:,} masked targets every model is scored on "
                  f"(held-out split: {b['held_out_tokens']:,} tokens; fitted on the "
                  f"{b['train_tokens']:,} training tokens, smoothing chosen to minimise the "
                  "cross-entropy, so the strongest of its kind):", "",
                  "| baseline | cross-entropy (nats) | perplexity |", "|---|---|---|",
                  f"| unigram | {b['unigram']:.4f} | {b['unigram_perplexity']:.2f} |",
                  f"| bigram (the true previous token) | {b['bigram']:.4f} | "
                  f"{b['bigram_perplexity']:.2f} |", ""]
    if rep.get("sweep"):
        sw = rep["sweep"]
        lines += ["## Learning-rate sweep (seed 1)", "",
                  f"{sw['metric']} at each peak rate; seeds 2.. ran at the chosen rate (the "
                  "sweep cell at that rate is the entry's seed 1).", "",
                  "| entry | " + " | ".join(sw["rates"]) + " | chosen |",
                  "|---" * (len(sw["rates"]) + 2) + "|"]
        for name, e in sw["entries"].items():
            vals = [("—" if v is None else v if isinstance(v, str) else f"{v:.4f}")
                    for v in e["values"].values()]
            chosen = "—" if e["chosen"] is None else f"{e['chosen']:g}" + (
                " (edge of the grid)" if e["at_edge"] else "")
            lines.append(f"| {name} | " + " | ".join(vals) + f" | {chosen} |")
        lines.append("")
    metrics_ = list(rep["primary"])
    lines += ["## Final held-out metrics", "",
              "| entry | " + " | ".join(metrics_) + (" | below bigram |" if b else " |"),
              "|---" * (len(metrics_) + 1 + bool(b)) + "|"]
    for name, row in rep["table"].items():
        gate_cell = ""
        if b:
            mean = row[metrics_[0]]["mean"]
            gate_cell = " | " + ("—" if not np.isfinite(mean) else
                                 "yes" if mean < b["bigram"] else "**no**")
        lines.append(f"| {name} | " + " | ".join(fmt(row[x]) for x in metrics_)
                     + gate_cell + " |")
    lines += ["", f"## {m}: each entry against {base}"
              + (f" and against {floor}" if floor else ""), "",
              "Paired per seed (entry − other): mean and 95% t-interval."
              + (f" The last column: one-sided test that the entry beats {floor}, Holm-"
                 "adjusted across entries: a scheme helps only beyond no positions at all."
                 if floor else ""), "",
              f"| entry | − {base} | n |" + (f" − {floor} | n | beyond {floor} (p, Holm) |"
                                             if floor else ""),
              "|---|---|---|" + ("---|---|---|" if floor else "")]
    for name, others in rep["paired"].items():
        cols = []
        for other in (base, floor) if floor else (base,):
            p = others.get(other, {}).get(m)
            cols += ["—", "—"] if p is None else [_interval(p), str(p["n"])]
        if floor:
            v = rep["floor_verdicts"].get(name)
            cols.append("—" if v is None else f"{v['verdict']} ({v['p_adjusted']:.3g})")
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    if rep.get("movement"):
        lines += ["", "## How far the positional parameters moved", "",
                  "Per positional parameter (layers pooled): median over seeds and layers of "
                  "‖θ_end − θ_init‖ / ‖θ_init‖, and the largest |θ_end − θ_init| of any "
                  "element (for an additive logit bias: the most any logit moved).", "",
                  "| entry | parameter | relative change | max abs change |", "|---|---|---|---|"]
        for name, groups_ in rep["movement"].items():
            for g, v in groups_.items():
                rel = "— (zero init)" if v["relative"] is None else f"{v['relative']:.3f}"
                lines.append(f"| {name} | {g} | {rel} | {v['max_abs_change']:.4f} |")
    if rep.get("convergence"):
        conv = rep["convergence"]
        lines += ["", "## Convergence (TUPE: BERT-A's final loss at 30% of its steps)", "",
                  f"Target, per seed: {base}'s final held-out loss of that seed; ratio: the "
                  f"steps an entry needs to reach it over the steps {base} needs; mean over "
                  "seeds with its 95% t-interval.", "",
                  "| entry | seeds reaching | ratio per seed | mean ratio [95% interval] |",
                  "|---|---|---|---|"]
        for name, v in conv.items():
            per_seed = ", ".join(f"s{seed}: {x:.2f}" for seed, x in sorted(v["ratios"].items()))
            mi = stats.mean_interval(list(v["ratios"].values()))
            lines.append(f"| {name} | {v['reached']} | {per_seed or '—'} | "
                         f"{_interval(mi).replace('+', '')} |")
    if rep.get("glue"):
        tasks = sorted({t for v in rep["glue"].values() for t in v})
        if tasks:
            lines += ["", "## GLUE dev (score: the task's official metric mean) from each "
                      "pretrained encoder", "", "| entry | " + " | ".join(tasks) + " |",
                      "|---" * (len(tasks) + 1) + "|"]
            for name, v in rep["glue"].items():
                lines.append(f"| {name} | " + " | ".join(fmt(v[t], 3) for t in tasks) + " |")
    if rep.get("extrapolation"):
        lines += _length_table("Length extrapolation (held-out MLM loss of the same targets "
                               "with the same masks inside windows of f·L)",
                               rep["extrapolation"])
    for task, table in rep.get("synthetic", {}).items():
        lines += _length_table(f"Synthetic task `{task}` (held-out accuracy)", table)
    if rep.get("transfer"):
        cols = sorted({k for v in rep["transfer"].values() for k in v})
        lines += ["", "## Resolution transfer (test accuracy)", "",
                  "| entry | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, v in rep["transfer"].items():
            lines.append(f"| {name} | " + " | ".join(fmt(v[c]) if c in v else "—"
                                                     for c in cols) + " |")
    if rep.get("layout"):
        lines += ["", "## Is the learned table two-dimensional? (similarity maps)", "",
                  "Per seed: Spearman's ρ between the cosine similarity of two patches' "
                  "position rows and their grid distance (−1: neighbours alike, 0: no layout), "
                  "and the share of patches whose most similar patch is a grid neighbour "
                  "(chance in brackets).", "", "| cell | ρ(similarity, distance) | nearest "
                  "is a neighbour |", "|---|---|---|"]
        for cells in rep["layout"].values():
            for cell, v in sorted(cells.items()):
                lines.append(f"| {cell} | {v['distance_correlation']:+.3f} | "
                             f"{v['nearest_is_neighbour']:.2f} ({v['by_chance']:.2f}) |")
    if rep.get("head_labels"):
        lines += ["", "## TUPE positional heads", "", f"Rule: {HEAD_RULE}.", ""]
        for name, labels in rep["head_labels"].items():
            lines.append(f"- {name}: " + ", ".join(f"head {i} {l}" for i, l in enumerate(labels)))
    lines += _cost_lines(rep, base)
    lines += ["", "## Claims", "", "| paper | claim | measured (95% interval) | the paper's "
              "effect | p (Holm) | verdict |", "|---|---|---|---|---|---|"]
    for c in rep["claims"]:
        h = c["holm"]
        pv = ("—" if not np.isfinite(h["p"]) else f"{h['p']:.3g}" + (
            f" ({h['p_adjusted']:.3g})" if np.isfinite(h["p_adjusted"]) else ""))
        why = f": {c['undecidable']}" if c["undecidable"] else ""
        lines.append(f"| {c.get('paper', '')} | {c['claim']} | {c['measured']} | "
                     f"{c.get('paper_effect', '—')} | {pv} | {c['verdict']}{why} |")
    lines += ["", "Rules: " + "; ".join(f"**{k}**: {v}" for k, v in CLAIM_RULES.items()), ""]
    lines += _time_lines(rep["time"])
    lines += ["", "## Cells", "", "| cell | scheme | rate | status | note |", "|---|---|---|---|---|"]
    for c in rep["cells"]:
        note = c.get("error") or ""
        if c.get("stage_errors"):
            note += " follow-ups failed: " + "; ".join(f"{k}: {v}"
                                                      for k, v in c["stage_errors"].items())
        rate = "—" if c.get("learning_rate") is None else f"{c['learning_rate']:g}"
        lines.append(f"| {c['cell']} | {c['scheme']} | {rate} | {c['status']} | "
                     f"{note.replace('|', '/').replace(chr(10), ' ')[:300]} |")
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in rep["figures"]]
    return "\n".join(lines) + "\n"


def _time_lines(time: dict[str, Any]) -> list[str]:
    def sec(x: float | None) -> str:
        return "—" if x is None else f"{x:.0f}"

    stages = sorted({k for e in time["entries"].values() for k in e["stage_s"]})
    lines = ["", "## Time per cell (wall seconds as run, machine load included; median over "
             f"finished cells; all cells together {time['sum_wall_s'] / 3600:.2f} h)", "",
             "| " + " | ".join(["entry", "cells", "wall", "training", *stages]) + " |",
             "|---" * (4 + len(stages)) + "|"]
    for name, e in time["entries"].items():
        row = [name, str(e["cells"]), sec(e["wall_s"]), sec(e["train_s"]),
               *(sec(e["stage_s"].get(k)) for k in stages)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _length_table(title: str, table: dict[str, Any]) -> list[str]:
    factors = sorted({f for v in table.values() for f in v}, key=int)
    lines = ["", f"## {title}", "", "Trained at L, evaluated at f·L; * an absolute table read "
             "interpolated to f·L (model.extend_positions='interpolate').", "",
             "| entry | " + " | ".join(f"{f}L" for f in factors) + " |",
             "|---" * (len(factors) + 1) + "|"]
    for name, v in table.items():
        cells = []
        for f in factors:
            e = v.get(f)
            cells.append("—" if e is None else e["reason"] if "reason" in e else
                         fmt(e) + ("*" if e.get("extended") else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
