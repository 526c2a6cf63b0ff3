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
from posjax.study.analysis import HEAD_RULE

CLAIM_RULES = {
    "paired": ("the 95% paired t-interval of (a − b) over seeds lies entirely on the claimed "
               "side of 0: reproduced; entirely on the other side: not reproduced; covers 0 or "
               "n < 2: inconclusive"),
    "same": ("the claim is that a and b do not differ: the 95% paired t-interval covers 0: "
             "reproduced (no difference detectable at this n); excludes 0: not reproduced; "
             "n < 2: inconclusive"),
    "convergence": ("the mean over seeds of (steps a needs to reach b's final held-out loss "
                    "of the same seed) / (steps b needs) is <= `at_most`: reproduced; >= 1 or "
                    "never reached in some seed: not reproduced; in between: inconclusive"),
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


def decide(claim: dict[str, Any], groups: dict[str, list[dict[str, Any]]],
           conv: dict[str, Any]) -> dict[str, Any]:
    """One claim's measurement and verdict (``CLAIM_RULES``)."""
    kind = claim.get("rule", "paired")
    a, b = claim["a"], claim["b"]
    out = {**claim, "rule_text": CLAIM_RULES[kind]}
    if a not in groups or b not in groups or not ok(groups[a]) or not ok(groups[b]):
        missing = [n for n in (a, b) if n not in groups or not ok(groups[n])]
        return {**out, "measured": f"no finished cells of {', '.join(missing)}",
                "verdict": "inconclusive"}
    if kind == "convergence":
        ratio = conv.get(a, {}).get("ratio")
        if ratio is None:
            return {**out, "measured": f"{a} did not reach {b}'s final loss in every seed",
                    "verdict": "not reproduced"}
        verdict = ("reproduced" if ratio <= claim.get("at_most", 0.5)
                   else "not reproduced" if ratio >= 1 else "inconclusive")
        return {**out, "measured": f"steps ratio {ratio:.2f}", "ratio": ratio, "verdict": verdict}
    metric_b = claim.get("metric_b", claim["metric"])
    p = stats.paired(seeds_of(groups[a], claim["metric"]), seeds_of(groups[b], metric_b))
    if kind == "same":
        verdict = ("inconclusive" if p["n"] < 2 else
                   "not reproduced" if p["distinguishable"] else "reproduced")
        return {**out, "measured": _measured(claim, p), "paired": p, "verdict": verdict}
    sign = -1.0 if claim.get("better", "higher") == "lower" else 1.0
    verdict = "inconclusive"
    if p["n"] >= 2:
        low, high = sign * p["low"], sign * p["high"]   # the claimed side is > 0
        if min(low, high) > 0:
            verdict = "reproduced"
        elif max(low, high) < 0:
            verdict = "not reproduced"
    return {**out, "measured": _measured(claim, p), "paired": p, "verdict": verdict}


def _measured(claim: dict[str, Any], p: dict[str, Any]) -> str:
    what = claim["metric"] + (f" vs {claim['metric_b']}" if claim.get("metric_b") else "")
    return (f"{what}: {claim['a']} − {claim['b']} = {p['mean']:+.4f} "
            f"[{p['low']:+.4f}, {p['high']:+.4f}] (n={p['n']})")


# ----------------------------------------------------------------------------- plots


def plot_curves(root: pathlib.Path, groups: dict[str, list[dict[str, Any]]], out: pathlib.Path,
                keys: tuple[str, ...]) -> pathlib.Path | None:
    """Held-out curves of every entry: mean over seeds and a min–max band."""
    from posjax.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    drawn = False
    for name, records in groups.items():
        curves = []
        for r in ok(records):
            path = root / "results" / f"{r['cell']}_curve.csv"
            if path.is_file():
                curves.append(read_curve(path))
        for ax, key in zip(axes[0], keys):
            series = [(c["step"][np.isfinite(c.get(key, np.array([np.nan])))],
                       c[key][np.isfinite(c[key])]) for c in curves if key in c]
            series = [s for s in series if len(s[0])]
            if not series:
                continue
            steps = series[0][0]
            same = [v for s, v in series if len(s) == len(steps) and np.all(s == steps)]
            stack = np.stack(same)
            line, = ax.plot(steps, stack.mean(0), marker=".", label=f"{name} (n={len(same)})")
            ax.fill_between(steps, stack.min(0), stack.max(0), alpha=0.2, color=line.get_color())
            ax.set_xlabel("step")
            ax.set_ylabel(f"held-out {key.removeprefix('eval_')}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
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
    groups = by_name(records)
    base = manifest["baseline"]
    kind = manifest["kind"]
    primary = ("final.loss", "final.accuracy") if kind == "text" else ("final.accuracy",
                                                                       "final.loss")
    rep: dict[str, Any] = {"kind": kind, "baseline": base, "cells": [], "table": {},
                           "paired": {}, "cost": {}, "figures": []}
    for r in records:
        rep["cells"].append({k: r.get(k) for k in ("cell", "name", "seed", "scheme", "status",
                                                   "error", "stage_errors")})
    for name, rs in groups.items():
        row = {m: stats.mean_std(list(seeds_of(rs, m).values())) for m in primary}
        row["status"] = {s: sum(r["status"] == s for r in rs)
                         for s in ("ok", "failed", "not run", "pending")}
        rep["table"][name] = row
        if name != base:
            rep["paired"][name] = {m: stats.paired(seeds_of(rs, m), seeds_of(groups[base], m))
                                   for m in primary}
    rep["cost"], rep["cost_measurement"] = _cost(root)
    rep["time"] = _times(groups)
    if kind == "text":
        rep["convergence"] = convergence(root, groups, base)
        rep["glue"] = _glue(groups)
        rep["extrapolation"] = _nested(groups, "extrapolation", "loss")
        rep["synthetic"] = {t: _nested(groups, f"synthetic.{t}", "accuracy")
                            for t in _keys(groups, "synthetic")}
    else:
        rep["transfer"] = _transfer(groups)
    rep["claims"] = [decide(c, groups, rep.get("convergence", {}))
                     for c in manifest.get("claims", [])]
    _figures(root, groups, rep, kind)
    (root / "report.json").write_text(json.dumps(rep, indent=1, default=_plain))
    (root / "report.md").write_text(markdown(manifest, rep))
    return rep


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
                    entry.setdefault(f, {"values": [], "length": v["length"]})
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
    keys = ("eval_loss", "eval_accuracy")
    if (p := plot_curves(root, groups, root / "curves.png", keys)) is not None:
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
                rep["figures"].append(plot_similarity(
                    data["vit_similarity"], root / f"position_similarity_{r['name']}.png").name)


def markdown(manifest: dict[str, Any], rep: dict[str, Any]) -> str:
    base = rep["baseline"]
    lines = [f"# {manifest.get('title') or manifest['kind'] + ' study'}", "",
             f"Baseline: `{base}`. Built from `results/` only. Mean ± sample std over seeds "
             "(n = finished seeds).", ""]
    lines += ["## Cells", "", "| cell | scheme | status | note |", "|---|---|---|---|"]
    for c in rep["cells"]:
        note = c.get("error") or ""
        if c.get("stage_errors"):
            note += " follow-ups failed: " + "; ".join(f"{k}: {v}"
                                                      for k, v in c["stage_errors"].items())
        lines.append(f"| {c['cell']} | {c['scheme']} | {c['status']} | "
                     f"{note.replace('|', '/').replace(chr(10), ' ')[:300]} |")
    lines += _time_lines(rep["time"])
    metrics_ = sorted(next(iter(rep["table"].values()), {}).keys() - {"status"})
    lines += ["", "## Final held-out metrics", "",
              "| entry | " + " | ".join(metrics_) + " |", "|---" * (len(metrics_) + 1) + "|"]
    for name, row in rep["table"].items():
        lines.append(f"| {name} | " + " | ".join(fmt(row[m]) for m in metrics_) + " |")
    lines += ["", f"## Paired comparison with {base}",
              "", "Per-seed differences (entry − baseline), their mean and 95% t-interval; "
              "\"not distinguishable\" where the interval covers 0.", "",
              "| entry | metric | differences | mean | 95% interval | n | verdict |",
              "|---|---|---|---|---|---|---|"]
    for name, ms in rep["paired"].items():
        for m, p in ms.items():
            verdict = ("n < 2" if p["distinguishable"] is None else
                       "distinguishable" if p["distinguishable"] else "not distinguishable")
            diffs = ", ".join(f"{d:+.4f}" for d in p["differences"])
            lines.append(f"| {name} | {m} | {diffs} | {p['mean']:+.4f} | "
                         f"[{p['low']:+.4f}, {p['high']:+.4f}] | {p['n']} | {verdict} |")
    if rep.get("convergence"):
        conv = rep["convergence"]
        lines += ["", "## Convergence (TUPE's claim: TUPE reaches BERT-A's final loss at 30% of "
                  "its steps)", "", f"Target, per seed: {base}'s final held-out loss of "
                  f"that seed; ratio: the steps an entry needs to reach it over the steps {base} "
                  "needs (mean over seeds); steps interpolated between evaluations.", "",
                  "| entry | steps to target (mean) | seeds reaching | ratio per seed | "
                  "ratio to baseline |", "|---|---|---|---|---|"]
        for name, v in conv.items():
            ms = "—" if v["mean_steps"] is None else f"{v['mean_steps']:.0f}"
            per_seed = ", ".join(f"s{seed}: {x:.2f}" for seed, x in sorted(v["ratios"].items()))
            ratio = "—" if v["ratio"] is None else f"{v['ratio']:.2f}"
            lines.append(f"| {name} | {ms} | {v['reached']} | {per_seed or '—'} | {ratio} |")
    if rep.get("glue"):
        tasks = sorted({t for v in rep["glue"].values() for t in v})
        if tasks:
            lines += ["", "## GLUE dev (score: the task's official metric mean) from each "
                      "pretrained encoder", "", "| entry | " + " | ".join(tasks) + " |",
                      "|---" * (len(tasks) + 1) + "|"]
            for name, v in rep["glue"].items():
                lines.append(f"| {name} | " + " | ".join(fmt(v[t], 3) for t in tasks) + " |")
    lines += _cost_lines(rep, base)
    for title, key, value in (("Length extrapolation (held-out MLM loss)", "extrapolation",
                               "loss"),):
        if rep.get(key):
            lines += _length_table(title, rep[key])
    for task, table in rep.get("synthetic", {}).items():
        lines += _length_table(f"Synthetic task `{task}` (held-out accuracy)", table)
    if rep.get("transfer"):
        cols = sorted({k for v in rep["transfer"].values() for k in v})
        lines += ["", "## Resolution transfer (test accuracy)", "",
                  "| entry | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, v in rep["transfer"].items():
            lines.append(f"| {name} | " + " | ".join(fmt(v[c]) if c in v else "—"
                                                     for c in cols) + " |")
    if rep.get("head_labels"):
        lines += ["", "## TUPE positional heads", "", f"Rule: {HEAD_RULE}.", ""]
        for name, labels in rep["head_labels"].items():
            lines.append(f"- {name}: " + ", ".join(f"head {i} {l}" for i, l in enumerate(labels)))
    lines += ["", "## Claims", "", "| paper | claim | measured | verdict |", "|---|---|---|---|"]
    for c in rep["claims"]:
        lines.append(f"| {c.get('paper', '')} | {c['claim']} | {c['measured']} | "
                     f"{c['verdict']} |")
    lines += ["", "Rules: " + "; ".join(f"**{k}**: {v}" for k, v in CLAIM_RULES.items()), ""]
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in rep["figures"]]
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
    lines = ["", f"## {title}", "", "Trained at L, evaluated at f·L.", "",
             "| entry | " + " | ".join(f"{f}L" for f in factors) + " |",
             "|---" * (len(factors) + 1) + "|"]
    for name, v in table.items():
        cells = []
        for f in factors:
            e = v.get(f)
            cells.append("—" if e is None else e["reason"] if "reason" in e else fmt(e))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
