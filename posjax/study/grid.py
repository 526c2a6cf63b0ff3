"""Run a study's grid: skip finished cells, resume interrupted ones, record failures, print a
progress line, and write ``results/study.json`` (the grid's manifest, so the report lists every
cell, run or not) before anything trains.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

from posjax.study import cells as cells_lib
from posjax.study.spec import Cell, StudyConfigError, baseline, check_study, sweep_rates

MANIFEST = "study.json"
BASELINES = "baselines.json"   # text: unigram/bigram cross-entropy of the held-out targets


def manifest(study: Any, cells: list[Cell], base: Any = None) -> dict[str, Any]:
    classes = base.model.get("num_classes") if base is not None and study.kind == "vit" else None
    return {"kind": study.kind, "chance": 1.0 / classes if classes else None, "title": study.get("title", ""), "baseline": baseline(study),
            "seeds": study.seeds, "claims": [dict(c) for c in study.get("claims", [])],
            "floor": study.get("floor", ""),
            "sweep": study.sweep.to_dict() if study.get("sweep") else None,
            "glue_tasks": list(study.get("glue", {}).get("tasks", [])),
            "entries": [{"name": e["name"], "scheme": e["scheme"],
                         "model": dict(e.get("model", {})), "train": dict(e.get("train", {}))}
                        for e in study.cells],
            "cells": [{"cell": c.id, "name": c.name, "seed": c.seed, "scheme": c.scheme,
                       "pending": c.pending, "sweep": c.sweep,
                       "learning_rate": c.learning_rate} for c in cells]}


def read_manifest(root: pathlib.Path) -> dict[str, Any]:
    return json.loads((cells_lib.results_dir(root) / MANIFEST).read_text())


def status(root: pathlib.Path, cell: Cell) -> str:
    """'done', 'failed', 'pending', 'running' (a workdir exists, no results) or 'left'."""
    if cell.pending:
        return "pending"
    path = cells_lib.results_file(root, cell.id)
    if path.is_file():
        return "done" if json.loads(path.read_text()).get("status") == "ok" else "failed"
    return "running" if cells_lib.cell_dir(root, cell.id).is_dir() else "left"


def progress_line(root: pathlib.Path, cells: list[Cell], current: str = "") -> str:
    """Cells done/failed/running/left and an ETA from the measured cell times of this grid."""
    states = {c.id: status(root, c) for c in cells}
    if current:
        states[current] = "running"
    counts = {s: sum(v == s for v in states.values()) for s in
              ("done", "failed", "running", "left", "pending")}
    times: dict[str, list[float]] = {}
    steps: list[float] = []
    for c in cells:
        if states[c.id] == "done":
            r = json.loads(cells_lib.results_file(root, c.id).read_text())
            times.setdefault(c.name, []).append(float(r.get("wall_s", 0.0)))
            steps.append(float(r.get("step_time_s", float("nan"))))
    every = [t for ts in times.values() for t in ts]
    if every:
        todo = [c for c in cells if states[c.id] in ("left", "running")]
        eta = sum(sum(times.get(c.name, every)) / len(times.get(c.name, every)) for c in todo)
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) + (f" (~{eta / 3600:.1f} h)"
                                                                   if eta > 3600 else "")
        step = f", median step {sorted(steps)[len(steps) // 2]:.3f}s" if steps else ""
    else:
        eta_text, step = "after the first cell", ""
    return (f"[study] {counts['done']}/{len(cells)} cells done, {counts['failed']} failed, "
            f"{counts['running']} running, {counts['left']} left"
            + (f", {counts['pending']} pending" if counts["pending"] else "")
            + f"; ETA {eta_text}{step}" + (f"; now {current}" if current else ""))


def sweep_scores(root: pathlib.Path, study: Any, name: str) -> dict[float, float | None]:
    """{rate: the sweep metric of entry ``name`` at that rate} (nan: the cell failed or
    diverged; None: not run yet)."""
    from posjax.study.report import metric

    rates, _ = sweep_rates(study)
    out: dict[float, float | None] = {}
    for rate in rates:
        path = cells_lib.results_file(root, f"{name}-lr{rate:g}")
        if not path.is_file():
            out[rate] = None
            continue
        record = json.loads(path.read_text())
        value = metric(record, study.sweep.metric) if record.get("status") == "ok" else None
        out[rate] = float("nan") if value is None else value
    return out


def chosen_rate(root: pathlib.Path, study: Any, name: str) -> tuple[float | None, str]:
    """(the sweep's best rate for entry ``name``, '') or (None, why there is none yet)."""
    scores = sweep_scores(root, study, name)
    left = [r for r, v in scores.items() if v is None]
    if left:
        return None, (f"the learning-rate sweep of {name!r} has not finished (rates "
                      f"{', '.join(f'{r:g}' for r in left)} left); run its -lr cells first")
    from posjax.study.report import best_rate

    best = best_rate(scores, study.sweep.better)
    if best is None:
        return None, f"every sweep cell of {name!r} failed: see results/{name}-lr*.json"
    return best, ""


def run_grid(study: Any, root: pathlib.Path, only: str = "", log=print,
             after_cell=lambda: None) -> list[dict[str, Any]]:
    """Run every cell not finished yet (or only cell id / entry name ``only``), calling
    ``after_cell()`` after each (a bucket workdir uploads the results so far)."""
    base, cells = check_study(study)
    chosen = [c for c in cells if not only or only in (c.id, c.name)]
    if only and not chosen:
        raise StudyConfigError(f"--cell {only!r} is not a cell of this study: use one of "
                         f"{', '.join(c.id for c in cells)} (or an entry name)")
    cells_lib.write_json(cells_lib.results_dir(root) / MANIFEST, manifest(study, cells, base))
    baselines_file = cells_lib.results_dir(root) / BASELINES
    if study.kind == "text" and study.get("baselines") and not baselines_file.is_file():
        from posjax.study import held_out
        log("[study] unigram and bigram baselines of the held-out targets")
        cells_lib.write_json(baselines_file, held_out.baselines(base, int(study.held_out.draws)))
    records = []
    for cell in chosen:
        state = status(root, cell)
        if state == "done":
            continue
        if state == "pending":
            cells_lib.write_json(cells_lib.results_file(root, cell.id),
                                 {"cell": cell.id, "name": cell.name, "seed": cell.seed,
                                  "scheme": cell.scheme, "status": "pending",
                                  "error": cell.pending})
            continue
        if not cell.sweep and sweep_rates(study)[0]:
            rate, why = chosen_rate(root, study, cell.name)
            if rate is None:
                log(f"[study] cell {cell.id} waits: {why}")
                continue
            cell = dataclasses.replace(cell, learning_rate=rate, sweep_chosen=True)
        log(progress_line(root, cells, cell.id))
        record = cells_lib.run_cell(root, study, base, cell)
        if record["status"] != "ok":
            log(f"[study] cell {cell.id} FAILED: {record['error']}")
        elif record.get("stage_errors"):
            log(f"[study] cell {cell.id}: follow-ups failed: {record['stage_errors']}")
        records.append(record)
        after_cell()
    log(progress_line(root, cells))
    return records
